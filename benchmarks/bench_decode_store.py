"""What storing answers costs decode: one engine, the same requests with and without stores.

Issue 37's goal: decode throughput with answers stored >= 0.98x of not storing them. Measured in
ONE engine (the tiny Gemma-3, bf16, CPU tier, ``hma_store_answers`` on), request by request:
each pair is two requests of the same shape (a ~200-token prompt of its own, 1030 greedy
tokens, ``min_tokens`` = ``max_tokens``): one stored as usual (its prompt's chunks, 4 answer
chunks with their sliding tails while it decodes, its turn end when it finishes), one with
``lmcache.skip_save`` (nothing stored; its lookup still runs). The order alternates (A B, B A,
...) so drift weighs on both alike. Every prompt is new, so neither request hits.

Reported: the median of the pairs' time ratios (``decode_store_vs_skip``: time without stores /
time with, so >= 0.98 meets the goal), and where the stores' time goes in the engine's steps,
from the timed connector (``_timed_connector``): per stored request, the worker's
``wait_for_save`` + ``handle_preemptions`` (which gathers turn ends and waits for gathers a step
must not overtake) and the scheduler's ``build_connector_meta``, against the same for the
unstored request.

    python benchmarks/bench_decode_store.py [--quick]

Prints a table and ``DECODE_STORE {json}``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Engine, bench_main, hma_transfer, lmcache_yaml, median, read_json, say, table,
)
from _timed_connector import SETTLE_S  # noqa: E402

OUTPUT_TOKENS = 1030  # 4 answer chunks of 256 past a ~200-token prompt, and a turn end
SKIP_SAVE = {"lmcache.skip_save": True}
WORDS = ["Hello", "Tell", "Good", "What", "Once", "Please", "Where", "The", "When", "Why", "How", "Some"]


def run(quick: bool = False) -> dict:
    import time

    from lmcache_hma.testing.tiny_model import build_tiny_model

    pairs = 3 if quick else 6
    model = build_tiny_model("tiny-gemma3")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        yaml = lmcache_yaml(work / "cpu.yaml", local_cpu=True, max_local_cpu_size=2)
        times = work / "decode.times"
        env = {"BENCH_CONNECTOR_TIMES": str(times)}

        def hooks() -> float:
            time.sleep(SETTLE_S)
            w = read_json(Path(f"{times}.worker.json")).get("seconds", {})
            s = read_json(Path(f"{times}.scheduler.json")).get("seconds", {})
            return (w.get("wait_for_save", 0.0) + w.get("handle_preemptions", 0.0)
                    + s.get("build_connector_meta", 0.0))

        rows, ratios, hook_s = [], [], {"stored": [], "skipped": []}
        with Engine(model, "decode_store.log", hma_transfer(yaml, timed=True), env=env,
                    max_model_len=2048, max_num_batched_tokens=512) as eng:
            eng.generate("Warm up " * 50, max_tokens=16)
            for i in range(pairs):
                seconds = {}
                for kind in (("stored", "skipped") if i % 2 == 0 else ("skipped", "stored")):
                    prompt = f"{WORDS[(2 * i + (kind == 'skipped')) % len(WORDS)]} {i}: " + "a story " * 95
                    before = hooks()
                    s, out = eng.generate(prompt, max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS,
                                          kv_transfer_params=SKIP_SAVE if kind == "skipped" else None)
                    assert len(out.outputs[0].token_ids) == OUTPUT_TOKENS and not out.num_cached_tokens
                    seconds[kind] = s
                    hook_s[kind].append(hooks() - before)
                ratios.append(seconds["skipped"] / seconds["stored"])
                rows.append([i, f"{OUTPUT_TOKENS / seconds['stored']:.1f}", f"{OUTPUT_TOKENS / seconds['skipped']:.1f}",
                             f"{ratios[-1]:.3f}", f"{1e3 * hook_s['stored'][-1]:.1f}",
                             f"{1e3 * hook_s['skipped'][-1]:.1f}"])
                say(f"[decode] pair {i}: stored {seconds['stored']:.2f} s, skipped {seconds['skipped']:.2f} s")
            counters = read_json(Path(f"{times}.worker.json")).get("counters", {})
    stored_ms, skipped_ms = 1e3 * median(hook_s["stored"]), 1e3 * median(hook_s["skipped"])
    return {
        "decode_store_vs_skip": round(median(ratios), 4),
        "decode_store_hook_ms": round(stored_ms, 2),
        "decode_skip_hook_ms": round(skipped_ms, 2),
        "decode_store_hook_ms_per_token": round((stored_ms - skipped_ms) / OUTPUT_TOKENS, 4),
        "objects_stored": counters.get("objects_stored", 0),
        "table": table(["pair", "tok/s stored", "tok/s not stored", "time ratio (not / stored)",
                        "connector ms in steps, stored", "not stored"], rows),
        "notes": [f"{pairs} pairs; {OUTPUT_TOKENS} tokens each; the connector's step-path time: worker "
                  "wait_for_save + handle_preemptions, scheduler build_connector_meta"],
    }


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "DECODE_STORE"))
