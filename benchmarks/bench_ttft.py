"""Time to first token on CPU: cold, vLLM's own prefix hit, this connector's hit.

Model (built locally, random weights): Gemma-3 text architecture, 12 layers in
Gemma-3's pattern (5 sliding-window : 1 full, window 1024), hidden 512, MLP 2048,
4 query heads, 2 KV heads of 128, bf16 (~``MODEL_PARAMS`` parameters; page 128 KiB
per layer and 128-token block). Large enough that prefill compute dominates: an
8k-token prompt takes seconds to prefill on these 2 cores.

Prompts: ``PROMPT_TOKENS`` = 8200 token ids (BOS + text), a distinct first word per
repeat so every repeat is a true cold run / true hit; ``max_tokens=1``. TTFT is
the wall time of ``LLM.generate`` for that one request (offline mode: scheduling,
prefill or load, one sampled token). The hit boundary is 8192 both for vLLM's
prefix cache (128-token blocks) and for the connector (256-token chunks).

Runs, all with the hybrid KV cache manager on, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``,
``kv_cache_memory_bytes`` = 1 GiB, ``max_num_batched_tokens`` 2048 (chunked prefill):

* ``cold``: an engine without a connector, each prompt once;
* ``local hit``: the same engine, the same prompt again, 3 times (vLLM's own prefix cache);
* ``hit (cpu|cpu_i1024|disk|redis)``: an engine with LMCacheHMAConnector and one LMCache
  tier (``cpu_i1024``: the CPU tier with ``hma_checkpoint_interval`` 1024 instead of 256);
  each prompt once (the connector stores it: "store" = cold TTFT with the connector),
  then 3 times ``reset_prefix_cache()`` + the same prompt (each hit can only come from
  the connector; the worker's stats confirm 8192 tokens loaded every time). Disk and
  Redis: bytes read from disk (``rchar`` of the engine processes) and Redis GET hits
  (``INFO stats``) are recorded per hit; only hits that read the tier count as the
  tier's figure. (LMCache 0.5.6 keeps a CPU copy of what it read, even with
  ``local_cpu: false``; unless the connector drops it, repeats are served from it and
  are reported apart.)
  The connector runs as ``_timed_connector.TimedLMCacheHMAConnector``: the product's
  class unchanged plus timers around its hooks, so the table can say how long the
  worker spent in ``wait_for_save`` per stored prompt, in ``start_load_kv`` per hit, and
  the scheduler in lookups.
  Redis: a private ``redis-server`` (``--save "" --appendonly no``), ``remote_serde:
  naive``, ``local_cpu: false``; skipped with a note when redis-server is missing.

Exactness: the connector hit's token and its logprob against vLLM's local hit
(same compute split: bit-identical expected), and its token against the cold run.

Also: the KV capacity vLLM reports ("CPU KV cache size: N tokens", "Maximum
concurrency") for the same 1 GiB with the hybrid manager on and off (no connector).

    python benchmarks/bench_ttft.py [--quick]     # --quick: 1 repeat, CPU tier only

Prints tables and a last line ``TTFT {json}`` with ``ttft_hit_vs_local`` and
``ttft_hit_vs_cold`` (CPU tier, ratio of medians: cold over 3 prompts, hits over 3 x 3).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    bench_main,
    OUT_DIR, Engine, RedisServer, hma_transfer, median, output_summary, ratio,
    read_json, read_syscall_bytes, redis_stat, say, table, wait_for_stats, write_yaml,
)

PROMPT_TOKENS = 8200
HIT = 8192
KV_BYTES = 2**30
MAX_MODEL_LEN = 16384
CHUNK = 256
HITS_PER_PROMPT = 3  # hits are cheap: each prompt is hit 3 times (vLLM's cache emptied before each)
FIRST_WORDS = ["Hello", "Tell", "Good", "What", "Once", "Please", "Where", "The"]


def model_spec():
    from lmcache_hma.tiny_model import F, S, TinyModelSpec

    return TinyModelSpec(
        "bench-gemma3-h512", "gemma3", ((S,) * 5 + (F,)) * 2, sliding_window=1024,
        hidden_size=512, intermediate_size=2048, num_attention_heads=4, num_kv_heads=2,
        head_dim=128)


def build_model() -> tuple[Path, dict]:
    from lmcache_hma.tiny_model import build_tiny_model

    spec = model_spec()
    d = build_tiny_model(spec)
    nbytes = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    info = dict(name=spec.name, path=str(d), layers=spec.num_layers,
                pattern="5 sliding : 1 full", window=spec.sliding_window, hidden=spec.hidden_size,
                intermediate=spec.intermediate_size, q_heads=spec.num_attention_heads,
                kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
                params_millions=round(nbytes / 2 / 1e6, 1),
                page_bytes=128 * spec.num_kv_heads * 2 * spec.head_dim * 2)
    return d, info


def make_prompts(model_dir: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for word in FIRST_WORDS[:n]:
        ids = tok(word + " " + "Hello, how are you?" * (PROMPT_TOKENS // 6 + 2)).input_ids
        out.append(ids[:PROMPT_TOKENS])
    assert len({tuple(p[:4]) for p in out}) == n, "prompts must differ at the start"
    return out


def _warm_up(eng: Engine) -> None:
    eng.generate_ids([2] + list(range(10, 300)))  # first-forward allocations, not timed


def capacity(log: str) -> dict:
    m = re.search(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                  r"tokens per request: ([\d.]+)x", log)
    if not m:
        return {}
    return {"kv_tokens": int(m.group(1).replace(",", "")), "per_request": int(m.group(2).replace(",", "")),
            "max_concurrency": float(m.group(3))}


def measure_no_connector(model_dir: Path, prompts, tag: str = "noconn") -> dict:
    log = OUT_DIR / f"ttft_{tag}.log"
    log.unlink(missing_ok=True)
    cold, local, outs = [], [], []
    with Engine(model_dir, log, kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN) as eng:
        _warm_up(eng)
        for i, p in enumerate(prompts):
            t_cold, o_cold = eng.generate_ids(p)
            c = output_summary(o_cold)
            cold.append(t_cold)
            locs = []
            for _ in range(HITS_PER_PROMPT):
                t_local, o_local = eng.generate_ids(p)
                lo = output_summary(o_local)
                if c["cached"] != 0 or lo["cached"] != HIT:
                    say(f"[ttft] WARNING no-connector repeat {i}: cached {c['cached']} / {lo['cached']}")
                local.append(t_local)
                locs.append(t_local)
            outs.append({"cold": c, "local": lo})
            say(f"[ttft] no connector, prompt {i}: cold {t_cold:.3f} s, local hits "
                f"{', '.join(f'{x:.3f}' for x in locs)} s (cached {lo['cached']})")
        start = eng.start_s
        cap = capacity(eng.log())
    return {"cold": cold, "local": local, "outs": outs, "start_s": start, "capacity": cap}


def tier_yaml(tier: str, workdir: Path, redis_url: str | None = None) -> Path:
    extra = {"hma_checkpoint_interval": 256}
    if tier == "cpu":  # as configs/cpu.yaml
        return write_yaml(workdir / "cpu.yaml", chunk_size=CHUNK, local_cpu=True,
                          max_local_cpu_size=2, extra_config=extra)
    if tier == "cpu_i1024":  # configs/cpu.yaml with a sliding tail every 1024 tokens (= the window)
        return write_yaml(workdir / "cpu_i1024.yaml", chunk_size=CHUNK, local_cpu=True,
                          max_local_cpu_size=2, extra_config={"hma_checkpoint_interval": 1024})
    if tier == "disk":  # as configs/disk.yaml, in a fresh directory
        disk = workdir / "disk"
        disk.mkdir()
        return write_yaml(workdir / "disk.yaml", chunk_size=CHUNK, local_cpu=False,
                          max_local_cpu_size=1, local_disk=f"file://{disk}/",
                          max_local_disk_size=5, extra_config=extra)
    if tier == "redis":
        return write_yaml(workdir / "redis.yaml", chunk_size=CHUNK, local_cpu=False,
                          max_local_cpu_size=1, remote_url=redis_url, remote_serde="naive",
                          extra_config=extra)
    raise ValueError(tier)


def measure_connector(model_dir: Path, prompts, tier: str, workdir: Path,
                      redis: RedisServer | None = None, settle_s: float = 1.0) -> dict:
    """Store each prompt, then hit it ``HITS_PER_PROMPT`` times (vLLM's cache emptied each time).

    LMCache 0.5.6 copies an object it read from disk or Redis into its CPU buffer
    (``StorageManager.get`` -> ``LocalCPUBackend.submit_put_task``, even with
    ``local_cpu: false``); unless the connector drops that copy, later hits of the
    same prompt are served from CPU memory. Per hit the bytes read (disk: ``rchar``
    of the engine processes) or Redis GET hits are recorded, and ``hit`` holds, for
    disk and Redis, only the hits that read the tier (``repeat_hit`` the others).
    """
    yaml = tier_yaml(tier, workdir, redis.url if redis else None)
    stats = workdir / f"{tier}.stats.json"
    log = OUT_DIR / f"ttft_{tier}.log"
    log.unlink(missing_ok=True)
    transfer = hma_transfer(yaml, {"hma_stats_file": str(stats)}, timed=True)
    times = workdir / f"{tier}.times"
    worker_times = lambda: read_json(Path(f"{times}.worker.json")).get("seconds", {})  # noqa: E731
    sched_times = lambda: read_json(Path(f"{times}.scheduler.json")).get("seconds", {})  # noqa: E731
    if tier == "redis":
        tier_reads = lambda: redis_stat(redis.port, "keyspace_hits")  # noqa: E731
    elif tier == "disk":
        tier_reads = lambda: read_syscall_bytes(os.getpid())  # noqa: E731
    else:
        tier_reads = lambda: 0  # noqa: E731
    # Set only while the engine's processes are spawned (they read them at start):
    # the worker logs each load's duration at DEBUG; the timed subclass writes its totals.
    env = {"LMCACHE_HMA_LOG_LEVEL": "DEBUG", "BENCH_CONNECTOR_TIMES": str(times)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        eng = Engine(model_dir, log, transfer, kv_cache_memory_bytes=KV_BYTES,
                     max_model_len=MAX_MODEL_LEN)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    store, save_s, outs, hits = [], [], [], []
    with eng:
        _warm_up(eng)
        for i, p in enumerate(prompts):
            w0 = worker_times().get("wait_for_save", 0.0)
            t_store, o_store = eng.generate_ids(p)
            s = output_summary(o_store)
            store.append(t_store)
            time.sleep(settle_s)  # let asynchronous tier writes land (not timed)
            save_s.append(worker_times().get("wait_for_save", 0.0) - w0)
            for n in range(HITS_PER_PROMPT):  # every one a connector hit: vLLM's cache is emptied
                eng.reset_prefix_cache()
                before = read_json(stats).get("loaded_tokens", 0)
                l0, r0 = sched_times().get("get_num_new_matched_tokens", 0.0), tier_reads()
                t_hit, o_hit = eng.generate_ids(p)
                after = wait_for_stats(stats, "loaded_tokens", before + HIT, timeout=3).get("loaded_tokens", 0)
                h = output_summary(o_hit)
                hits.append(dict(prompt=i, n=n, ttft=t_hit, loaded=after - before, reads=tier_reads() - r0,
                                 lookup_ms=1e3 * (sched_times().get("get_num_new_matched_tokens", 0.0) - l0)))
                outs.append({"store": s, "hit": h, "prompt": i})
            mine = [x for x in hits if x["prompt"] == i]
            ttfts = ", ".join(f"{x['ttft']:.3f}" for x in mine)
            say(f"[ttft] {tier}, prompt {i}: store (cold) {t_store:.3f} s, hits {ttfts} s "
                f"(cached {h['cached']}, loaded by the connector {[x['loaded'] for x in mine]}, "
                f"tier reads {[x['reads'] for x in mine]})")
        load_ms = [float(m) for m in re.findall(r"loaded \S+ tokens \[\d+, \d+\) \w+ in ([\d.]+) ms", eng.log())]
        start = eng.start_s
    for x, ms in zip(hits, load_ms):  # one load per hit, in order
        x["load_ms"] = ms
    # A hit read the tier if the tier saw the reads (disk: at least 1 MiB through read();
    # Redis: any GET hit); otherwise LMCache served it from its CPU copy.
    read_tier = {"disk": lambda x: x["reads"] >= 2**20, "redis": lambda x: x["reads"] > 0}.get(tier)
    tier_hits = hits if read_tier is None else [x for x in hits if read_tier(x)]
    repeat = [] if read_tier is None else [x for x in hits if not read_tier(x)]
    return {"store": store, "hit": [x["ttft"] for x in tier_hits],
            "repeat_hit": [x["ttft"] for x in repeat], "hits": hits, "outs": outs,
            "loaded": [x["loaded"] for x in hits], "start_s": start, "stats": read_json(stats),
            "load_ms": [x.get("load_ms") for x in tier_hits if x.get("load_ms") is not None],
            "repeat_load_ms": [x.get("load_ms") for x in repeat if x.get("load_ms") is not None],
            "save_s": save_s, "lookup_ms": [x["lookup_ms"] for x in tier_hits],
            "tier_reads": [x["reads"] for x in tier_hits], "repeat_tier_reads": [x["reads"] for x in repeat]}


def measure_capacity_hma_off(model_dir: Path) -> dict:
    log = OUT_DIR / "ttft_hma_off.log"
    log.unlink(missing_ok=True)
    with Engine(model_dir, log, hma=False, kv_cache_memory_bytes=KV_BYTES,
                max_model_len=MAX_MODEL_LEN) as eng:
        return capacity(eng.log())


def exactness(ref: dict, res: dict) -> dict:
    """Connector hits vs vLLM's local hit (token + logprob) and vs cold (token)."""
    pairs = [(o, ref["outs"][o["prompt"]]) for o in res["outs"]]
    return dict(
        hit_equals_local_bitwise=all(o["hit"]["tokens"] == r["local"]["tokens"]
                                     and o["hit"]["logprob0"] == r["local"]["logprob0"] for o, r in pairs),
        hit_tokens_equal_cold=all(o["hit"]["tokens"] == r["cold"]["tokens"] for o, r in pairs),
        store_tokens_equal_cold=all(o["store"]["tokens"] == r["cold"]["tokens"] for o, r in pairs),
        all_hits_8192=all(o["hit"]["cached"] == HIT for o, _ in pairs),
        all_loaded_by_connector=all(n == HIT for n in res["loaded"]),
    )


def run(quick: bool = False) -> dict:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    repeats = 1 if quick else 3
    tiers = ["cpu"] if quick else ["cpu", "cpu_i1024", "disk", "redis"]
    model_dir, model = build_model()
    prompts = make_prompts(model_dir, repeats)
    say(f"[ttft] model {model['name']}: {model['params_millions']}M params, {model['layers']} layers "
        f"({model['pattern']}, window {model['window']}), hidden {model['hidden']}; "
        f"{len(prompts)} prompts of {PROMPT_TOKENS} tokens")
    ref = measure_no_connector(model_dir, prompts)
    results, notes = {}, []
    for tier in tiers:
        with tempfile.TemporaryDirectory(prefix=f"bench_ttft_{tier}_") as d:
            redis = None
            try:
                if tier == "redis":
                    if shutil.which("redis-server") is None:
                        notes.append("Redis tier skipped: redis-server is not installed")
                        say("[ttft] " + notes[-1])
                        continue
                    redis = RedisServer(OUT_DIR / "ttft_redis_server.log")
                results[tier] = measure_connector(model_dir, prompts, tier, Path(d), redis)
                results[tier]["exact"] = exactness(ref, results[tier])
            except Exception as exc:  # record, don't fake
                notes.append(f"{tier} tier failed: {type(exc).__name__}: {exc}")
                say("[ttft] " + notes[-1])
            finally:
                if redis is not None:
                    redis.stop()
    cap_on = ref["capacity"]
    cap_off = {} if quick else measure_capacity_hma_off(model_dir)

    cold, local = median(ref["cold"]), median(ref["local"])
    rows = [["no connector: cold", cold, 1.0, None, ""],
            ["no connector: vLLM local prefix hit", local, cold / local, 1.0, f"cached {HIT}"]]
    for tier, r in results.items():
        h, s = median(r["hit"]), median(r["store"])
        rows.append([f"LMCacheHMA {tier}: store (first request)", s, cold / s, None,
                     f"{s / cold:.3f}x cold; in wait_for_save {median(r['save_s']):.3f} s"])
        reads = {"cpu": "", "cpu_i1024": "", "disk": f", read {median(r['tier_reads']) / 2**20:.0f} MiB (rchar)",
                 "redis": f", {median(r['tier_reads']):.0f} Redis GET hits"}[tier]
        label = "hit" if tier.startswith("cpu") else "hit that read the tier"
        rows.append([f"LMCacheHMA {tier}: {label}", h, cold / h, h / local,
                     f"in start_load_kv {median(r['load_ms']):.1f} ms, lookups "
                     f"{median(r['lookup_ms']):.1f} ms{reads}"])
        if r["repeat_hit"]:  # served from LMCache's CPU copy (see measure_connector)
            rh = median(r["repeat_hit"])
            rreads = {"disk": f", read {median(r['repeat_tier_reads']) / 2**20:.0f} MiB",
                      "redis": f", {median(r['repeat_tier_reads']):.0f} Redis GET hits"}[tier]
            rows.append([f"LMCacheHMA {tier}: repeat hits (LMCache's CPU copy)", rh, cold / rh, rh / local,
                         f"in start_load_kv {median(r['repeat_load_ms']):.1f} ms{rreads}"])
    cpu = results.get("cpu", {})
    default_cpu = results.get("cpu_i1024") or cpu  # interval 1024 = this model's default (its window)
    summary = {
        "ttft_hit_vs_local": ratio(median(cpu["hit"]), local) if cpu else None,
        "ttft_hit_vs_cold": ratio(cold, median(cpu["hit"])) if cpu else None,
        # first request (stores) over a cold run without the connector
        "store_overhead": ratio(median(default_cpu["store"]), cold) if default_cpu else None,
        **{f"store_overhead_{t}": ratio(median(results[t]["store"]), cold) for t in ("disk", "redis")
           if t in results},
        # what the engine waited in wait_for_save per stored prompt (the rest is off the step)
        "wait_for_save_ms": 1e3 * median(default_cpu["save_s"]) if default_cpu else None,
        "ttft_cold_s": cold, "ttft_local_hit_s": local,
        "model": model, "prompt_tokens": PROMPT_TOKENS, "repeats": repeats,
        "no_connector": {k: ref[k] for k in ("cold", "local", "start_s")},
        "hits_per_prompt": HITS_PER_PROMPT,
        "tiers": {t: {**{k: r[k] for k in ("store", "hit", "repeat_hit", "loaded", "start_s", "exact",
                                             "load_ms", "repeat_load_ms", "save_s", "lookup_ms",
                                             "tier_reads", "repeat_tier_reads")},
                      "stored_bytes_full": r["stats"].get("stored_bytes_full_attention"),
                      "stored_bytes_sliding": r["stats"].get("stored_bytes_sliding_window"),
                      "loaded_bytes_per_hit": (r["stats"].get("loaded_bytes_full_attention", 0)
                                               + r["stats"].get("loaded_bytes_sliding_window", 0))
                      / max(1, r["stats"].get("loads_ok", 1))}
                  for t, r in results.items()},
        "capacity": {"hma_on": cap_on, "hma_off": cap_off},
        "notes": notes,
        "table": table(["run", "TTFT median (s)", "speed-up vs cold", "vs local hit", "notes"], rows),
        "raw": {"no_connector": ref, **results},
    }
    if cap_on and cap_off:
        summary["capacity_ratio_on_vs_off"] = cap_on["kv_tokens"] / cap_off["kv_tokens"]
        summary["capacity_table"] = table(
            ["hybrid KV cache manager", "KV cache memory", "CPU KV cache size (tokens)",
             f"max concurrency at {cap_on['per_request']} tokens"],
            [["on", "1 GiB", cap_on["kv_tokens"], cap_on["max_concurrency"]],
             ["off", "1 GiB", cap_off["kv_tokens"], cap_off["max_concurrency"]]])
    return summary


def main() -> int:
    return bench_main(__doc__, run, "TTFT", tables=("table", "capacity_table"),
                      keys=("ttft_hit_vs_local", "ttft_hit_vs_cold", "store_overhead", "store_overhead_disk",
                            "store_overhead_redis", "wait_for_save_ms", "ttft_cold_s",
                            "ttft_local_hit_s", "capacity_ratio_on_vs_off"))


if __name__ == "__main__":
    sys.exit(main())
