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
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ttft  # noqa: E402
from _common import (  # noqa: E402
    bench_main,
    OUT_DIR, Engine, cpu_seconds, free_port, lmcache_mp_transfer, median,
    output_summary, ratio, say, table,
)


class LMCacheMPServer:
    """``lmcache server`` on 127.0.0.1 (ZMQ port + HTTP health port)."""

    def __init__(self, log_path: Path, l1_gb: float = 2, chunk: int = 256, timeout: float = 120):
        exe = shutil.which("lmcache") or str(Path(sys.executable).parent / "lmcache")
        self.port, self.http_port = free_port(), free_port()
        self.log = open(log_path, "w")
        cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", str(self.http_port), "--l1-size-gb", str(l1_gb),
               "--chunk-size", str(chunk), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto"]
        self.cmd = " ".join(["lmcache", *cmd[1:]])  # for the report: no machine paths
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode} (log {log_path})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        self.start_s = time.time() - t0
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"lmcache server not healthy after {timeout} s (log {log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def measure_mp(model_dir: Path, prompts) -> dict:
    log = OUT_DIR / "peer_vllm.log"
    log.unlink(missing_ok=True)
    server = LMCacheMPServer(OUT_DIR / "peer_server.log")
    store, hit, outs, server_cpu_store, server_cpu_hit = [], [], [], [], []
    try:
        with Engine(model_dir, log, lmcache_mp_transfer("127.0.0.1", server.port),
                    kv_cache_memory_bytes=bench_ttft.KV_BYTES,
                    max_model_len=bench_ttft.MAX_MODEL_LEN) as eng:
            bench_ttft._warm_up(eng)
            # the server's background threads use some CPU while idle: measure, subtract
            pid = server.proc.pid
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            time.sleep(3.0)
            idle_cpu_per_s = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
            for i, p in enumerate(prompts):
                c0, t0 = cpu_seconds(pid), time.perf_counter()
                t_store, o_store = eng.generate_ids(p)
                s = output_summary(o_store)
                store.append(t_store)
                time.sleep(1.0)  # same settle time as bench_ttft (not timed)
                server_cpu_store.append(cpu_seconds(pid) - c0 - (time.perf_counter() - t0) * idle_cpu_per_s)
                hs = []
                for _ in range(bench_ttft.HITS_PER_PROMPT):
                    eng.reset_prefix_cache()
                    c0, t0 = cpu_seconds(pid), time.perf_counter()
                    t_hit, o_hit = eng.generate_ids(p)
                    server_cpu_hit.append(cpu_seconds(pid) - c0 - (time.perf_counter() - t0) * idle_cpu_per_s)
                    h = output_summary(o_hit)
                    hit.append(t_hit)
                    hs.append(t_hit)
                    outs.append({"store": s, "hit": h, "prompt": i})
                say(f"[peer] LMCache MP, prompt {i}: store (cold) {t_store:.3f} s, hits "
                    f"{', '.join(f'{x:.3f}' for x in hs)} s (cached {h['cached']})")
            start = eng.start_s
    finally:
        server.stop()
    return {"store": store, "hit": hit, "outs": outs, "start_s": start,
            "server_start_s": server.start_s, "server_cmd": server.cmd,
            "server_cpu_store_s": server_cpu_store, "server_cpu_hit_s": server_cpu_hit,
            "server_idle_cpu_per_s": idle_cpu_per_s}


def run(quick: bool = False, ours: dict | None = None) -> dict:
    """``ours``: bench_ttft.run()'s result (its engines are not started again)."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if ours is None or "cpu" not in ours.get("raw", {}):
        say("[peer] measuring this connector's CPU tier first (bench_ttft, --quick set of runs)")
        ours = bench_ttft.run(quick=True) if quick else _ours_cpu_only()
    repeats = ours["repeats"]
    model_dir, model = bench_ttft.build_model()
    prompts = bench_ttft.make_prompts(model_dir, repeats)
    ref, cpu = ours["raw"]["no_connector"], ours["raw"]["cpu"]
    notes = []
    try:
        mp = measure_mp(model_dir, prompts)
    except Exception as exc:  # record why; no numbers are made up
        notes.append(f"LMCache MP failed: {type(exc).__name__}: {exc}")
        say("[peer] " + notes[-1])
        mp = None
    cold, local = median(ref["cold"]), median(ref["local"])
    our_hit, our_store = median(cpu["hit"]), median(cpu["store"])
    rows = [["no connector", None, cold, local, None, None, None, "reference"],
            ["LMCacheHMA (CPU tier)", median(o["hit"]["cached"] for o in cpu["outs"]), our_store,
             our_hit, our_store / cold,
             f"{median(cpu['save_s']):.3f} (worker, in wait_for_save)" if cpu.get("save_s") else None,
             f"{median(cpu['load_ms']):.1f} (worker, in start_load_kv)" if cpu.get("load_ms") else None,
             _exact_note(ref, cpu)]]
    c1024 = ours["raw"].get("cpu_i1024")
    if c1024:
        rows.append(["LMCacheHMA (CPU tier, interval 1024)", median(o["hit"]["cached"] for o in c1024["outs"]),
                     median(c1024["store"]), median(c1024["hit"]), median(c1024["store"]) / cold,
                     f"{median(c1024['save_s']):.3f} (worker, in wait_for_save)",
                     f"{median(c1024['load_ms']):.1f} (worker, in start_load_kv)", _exact_note(ref, c1024)])
    summary = {"ttft_hit_vs_lmcache_mp": None, "notes": notes, "repeats": repeats,
               "ours": {"store_s": cpu["store"], "hit_s": cpu["hit"], "store_overhead": our_store / cold},
               "no_connector": {"cold_s": ref["cold"], "local_s": ref["local"]}}
    if mp is not None:
        mp_hit, mp_store = median(mp["hit"]), median(mp["store"])
        rows.append(["LMCache MP (lmcache_driven)", median(o["hit"]["cached"] for o in mp["outs"]),
                     mp_store, mp_hit, mp_store / cold,
                     f"{median(mp['server_cpu_store_s']):.3f} (server CPU, asynchronous)",
                     f"{1e3 * median(mp['server_cpu_hit_s']):.1f} (server CPU)", _exact_note(ref, mp)])
        summary.update(
            ttft_hit_vs_lmcache_mp=ratio(our_hit, mp_hit),
            store_overhead_ours=our_store / cold, store_overhead_lmcache_mp=mp_store / cold,
            lmcache_mp={"store_s": mp["store"], "hit_s": mp["hit"],
                        "hit_tokens": [o["hit"]["cached"] for o in mp["outs"]],
                        "engine_start_s": mp["start_s"], "server_start_s": mp["server_start_s"],
                        "server_cmd": mp["server_cmd"], "exact": _exact(ref, mp),
                        "server_cpu_store_s": mp["server_cpu_store_s"],
                        "server_cpu_hit_s": mp["server_cpu_hit_s"],
                        "server_idle_cpu_per_s": mp["server_idle_cpu_per_s"]},
            ours_save_s=cpu.get("save_s"), ours_load_ms=cpu.get("load_ms"),
            ours_i1024={"store_s": c1024["store"], "save_s": c1024["save_s"],
                        "store_overhead": median(c1024["store"]) / cold} if c1024 else None,
            ours_engine_start_s=cpu["start_s"], no_connector_engine_start_s=ref["start_s"])
    summary["table"] = table(
        ["connector", "hit tokens (median)", "first-request TTFT (s)", "hit TTFT (s)",
         "store overhead (x cold)", "store work per prompt (s)", "load work per hit (ms)",
         "exactness"], rows)
    return summary


def _exact(ref: dict, res: dict) -> dict:
    pairs = [(o, ref["outs"][o["prompt"]]) for o in res["outs"]]
    return {
        "hit_equals_local_bitwise": all(
            o["hit"]["tokens"] == r["local"]["tokens"] and o["hit"]["logprob0"] == r["local"]["logprob0"]
            for o, r in pairs),
        "hit_tokens_equal_cold": all(o["hit"]["tokens"] == r["cold"]["tokens"] for o, r in pairs),
    }


def _exact_note(ref: dict, res: dict) -> str:
    e = _exact(ref, res)
    return (f"token+logprob = vLLM local hit: {e['hit_equals_local_bitwise']}; "
            f"token = cold: {e['hit_tokens_equal_cold']}")


def _ours_cpu_only() -> dict:
    """bench_ttft's no-connector and CPU-tier runs only (3 repeats)."""
    model_dir, model = bench_ttft.build_model()
    prompts = bench_ttft.make_prompts(model_dir, 3)
    ref = bench_ttft.measure_no_connector(model_dir, prompts)
    with tempfile.TemporaryDirectory(prefix="bench_peer_cpu_") as d:
        cpu = bench_ttft.measure_connector(model_dir, prompts, "cpu", Path(d))
    return {"repeats": 3, "raw": {"no_connector": ref, "cpu": cpu}}  # as bench_ttft.run's


def main() -> int:
    return bench_main(__doc__, run, "PEER", keys=("ttft_hit_vs_lmcache_mp", "store_overhead_ours",
                                                  "store_overhead_lmcache_mp", "notes"))


if __name__ == "__main__":
    sys.exit(main())
