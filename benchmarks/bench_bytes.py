"""Bytes moved by the connector, counted in real vLLM runs (the worker's stats file).

For each tiny hybrid model: one engine with the connector (LMCache CPU tier),
the reproduction's last prompt (``"Hello, how are you?"*1000 + "Tell me a very long
story"``, 6007 tokens) run cold (the connector stores it), then
``reset_prefix_cache()`` and run again: a 5888-token hit (23 chunks of 256) that
only the connector can serve. Counted by the worker (``hma_stats_file``), by group
kind: ``stored_bytes_<kind>`` after the first run, ``loaded_bytes_<kind>`` after the
second. Also read back from the scheduler's per-request log line (which prints the
bytes it planned and its own all-layers figure).

An all-layers connector (one that ignores the hybrid layout and moves every block of
every group, as LMCache's in-process connector does for a single group) loads
``num_layers x hit/block_size x page_bytes`` and stores ``num_layers x page_bytes /
block_size`` bytes per token (page = 32768 bytes for the attention-only models,
block 128; the Qwen3-Next shape: block 256, page 256 KiB, which vLLM also gives each
gated-delta-net layer's state block). For that model the log line's all-layers figure
counts one state per GDN layer, not a block per 256 tokens.

Models: tiny-gemma3 (the reproduction's; S,S,F,S,S,F, window 128), tiny-gemma3-5to1
(Gemma-3's shape: 12 layers, 5 sliding : 1 full, window 1024; with
``hma_checkpoint_interval`` 256 and 1024), tiny-gptoss-like (S,F,S,F, window 128),
tiny-qwen3next (Qwen3-Next's shape: 3 gated-delta-net layers : 1 full attention; a hit
loads the full-attention KV plus one recurrent state per GDN layer; vLLM's defaults:
prefix caching on, ``mamba_cache_mode`` "align", block size 256), tiny-qwen35 (Qwen3.5 as
shipped: a vision tower in front of [3 GDN, 1 full] x 2; text prompt; vLLM needs the
torchvision shim of ``lmcache_hma.testing.tiny_vlm`` for it).

    python benchmarks/bench_bytes.py [--quick]      # --quick: the Gemma-3 shape only

Prints a table and a last line ``BYTES {json}``; ``bytes_loaded_vs_all_layers`` is
the Gemma-3 shape's (interval 256), ``gdn_loaded_vs_all_layers`` the Qwen3-Next shape's,
``qwen35_loaded_vs_all_layers`` the Qwen3.5 shape's.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Engine, bench_main, hma_transfer, lmcache_yaml, request_lines, say, table, wait_for_stats,
)

PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"  # 6007 tokens
CHUNK = 256
KINDS = ("full_attention", "sliding_window", "recurrent_state")  # lmcache_hma.core.layout.GroupKind

CASES = [  # (label, preset, checkpoint interval)
    ("tiny-gemma3 (repro)", "tiny-gemma3", 256),
    ("Gemma-3 shape (5:1, W=1024)", "tiny-gemma3-5to1", 256),
    ("Gemma-3 shape, interval 1024", "tiny-gemma3-5to1", 1024),
    ("gpt-oss shape (1:1, W=128)", "tiny-gptoss-like", 256),
    ("Qwen3-Next shape (3 GDN : 1 full)", "tiny-qwen3next", 256),
    ("Qwen3.5 shape (vision + 3 GDN : 1 full)", "tiny-qwen35", 256),
]


def model_for(preset: str):
    """(model directory, its shape: layers, KV heads, head size, window; env for vLLM's processes)."""
    from types import SimpleNamespace

    if preset == "tiny-qwen35":
        from lmcache_hma.testing.tiny_qwen35 import LAYER_TYPES, TEXT, build_tiny_qwen35
        from lmcache_hma.testing.tiny_vlm import shim_env

        env = shim_env()
        shape = SimpleNamespace(num_layers=len(LAYER_TYPES), num_kv_heads=TEXT["num_key_value_heads"],
                                head_dim=TEXT["head_dim"], sliding_window=0)
        return build_tiny_qwen35(), shape, env
    from lmcache_hma.testing.tiny_model import build_tiny_model, resolve_spec

    return build_tiny_model(preset), resolve_spec(preset), None


def page_and_block(spec, log: str) -> tuple[int, int]:
    """Bytes of one block of one layer (bf16 K and V) and vLLM's block size: 128 on CPU, unless
    it raised it so that a block's page holds a GDN state (it says so in its log)."""
    m = re.search(r"Setting attention block size to (\d+) tokens", log)
    block = int(m.group(1)) if m else 128
    return block * spec.num_kv_heads * 2 * spec.head_dim * 2, block


def measure(label: str, preset: str, interval: int, workdir: Path) -> dict:
    model_dir, spec, env = model_for(preset)
    tag = f"{preset}-{interval}"
    yaml = lmcache_yaml(workdir / f"{tag}.yaml", interval=interval, local_cpu=True, max_local_cpu_size=1)
    stats_path = workdir / f"{tag}.stats.json"
    with Engine(model_dir, f"bytes_{tag}.log", hma_transfer(yaml, stats_path), env=env) as eng:
        _, cold = eng.generate(PROMPT, max_tokens=5)
        stored = wait_for_stats(stats_path, "objects_stored", 1)
        eng.reset_prefix_cache()
        _, hit = eng.generate(PROMPT, max_tokens=5)
        stats = wait_for_stats(stats_path, "loads_ok", 1)
        log = eng.log()
    hit_line = next((l for l in request_lines(log) if l["load"] > 0), None)
    page, block = page_and_block(spec, log)
    loaded = {k: stats.get(f"loaded_bytes_{k}", 0) for k in KINDS}
    stored_by = {k: stored.get(f"stored_bytes_{k}", 0) for k in KINDS}
    r = dict(
        label=label, preset=preset, interval=interval, layers=spec.num_layers,
        window=spec.sliding_window, total_tokens=len(hit.prompt_token_ids),
        hit_tokens=hit.num_cached_tokens, loaded_tokens=stats.get("loaded_tokens", 0),
        loaded_full=loaded["full_attention"], loaded_sliding=loaded["sliding_window"],
        loaded_state=loaded["recurrent_state"], loaded=sum(loaded.values()),
        all_layers_loaded=spec.num_layers * (hit.num_cached_tokens // block) * page,
        log_all_layers=hit_line["all"] if hit_line else None,
        log_planned=(hit_line["full"] + hit_line["sliding"] + hit_line["state"]) if hit_line else None,
        stored_full=stored_by["full_attention"], stored_sliding=stored_by["sliding_window"],
        stored_state=stored_by["recurrent_state"], stored_bytes=sum(stored_by.values()),
        stored_tokens=(len(cold.prompt_token_ids) // CHUNK) * CHUNK,
        all_layers_stored_per_token=spec.num_layers * page / block,
        exact=list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids),
    )
    r["loaded_from_connector"] = r["loaded_tokens"] == r["hit_tokens"]
    r["loaded_vs_all_layers"] = r["loaded"] / r["all_layers_loaded"] if r["all_layers_loaded"] else None
    r["stored_per_token"] = r["stored_bytes"] / r["stored_tokens"]
    r["stored_vs_all_layers"] = r["stored_per_token"] / r["all_layers_stored_per_token"]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    other = f"state {mib(r['loaded_state'])}" if r["loaded_state"] else f"sliding {mib(r['loaded_sliding'])}"
    say(f"[bytes] {label}: hit {r['hit_tokens']}/{r['total_tokens']}, loaded {mib(r['loaded'])} MiB "
        f"(full {mib(r['loaded_full'])} + {other}) vs all-layers {mib(r['all_layers_loaded'])} MiB = "
        f"{r['loaded_vs_all_layers']:.3f}x; stored {r['stored_per_token']:.0f} B/token vs "
        f"{r['all_layers_stored_per_token']:.0f}; log all-layers {r['log_all_layers']}; exact {r['exact']}")
    return r


def run(quick: bool = False) -> dict:
    cases = [c for c in CASES if c[1] == "tiny-gemma3-5to1" and c[2] == 256] if quick else CASES
    with tempfile.TemporaryDirectory(prefix="bench_bytes_") as d:
        rows = [measure(label, preset, interval, Path(d)) for label, preset, interval in cases]
    gemma = next(r for r in rows if r["preset"] == "tiny-gemma3-5to1" and r["interval"] == 256)
    gdn = next((r for r in rows if r["preset"] == "tiny-qwen3next"), None)
    qwen35 = next((r for r in rows if r["preset"] == "tiny-qwen35"), None)
    mib = lambda b: b / 2**20  # noqa: E731
    per_token = lambda r, b: f"{b / r['stored_tokens']:.0f}"  # noqa: E731
    summary = {
        "bytes_loaded_vs_all_layers": gemma["loaded_vs_all_layers"],
        "gemma3_stored_vs_all_layers": gemma["stored_vs_all_layers"],
        **({"gdn_loaded_vs_all_layers": gdn["loaded_vs_all_layers"],
            "gdn_stored_vs_all_layers": gdn["stored_vs_all_layers"]} if gdn else {}),
        **({"qwen35_loaded_vs_all_layers": qwen35["loaded_vs_all_layers"],
            "qwen35_stored_vs_all_layers": qwen35["stored_vs_all_layers"]} if qwen35 else {}),
        "cases": rows,
        "table": table(
            ["model", "interval", "hit/total", "loaded MiB (full+sliding or state)", "all-layers MiB",
             "loaded/all", "log: all-layers MiB", "stored B/token (full+sliding or state)",
             "all-layers B/token", "stored/all", "tokens exact"],
            [[r["label"], r["interval"], f"{r['hit_tokens']}/{r['total_tokens']}",
              f"{mib(r['loaded']):.2f} ({mib(r['loaded_full']):.2f}"
              f"+{mib(r['loaded_sliding'] + r['loaded_state']):.2f})",
              mib(r["all_layers_loaded"]), r["loaded_vs_all_layers"],
              mib(r["log_all_layers"]) if r["log_all_layers"] is not None else None,
              f"{r['stored_per_token']:.0f} ({per_token(r, r['stored_full'])}"
              f"+{per_token(r, r['stored_sliding'] + r['stored_state'])})",
              r["all_layers_stored_per_token"], r["stored_vs_all_layers"], r["exact"]]
             for r in rows]),
    }
    return summary


def main() -> int:
    return bench_main(__doc__, run, "BYTES")


if __name__ == "__main__":
    sys.exit(main())
