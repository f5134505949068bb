"""NVIDIA Dynamo's standalone KV indexer (an existing router's index) for tests and examples.

``install()`` puts the ``[fleet]`` extra of ``pyproject.toml`` (the pinned indexer package and
what it imports) under ``.cache/fleet-indexer/`` with ``pip install --target`` once, and
returns that directory, or None (with the reason in ``INSTALL_ERROR``) when it cannot be
installed (no network, no wheel for this platform). It goes on the indexer process's
``PYTHONPATH`` only: nothing of it is imported here.

``Indexer`` runs ``python -m dynamo.indexer``; ``register`` subscribes it to an engine's ZMQ KV
event endpoint (``--kv-events-config`` with a bound ``tcp://*:PORT``); it answers ``/query`` (per instance:
``longest_matched``, ``gpu``, ``cpu``, ``disk`` tokens) and ``/dump``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
INSTALL_ERROR: Optional[str] = None


def fleet_requirements() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["fleet"])


def install(timeout_s: float = 600.0) -> Optional[Path]:
    """The directory holding the indexer package (installed now if missing), or None."""
    global INSTALL_ERROR
    reqs = fleet_requirements()
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", "-".join(reqs))
    target = REPO / ".cache" / "fleet-indexer" / tag
    if (target / "dynamo" / "indexer").is_dir():
        return target
    tmp = target.with_name(target.name + f".part{os.getpid()}")
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-warn-conflicts", "--target", str(tmp), *reqs],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        INSTALL_ERROR = f"pip install {' '.join(reqs)} took over {timeout_s:.0f} s"
        return None
    if done.returncode != 0:
        INSTALL_ERROR = f"pip install {' '.join(reqs)} failed: {done.stderr.strip()[-600:]}"
        return None
    try:
        tmp.rename(target)
    except OSError:  # another process installed it meanwhile
        pass
    return target if (target / "dynamo" / "indexer").is_dir() else None


class Indexer:
    """``python -m dynamo.indexer`` on ``port``; ``workers``: instance id -> ZMQ endpoint."""

    def __init__(self, site: Path, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(site)}
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
                                     env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def register(self, instance: int, endpoint: str, block_size: int, replay_endpoint: Optional[str] = None) -> None:
        """Subscribe to an engine's KV events (``endpoint``: its bound ``--kv-events-config``
        endpoint; ``replay_endpoint``: its ``replay_endpoint``, for batches published before the
        subscription took: without it, the index misses them for good). ``block_size``: the
        events' block size (the engine's, for full attention); events of another size are dropped."""
        body = {"instance_id": instance, "endpoint": endpoint, "block_size": block_size, "model_name": "default"}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        self._call("/register", body)

    def _call(self, path: str, body: Optional[dict] = None, timeout: float = 10.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the indexer exited ({self.proc.returncode}): {self.text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the indexer did not answer in {timeout:.0f} s: {self.text()[-2000:]}")
                time.sleep(0.3)

    def query(self, tokens: list[int]) -> dict:
        """Per instance id (a string): ``{"longest_matched", "gpu", "cpu", "disk"}`` in tokens
        (``cpu`` counts device and CPU blocks, ``disk`` all tiers: a prefix per tier and up)."""
        try:
            return self._call("/query", {"token_ids": list(tokens), "model_name": "default"}).get("instances", {})
        except urllib.error.HTTPError as e:
            if e.code == 404:  # nothing indexed for the model yet
                return {}
            raise

    def score(self, tokens: list[int], instance: int) -> dict:
        got = self.query(tokens).get(str(instance))
        return got or {"longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0}

    def dump(self):
        return self._call("/dump")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()
