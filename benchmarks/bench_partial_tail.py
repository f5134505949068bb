"""Hits on prompts shorter than a few Mamba blocks, with vLLM's partial tails off and on.

vLLM 0.32 keeps a recurrent state inside a Mamba block (a "partial tail", at the prompt's last
multiple of ``prefix_match_unit`` before its last token) only when ``prefix_match_unit`` is
below the block size; by default it equals the block size (the GCD of the KV cache groups'
block sizes, all equal on Qwen3.5 and Qwen3-Next). It hands such a state to a connector like a
block-aligned one (``boundary_state_offloads``, after the copy-on-write that preserves it), and
at a request's end through ``register_finished_partial_tail`` when the request stopped exactly
there. This connector keys states by whole chunks (a multiple of the block size): a partial
tail has no chunk key, so it is not stored and a hit ends on the last chunk boundary.

On the tiny Qwen3.5 (block 256 = chunk 256, text prompts of 300 to 1500 random token ids),
``--block-size 256`` given to vLLM (see README: its scheduler otherwise ends prefill steps on
128-token boundaries), two settings side by side: vLLM's defaults ("off") and
``prefix_match_unit`` U ("on": partial tails). Per setting, vLLM alone (no connector: the
reference tokens; "on": also its own cache's hit on a repeat) and the connector: each prompt
once (stored), then, after ``reset_prefix_cache``, again: external hit tokens, tokens loaded
by the connector, and whether both runs' greedy tokens equal the reference's (bf16: a near-tie
within ``BF16_TIE_TOL`` ends the comparison). Four engine starts.

    python benchmarks/bench_partial_tail.py [--quick] [--unit U]

Prints the table and a last line ``PARTIAL_TAIL {json}``.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Engine, bench_main, hma_transfer, lmcache_yaml, read_json, say, table  # noqa: E402

LENGTHS = (300, 600, 900, 1200, 1500)
CHUNK = BLOCK = 256
KV_BYTES = 2**28
FIRST_ID, LAST_ID = 4, 790  # ordinary tokens of the tiny tokenizer (no special or vision tokens)


def prompts(lengths) -> dict[int, list[int]]:
    """BOS and seeded random token ids: no two prompts share a prefix beyond BOS."""
    rng = random.Random(0)
    return {n: [2] + [rng.randrange(FIRST_ID, LAST_ID) for _ in range(n - 1)] for n in lengths}


def qwen35():
    from lmcache_hma.testing.tiny_qwen35 import build_tiny_qwen35
    from lmcache_hma.testing.tiny_vlm import shim_env

    return build_tiny_qwen35(), shim_env()


def engine(model, env, log, transfer=None, unit=None):
    extra = {"prefix_match_unit": unit} if unit else {}
    return Engine(model, log, transfer, env=env, kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK,
                  limit_mm_per_prompt={"image": 0, "video": 0}, **extra)


def run(quick: bool = False, unit: int = 32) -> dict:
    from tests.engines import BF16_TIE_TOL, diff, generate, same_greedy

    model, env = qwen35()
    cases = prompts(LENGTHS[::2] if quick else LENGTHS)
    tokens = {n: {"prompt_token_ids": ids} for n, ids in cases.items()}
    rows, result, local = [], {"unit": unit, "lengths": list(cases)}, {}
    with tempfile.TemporaryDirectory(prefix="bench_partial_tail_") as d:
        for mode, mode_unit in (("off", None), ("on", unit)):
            ref = {}  # vLLM alone with this mode's settings: the reference tokens (and its own hit)
            with engine(model, env, f"partial_tail_ref_{mode}.log", unit=mode_unit) as eng:
                for n, p in tokens.items():
                    [ref[n]] = generate(eng.llm, p)
                    if mode == "on":
                        [again] = generate(eng.llm, p)  # vLLM's own cache, partial tails on
                        local[n] = again.cached
            stats = Path(d) / f"{mode}.json"
            yaml = lmcache_yaml(Path(d) / f"{mode}.yaml", local_cpu=True, max_local_cpu_size=0.5)
            hits, loaded, exact = {}, {}, {}
            with engine(model, env, f"partial_tail_{mode}.log", hma_transfer(yaml, stats), mode_unit) as eng:
                for n, p in tokens.items():
                    [cold] = generate(eng.llm, p)
                    before = read_json(stats).get("loaded_tokens", 0)
                    eng.reset_prefix_cache()
                    [hit] = generate(eng.llm, p)
                    hits[n], loaded[n] = hit.cached, read_json(stats).get("loaded_tokens", 0) - before
                    exact[n] = same_greedy(ref[n], cold, BF16_TIE_TOL) and same_greedy(ref[n], hit, BF16_TIE_TOL)
                    say(f"[partial_tail] {mode} n={n}: hit {hits[n]}, loaded {loaded[n]}, exact {exact[n]}"
                        + ("" if exact[n] else f" (cold: {diff(ref[n], cold)}; hit: {diff(ref[n], hit)})"))
            result[mode] = {"hit": hits, "loaded": loaded, "exact": exact}
    for n in cases:
        rows.append([n, (n - 1) // CHUNK * CHUNK, local[n], result["off"]["hit"][n], result["on"]["hit"][n],
                     result["off"]["loaded"][n], result["on"]["loaded"][n],
                     result["off"]["exact"][n] and result["on"]["exact"][n]])
    result["local"] = local
    result["exact"] = all(r[-1] for r in rows)
    result["gain_tokens"] = sum(result["on"]["hit"][n] - result["off"]["hit"][n] for n in cases)
    result["partial_tail_reach"] = sum(local[n] - result["off"]["hit"][n] for n in cases)
    result["table"] = table(
        ["prompt tokens", "last chunk boundary", f"vLLM alone, unit {unit}", "connector: off",
         f"connector: on (unit {unit})", "loaded: off", "loaded: on", "exact"], rows)
    result["notes"] = [
        "connector columns: external hit tokens of the repeat after reset_prefix_cache",
        f"vLLM alone: its own prefix-cache hit on the repeat with prefix_match_unit {unit} (no connector)",
    ]
    return result


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "PARTIAL_TAIL", keys=("unit", "exact", "gain_tokens", "partial_tail_reach"),
                        options=[("--unit", dict(type=int, default=32, help="vLLM's prefix_match_unit when on"))],
                        quick="three prompt lengths", ok=lambda s: s["exact"]))
