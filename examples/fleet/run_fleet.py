"""Start a fleet on one machine: N ``lmcache-hma serve`` instances publishing KV cache events,
Dynamo's standalone indexer subscribed to them, and the proxy (``proxy.py``) in front.

    python examples/fleet/run_fleet.py MODEL --instances 3 --config lmcache.yaml \
        --indexer-path DIR --policy kv --port 8000 [-- extra vllm serve options]

``--indexer-path``: where ``ai-dynamo-runtime`` is installed (``pip install --target DIR
ai-dynamo-runtime==1.6.1 pydantic uvloop``; default: importable as is, ``pip install
'lmcache_hma[fleet]'``). Instance ``i`` listens on ``--base-port + i``, publishes its events on
``--events-port + 2 i`` (replay on the next port); ``--base-port 0``: free ports. ``--block-size``: the block size the
events carry (vLLM CPU: 128 unless ``--block-size`` is passed to vLLM). Ctrl-C stops all.
Each instance computes on the machine's CPUs: on a small machine, give them few threads
(``VLLM_CPU_OMP_THREADS_BIND``) or expect them to compete.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import proxy  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline: float, proc: subprocess.Popen, what: str) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer {url} in time")
        time.sleep(1)


class LocalFleet:
    """The processes of a fleet; ``stop()`` ends them all."""

    def __init__(self, model: str, n: int, config: str, *, indexer_path: Optional[str] = None,
                 base_port: int = 8100, events_port: int = 5600, indexer_port: int = 8090,
                 block_size: int = 128, serve_args: Sequence[str] = (), logdir: Path = Path("."),
                 env_extra: Optional[dict] = None, config_per_instance: Optional[Sequence[str]] = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.instances: dict[int, str] = {}
        self.indexer = f"http://127.0.0.1:{indexer_port}"
        logdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if indexer_path:
            env["PYTHONPATH"] = indexer_path
        idx = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(indexer_port), "--threads", "1"],
                               env=env, stdout=open(logdir / "indexer.log", "wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        self.procs.append(idx)
        try:
            _wait_http(f"{self.indexer}/health", time.monotonic() + 60, idx, "the indexer")
            servers = []
            for i in range(1, n + 1):
                if base_port:
                    ev, replay, port = events_port + 2 * i, events_port + 2 * i + 1, base_port + i
                else:  # 0: free ports, picked now
                    ev, replay, port = _free_port(), _free_port(), _free_port()
                events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
                          "replay_endpoint": f"tcp://*:{replay}"}
                cfg = config_per_instance[i - 1] if config_per_instance else config
                senv = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                senv.update({"LMCACHE_CONFIG_FILE": cfg, **(env_extra or {})})
                p = subprocess.Popen([sys.executable, "-m", "lmcache_hma.tools.serve", model, "--port", str(port),
                                      "--host", "127.0.0.1", "--kv-events-config", json.dumps(events),
                                      "--prefix-caching-hash-algo", "sha256_cbor", "--enable-prompt-tokens-details",
                                      *serve_args], env=senv, stdout=open(logdir / f"serve-{i}.log", "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
                self.procs.append(p)
                body = {"instance_id": i, "endpoint": f"tcp://127.0.0.1:{ev}", "block_size": block_size,
                        "replay_endpoint": f"tcp://127.0.0.1:{replay}", "model_name": "default"}
                with proxy._call(f"{self.indexer}/register", body, 10):
                    pass
                self.instances[i] = f"http://127.0.0.1:{port}"
                servers.append((p, port, i))
            for p, port, i in servers:
                _wait_http(f"http://127.0.0.1:{port}/health", time.monotonic() + 900, p, f"instance {i}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        import signal

        for p in reversed(self.procs):  # each in its own session: its engine and workers with it
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--config", required=True, help="the LMCache YAML every instance reads")
    ap.add_argument("--indexer-path")
    ap.add_argument("--policy", choices=proxy.POLICIES, default="kv")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--events-port", type=int, default=5600)
    ap.add_argument("--indexer-port", type=int, default=8090)
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args(argv)
    fleet = LocalFleet(args.model, args.instances, args.config, indexer_path=args.indexer_path,
                       base_port=args.base_port, events_port=args.events_port, indexer_port=args.indexer_port,
                       block_size=args.block_size, serve_args=extra)
    try:
        front = proxy.Fleet(fleet.instances, fleet.indexer, args.policy)
        server = proxy.serve(front, "127.0.0.1", args.port)
        print(f"fleet of {args.instances} behind http://127.0.0.1:{args.port} ({args.policy}); "
              f"index at {fleet.indexer}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
