"""Store and load throughput through the Redis tier, against raw redis-py, same run.

``ChunkStore`` (LMCache's StorageManager with ``configs/redis.yaml``: Redis only,
a small CPU staging buffer) puts and gets chunk-sized objects; a plain redis-py
client SETs and GETs values of the same size on the same ``redis-server``.

* store put: allocate from the staging buffer, copy the payload in (what the
  worker's gather does), seal (CRC32 trailer), hand to LMCache, which writes two
  keys per object (metadata + bytes) from its event loop, 4 writers at once. The
  time runs until every object is in Redis (polled with EXISTS).
* store get: LMCache's two GETs, a copy into the staging buffer, then the trailer
  check (length, fingerprint, key, CRC32) -- what every load pays. LMCache keeps a
  copy of what it read from Redis in its CPU buffer even with ``local_cpu: false``;
  every round reads new keys (so every get reads Redis) and those copies are
  dropped after the round (untimed).
* raw: ``SET`` / ``GET`` of the same bytes in a loop, one client, one connection.

torch runs with one thread here: with two, each 1 MiB payload copy took ~8 ms
instead of ~0.1 ms on this 2-core machine (OpenMP workers competing with
LMCache's event-loop thread), which would measure thread contention, not the tier.

Also the time of one lookup of a 23-chunk prefix (a 6000-token prompt) that is
all in Redis: LMCache's Redis connector has no batched ``contains``, so it is one
EXISTS round trip per chunk.

Sizes 128 KiB, 1 MiB, 4 MiB; each cell is the median of ``--rounds`` rounds over
``N`` objects (MB/s, 1 MB = 1e6 bytes, object = payload + 128-byte trailer).

    python benchmarks/bench_redis.py [--rounds 5] [--quick]

Prints a table and a last line ``REDIS_BENCH {json}`` (ratios store/raw per size).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, RedisServer, final_line, machine_info, median, say, table  # noqa: E402

SIZES = {"128KiB": 128 * 1024, "1MiB": 1024 * 1024, "4MiB": 4 * 1024 * 1024}
COUNTS = {"128KiB": 64, "1MiB": 32, "4MiB": 8}


def open_store(url: str, workdir: Path):
    import torch
    import yaml

    from lmcache_hma.config import load_config
    from lmcache_hma.keys import Namespace
    from lmcache_hma.layout import GroupKind, GroupLayout, HybridLayout
    from lmcache_hma.store import ChunkStore

    keys = yaml.safe_load((ROOT / "configs" / "redis.yaml").read_text())
    keys["remote_url"] = url
    path = workdir / "redis.yaml"
    path.write_text(yaml.safe_dump(keys))
    cfg = load_config({"lmcache_config_file": str(path)})
    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("L0", "L1"), 128, 32768),), cfg.chunk_size)
    ns = Namespace(model="bench", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/bench",
                   world_size=1, rank=0)
    return ChunkStore(cfg.lmcache, ns, cfg.verify_checksums)


def digest(n: int) -> bytes:
    """A 32-byte chunk digest standing in for a prompt's (keys.ChunkHasher)."""
    import hashlib

    return hashlib.sha256(b"bench %d" % n).digest()


def bench_store(store, redis_client, size: int, n: int, rounds: int, base: int) -> tuple[list, list]:
    import torch

    from lmcache_hma.objects import TRAILER_BYTES, ObjectKind
    from lmcache_hma.store import release

    src = torch.randn(size // 2).to(torch.bfloat16)
    puts, gets = [], []
    for r in range(rounds):
        hashes = [digest(base + r * 1000 + i) for i in range(n)]
        meta = [store.key(ObjectKind.FULL, h).to_string() + "metadata" for h in hashes]
        t0 = time.perf_counter()
        for h in hashes:
            assert store.put(ObjectKind.FULL, h, size, lambda p: p.copy_(src))
        while redis_client.exists(*meta) < n:
            time.sleep(0.0005)
        puts.append(n * (size + TRAILER_BYTES) / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        for h in hashes:
            obj = store.get(ObjectKind.FULL, h, size)
            assert obj is not None, "object missing or failed its checks"
            release(obj)
        gets.append(n * (size + TRAILER_BYTES) / (time.perf_counter() - t0) / 1e6)
        for h in hashes:  # untimed: drop LMCache's CPU copies of what it read (see above)
            store.remove(ObjectKind.FULL, h, remote=False)
        redis_client.flushall()
    return puts, gets


def bench_lookup(store, redis_client, chunks: int, rounds: int) -> list:
    """ms for one lookup of a ``chunks``-chunk prefix that is all in Redis (LMCache: one EXISTS per key)."""
    from lmcache_hma.objects import ObjectKind

    hashes = [digest(7 * 10**8 + i) for i in range(chunks)]
    for h in hashes:
        store.put(ObjectKind.FULL, h, 4096, lambda p: p.zero_())
    meta = [store.key(ObjectKind.FULL, h).to_string() + "metadata" for h in hashes]
    while redis_client.exists(*meta) < chunks:
        time.sleep(0.001)
    times = []
    for _ in range(rounds * 4):
        t0 = time.perf_counter()
        assert store.count_full_prefix(hashes) == chunks
        times.append(1e3 * (time.perf_counter() - t0))
    redis_client.flushall()
    return times


def bench_raw(redis_client, size: int, n: int, rounds: int) -> tuple[list, list]:
    import os

    from lmcache_hma.objects import TRAILER_BYTES

    value = os.urandom(size + TRAILER_BYTES)
    sets, gets = [], []
    for r in range(rounds):
        keys = [f"raw:{size}:{r}:{i}" for i in range(n)]
        t0 = time.perf_counter()
        for k in keys:
            redis_client.set(k, value)
        sets.append(n * len(value) / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        for k in keys:
            assert len(redis_client.get(k)) == len(value)
        gets.append(n * len(value) / (time.perf_counter() - t0) / 1e6)
        redis_client.flushall()
    return sets, gets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds

    import redis
    import torch

    torch.set_num_threads(1)  # see the module docstring
    work = Path(tempfile.mkdtemp(prefix="bench_redis_"))
    server = RedisServer(work / "redis.log")
    store = None
    try:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        store = open_store(server.url, work)
        say(f"redis-server on {server.url}; ChunkStore tiers {store.tiers}; {rounds} rounds")
        # warm up both paths (connections, allocator)
        bench_store(store, client, 64 * 1024, 4, 1, base=10**9)
        bench_raw(client, 64 * 1024, 4, 1)
        rows, summary = [], {"rounds": rounds, "unit": "MB/s (median)", "sizes": {}}
        for i, (name, size) in enumerate(SIZES.items()):
            n = COUNTS[name]
            s_put, s_get = bench_store(store, client, size, n, rounds, base=(i + 1) * 10**6)
            r_set, r_get = bench_raw(client, size, n, rounds)
            cell = {"store_put": median(s_put), "raw_set": median(r_set),
                    "store_get": median(s_get), "raw_get": median(r_get)}
            cell["put_ratio"] = cell["store_put"] / cell["raw_set"]
            cell["get_ratio"] = cell["store_get"] / cell["raw_get"]
            summary["sizes"][name] = {k: round(v, 3) for k, v in cell.items()}
            rows.append([name, n, cell["store_put"], cell["raw_set"], cell["put_ratio"],
                         cell["store_get"], cell["raw_get"], cell["get_ratio"]])
        lookup = median(bench_lookup(store, client, 23, rounds))
        summary["lookup_23_chunks_ms"] = round(lookup, 3)
        say(f"lookup of a 23-chunk prefix in Redis (count_full_prefix): {lookup:.2f} ms (median)")
        say(table(["size", "objects", "store put MB/s", "raw SET MB/s", "put ratio",
                   "store get MB/s", "raw GET MB/s", "get ratio"], rows))
        summary["put_ratio"] = {k: v["put_ratio"] for k, v in summary["sizes"].items()}
        summary["get_ratio"] = {k: v["get_ratio"] for k, v in summary["sizes"].items()}
        summary["machine"] = machine_info()
        final_line("REDIS_BENCH", summary)
    finally:
        if store is not None:
            store.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
