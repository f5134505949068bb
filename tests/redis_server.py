"""A real ``redis-server`` on 127.0.0.1 for tests: free port, no persistence.

``RedisServer`` starts Debian's ``redis-server`` (installed by ``make setup``) with
``--save "" --appendonly no`` in a private directory, waits until it answers
PING, and stops it afterwards. For fault tests it can be killed with SIGKILL,
paused (SIGSTOP, a hung server) and restarted on the same port (empty again).

``write_redis_yaml`` writes a copy of one of the repository's YAMLs
(``configs/redis.yaml``, ``configs/cpu_disk_redis.yaml``) with the fixture's URL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
MISSING = "redis-server not found (Debian package redis-server); run make setup"


def redis_server_binary() -> Optional[str]:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (see module docstring)."""

    def __init__(self, password: Optional[str] = None, port: Optional[int] = None,
                 workdir: Optional[Path] = None):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.password = password
        self.port = port or free_port()
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="lmcache_hma_redis_"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None

    # URLs --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis://`` URL, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def plain_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=kwargs.pop("socket_timeout", 5), **kwargs)

    # life cycle ----------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> "RedisServer":
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no",
               "--logfile", str(self.dir / "redis.log")]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(socket_timeout=0.5).ping():
                    return self
            except Exception:
                pass
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text()[-2000:] if (self.dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server vanishes, with everything it held."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a hung server (connections accepted by the kernel, no answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> "RedisServer":
        """Kill (if running) and start again on the same port: an empty Redis."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.alive():
            try:
                self.resume()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def write_redis_yaml(dest: Path, url: str, template: str = "redis.yaml", **overrides) -> Path:
    """A copy of ``configs/<template>`` with ``remote_url`` set to ``url`` (and ``overrides``)."""
    keys = yaml.safe_load((CONFIGS / template).read_text())
    keys["remote_url"] = url
    for key, value in overrides.items():
        if key == "extra_config":
            keys["extra_config"] = {**(keys.get("extra_config") or {}), **value}
        else:
            keys[key] = value
    dest = Path(dest)
    dest.write_text(yaml.safe_dump(keys))
    return dest


# -- pytest fixtures (exposed in tests/conftest.py; test modules may import them too) -----

try:
    import pytest
except ImportError:  # used outside pytest (examples, benchmarks)
    pytest = None

if pytest is not None:

    @pytest.fixture
    def redis_server(tmp_path):
        """A fresh, empty ``RedisServer`` for one test (fails, not skips, without redis-server)."""
        if redis_server_binary() is None:
            pytest.fail(MISSING)
        server = RedisServer(workdir=tmp_path / "redis").start()
        yield server
        server.stop()

    @pytest.fixture
    def redis_yaml(tmp_path):
        """``redis_yaml(url, template="redis.yaml", **overrides)``: a YAML copy with that URL."""
        count = iter(range(10**6))

        def make(url: str, template: str = "redis.yaml", **overrides) -> Path:
            return write_redis_yaml(tmp_path / f"redis-{next(count)}.yaml", url, template, **overrides)

        return make
