"""The reproduction: evict a prompt from vLLM's prefix cache, then reload 5888 tokens.

The test of vLLM's "[Core][Hybrid allocator + connector]" PR, on the built-in
tiny hybrid model (``--preset tiny-qwen3next`` for a gated-delta-net hybrid, or
``--model DIR``), with the hybrid KV cache manager on:

1. ``first_prompt = "Hello, how are you?" * 5000 + "Hello, my name is"``;
2. ``"1" + first_prompt`` and ``"2" + first_prompt``: vLLM's own KV cache is
   sized so that these evict the first prompt's blocks from its prefix cache;
3. ``second_prompt = "Hello, how are you?" * 1000 + "Tell me a very long story"``
   shares its first 23 chunks with ``first_prompt``: only the connector has them.

Then the last request again on a cold engine without the connector: the tokens
must be identical. (A gated-delta-net model hits the last recurrent state stored
before token 5888: first_prompt's prefill steps end every 2048 tokens, so 4096.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

FIRST_PROMPT = "Hello, how are you?" * 5000 + "Hello, my name is"
SECOND_PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
# 384 blocks of the tiny model: one 30k-token prompt fits, two do not.
DEFAULT_KV_CACHE_BYTES = 24 * 2**20
# The same for other presets (tiny-qwen3next: 160 blocks of 256 tokens, 256 KiB each). Other
# presets and --model get ``kv_cache_bytes_for`` their config.json.
KV_CACHE_BYTES = {"tiny-gemma3": DEFAULT_KV_CACHE_BYTES, "tiny-qwen3next": 40 * 2**20}
MAX_MODEL_LEN = 32768
MAX_NUM_BATCHED_TOKENS = 2048
MAX_TOKENS = 10  # generated per request
TINY_FIRST_PROMPT_TOKENS = 30006  # first_prompt with the tiny models' tokenizer (BOS included)
# vLLM's KV cache holds about this many first prompts: one fits (with vLLM's check that
# max_model_len does), two do not, so prompts 2 and 3 evict prompt 1 from vLLM's prefix cache.
ROOM_IN_PROMPTS = 1.45
HOME_ENV = "LMCACHE_HMA_HOME"
EPILOG = f"""\
Before vLLM starts, the YAML is read as the connector reads it and every tier it names is reached
(as `lmcache-hma check` does): a bad YAML or an unreachable tier ends the run with one line.

environment:
  {HOME_ENV}  where the built-in tiny models are built and kept: ${HOME_ENV}/models
                    (default ~/.cache/lmcache_hma/models)
  VLLM_CPU_NUM_OF_RESERVED_CPU  set to 1 unless given (vLLM's CPU build)

Exit status: 0 when the tokens match and the hit came from the connector, 1 when not (or a tier
is unreachable), 2 for a usage error (an unknown preset, a bad YAML, a model it cannot size).
"""


class ReproError(Exception):
    """Why the reproduction cannot start (one line), and its exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _llm(model, config, stats_file, kv_cache_bytes):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if config is not None:
        transfer = KVTransferConfig(
            kv_connector="LMCacheHMAConnector", kv_connector_module_path="lmcache_hma",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache_config_file": str(config), "hma_stats_file": str(stats_file)},
        )
    return LLM(model=str(model), dtype="bfloat16", max_model_len=32768, enforce_eager=True,
               disable_hybrid_kv_cache_manager=False, kv_cache_memory_bytes=kv_cache_bytes,
               max_num_batched_tokens=2048, kv_transfer_config=transfer, seed=0)


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, top_p=0.95, max_tokens=10)


def _stats(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def run_repro(model: Path, config: Path, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
              preset: str | None = None) -> dict:
    """Run the reproduction; returns its figures (also printed)."""
    from lmcache_hma.testing.tiny_model import DEFAULT_MODEL, build_tiny_model

    model = Path(model) if model else build_tiny_model(preset or DEFAULT_MODEL)
    stats_file = Path(tempfile.mkdtemp(prefix="lmcache_hma_repro_")) / "stats.json"
    llm = _llm(model, config, stats_file, kv_cache_bytes)
    rows = []
    for name, prompt in (("first_prompt", FIRST_PROMPT), ('"1" + first_prompt', "1" + FIRST_PROMPT),
                         ('"2" + first_prompt', "2" + FIRST_PROMPT), ("second_prompt", SECOND_PROMPT)):
        before = _stats(stats_file).get("loaded_tokens", 0)
        t0 = time.perf_counter()
        out = llm.generate([prompt], _sampling(), use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        loaded = _stats(stats_file).get("loaded_tokens", 0) - before
        rows.append(dict(request=name, total=len(out.prompt_token_ids), hit=out.num_cached_tokens,
                         loaded=loaded, time_s=elapsed, tokens=list(out.outputs[0].token_ids),
                         text=out.outputs[0].text))
    _shutdown(llm)

    cold_llm = _llm(model, None, None, kv_cache_bytes)
    cold_llm.generate(["Hello, how are you?"], _sampling(), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    cold = cold_llm.generate([SECOND_PROMPT], _sampling(), use_tqdm=False)[0]
    cold_time = time.perf_counter() - t0
    _shutdown(cold_llm)

    last = rows[-1]
    result = dict(
        rows=rows, cold_time_s=cold_time, cold_tokens=list(cold.outputs[0].token_ids),
        identical=last["tokens"] == list(cold.outputs[0].token_ids),
        evicted=last["loaded"] == last["hit"] > 0,  # nothing of it came from vLLM's cache
    )
    _report(result)
    return result


def _shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _report(result: dict) -> None:
    rows, last = result["rows"], result["rows"][-1]
    print("\n=== lmcache_hma reproduction ===")
    print(f"{'request':<22}{'total':>8}{'hit':>8}{'loaded':>8}{'time (s)':>10}")
    for r in rows:
        print(f"{r['request']:<22}{r['total']:>8}{r['hit']:>8}{r['loaded']:>8}{r['time_s']:>10.3f}")
    print(f"\nsecond_prompt generated: {last['text']!r}")
    print(f"second_prompt time: {last['time_s']:.3f} s with the LMCache hit, "
          f"{result['cold_time_s']:.3f} s cold without the connector "
          f"({result['cold_time_s'] / last['time_s']:.1f}x)")
    if last["hit"] == 0:
        print("the connector served no hit for second_prompt (0 tokens loaded): see the LMCacheHMA warnings "
              "above (a tier that did not answer, or objects that failed their checks)")
    else:
        print(f"vLLM's prefix cache had evicted first_prompt: {result['evicted']} "
              f"(all {last['hit']} hit tokens were loaded by the connector)")
    print(f"tokens identical to the cold run without the connector: {result['identical']}")


# -- before vLLM starts ----------------------------------------------------------------------
def kv_cache_bytes_for(shape, first_tokens: int = TINY_FIRST_PROMPT_TOKENS) -> tuple[int, int]:
    """(vLLM's KV cache bytes for the reproduction with this model, tokens of full-attention KV
    they hold): room for ``ROOM_IN_PROMPTS`` first prompts in the block pool vLLM's hybrid
    manager shares between its KV cache groups, plus what the sliding-window groups hold
    (a window and a prefill step each) and the gated-delta-net groups (a few state pages each).

    vLLM groups layers as ``_get_kv_cache_groups_uniform_page_size`` does: groups of the smallest
    kind's layer count (the largest's when under 1.5 times it); every group's block costs a page
    per layer of the group. ``shape``: ``model_costs.ModelShape``."""
    from lmcache_hma.tools.model_costs import FULL, GDN, SLIDING

    if shape.unknown:
        raise ReproError(f"{shape.name}: layer kinds {', '.join(shape.unknown)} are not served by the connector "
                         f"(docs/models.md)")
    counts = {k: shape.count(k) for k in (FULL, SLIDING, GDN) if shape.count(k)}
    if FULL not in counts:
        raise ReproError(f"{shape.name} has no full-attention layer: the reproduction evicts and reloads "
                         f"full-attention KV")
    smallest, largest = min(counts.values()), max(counts.values())
    group = largest if largest < smallest * 1.5 else smallest
    groups = {k: -(-n // group) for k, n in counts.items()}
    kv = shape.kv_bytes_per_token_layer
    room = max(int(ROOM_IN_PROMPTS * first_tokens), int(1.1 * MAX_MODEL_LEN))
    if room >= 1.9 * first_tokens:
        raise ReproError(f"first_prompt is only {first_tokens} tokens with {shape.name}'s tokenizer: vLLM's KV "
                         f"cache must hold max_model_len {MAX_MODEL_LEN} tokens, which leaves room for two of "
                         f"them, and nothing is evicted; pass --kv-cache-bytes N to try another size")
    nbytes = groups[FULL] * group * kv * room
    if SLIDING in groups:
        nbytes += groups[SLIDING] * group * kv * (shape.sliding_window + MAX_NUM_BATCHED_TOKENS + 256)
    if GDN in groups:
        page_tokens = 128 * -(-shape.gdn_state_bytes // (128 * kv))  # an attention page holds a state
        nbytes += groups[GDN] * group * kv * page_tokens * 4
    return -(-nbytes // 2**20) * 2**20, room


def first_prompt_tokens(model: str) -> Optional[int]:
    """first_prompt's length with ``model``'s tokenizer (tokenizer.json), None when unread."""
    from lmcache_hma.tools.model_costs import find_model_file

    try:
        from tokenizers import Tokenizer

        path = find_model_file(model, "tokenizer.json")
        return len(Tokenizer.from_file(str(path)).encode(FIRST_PROMPT).ids)
    except Exception:  # no tokenizer.json, or one the tokenizers library cannot read
        return None


def size_kv_cache(model: str) -> tuple[int, str]:
    """(vLLM's KV cache bytes for ``model``, a line saying why)."""
    from lmcache_hma.tools.model_costs import ModelError, read_model

    hint = (f"pass --kv-cache-bytes N (vLLM's KV cache: room for first_prompt once, about "
            f"{TINY_FIRST_PROMPT_TOKENS} tokens, not twice)")
    try:
        shape = read_model(model)
    except ModelError as exc:
        raise ReproError(f"cannot size vLLM's KV cache: {exc}; or {hint}") from None
    if shape.max_position_embeddings and shape.max_position_embeddings < MAX_MODEL_LEN:
        raise ReproError(f"{model}: max_position_embeddings {shape.max_position_embeddings} is under the "
                         f"reproduction's max_model_len {MAX_MODEL_LEN} (first_prompt is ~30k tokens)")
    counted = first_prompt_tokens(model)
    tokens = counted or TINY_FIRST_PROMPT_TOKENS
    if tokens + MAX_TOKENS > MAX_MODEL_LEN:
        raise ReproError(f"first_prompt is {tokens} tokens with {model}'s tokenizer: more than the reproduction's "
                         f"max_model_len {MAX_MODEL_LEN} allows")
    nbytes, room = kv_cache_bytes_for(shape, tokens)
    how = f"first_prompt is {tokens} tokens" if counted else (
        f"first_prompt taken as {tokens} tokens (the tiny models' count: no tokenizer.json read)")
    return nbytes, (f"vLLM's KV cache for {shape.name}: {nbytes / 2**20:.0f} MiB, room for about {room} tokens "
                    f"({how}: it fits once, not twice; --kv-cache-bytes overrides)")


def check_config_and_tiers(config: Path) -> None:
    """The YAML read as the connector reads it, then every tier it names reached (``check``);
    raises ``ReproError`` (one line per problem) before vLLM starts."""
    from lmcache_hma.tools import check

    cfg, lines = check.load(str(config))
    if cfg is None:
        raise ReproError("; ".join(line.message for line in lines if line.verdict == check.FAIL), 2)
    tiers, _ = check.tier_checks(cfg)
    fails = [line for line in tiers if line.verdict == check.FAIL]
    if fails:
        other = (f"; or run the reproduction on the CPU tier: --config {_shown(DEFAULT_CONFIG)}"
                 if Path(config).resolve() != DEFAULT_CONFIG else "")
        raise ReproError("\n".join(f"{line.message}{other}" for line in fails), 1)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def prepare(args) -> tuple[Optional[str], int]:
    """Everything checked before vLLM starts: (the model, vLLM's KV cache bytes)."""
    from lmcache_hma.testing.tiny_model import PRESETS, build_tiny_model

    if args.preset is not None and args.model is not None:
        raise ReproError("--model and --preset both name a model; give one")
    if args.preset is not None and args.preset not in PRESETS:
        raise ReproError(f"unknown preset {args.preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    if args.kv_cache_bytes is not None and args.kv_cache_bytes <= 0:
        raise ReproError(f"--kv-cache-bytes must be > 0, got {args.kv_cache_bytes}")
    check_config_and_tiers(args.config)
    model = str(args.model) if args.model is not None else None
    if args.kv_cache_bytes is not None:
        return model, args.kv_cache_bytes
    if model is None and (args.preset or "tiny-gemma3") in KV_CACHE_BYTES:
        return None, KV_CACHE_BYTES[args.preset or "tiny-gemma3"]
    if model is None:  # another preset: built here, sized by its config.json
        model = str(build_tiny_model(args.preset))
    nbytes, why = size_kv_cache(model)
    print(f"lmcache-hma repro: {why}", flush=True)
    return model, nbytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-hma repro", description=__doc__.splitlines()[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="YAML", type=Path, default=DEFAULT_CONFIG,
                        help="LMCache YAML (configs/cpu.yaml (default), disk.yaml, redis.yaml, ...)")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="model directory (or a Hugging Face id) instead of the built-in tiny model; vLLM's "
                             "KV cache is sized from its config.json and tokenizer")
    parser.add_argument("--preset", metavar="NAME", default=None,
                        help="built-in tiny model when no --model: tiny-gemma3 (default; sliding window), "
                             "tiny-qwen3next (gated delta net), ...: see lmcache-hma build-model --help")
    parser.add_argument("--kv-cache-bytes", metavar="N", type=int, default=None,
                        help="vLLM's KV cache size; small enough that prompts 2 and 3 evict prompt 1 "
                             "(default: sized for the model)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, kv_cache_bytes = prepare(args)
    except ReproError as exc:
        for line in str(exc).splitlines():  # one line per problem
            print(f"lmcache-hma repro: {line}", file=sys.stderr)
        return exc.status
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    t0 = time.perf_counter()
    result = run_repro(model, args.config, kv_cache_bytes, args.preset)
    print(f"\nreproduction took {time.perf_counter() - t0:.0f} s")
    ok = result["identical"] and result["evicted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
