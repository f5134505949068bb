"""A fleet of mixed parallel shapes on one Redis: what it stores and what it hits, with
``hma_share_parallel_shapes`` off (per-rank objects, today's default) and on, in one run.

Fleet: two ``lmcache-hma serve`` servers of the tiny Gemma-3 (float32, ``--block-size 16``)
on one Redis (the only tier): ``tp1`` (TP=1) and ``tp2`` (TP=2; vLLM's CPU build, one core
per rank). Workload: ``PROMPTS`` prompts of 11 chunks of 256 tokens that share nothing; phase 1
sends each to ``tp1`` (cold), phase 2 each to ``tp2``. Per setting: Redis keys and bytes after
phase 1 (one instance's) and after phase 2 (the fleet's), and the tokens ``tp2`` hit in
phase 2 (of the 11 x 256 stored per prompt). Then the same with the option on, Redis emptied
and both servers restarted.

    python benchmarks/bench_fleet_shapes.py [--quick]

Prints the table and a last line ``FLEET {json}``: ``fleet_bytes_vs_one_instance`` (option on;
goal <= 1.05), ``fleet_bytes_vs_one_instance_off``, ``fleet_hit_fraction`` (option on; goal
>= 0.9) and ``fleet_hit_fraction_off``. The translating copy's cost is
``bench_canonical_copy.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (OUT_DIR, RedisServer, ServerProcess, bench_main, fmt, free_port, lmcache_yaml,  # noqa: E402
                     ratio, say, serve_command, table)

PROMPTS = 6
HELLO = "Hello, how are you?"
CHUNKS, CHUNK = 11, 256


def prompt(n: int) -> str:
    return f"Prompt {n}: " + HELLO * 500 + "Tell me a very long story"  # 3000+ tokens: 11 chunks


class FleetServer(ServerProcess):
    """``lmcache-hma serve`` of the tiny model with the connector on ``yaml``; ``complete``
    returns the request's hit tokens (the connector's log line)."""

    group = True

    def __init__(self, name: str, model: Path, yaml: Path, tp: int, work: Path):
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = OUT_DIR / f"fleet_{name}.log"
        cmd = serve_command(model, self.port, yaml, extra=["--block-size", "16", "--tensor-parallel-size", str(tp)])
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
        if tp > 1:  # vLLM's CPU build binds each rank's threads to a NUMA node unless told which cores
            env.update(VLLM_CPU_OMP_THREADS_BIND="|".join(str(r) for r in range(tp)), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        import requests

        self._start(cmd, self.log_path, lambda: requests.get(f"{self.base}/health", timeout=5).status_code == 200,
                    timeout=300, env=env)

    def complete(self, text: str) -> int:
        import re

        import requests

        mark = self.log_path.stat().st_size
        r = requests.post(f"{self.base}/v1/completions", timeout=600,
                          json={"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
        time.sleep(0.2)
        with open(self.log_path, errors="replace") as f:
            f.seek(mark)
            hits = re.findall(r"LMCache hit tokens: (\d+)", f.read())
        return int(hits[-1]) if hits else 0


def redis_usage(redis) -> tuple[int, int]:
    """(keys, value bytes) in Redis once writes stopped landing."""
    client, last = redis.client(), None
    for _ in range(60):
        keys = client.keys("*")
        now = (len(keys), sum(client.strlen(k) for k in keys))
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    return last


def run_setting(model: Path, redis, work: Path, shared: bool, prompts: int) -> dict:
    redis.client().flushall()
    yaml = lmcache_yaml(work / f"fleet_{shared}.yaml", local_cpu=False, max_local_cpu_size=0.5,
                        remote_url=redis.url, remote_serde="naive",
                        extra_config={"hma_share_parallel_shapes": shared})
    out = {}
    with FleetServer(f"tp1_{'on' if shared else 'off'}", model, yaml, 1, work) as tp1:
        for n in range(prompts):
            tp1.complete(prompt(n))
        out["keys_one"], out["bytes_one"] = redis_usage(redis)
    with FleetServer(f"tp2_{'on' if shared else 'off'}", model, yaml, 2, work) as tp2:
        out["hit_tokens"] = sum(tp2.complete(prompt(n)) for n in range(prompts))
        out["keys_fleet"], out["bytes_fleet"] = redis_usage(redis)
    out["stored_tokens"] = prompts * CHUNKS * CHUNK
    return out


def run(quick: bool = False) -> dict:
    from lmcache_hma.testing.tiny_model import build_tiny_model

    work = OUT_DIR / "fleet"
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model("tiny-gemma3")
    prompts = 2 if quick else PROMPTS
    with RedisServer(OUT_DIR / "fleet_redis.log") as redis:
        results = {}
        for shared in (False, True):
            say(f"fleet: hma_share_parallel_shapes {shared}")
            results[shared] = run_setting(model, redis, work, shared, prompts)
    rows = []
    for shared, r in results.items():
        rows.append(["on" if shared else "off", r["keys_one"], fmt(r["bytes_one"] / 2**20), r["keys_fleet"],
                     fmt(r["bytes_fleet"] / 2**20), fmt(ratio(r["bytes_fleet"], r["bytes_one"])),
                     f"{r['hit_tokens']} / {r['stored_tokens']}", fmt(r["hit_tokens"] / r["stored_tokens"])])
    on, off = results[True], results[False]
    return {
        "table": table(["share_parallel_shapes", "keys (tp1)", "MiB (tp1)", "keys (tp1+tp2)", "MiB (tp1+tp2)",
                        "fleet / one", "tp2 hit tokens", "hit fraction"], rows),
        "fleet_bytes_vs_one_instance": ratio(on["bytes_fleet"], on["bytes_one"]),
        "fleet_bytes_vs_one_instance_off": ratio(off["bytes_fleet"], off["bytes_one"]),
        "fleet_hit_fraction": on["hit_tokens"] / on["stored_tokens"],
        "fleet_hit_fraction_off": off["hit_tokens"] / off["stored_tokens"],
        "prompts": prompts,
    }


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "FLEET", quick="2 prompts"))
