"""Bounded soak: two `lmcache-hma serve` instances sharing one Redis, many mixed requests.

Reports hit rate, errors (must be 0), token mismatches on a sample against an
engine without the connector (must be 0), and the servers' memory growth.

With ``--cluster``: the two servers share a Redis Cluster of 3 masters with a replica
each (``tests.redis_server.LocalRedisCluster``, password-protected), and the master
holding the most keys is killed (SIGKILL) when half the requests have been sent: the
rest run while its replica takes over.

    .venv/bin/python benchmarks/soak.py [--requests 200] [--concurrency 4] [--sample 24] [--cluster]
"""

from __future__ import annotations

import os
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RedisServer, bench_main, lmcache_yaml  # noqa: E402

HIT = re.compile(r"Total tokens (\d+), LMCache hit tokens: (\d+), need to load: (\d+)")
DOCS = [f"Document {d}: " + "Hello, how are you?" * (100 + 60 * (d % 7)) for d in range(20)]
QUESTIONS = ["Tell me a very long story", "Hello, my name is", "How are you?", "Tell me more"]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(DOCS) + f" Q{rng.randrange(50)}: " + rng.choice(QUESTIONS) for _ in range(n)]


def rss_mb(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20


def reset_local_cache(server) -> None:
    import requests

    requests.post(f"http://127.0.0.1:{server.port}/reset_prefix_cache", timeout=30)


def ask(server, prompt: str):
    """(tokens, margins) of a greedy completion through the OpenAI API."""
    out = server.client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    tokens = [int(t.split(":")[-1]) for t in lp.tokens]
    margins = []
    for top in lp.top_logprobs:
        vals = sorted(top.values(), reverse=True)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return tokens, margins


def run(requests: int = 200, concurrency: int = 4, sample: int = 24, cluster: bool = False) -> dict:
    from lmcache_hma.testing.tiny_model import build_tiny_model
    from tests.engines import Gen, generate, make_llm, same_greedy, shutdown
    from tests.redis_server import LocalRedisCluster
    from tests.test_redis import Server

    n_requests = requests
    model = build_tiny_model("tiny-gemma3")
    work = Path(tempfile.mkdtemp(prefix="lmcache_hma_soak_"))
    if cluster:
        redis = LocalRedisCluster(work / "cluster", masters=3, replicas=1, password="soak-" + os.urandom(8).hex())
        redis.start()
    else:
        redis = RedisServer(work / "redis.log")
    yaml = lmcache_yaml(work / "redis.yaml", base="redis", remote_url=redis.url, local_cpu=True,
                        max_local_cpu_size=0.05)
    killed = []
    # Dev mode exposes /reset_prefix_cache: emptying vLLM's own cache now and then sends
    # repeated prefixes to the connector instead of vLLM's local prefix cache.
    servers = [Server(name, model, yaml, work, {"VLLM_SERVER_DEV_MODE": "1"}) for name in ("A", "B")]
    results, errors = [], []
    try:
        deadline = time.monotonic() + 300
        for s in servers:
            s.wait_ready(deadline)
        rss0 = [rss_mb(s.proc.pid) for s in servers]
        plist = prompts(n_requests)
        t0 = time.monotonic()

        def one(i):
            try:
                if cluster and i == n_requests // 2:  # pool.map hands out requests in order
                    victim = max(redis.masters(), key=lambda n: len(n.client().keys("*")))
                    victim.kill()
                    killed.append(victim.port)
                if i % 5 == 0:
                    reset_local_cache(servers[i % 2])
                return i, ask(servers[i % 2], plist[i])
            except Exception as exc:  # counted, never raised: the soak reports them
                errors.append(f"{i}: {type(exc).__name__}: {exc}")
                return i, None

        with ThreadPoolExecutor(concurrency) as pool:
            results = sorted(r for r in pool.map(one, range(n_requests)) if r[1] is not None)
        elapsed = time.monotonic() - t0
        rss1 = [rss_mb(s.proc.pid) for s in servers]
        lines = [m for s in servers for m in HIT.findall(s.text())]
    finally:
        for s in servers:
            s.stop()
        failover = redis.wait_failover(next(n for n in redis.nodes if n.port == killed[0]), timeout=30) \
            if killed else None
        redis.stop()

    # A sample against an engine without the connector, one prompt at a time.
    picks = random.Random(1).sample(range(len(results)), min(sample, len(results)))
    ref_llm = make_llm(model)
    mismatches = []
    for k in picks:
        i, (tokens, margins) = results[k]
        [ref] = generate(ref_llm, plist[i])
        if not same_greedy(ref, Gen(tokens, 0, margins)):
            mismatches.append(i)
    shutdown(ref_llm)

    total = sum(int(t) for t, _, _ in lines)
    hit = sum(int(h) for _, h, _ in lines)
    report = {
        "requests": n_requests, "completed": len(results), "errors": len(errors),
        "seconds": round(elapsed, 1), "requests_with_hit": sum(int(h) > 0 for _, h, _ in lines),
        "hit_token_rate": round(hit / max(total, 1), 3), "sampled": len(picks),
        "mismatches": len(mismatches),
        "rss_mb_start": [round(x) for x in rss0], "rss_mb_end": [round(x) for x in rss1],
        "redis": "cluster (3 masters + 3 replicas), a master killed mid-run" if cluster else "one Redis",
        "master_killed_at_request": n_requests // 2 if killed else None, "failover_completed": failover,
    }
    print(f"{n_requests} requests over 2 servers sharing {report['redis']} in {elapsed:.0f} s: "
          f"{report['requests_with_hit']} with a hit, {report['hit_token_rate']:.0%} of prompt tokens "
          f"from the cache, {len(errors)} errors, {len(mismatches)}/{len(picks)} sampled mismatches, "
          f"RSS {report['rss_mb_start']} -> {report['rss_mb_end']} MB")
    for e in errors[:5]:
        print("error:", e)
    return report


def main() -> int:
    return bench_main(__doc__, run, "SOAK", quick=None, ok=lambda r: not (r["errors"] or r["mismatches"]),
                      options=[("--requests", dict(type=int, default=200)),
                               ("--concurrency", dict(type=int, default=4)),
                               ("--sample", dict(type=int, default=24)),
                               ("--cluster", dict(action="store_true"))])


if __name__ == "__main__":
    sys.exit(main())
