"""Bytes moved by the connector, counted in real vLLM runs (the worker's stats file).

For each tiny hybrid model: one engine with the connector (LMCache CPU tier),
the reproduction's last prompt (``"Hello, how are you?"*1000 + "Tell me a very long
story"``, 6007 tokens) run cold (the connector stores it), then
``reset_prefix_cache()`` and run again: a 5888-token hit (23 chunks of 256) that
only the connector can serve. Counted by the worker (``hma_stats_file``):
``stored_bytes_*`` after the first run, ``loaded_bytes_*`` after the second. Also
read back from the scheduler's per-request log line (which prints the bytes it
planned and what an all-layers connector would load).

An all-layers connector (one that ignores the hybrid layout and moves every
layer's blocks, as LMCache's in-process connector does for a single group) loads
``num_layers x hit/block_size x page_bytes`` and stores ``num_layers x page_bytes /
block_size`` bytes per token (page = 32768 bytes for these models, block 128).

Models: tiny-gemma3 (the reproduction's; S,S,F,S,S,F, window 128), tiny-gemma3-5to1
(Gemma-3's shape: 12 layers, 5 sliding : 1 full, window 1024; with
``hma_checkpoint_interval`` 256 and 1024), tiny-gptoss-like (S,F,S,F, window 128).

    python benchmarks/bench_bytes.py [--quick]      # --quick: the Gemma-3 shape only

Prints a table and a last line ``BYTES {json}``; ``bytes_loaded_vs_all_layers`` is
the Gemma-3 shape's (interval 256).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    bench_main,
    OUT_DIR, Engine, hma_transfer, request_lines, say, table,
    wait_for_stats, write_yaml,
)

PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"  # 6007 tokens
CHUNK = 256

CASES = [  # (label, preset, checkpoint interval)
    ("tiny-gemma3 (repro)", "tiny-gemma3", 256),
    ("Gemma-3 shape (5:1, W=1024)", "tiny-gemma3-5to1", 256),
    ("Gemma-3 shape, interval 1024", "tiny-gemma3-5to1", 1024),
    ("gpt-oss shape (1:1, W=128)", "tiny-gptoss-like", 256),
]


def measure(label: str, preset: str, interval: int, workdir: Path) -> dict:
    from lmcache_hma.tiny_model import build_tiny_model, resolve_spec

    spec = resolve_spec(preset)
    model = build_tiny_model(preset)
    tag = f"{preset}-{interval}"
    yaml = write_yaml(workdir / f"{tag}.yaml", chunk_size=CHUNK, local_cpu=True,
                      max_local_cpu_size=1, extra_config={"hma_checkpoint_interval": interval})
    stats_path = workdir / f"{tag}.stats.json"
    log = OUT_DIR / f"bytes_{tag}.log"
    log.unlink(missing_ok=True)
    with Engine(model, log, hma_transfer(yaml, {"hma_stats_file": str(stats_path)})) as eng:
        _, cold = eng.generate_text(PROMPT, max_tokens=5)
        stored = wait_for_stats(stats_path, "objects_stored", 1)
        eng.reset_prefix_cache()
        _, hit = eng.generate_text(PROMPT, max_tokens=5)
        stats = wait_for_stats(stats_path, "loads_ok", 1)
        lines = request_lines(eng.log())
    hit_tokens = hit.num_cached_tokens
    total = len(hit.prompt_token_ids)
    page, block = 32768, 128
    loaded = stats.get("loaded_bytes_full_attention", 0) + stats.get("loaded_bytes_sliding_window", 0)
    all_layers_loaded = spec.num_layers * (hit_tokens // block) * page
    stored_tokens = (len(cold.prompt_token_ids) // CHUNK) * CHUNK
    stored_bytes = stored.get("stored_bytes_full_attention", 0) + stored.get("stored_bytes_sliding_window", 0)
    hit_line = next((l for l in lines if l["load"] > 0), None)
    r = dict(
        label=label, preset=preset, interval=interval, layers=spec.num_layers,
        window=spec.sliding_window, total_tokens=total, hit_tokens=hit_tokens,
        loaded_tokens=stats.get("loaded_tokens", 0),
        loaded_full=stats.get("loaded_bytes_full_attention", 0),
        loaded_sliding=stats.get("loaded_bytes_sliding_window", 0), loaded=loaded,
        all_layers_loaded=all_layers_loaded,
        log_all_layers=hit_line["all"] if hit_line else None,
        log_planned=(hit_line["full"] + hit_line["sliding"]) if hit_line else None,
        loaded_vs_all_layers=loaded / all_layers_loaded if all_layers_loaded else None,
        stored_full=stored.get("stored_bytes_full_attention", 0),
        stored_sliding=stored.get("stored_bytes_sliding_window", 0),
        stored_bytes=stored_bytes, stored_tokens=stored_tokens,
        stored_per_token=stored_bytes / stored_tokens,
        all_layers_stored_per_token=spec.num_layers * page / block,
        exact=list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids),
        loaded_from_connector=stats.get("loaded_tokens", 0) == hit_tokens,
    )
    r["stored_vs_all_layers"] = r["stored_per_token"] / r["all_layers_stored_per_token"]
    say(f"[bytes] {label}: hit {hit_tokens}/{total}, loaded {loaded / 2**20:.2f} MiB "
        f"(full {r['loaded_full'] / 2**20:.2f} + sliding {r['loaded_sliding'] / 2**20:.2f}) vs "
        f"all-layers {all_layers_loaded / 2**20:.2f} MiB = {r['loaded_vs_all_layers']:.3f}x; "
        f"stored {r['stored_per_token']:.0f} B/token vs {r['all_layers_stored_per_token']:.0f}; "
        f"log all-layers {r['log_all_layers']}; exact {r['exact']}")
    return r


def run(quick: bool = False) -> dict:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    cases = [c for c in CASES if c[1] == "tiny-gemma3-5to1" and c[2] == 256] if quick else CASES
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_bytes_") as d:
        for label, preset, interval in cases:
            rows.append(measure(label, preset, interval, Path(d)))
    gemma = next(r for r in rows if r["preset"] == "tiny-gemma3-5to1" and r["interval"] == 256)
    mib = lambda b: b / 2**20  # noqa: E731
    summary = {
        "bytes_loaded_vs_all_layers": gemma["loaded_vs_all_layers"],
        "gemma3_stored_vs_all_layers": gemma["stored_vs_all_layers"],
        "cases": rows,
        "table": table(
            ["model", "interval", "hit/total", "loaded MiB (full+sliding)", "all-layers MiB",
             "loaded/all", "log: all-layers MiB", "stored B/token (full+sliding)",
             "all-layers B/token", "stored/all", "tokens exact"],
            [[r["label"], r["interval"], f"{r['hit_tokens']}/{r['total_tokens']}",
              f"{mib(r['loaded']):.2f} ({mib(r['loaded_full']):.2f}+{mib(r['loaded_sliding']):.2f})",
              mib(r["all_layers_loaded"]), r["loaded_vs_all_layers"],
              mib(r["log_all_layers"]) if r["log_all_layers"] is not None else None,
              f"{r['stored_per_token']:.0f} ({r['stored_full'] / r['stored_tokens']:.0f}"
              f"+{r['stored_sliding'] / r['stored_tokens']:.0f})",
              r["all_layers_stored_per_token"], r["stored_vs_all_layers"], r["exact"]]
             for r in rows]),
    }
    return summary


def main() -> int:
    return bench_main(__doc__, run, "BYTES")


if __name__ == "__main__":
    sys.exit(main())
