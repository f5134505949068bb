"""What a store's background work costs the prefill beside it, finely interleaved.

``bench_ttft``'s ``store_overhead*`` compare whole 8200-token prefills (4-6 s each) with and
without a store; on this shared 2-core host two such prefills of one engine, seconds apart,
differ by up to a third, so a 1-3% cost cannot be resolved there. The store's cost to the
prefill has two parts: what the engine's step waits for (``wait_for_save_ms`` in bench_ttft,
measured in the connector) and what the background work (allocating, copying, sealing, the
tier's put; on the CPUs the worker does not compute on, ``lmcache_hma/worker/cpu_placement.py``) takes from
the compute core through the shared GIL, caches and memory. This measures the second.

* compute: a forward of the ``bench_ttft`` model's shape (12 layers, hidden 512, 4 query and
  2 KV heads of 128, MLP 2048, bf16, causal attention) over ``TOKENS`` tokens in a loop, one
  torch thread, bound to one CPU, as vLLM's CPU worker runs;
* beside it, in the same process on the other CPUs: the connector's own ``ChunkStore`` and
  ``StoreWriter`` storing one 8192-token prompt's objects after another, as bench_ttft's
  engines store with the default interval (32 full-attention objects of 512 KiB and 8
  sliding-window tails of 10 MiB: 96 MiB; each filled by a copy, as the gather does);
* windows of ``STEPS`` forwards with the stores running and without them alternate; each
  pair of adjacent windows gives a ratio (``slowdown``: the geometric mean, with its 95%
  confidence interval).

Per tier (CPU, disk, Redis on loopback bound to the other CPU, as the benchmarks' servers):
``slowdown`` while storing, ``store_s`` the wall time storing one prompt takes beside the
compute, and ``prompt_cost_ms`` = (slowdown - 1) x store_s: the compute time one prompt's
store costs the prefill. run_all.py sets it beside bench_ttft's cold prefill and
``wait_for_save_ms``.

    python benchmarks/bench_beside.py [--quick] [--seconds S]   # --quick: 20 s, CPU tier only; default 90 s per tier

Prints a table and a last line ``BESIDE {json}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, RedisServer, OUT_DIR, bench_main, lmcache_yaml, say, table  # noqa: E402

TOKENS = 384  # tokens per forward: ~0.1-0.3 s here, so a window is ~1 s
STEPS = 4  # forwards per window
SECONDS = 90  # per tier
FULL, TAIL = 512 * 2**10, 10 * 2**20  # bench_ttft's model: 2 full layers x 256 tokens; 10 sliding x 1024
PROMPT = (FULL,) * 32 + (TAIL,) * 8  # one 8192-token prompt at the default interval (the window)
TIERS = {"cpu": dict(local_cpu=True, max_local_cpu_size=2),
         "disk": dict(local_cpu=False, max_local_cpu_size=1, max_local_disk_size=5),
         "redis": dict(local_cpu=False, max_local_cpu_size=1, remote_serde="naive")}


class Forward:
    """The bench_ttft model's forward over ``TOKENS`` tokens (random weights)."""

    def __init__(self, layers=12, hidden=512, heads=4, kv_heads=2, head=128, mlp=2048):
        import torch

        g = torch.Generator().manual_seed(0)
        w = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
        self.shape = (heads, kv_heads, head, mlp)
        self.layers = [(w(hidden, (heads + 2 * kv_heads) * head), w(heads * head, hidden),
                        w(hidden, 2 * mlp), w(mlp, hidden)) for _ in range(layers)]
        self.x = w(TOKENS, hidden)

    def __call__(self):
        import torch.nn.functional as F

        heads, kv_heads, head, mlp = self.shape
        x, t = self.x, self.x.shape[0]
        for qkv_w, o_w, up_w, down_w in self.layers:
            qkv = x @ qkv_w
            q = qkv[:, :heads * head].view(t, heads, head).transpose(0, 1)
            k, v = (qkv[:, (heads + i * kv_heads) * head:(heads + (i + 1) * kv_heads) * head]
                    .view(t, kv_heads, head).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                    for i in (0, 1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, -1)
            x = x + a @ o_w
            up = x @ up_w
            x = x + (F.gelu(up[:, :mlp]) * up[:, mlp:]) @ down_w
        return x


class Storer:
    """One prompt's objects after another through the connector's ChunkStore and StoreWriter,
    while ``running`` is set; its threads run on ``cpus``."""

    def __init__(self, lmcache_config, cpus: frozenset):
        import torch

        from lmcache_hma.worker import cpu_placement as cpu_binding
        from lmcache_hma.core.keys import Namespace
        from lmcache_hma.store.chunk_store import ChunkStore
        from lmcache_hma.worker.store_writer import StoreWriter
        from tests.fakes import layout

        ns = Namespace(model="bench-beside", kv_dtype=torch.bfloat16, layout=layout("SSF"),
                       kv_layout="bench", world_size=1, rank=0)
        with cpu_binding.threads_started_on(cpus):
            self.store = ChunkStore(lmcache_config, ns)
            self.writer = StoreWriter(self.store, 4096)
            self.running, self.busy, self.stop = threading.Event(), threading.Event(), threading.Event()
            self.thread = threading.Thread(target=self._run, name="bench-storer", daemon=True)
            self.thread.start()
        self.source = torch.randn(TAIL // 2).to(torch.bfloat16)
        self.prompts, self.busy_s, self.n = 0, 0.0, 0

    def _fill(self, obj, size: int) -> None:
        from lmcache_hma.core.objects import payload_of
        from lmcache_hma.store.lmcache_storage import flat

        payload_of(flat(obj))[:size].view(self.source.dtype).copy_(self.source[:size // 2])

    def _one_prompt(self) -> None:
        from lmcache_hma.core.kinds import ObjectKind

        for size in PROMPT:
            obj = self.store.allocate(size)
            if obj is None:
                continue
            self._fill(obj, size)
            self.n += 1
            kind = ObjectKind.FULL if size == FULL else ObjectKind.TAIL
            self.writer.submit(kind, hashlib.sha256(b"%d" % self.n).digest(), obj, kind.name.lower(), size)
        self.writer.drain()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.running.wait(0.05):
                continue
            self.busy.set()
            t0 = time.perf_counter()
            self._one_prompt()
            self.busy_s += time.perf_counter() - t0
            self.prompts += 1
            self.busy.clear()

    def close(self) -> None:
        self.stop.set()
        self.running.clear()
        self.thread.join()
        self.writer.close(10)
        self.store.close()


def measure(tier: str, seconds: float, beside: frozenset, workdir: Path) -> dict:
    """One tier's windows; the caller runs on the compute CPU, ``beside`` are the others."""
    from lmcache_hma.config.settings import load_config

    with contextlib.ExitStack() as stack:
        where = {}
        if tier.startswith("disk"):
            where = dict(local_disk=f"file://{workdir}/disk/")
        elif tier == "redis":
            redis = stack.enter_context(RedisServer(OUT_DIR / "beside_redis.log"))
            os.sched_setaffinity(redis.proc.pid, beside)  # as the benchmarks' servers (bind_beside_worker)
            where = dict(remote_url=redis.url)
        yaml = lmcache_yaml(workdir / f"{tier}.yaml", **TIERS[tier], **where)
        storer = Storer(load_config({"lmcache_config_file": str(yaml)}).lmcache, beside)
        stack.callback(storer.close)
        forward = Forward()
        forward()  # first-call allocations
        windows = {"storing": [], "idle": []}
        thread_s = {"storing": [], "idle": []}  # the forward thread's CPU time: the GIL waits are not in it
        end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < end or len(windows["idle"]) < len(windows["storing"]):
            mode = ("storing", "idle")[n % 2] if n // 2 % 2 == 0 else ("idle", "storing")[n % 2]  # AB BA
            n += 1
            if mode == "storing":
                storer.running.set()
                time.sleep(0.02)  # the first prompt under way
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(STEPS):
                forward()
            windows[mode].append((time.perf_counter() - t0) / STEPS)
            thread_s[mode].append((time.thread_time() - c0) / STEPS)
            storer.running.clear()
            while storer.busy.is_set():  # the prompt under way ends: it must not overlap an idle window
                time.sleep(0.01)
            time.sleep(0.1)
        logs = [math.log(a / b) for a, b in zip(windows["storing"], windows["idle"])]
        mid, half = statistics.fmean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
        slowdown = math.exp(mid)
        store_s = storer.busy_s / max(1, storer.prompts)
        counts = storer.writer.counts()
    return {"tier": tier, "windows": len(logs), "forward_ms_idle": 1e3 * statistics.median(windows["idle"]),
            "forward_ms_storing": 1e3 * statistics.median(windows["storing"]), "slowdown": slowdown,
            "forward_cpu_ms_idle": 1e3 * statistics.median(thread_s["idle"]),
            "forward_cpu_ms_storing": 1e3 * statistics.median(thread_s["storing"]),
            "slowdown_ci95": [math.exp(mid - half), math.exp(mid + half)], "prompts_stored": storer.prompts,
            "store_s": store_s, "prompt_cost_ms": 1e3 * (slowdown - 1) * store_s,
            "prompt_cost_ms_ci95": [1e3 * (math.exp(mid - half) - 1) * store_s,
                                    1e3 * (math.exp(mid + half) - 1) * store_s],
            "objects_dropped": counts.get("objects_dropped", 0)}


def run(quick: bool = False, seconds: int | None = None) -> dict:
    """``seconds``: per tier (default ``SECONDS``, 20 with ``quick``, which measures the CPU tier only)."""
    import shutil

    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return {"notes": ["one CPU: nothing runs beside the compute"], "tiers": {}}
    compute, beside = allowed[0], frozenset(allowed[1:])
    tiers = ["cpu"] if quick else list(TIERS)
    notes = []
    if "redis" in tiers and shutil.which("redis-server") is None:
        tiers.remove("redis")
        notes.append("Redis tier skipped: redis-server is not installed")
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    results = {}
    try:
        os.sched_setaffinity(0, {compute})
        torch.set_num_threads(1)
        for tier in tiers:
            with tempfile.TemporaryDirectory(prefix=f"bench_beside_{tier}_") as d:
                results[tier] = measure(tier, seconds or (20 if quick else SECONDS), beside, Path(d))
            r = results[tier]
            say(f"[beside] {tier}: forward {r['forward_ms_idle']:.0f} ms idle, {r['forward_ms_storing']:.0f} ms "
                f"storing; slowdown {r['slowdown']:.3f} ({r['slowdown_ci95'][0]:.3f}-{r['slowdown_ci95'][1]:.3f}, "
                f"{r['windows']} pairs); a prompt's store {1e3 * r['store_s']:.0f} ms -> "
                f"{r['prompt_cost_ms']:.1f} ms of compute")
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    rows = [[t, f"{r['forward_ms_idle']:.0f} ({r['forward_cpu_ms_idle']:.0f})",
             f"{r['forward_ms_storing']:.0f} ({r['forward_cpu_ms_storing']:.0f})",
             f"{r['slowdown']:.3f} ({r['slowdown_ci95'][0]:.3f}-{r['slowdown_ci95'][1]:.3f})", r["windows"],
             r["prompts_stored"], 1e3 * r["store_s"],
             f"{r['prompt_cost_ms']:.1f} ({r['prompt_cost_ms_ci95'][0]:.1f}-{r['prompt_cost_ms_ci95'][1]:.1f})"]
            for t, r in results.items()]
    return {"tiers": results, "notes": notes, "compute_cpu": compute, "beside_cpus": sorted(beside),
            "tokens": TOKENS, "steps_per_window": STEPS, "prompt_mib": sum(PROMPT) / 2**20,
            **{f"store_cost_ms_{t}": r["prompt_cost_ms"] for t, r in results.items()},
            "table": table(["tier", "forward idle, ms (its thread's CPU)", "forward storing, ms (CPU)",
                            "slowdown (95% CI)",
                            "window pairs", "prompts stored", "store per prompt (ms)",
                            "compute cost per prompt, ms (95% CI)"], rows)}


def main() -> int:
    return bench_main(__doc__, run, "BESIDE", keys=[f"store_cost_ms_{t}" for t in TIERS],
                      quick="20 s, CPU tier only",
                      options=[("--seconds", dict(type=int, help=f"per tier (default {SECONDS})"))])


if __name__ == "__main__":
    sys.exit(main())
