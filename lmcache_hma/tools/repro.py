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

FIRST_PROMPT = "Hello, how are you?" * 5000 + "Hello, my name is"
SECOND_PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
# 384 blocks of the tiny model: one 30k-token prompt fits, two do not.
DEFAULT_KV_CACHE_BYTES = 24 * 2**20
# The same for other presets (tiny-qwen3next: 160 blocks of 256 tokens, 256 KiB each).
KV_CACHE_BYTES = {"tiny-qwen3next": 40 * 2**20}


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
    print(f"vLLM's prefix cache had evicted first_prompt: {result['evicted']} "
          f"(all {last['hit']} hit tokens were loaded by the connector)")
    print(f"tokens identical to the cold run without the connector: {result['identical']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-hma repro", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="LMCache YAML (configs/cpu.yaml, disk.yaml, redis.yaml, ...)")
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: the built-in tiny hybrid model)")
    parser.add_argument("--preset", default=None,
                        help="built-in tiny model when no --model: tiny-gemma3 (default; sliding "
                             "window) or tiny-qwen3next (gated delta net), see lmcache-hma build-model")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="vLLM's KV cache size; small enough that prompts 2 and 3 evict prompt 1")
    args = parser.parse_args(argv)
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = KV_CACHE_BYTES.get(args.preset, DEFAULT_KV_CACHE_BYTES)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    t0 = time.perf_counter()
    result = run_repro(args.model, args.config, args.kv_cache_bytes, args.preset)
    print(f"\nreproduction took {time.perf_counter() - t0:.0f} s")
    ok = result["identical"] and result["evicted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
