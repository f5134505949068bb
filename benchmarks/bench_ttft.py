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
``kv_cache_memory_bytes`` = 1 GiB, ``max_num_batched_tokens`` 2048 (chunked prefill), and
everything but vLLM's worker (front end, engine core, servers) bound to the core the worker
does not compute on (``_common.bind_beside_worker``):

* ``cold``: an engine without a connector, each prompt once;
* ``local hit``: the same engine, the same prompt again, 3 times (vLLM's own prefix cache);
  in every connector engine also right after each connector hit (no reset: vLLM's own hit
  with the connector configured, at the same moment; ``ttft_hit_vs_local`` is the ``cpu``
  tier's hit over it, ``ttft_hit_vs_local_no_connector_engine`` over the engine above; in the
  other tiers' engines it shows how fast that engine was at the time);
* ``hit (cpu|cpu_i1024|disk|redis|redis_cluster)``: an engine with LMCacheHMAConnector and
  one LMCache tier (``cpu``: a sliding-window tail at every chunk boundary,
  ``hma_checkpoint_interval`` 256; ``cpu_i1024``, disk and Redis: the default interval, this
  model's window of 1024, as the shipped configs);
  each prompt once (the connector stores it: "store" = cold TTFT with the connector),
  then 3 times ``reset_prefix_cache()`` + the same prompt (each hit can only come from
  the connector; the worker's stats confirm 8192 tokens loaded every time); next to each
  stored prompt, a cold prompt of its own that asks not to be stored (LMCache's
  ``lmcache.skip_save``), after it for even prompts and before it for odd ones: the
  same-engine, same-moment baseline of the store overheads (``store_overhead*``: the
  geometric mean of the pairs' ratios, ``store_overhead_ci95`` its 95% confidence interval
  by tier; over the no-connector engine: ``store_overhead_vs_no_connector_engine``). Disk and
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
  Redis Cluster: the same with 3 masters (``tests/redis_server.LocalRedisCluster``,
  ``redis-cluster://``); ``redis_hit_vs_cpu_hit`` and ``redis_cluster_hit_vs_cpu_hit``:
  their hits over the ``cpu_i1024`` hit (same interval, same bytes), each hit first taken
  over vLLM's local hit right after it in its own engine (``..._raw``: the plain ratio).

Exactness: the connector hit's token and its logprob against vLLM's local hit
(same compute split: bit-identical expected), and its token against the cold run.

Also: the KV capacity vLLM reports ("CPU KV cache size: N tokens", "Maximum
concurrency") for the same 1 GiB with the hybrid manager on and off (no connector).

    python benchmarks/bench_ttft.py [--quick] [--repeats N]   # --quick: 1 repeat, CPU tier only

Prints tables and a last line ``TTFT {json}`` with ``ttft_hit_vs_local`` and
``ttft_hit_vs_cold`` (CPU tier, ratio of medians: cold over 4 prompts, hits over 4 x 3,
local hits after them 4 x 3; ``--quick``: 1 prompt).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import statistics
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    OUT_DIR, Engine, RedisServer, bench_main, hma_transfer, lmcache_yaml, median, ratio, read_json,
    read_syscall_bytes, say, store_and_hit, table, ttfts,
)
from _timed_connector import SETTLE_S as TIMES_SETTLE_S  # noqa: E402

PROMPT_TOKENS = 8200
HIT = 8192
KV_BYTES = 2**30
MAX_MODEL_LEN = 16384
SKIP_SAVE = {"lmcache.skip_save": True}  # a request's kv_transfer_params: not stored
HITS_PER_PROMPT = 3  # hits are cheap: each prompt is hit 3 times (vLLM's cache emptied before each)
FIRST_WORDS = ["Hello", "Tell", "Good", "What", "Once", "Please", "Where", "The"]
WARM_UP = [2] + list(range(10, 300))  # a request before the timed ones: first-forward allocations
TIERS = {  # LMCache keys of each tier (chunk 256), as the shipped configs/*.yaml
    # the CPU tier with a sliding tail at every chunk boundary (the most hits, the most bytes)
    "cpu": dict(local_cpu=True, max_local_cpu_size=2, interval=256),
    # the CPU tier with the default interval (this model's window, 1024), as configs/cpu.yaml
    "cpu_i1024": dict(local_cpu=True, max_local_cpu_size=2),
    "disk": dict(local_cpu=False, max_local_cpu_size=1, max_local_disk_size=5),  # + local_disk
    "redis": dict(local_cpu=False, max_local_cpu_size=1, remote_serde="naive"),  # + remote_url
    "redis_cluster": dict(local_cpu=False, max_local_cpu_size=1, remote_serde="naive"),  # + remote_url
}
REDIS_TIERS = ("redis", "redis_cluster")
CLUSTER_MASTERS = 3


def build_model() -> tuple[Path, dict]:
    from lmcache_hma.testing.tiny_model import F, S, TinyModelSpec, build_tiny_model

    spec = TinyModelSpec("bench-gemma3-h512", "gemma3", ((S,) * 5 + (F,)) * 2, sliding_window=1024,
                         hidden_size=512, intermediate_size=2048, num_attention_heads=4, num_kv_heads=2,
                         head_dim=128)
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


def engine(model_dir: Path, log: str, transfer=None, **kwargs) -> Engine:
    """An engine as every run here has it: 1 GiB of KV cache, 16k tokens."""
    return Engine(model_dir, log, transfer, kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN,
                  **kwargs)


def capacity(log: str) -> dict:
    m = re.search(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                  r"tokens per request: ([\d.]+)x", log)
    if not m:
        return {}
    return {"kv_tokens": int(m.group(1).replace(",", "")), "per_request": int(m.group(2).replace(",", "")),
            "max_concurrency": float(m.group(3))}


def measure_no_connector(model_dir: Path, prompts) -> dict:
    """Each prompt cold, then ``HITS_PER_PROMPT`` times again: vLLM's own (local) prefix hits."""
    cold, local, outs = [], [], []
    with engine(model_dir, "ttft_noconn.log") as eng:
        for first, hits in store_and_hit(eng, prompts, HITS_PER_PROMPT, reset=False, warm_up=WARM_UP):
            c, lo = first["out"], hits[-1]["out"]
            if c["cached"] != 0 or any(h["out"]["cached"] != HIT for h in hits):
                say(f"[ttft] WARNING no-connector repeat {first['prompt']}: cached {c['cached']} / "
                    f"{[h['out']['cached'] for h in hits]}")
            cold.append(first["ttft"])
            local += [h["ttft"] for h in hits]
            outs.append({"cold": c, "local": lo})
            say(f"[ttft] no connector, prompt {first['prompt']}: cold {first['ttft']:.3f} s, local hits "
                f"{ttfts(hits)} s (cached {lo['cached']})")
        return {"cold": cold, "local": local, "outs": outs, "start_s": eng.start_s,
                "capacity": capacity(eng.log())}


def measure_connector(model_dir: Path, prompts, tier: str, workdir: Path,
                      redis: RedisServer | None = None, settle_s: float = 1.0, unstored=()) -> dict:
    """Store each prompt, then hit it ``HITS_PER_PROMPT`` times (vLLM's cache emptied each time).

    LMCache 0.5.6 copies an object it read from disk or Redis into its CPU buffer
    (``StorageManager.get`` -> ``LocalCPUBackend.submit_put_task``, even with
    ``local_cpu: false``); unless the connector drops that copy, later hits of the
    same prompt are served from CPU memory. Per hit the bytes read (disk: ``rchar``
    of the engine processes) or Redis GET hits are recorded, and ``hit`` holds, for
    disk and Redis, only the hits that read the tier (``repeat_hit`` the others).
    """
    where = {"disk": dict(local_disk=f"file://{workdir}/disk/"),
             **{t: dict(remote_url=redis.url if redis else None) for t in REDIS_TIERS}}.get(tier, {})
    yaml = lmcache_yaml(workdir / f"{tier}.yaml", **TIERS[tier], **where)
    times = workdir / f"{tier}.times"
    tier_reads = {**{t: lambda: redis_gets(redis) for t in REDIS_TIERS},
                  "disk": lambda: read_syscall_bytes(os.getpid())}.get(tier, lambda: 0)

    def probe() -> dict:  # counters of the worker, the scheduler (the timed subclass) and the tier
        w = read_json(Path(f"{times}.worker.json"))
        worker, sched = w.get("seconds", {}), read_json(Path(f"{times}.scheduler.json")).get("seconds", {})
        # what the engine waits for stores: in wait_for_save, and before a later step writes
        # a block the gathers read (worker.before_step, counted in gather_wait)
        return {"save_s": worker.get("wait_for_save", 0.0) + worker.get("gather_wait", 0.0), "reads": tier_reads(),
                "loaded": w.get("counters", {}).get("loaded_tokens", 0),
                "load_ms": 1e3 * worker.get("start_load_kv", 0.0),
                "lookup_ms": 1e3 * sched.get("get_num_new_matched_tokens", 0.0),
                # the scheduler's per-step work for the connector, between the worker's steps
                "meta_ms": 1e3 * sched.get("build_connector_meta", 0.0)}

    # Read by the engine's processes at start: the timed subclass writes its totals and the
    # worker's counters (beside the steps, not in them; no stats file, no DEBUG logging).
    env = {"BENCH_CONNECTOR_TIMES": str(times)}
    store, save_s, meta_ms, outs, hits, cold_unstored = [], [], [], [], [], []
    with engine(model_dir, f"ttft_{tier}.log", hma_transfer(yaml, timed=True), env=env) as eng:
        # the baseline of store_overhead in this engine: next to each stored prompt, a cold prompt
        # of its own that asks not to be stored (LMCache's lmcache.skip_save; the lookup still
        # runs); after the stored one for even prompts, before it for odd ones (A B, B A, ...), so
        # drift over the run weighs on both alike
        def unstored_cold(i: int) -> None:
            if i < len(unstored):
                cold_unstored.append(eng.generate(unstored[i], kv_transfer_params=SKIP_SAVE)[0])

        for first, mine in store_and_hit(eng, prompts, HITS_PER_PROMPT, settle_s=settle_s, probe=probe,
                                         probe_settle_s=TIMES_SETTLE_S, warm_up=WARM_UP, local_after_hit=True,
                                         before_first=lambda i: unstored_cold(i) if i % 2 else None):
            store.append(first["ttft"])
            save_s.append(first["save_s"])
            meta_ms.append(first["meta_ms"])
            hits += mine
            outs += [{"store": first["out"], "hit": h["out"], "prompt": h["prompt"]} for h in mine]
            if first["prompt"] % 2 == 0:
                unstored_cold(first["prompt"])
            say(f"[ttft] {tier}, prompt {first['prompt']}: store (cold) {first['ttft']:.3f} s, hits "
                f"{ttfts(mine)} s (cached {mine[-1]['out']['cached']}, loaded by the connector "
                f"{[x['loaded'] for x in mine]}, tier reads {[x['reads'] for x in mine]})"
                + (f", cold not stored {cold_unstored[-1]:.3f} s" if first["prompt"] < len(unstored) else ""))
        # vLLM's own prefix-cache hit in this engine right after each hit (no reset: the connector
        # looks nothing up), the baseline of ttft_hit_vs_local at the same moment on this host
        local_with = [h["local"]["ttft"] for h in hits if "local" in h]
        start = eng.start_s
        counters = read_json(Path(f"{times}.worker.json")).get("counters", {})
    # A hit read the tier if the tier saw the reads (disk: at least 1 MiB through read();
    # Redis: any GET hit); otherwise LMCache served it from its CPU copy.
    read_tier = {"disk": lambda x: x["reads"] >= 2**20,
                 **{t: lambda x: x["reads"] > 0 for t in REDIS_TIERS}}.get(tier)
    tier_hits = [x for x in hits if read_tier is None or read_tier(x)]
    repeat = [x for x in hits if read_tier is not None and not read_tier(x)]
    col = lambda xs, k: [x[k] for x in xs if x.get(k) is not None]  # noqa: E731
    return {"store": store, "cold_unstored": cold_unstored, "hit": col(tier_hits, "ttft"), "repeat_hit": col(repeat, "ttft"), "hits": hits,
            "local_hit_with_connector": local_with,
            "outs": outs, "loaded": col(hits, "loaded"), "start_s": start, "stats": counters,
            "load_ms": col(tier_hits, "load_ms"), "repeat_load_ms": col(repeat, "load_ms"), "save_s": save_s,
            "store_meta_ms": meta_ms,
            "lookup_ms": col(tier_hits, "lookup_ms"), "tier_reads": col(tier_hits, "reads"),
            "repeat_tier_reads": col(repeat, "reads")}


def redis_gets(redis) -> int:
    """GETs that found their key (``keyspace_hits``), over every node of a cluster."""
    nodes = getattr(redis, "nodes", None) or [redis]
    return sum(int(n.client().info("stats")["keyspace_hits"]) for n in nodes)


def redis_for(tier: str):
    """The Redis a tier's run needs (a context manager), or a null context."""
    if tier == "redis":
        return RedisServer(OUT_DIR / "ttft_redis_server.log")
    if tier == "redis_cluster":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.redis_server import LocalRedisCluster

        return LocalRedisCluster(Path(tempfile.mkdtemp(prefix="bench_ttft_cluster_")), masters=CLUSTER_MASTERS)
    return contextlib.nullcontext()


def measure_capacity_hma_off(model_dir: Path) -> dict:
    with engine(model_dir, "ttft_hma_off.log", hma=False) as eng:
        return capacity(eng.log())


def exactness(ref: dict, res: dict) -> dict:
    """Connector hits vs vLLM's local hit (token + logprob) and vs cold (token)."""
    pairs = [(o, ref["outs"][o["prompt"]]) for o in res["outs"]]
    out = dict(
        hit_equals_local_bitwise=all(o["hit"]["tokens"] == r["local"]["tokens"]
                                     and o["hit"]["logprob0"] == r["local"]["logprob0"] for o, r in pairs),
        hit_tokens_equal_cold=all(o["hit"]["tokens"] == r["cold"]["tokens"] for o, r in pairs),
        store_tokens_equal_cold=all(o["store"]["tokens"] == r["cold"]["tokens"] for o, r in pairs),
        all_hits_8192=all(o["hit"]["cached"] == HIT for o, _ in pairs),
    )
    if "loaded" in res:  # counted by our connector's worker
        out["all_loaded_by_connector"] = all(n == HIT for n in res["loaded"])
    return out


T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}  # two-sided t, by d.o.f.


def _store_pairs(r: dict) -> list[float]:
    """A tier's stored first requests, each over the cold prompt next to it that was not stored."""
    return [a / b for a, b in zip(r.get("store", []), r.get("cold_unstored", []))] if r else []


def _store_overhead(r: dict):
    """The geometric mean of ``_store_pairs``."""
    pairs = _store_pairs(r)
    return math.exp(statistics.fmean(map(math.log, pairs))) if pairs else None


def _store_overhead_ci95(r: dict):
    """95% confidence interval of ``_store_overhead`` (t over the pairs' log ratios), or None."""
    logs = [math.log(x) for x in _store_pairs(r)]
    if len(logs) < 2 or len(logs) - 1 not in T95:
        return None
    half = T95[len(logs) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    mid = statistics.fmean(logs)
    return [math.exp(mid - half), math.exp(mid + half)]


def _over_local(r: dict) -> float:
    """A tier's hit over vLLM's local hit right after each, in the same engine."""
    return median(r["hit"]) / median(r["local_hit_with_connector"])


def run(quick: bool = False, tiers=None, capacity_off: bool = True, repeats: int | None = None) -> dict:
    """``tiers``: default all four (CPU only with ``quick``); ``capacity_off``: also the KV
    capacity with the hybrid manager off (one more engine; never with ``quick``); ``repeats``:
    prompts per engine (default 4, 1 with ``quick``)."""
    repeats = repeats or (1 if quick else 4)
    tiers = tiers or (["cpu"] if quick else list(TIERS))
    model_dir, model = build_model()
    prompts = make_prompts(model_dir, repeats)
    # cold prompts of their own for each connector engine's same-moment baseline (never stored)
    unstored = make_prompts(model_dir, len(FIRST_WORDS))[-repeats:]
    say(f"[ttft] model {model['name']}: {model['params_millions']}M params, {model['layers']} layers "
        f"({model['pattern']}, window {model['window']}), hidden {model['hidden']}; "
        f"{len(prompts)} prompts of {PROMPT_TOKENS} tokens")
    ref = measure_no_connector(model_dir, prompts)
    results, notes = {}, []
    for tier in tiers:
        if tier in REDIS_TIERS and shutil.which("redis-server") is None:
            notes.append("Redis tier skipped: redis-server is not installed")
            say("[ttft] " + notes[-1])
            continue
        try:
            with tempfile.TemporaryDirectory(prefix=f"bench_ttft_{tier}_") as d, redis_for(tier) as redis:
                results[tier] = measure_connector(model_dir, prompts, tier, Path(d), redis, unstored=unstored)
            results[tier]["exact"] = exactness(ref, results[tier])
        except Exception as exc:  # record, don't fake
            notes.append(f"{tier} tier failed: {type(exc).__name__}: {exc}")
            say("[ttft] " + notes[-1])
    cap_on = ref["capacity"]
    cap_off = measure_capacity_hma_off(model_dir) if capacity_off and not quick else {}

    cold, local = median(ref["cold"]), median(ref["local"])
    rows = [["no connector: cold", cold, 1.0, None, ""],
            ["no connector: vLLM local prefix hit", local, cold / local, 1.0, f"cached {HIT}"]]
    for tier, r in results.items():
        h, s = median(r["hit"]), median(r["store"])
        rows.append([f"LMCacheHMA {tier}: store (first request)", s, cold / s, None,
                     f"{s / cold:.3f}x cold; in wait_for_save {median(r['save_s']):.3f} s"])
        if r.get("cold_unstored"):
            cu, ci = median(r["cold_unstored"]), _store_overhead_ci95(r)
            rows.append([f"LMCacheHMA {tier}: cold, not stored (lmcache.skip_save)", cu, cold / cu, None,
                         f"each first request above is {_store_overhead(r):.3f}x the one next to it"
                         + (f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")])
        reads = lambda xs: {"disk": f", read {median(xs) / 2**20:.0f} MiB (rchar)",  # noqa: E731
                            **{t: f", {median(xs):.0f} Redis GET hits" for t in REDIS_TIERS}}.get(tier, "")
        label = "hit" if tier.startswith("cpu") else "hit that read the tier"
        rows.append([f"LMCacheHMA {tier}: {label}", h, cold / h, h / local,
                     f"in start_load_kv {median(r['load_ms']):.1f} ms, lookups "
                     f"{median(r['lookup_ms']):.1f} ms{reads(r['tier_reads'])}"])
        if r.get("local_hit_with_connector"):  # vLLM's own hit right after each of those, same engine
            lw = median(r["local_hit_with_connector"])
            rows.append([f"LMCacheHMA {tier}: vLLM local hit right after each", lw, cold / lw, lw / local,
                         f"the connector hit is {h / lw:.3f}x this"])
        if r["repeat_hit"]:  # served from LMCache's CPU copy (see measure_connector)
            rh = median(r["repeat_hit"])
            rows.append([f"LMCacheHMA {tier}: repeat hits (LMCache's CPU copy)", rh, cold / rh, rh / local,
                         f"in start_load_kv {median(r['repeat_load_ms']):.1f} ms{reads(r['repeat_tier_reads'])}"])
    cpu = results.get("cpu", {})
    default_cpu = results.get("cpu_i1024") or cpu  # interval 1024 = this model's default (its window)
    local_with = cpu.get("local_hit_with_connector")
    summary = {
        # over vLLM's local hit in the same engine, each right after a connector hit: engines
        # started minutes apart on this shared host differ more than the connector's share
        "ttft_hit_vs_local": ratio(median(cpu["hit"]), median(local_with)) if local_with else None,
        # the same over the no-connector engine's local hit (another engine, another moment)
        "ttft_hit_vs_local_no_connector_engine": ratio(median(cpu["hit"]), local) if cpu else None,
        "ttft_hit_vs_cold": ratio(cold, median(cpu["hit"])) if cpu else None,
        # first request (stores) over a cold prompt of the same engine next to it that asked not
        # to be stored: engines started minutes apart on this shared host differ by more than that
        "store_overhead": _store_overhead(default_cpu),
        **{f"store_overhead_{t}": _store_overhead(results[t]) for t in ("disk", "redis") if t in results},
        # how well the pairs pin that down on this host (95% confidence interval, by tier)
        "store_overhead_ci95": {t: _store_overhead_ci95(r) for t, r in results.items()},
        # the same over the no-connector engine's cold runs (another engine, another moment)
        "store_overhead_vs_no_connector_engine": {t: ratio(median(r["store"]), cold) for t, r in results.items()},
        # a hit from Redis (one server, a cluster) over a hit from the CPU tier (same interval),
        # each over vLLM's local hit right after it in its own engine (how fast that engine was)
        **{f"{t}_hit_vs_cpu_hit": ratio(_over_local(results[t]), _over_local(default_cpu))
           for t in REDIS_TIERS if t in results and results[t]["hit"] and default_cpu},
        # the same, the hits' TTFTs as measured (engines minutes apart)
        **{f"{t}_hit_vs_cpu_hit_raw": ratio(median(results[t]["hit"]), median(default_cpu["hit"]))
           for t in REDIS_TIERS if t in results and results[t]["hit"] and default_cpu},
        # what the engine waited in wait_for_save per stored prompt (the rest is off the step)
        "wait_for_save_ms": 1e3 * median(default_cpu["save_s"]) if default_cpu else None,
        "ttft_cold_s": cold, "ttft_local_hit_s": local,
        "ttft_local_hit_with_connector_s": median(local_with) if local_with else None,
        "model": model, "prompt_tokens": PROMPT_TOKENS, "repeats": repeats,
        "no_connector": {k: ref[k] for k in ("cold", "local", "start_s")},
        "hits_per_prompt": HITS_PER_PROMPT,
        "tiers": {t: {**{k: v for k, v in r.items() if k not in ("hits", "outs", "stats")},
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
                      options=[("--repeats", dict(type=int, help="prompts per engine (default 4)"))],
                      keys=("ttft_hit_vs_local", "ttft_hit_vs_local_no_connector_engine", "ttft_hit_vs_cold", "store_overhead", "store_overhead_disk",
                            "store_overhead_redis", "redis_hit_vs_cpu_hit", "redis_cluster_hit_vs_cpu_hit",
                            "wait_for_save_ms", "ttft_cold_s",
                            "ttft_local_hit_s", "capacity_ratio_on_vs_off"))


if __name__ == "__main__":
    sys.exit(main())
