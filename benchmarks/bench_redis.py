"""Store and load throughput through the Redis tier, against raw redis-py, same run.

``ChunkStore`` (LMCache's StorageManager with ``configs/redis.yaml``: Redis only,
a small CPU staging buffer) puts and gets chunk-sized objects; a plain redis-py
client SETs and GETs values of the same size on the same ``redis-server``.

* store put: a batch of filled objects (what the worker's gather leaves for the store
  writer): seal (CRC32 trailer) and write, each object as LMCache stores it (two keys:
  bytes, then metadata), in one pipelined round trip (``ChunkStore.commit_many``, the
  store writer's call).
* store get: a hit's objects (``ChunkStore.get_many``, the load's call): one pipelined
  round trip of both keys of every object, a copy into newly allocated objects, the
  trailer check (length, fingerprint, key, CRC32) -- what every load from Redis pays.
* raw: redis-py pipelined ``SET`` / ``GET`` of the same two keys per object and the same
  bytes, one client, one round trip per batch, nothing copied or checked.

torch runs with one thread here: with two, each 1 MiB payload copy took ~8 ms
instead of ~0.1 ms on this 2-core machine (OpenMP workers competing with
LMCache's event-loop thread), which would measure thread contention, not the tier.

Also the time of one lookup of a 23-chunk prefix (a 6000-token prompt) that is
all in Redis (``count_full_prefix``: one pipelined EXISTS round trip).

Sizes 128 KiB, 1 MiB, 4 MiB; each cell is the median of ``--rounds`` rounds over
``N`` objects (MB/s, 1 MB = 1e6 bytes, object = payload + 128-byte trailer).

    python benchmarks/bench_redis.py [--rounds 5] [--quick]

Prints a table and a last line ``REDIS_BENCH {json}`` (ratios store/raw per size).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RedisServer, Timer, bench_main, lmcache_yaml, machine_info, median, say, table, torch_threads,
)

SIZES = {"128KiB": 128 * 1024, "1MiB": 1024 * 1024, "4MiB": 4 * 1024 * 1024}
COUNTS = {"128KiB": 64, "1MiB": 32, "4MiB": 8}


def open_store(url: str, workdir: Path):
    """A ``ChunkStore`` on ``configs/redis.yaml`` with its Redis at ``url``."""
    import torch

    from lmcache_hma.config.settings import load_config
    from lmcache_hma.core.keys import Namespace
    from lmcache_hma.core.layout import GroupKind, GroupLayout, HybridLayout
    from lmcache_hma.store.chunk_store import ChunkStore

    path = lmcache_yaml(workdir / "redis.yaml", base="redis", remote_url=url)
    cfg = load_config({"lmcache_config_file": str(path)})
    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("L0", "L1"), 128, 32768),), cfg.chunk_size)
    ns = Namespace(model="bench", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/bench",
                   world_size=1, rank=0)
    return ChunkStore(cfg.lmcache, ns, cfg.verify_checksums)


def digest(n: int) -> bytes:
    """A 32-byte chunk digest standing in for a prompt's (keys.ChunkHasher)."""
    import hashlib

    return hashlib.sha256(b"bench %d" % n).digest()


def object_bytes(size: int) -> int:
    from lmcache_hma.core.objects import TRAILER_BYTES

    return size + TRAILER_BYTES


def put_all(store, client, hashes: list[bytes], size: int, fill) -> float:
    """Seconds to store every object (one ``commit_many``, like the store writer's batch)."""
    from lmcache_hma.core.objects import ObjectKind, payload_of
    from lmcache_hma.store.lmcache_storage import flat

    items = []
    for h in hashes:
        obj = store.allocate(size)
        assert obj is not None, "the staging buffer is full"
        fill(payload_of(flat(obj)))
        items.append((ObjectKind.FULL, h, obj))
    with Timer() as t:
        store.commit_many(items)
    return t.s


# The paths measured for every size, each ``fn(store, client, size, n, rounds, base)`` ->
# ``{column: [MB/s of each round]}`` over ``n`` objects of ``size`` payload bytes (``base``:
# a digest range of its own). A new path: a function here, an entry in PATHS, its columns in
# COLUMNS (and a ratio in RATIOS if it has a raw counterpart).


def store_put_get(store, client, size: int, n: int, rounds: int, base: int) -> dict[str, list]:
    import torch

    from lmcache_hma.core.objects import ObjectKind
    from lmcache_hma.store.lmcache_storage import release

    src = torch.randn(size // 2).to(torch.bfloat16)
    nbytes = n * object_bytes(size)
    puts, gets = [], []
    for r in range(rounds):
        hashes = [digest(base + r * 1000 + i) for i in range(n)]
        puts.append(nbytes / put_all(store, client, hashes, size, lambda p: p.copy_(src)) / 1e6)
        with Timer() as t:
            got = store.get_many([(ObjectKind.FULL, h, size) for h in hashes])
        assert all(obj is not None for obj, _ in got), "object missing or failed its checks"
        for obj, _ in got:
            release(obj)
        gets.append(nbytes / t.s / 1e6)
        client.flushall()
    return {"store_put": puts, "store_get": gets}


def raw_set_get(store, client, size: int, n: int, rounds: int, base: int) -> dict[str, list]:
    import os

    value, meta = os.urandom(object_bytes(size)), os.urandom(28)  # LMCache's metadata is 28 bytes
    sets, gets = [], []
    for r in range(rounds):
        keys = [f"raw:{size}:{r}:{i}" for i in range(n)]
        with Timer() as t:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.set(k + "kv_bytes", value).set(k + "metadata", meta)
            pipe.execute()
        sets.append(n * len(value) / t.s / 1e6)
        with Timer() as t:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k + "metadata").get(k + "kv_bytes")
            replies = pipe.execute()
        assert all(len(v) == len(value) for v in replies[1::2])
        gets.append(n * len(value) / t.s / 1e6)
        client.flushall()
    return {"raw_set": sets, "raw_get": gets}


PATHS = (store_put_get, raw_set_get)
RATIOS = {"put_ratio": ("store_put", "raw_set"), "get_ratio": ("store_get", "raw_get")}
COLUMNS = [("store put MB/s", "store_put"), ("raw pipelined SET MB/s", "raw_set"), ("put ratio", "put_ratio"),
           ("store get (a hit) MB/s", "store_get"), ("raw pipelined GET MB/s", "raw_get"),
           ("get ratio", "get_ratio")]


def lookup_ms(store, client, chunks: int, rounds: int) -> list:
    """ms for one lookup of a ``chunks``-chunk prefix that is all in Redis (one pipelined EXISTS)."""
    hashes = [digest(7 * 10**8 + i) for i in range(chunks)]
    put_all(store, client, hashes, 4096, lambda p: p.zero_())
    times = []
    for _ in range(rounds * 4):
        with Timer() as t:
            assert store.count_full_prefix(hashes) == chunks
        times.append(1e3 * t.s)
    client.flushall()
    return times


def run(quick: bool = False, rounds: int = 5) -> dict:
    rounds = 3 if quick else rounds
    work = Path(tempfile.mkdtemp(prefix="bench_redis_"))
    with torch_threads(1), RedisServer(work / "redis.log") as server:  # 1 thread: see the module docstring
        store = open_store(server.url, work)
        try:
            say(f"redis-server on {server.url}; ChunkStore tiers {store.tier_labels}; {rounds} rounds")
            return measure(store, server.client(), rounds)
        finally:
            store.close()


def measure(store, client, rounds: int) -> dict:
    for path in PATHS:  # warm up every path (connections, allocator)
        path(store, client, 64 * 1024, 4, 1, base=10**9)
    sizes = {}
    for i, (name, size) in enumerate(SIZES.items()):
        cell = {}
        for path in PATHS:
            mbps = path(store, client, size, COUNTS[name], rounds, base=(i + 1) * 10**6)
            cell.update({k: median(v) for k, v in mbps.items()})
        cell.update({k: cell[a] / cell[b] for k, (a, b) in RATIOS.items()})
        sizes[name] = {k: round(cell[k], 3) for _, k in COLUMNS}
    lookup = median(lookup_ms(store, client, 23, rounds))
    say(f"lookup of a 23-chunk prefix in Redis (count_full_prefix): {lookup:.2f} ms (median)")
    return {"rounds": rounds, "unit": "MB/s (median)", "sizes": sizes,
            "lookup_23_chunks_ms": round(lookup, 3),
            **{k: {name: c[k] for name, c in sizes.items()} for k in RATIOS}, "machine": machine_info(),
            "table": table(["size", "objects"] + [h for h, _ in COLUMNS],
                           [[name, COUNTS[name]] + [c[k] for _, k in COLUMNS] for name, c in sizes.items()])}


def main() -> int:
    return bench_main(__doc__, run, "REDIS_BENCH", quick="3 rounds",
                      options=[("--rounds", dict(type=int, default=5))])


if __name__ == "__main__":
    sys.exit(main())
