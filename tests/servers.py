"""``lmcache-hma serve`` processes (``python -m lmcache_hma.tools.serve``) for end-to-end tests.

One vLLM OpenAI server with the connector, its stdout and stderr in a log file, the worker's
counters in a stats file (``hma_stats_file``). It computes in ``tests.engines.DTYPE`` (float32)
like the tests' engines, so answers are compared within ``TIE_TOL``. Its start and stop are
recorded like an engine's (``tests.engines.record_engine``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from tests.engines import DTYPE, record_engine
from tests.redis_server import free_port
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]


class ServeProcess:
    """Started at construction; ``wait_ready`` until its /health answers; ``stop`` at the end."""

    def __init__(self, name: str, model, yaml_path: Path, workdir: Path, args: Sequence[str] = (),
                 env_extra: Optional[dict] = None, drop_env: Sequence[str] = (), kv_role: str = "kv_both",
                 connector_extra: Optional[dict] = None):
        """``kv_role``, ``connector_extra``: vLLM's, and more ``kv_connector_extra_config`` keys."""
        self.name, self.port = name, free_port()
        self.log, self.stats = workdir / f"{name}.log", workdir / f"{name}-stats.json"
        self.base = f"http://127.0.0.1:{self.port}"
        transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                    "kv_role": kv_role,
                    "kv_connector_extra_config": {"hma_stats_file": str(self.stats), **(connector_extra or {})}}
        cmd = [sys.executable, "-m", "lmcache_hma.tools.serve", str(model), "--port", str(self.port),
               "--host", "127.0.0.1", "--kv-transfer-config", json.dumps(transfer),
               "--no-disable-hybrid-kv-cache-manager", "--enforce-eager", "--dtype", DTYPE,
               "--max-num-batched-tokens", "2048", "--seed", "0", *args]
        env = {**os.environ, "LMCACHE_CONFIG_FILE": str(yaml_path), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        # LMCache's StorageManager sets PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus in the
        # process that opens a store (this pytest process, after any in-process store test). A
        # server inheriting it would serve the sum of every process's leftover files there.
        for name_ in ("PROMETHEUS_MULTIPROC_DIR", *drop_env):
            if name_ not in (env_extra or {}):
                env.pop(name_, None)
        self._log_file = open(self.log, "wb")
        self._started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def counters(self) -> dict:
        return json.loads(self.stats.read_text()) if self.stats.exists() else {}

    def healthy(self) -> bool:
        import requests

        try:
            return requests.get(f"{self.base}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers, before ``deadline`` (``time.monotonic()``); the log's tail if not."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}):\n{self.text()[-4000:]}")
            return self.healthy()

        try:
            wait_for(ready, timeout=max(1.0, deadline - time.monotonic()),
                     what=f"server {self.name}'s /health", interval=1)
        except AssertionError as e:
            raise RuntimeError(f"{e}:\n{self.text()[-4000:]}") from None
        record_engine("start", time.monotonic() - self._started, f"server {self.name}")

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM, then SIGKILL of the whole process group (server, engine core, worker) after
        ``timeout`` (0: at once); the seconds the SIGTERM took."""
        t0 = time.monotonic()
        running = self.proc.poll() is None
        if running and timeout > 0:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        seconds = time.monotonic() - t0
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers (engine core, workers)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log_file.close()
        if running:
            record_engine("stop", time.monotonic() - t0, f"server {self.name}")
        return seconds


def serve_fleet(work: Path, model_name: str, extra_config: dict, servers: dict):
    """A generator for module fixtures: a fresh Redis, then one ``tests.test_redis.Server`` of the
    tiny model ``model_name`` per ``servers`` entry (name -> its keyword arguments: ``extra_args``,
    ``env_extra``, ``kv_role``, ...), started one at a time (two cores), all on one YAML naming
    that Redis with ``extra_config``; yields them by name and ``redis``, and stops all at the end."""
    import pytest

    from lmcache_hma.testing.tiny_model import build_tiny_model
    from tests.redis_server import MISSING, RedisServer, redis_server_binary, write_redis_yaml
    from tests.test_redis import Server

    if redis_server_binary() is None:
        pytest.fail(MISSING)
    redis = RedisServer(password=None, workdir=work / "redis")
    redis.start()
    model = build_tiny_model(model_name)
    # Two or three CPU engines on two cores (their OMP threads spin between steps) starve the
    # loopback redis-server: calls past the 2 s default were seen, the tier bypassed, writes
    # skipped and the test's hit missing. These tests are about what a fleet shares, not about a
    # slow Redis (tests/test_redis.py and test_faults.py are): a longer deadline, still a deadline.
    extra_config = {"hma_remote_timeout_s": 15.0, **extra_config}
    yaml_path = write_redis_yaml(work / "fleet.yaml", redis.url, extra_config=extra_config)
    started = {}
    try:
        for name, kwargs in servers.items():
            started[name] = Server(f"{model_name}-{name}", model, yaml_path, work, **kwargs)
            started[name].wait_ready(time.monotonic() + 300)
        yield {**started, "redis": redis}
    finally:
        for s in started.values():
            s.stop()
        redis.stop()
