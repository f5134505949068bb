"""The peer: LMCache's multi-process (MP) mode, on the model and prompts of bench_ttft.

LMCache MP is the LMCache setup that runs on CPU with vLLM's hybrid manager on
(NOTES.md): a separate ``lmcache server`` process holds the cache, vLLM talks to
it through ``LMCacheMPConnector`` (``lmcache_driven`` transfer mode: the CPU
default ``engine_driven`` refuses several KV groups). Same model, prompts,
``kv_cache_memory_bytes`` and thread settings as bench_ttft; server L1 2 GB,
chunk 256 (our CPU tier: 2 GB, chunk 256).

Per prompt: a first request (the connector stores; "store" TTFT, compared with the
cold TTFT without a connector = store overhead), then 3 times ``reset_prefix_cache()``
+ the same prompt (hit TTFT, hit tokens = ``num_cached_tokens``), as bench_ttft does. Exactness: the
hit's token and logprob against vLLM's own local hit, its token against cold.

Compared with this connector's CPU-tier results from bench_ttft (passed in by
run_all.py; measured here when run alone).

    python benchmarks/bench_peer.py [--quick]

Prints a table and ``PEER {json}`` with ``ttft_hit_vs_lmcache_mp`` (our CPU-tier
hit TTFT / LMCache MP's, medians).
"""

from __future__ import annotations

import shutil
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ttft  # noqa: E402
from _common import (  # noqa: E402
    OUT_DIR, ServerProcess, bench_main, cpu_seconds, free_port, lmcache_mp_transfer, median,
    ratio, say, store_and_hit, table, ttfts,
)


class LMCacheMPServer(ServerProcess):
    """``lmcache server`` on 127.0.0.1 (ZMQ port + HTTP health port)."""

    stop_timeout = 15.0

    def __init__(self, log_path: Path, l1_gb: float = 2, chunk: int = 256, timeout: float = 120):
        exe = shutil.which("lmcache") or str(Path(sys.executable).parent / "lmcache")
        self.port, self.http_port = free_port(), free_port()
        cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", str(self.http_port), "--l1-size-gb", str(l1_gb),
               "--chunk-size", str(chunk), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto"]
        self.cmd = " ".join(["lmcache", *cmd[1:]])  # for the report: no machine paths
        self._start(cmd, log_path, self._healthy, timeout)

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=1) as r:
            return r.status == 200


def measure_mp(model_dir: Path, prompts) -> dict:
    """bench_ttft's procedure with LMCacheMPConnector; the server's CPU time per request
    (utime + stime of its processes, less its idle rate over the same wall time)."""
    store, hit, outs, server_cpu_store, server_cpu_hit = [], [], [], [], []
    with LMCacheMPServer(OUT_DIR / "peer_server.log") as server, bench_ttft.engine(
            model_dir, "peer_vllm.log", lmcache_mp_transfer("127.0.0.1", server.port)) as eng:
        pid = server.proc.pid
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        time.sleep(3.0)  # the server's background threads use some CPU while idle: measure, subtract
        idle_cpu_per_s = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
        probe = lambda: {"cpu": cpu_seconds(pid) - idle_cpu_per_s * time.perf_counter()}  # noqa: E731
        for first, hits in store_and_hit(eng, prompts, bench_ttft.HITS_PER_PROMPT, settle_s=1.0,
                                         probe=probe, warm_up=bench_ttft.WARM_UP):
            store.append(first["ttft"])
            server_cpu_store.append(first["cpu"])
            hit += [h["ttft"] for h in hits]
            server_cpu_hit += [h["cpu"] for h in hits]
            outs += [{"store": first["out"], "hit": h["out"], "prompt": h["prompt"]} for h in hits]
            say(f"[peer] LMCache MP, prompt {first['prompt']}: store (cold) {first['ttft']:.3f} s, hits "
                f"{ttfts(hits)} s (cached {hits[-1]['out']['cached']})")
    return {"store": store, "hit": hit, "outs": outs, "start_s": eng.start_s,
            "server_start_s": server.start_s, "server_cmd": server.cmd,
            "server_cpu_store_s": server_cpu_store, "server_cpu_hit_s": server_cpu_hit,
            "server_idle_cpu_per_s": idle_cpu_per_s}


def run(quick: bool = False, ours: dict | None = None) -> dict:
    """``ours``: bench_ttft.run()'s result (its engines are not started again)."""
    if ours is None or "cpu" not in ours.get("raw", {}):
        say("[peer] measuring this connector's CPU tier first (bench_ttft's no-connector and CPU runs)")
        ours = bench_ttft.run(quick, tiers=["cpu"], capacity_off=False)
    repeats = ours["repeats"]
    model_dir, model = bench_ttft.build_model()
    prompts = bench_ttft.make_prompts(model_dir, repeats)
    ref, cpu, c1024 = ours["raw"]["no_connector"], ours["raw"]["cpu"], ours["raw"].get("cpu_i1024")
    notes = []
    try:
        mp = measure_mp(model_dir, prompts)
    except Exception as exc:  # record why; no numbers are made up
        notes.append(f"LMCache MP failed: {type(exc).__name__}: {exc}")
        say("[peer] " + notes[-1])
        mp = None
    cold, local = median(ref["cold"]), median(ref["local"])
    our_hit, our_store = median(cpu["hit"]), median(cpu["store"])

    def row(label: str, r: dict, store_work: str | None, load_work: str | None) -> list:
        e = bench_ttft.exactness(ref, r)
        return [label, median(o["hit"]["cached"] for o in r["outs"]), median(r["store"]), median(r["hit"]),
                median(r["store"]) / cold, store_work, load_work,
                f"token+logprob = vLLM local hit: {e['hit_equals_local_bitwise']}; "
                f"token = cold: {e['hit_tokens_equal_cold']}"]

    def ours_row(label: str, r: dict) -> list:
        save, load = r.get("save_s"), r.get("load_ms")
        return row(label, r, f"{median(save):.3f} (worker, in wait_for_save)" if save else None,
                   f"{median(load):.1f} (worker, in start_load_kv)" if load else None)

    rows = [["no connector", None, cold, local, None, None, None, "reference"],
            ours_row("LMCacheHMA (CPU tier)", cpu)]
    if c1024:
        rows.append(ours_row("LMCacheHMA (CPU tier, interval 1024)", c1024))
    summary = {"ttft_hit_vs_lmcache_mp": None, "notes": notes, "repeats": repeats,
               "ours": {"store_s": cpu["store"], "hit_s": cpu["hit"], "store_overhead": our_store / cold},
               "no_connector": {"cold_s": ref["cold"], "local_s": ref["local"]}}
    if mp is not None:
        mp_hit, mp_store = median(mp["hit"]), median(mp["store"])
        rows.append(row("LMCache MP (lmcache_driven)", mp,
                        f"{median(mp['server_cpu_store_s']):.3f} (server CPU, asynchronous)",
                        f"{1e3 * median(mp['server_cpu_hit_s']):.1f} (server CPU)"))
        summary.update(
            ttft_hit_vs_lmcache_mp=ratio(our_hit, mp_hit),
            store_overhead_ours=our_store / cold, store_overhead_lmcache_mp=mp_store / cold,
            lmcache_mp={"store_s": mp["store"], "hit_s": mp["hit"], "engine_start_s": mp["start_s"],
                        "hit_tokens": [o["hit"]["cached"] for o in mp["outs"]],
                        "exact": bench_ttft.exactness(ref, mp),
                        **{k: v for k, v in mp.items() if k.startswith("server_")}},
            ours_save_s=cpu.get("save_s"), ours_load_ms=cpu.get("load_ms"),
            ours_i1024={"store_s": c1024["store"], "save_s": c1024["save_s"],
                        "store_overhead": median(c1024["store"]) / cold} if c1024 else None,
            ours_engine_start_s=cpu["start_s"], no_connector_engine_start_s=ref["start_s"])
    summary["table"] = table(
        ["connector", "hit tokens (median)", "first-request TTFT (s)", "hit TTFT (s)",
         "store overhead (x cold)", "store work per prompt (s)", "load work per hit (ms)",
         "exactness"], rows)
    return summary


def main() -> int:
    return bench_main(__doc__, run, "PEER", keys=("ttft_hit_vs_lmcache_mp", "store_overhead_ours",
                                                  "store_overhead_lmcache_mp", "notes"))


if __name__ == "__main__":
    sys.exit(main())
