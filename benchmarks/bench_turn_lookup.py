"""What finding a turn end costs a lookup, per tier, against a lookup of whole chunks, same run.

A worker (``WorkerHalf``, real LMCache tiers, paged KV tensors shaped like vLLM's CPU
backend: 3 groups of 2 layers, block 16, chunk 256, 64 KiB pages) stores a 6-chunk prefix,
then answers lookups the way the scheduler sends them:

* ``chunks``: a prompt whose run of whole chunks ends where no turn end was stored: one
  presence pass (markers included), then the fetch and hold of the 6 chunks' objects;
* ``turn end``: a prompt that extends a stored turn end 100 tokens into chunk 6: the presence
  pass finds the marker and reads it (phase 1, nothing held), then the second lookup checks
  the candidate and fetches and holds the 6 chunks and the turn object (phase 2). The two
  lookups' times are summed; the scheduler's candidate keys (one SHA-256 over the partial
  chunk each) are timed apart.

Tiers: CPU memory; local disk (``local_cpu: false``: every object read from disk); Redis
(``configs/redis.yaml``: Redis only, a small staging buffer). Each cell: the median over
``--rounds`` lookups, in microseconds; every held hit is released after its lookup.

    python benchmarks/bench_turn_lookup.py [--rounds 30] [--quick]

Prints a table and a last line ``TURN_LOOKUP {json}`` (turn end / chunks per tier).
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RedisServer, bench_main, lmcache_yaml, median, say, table, torch_threads  # noqa: E402

CHUNK, BLOCK, CHUNKS, OFFSET = 256, 16, 6, 100
NUM_BLOCKS = 1 + 3 * (CHUNKS + 1) * (CHUNK // BLOCK)  # every group's blocks of 7 chunks, apart


def make_worker(yaml_path: Path):
    import torch

    from lmcache_hma.config.settings import load_config
    from lmcache_hma.core.keys import Namespace
    from lmcache_hma.core.kinds import GroupKind
    from lmcache_hma.core.layout import GroupLayout, HybridLayout
    from lmcache_hma.worker.worker_half import WorkerHalf

    cfg = load_config({"lmcache_config_file": str(yaml_path)})
    page = BLOCK * 2 * 8 * 128 * 2  # K and V of 8 heads of 128, bf16
    groups = tuple(GroupLayout(i, kind, (f"L{2 * i}", f"L{2 * i + 1}"), BLOCK, page, window)
                   for i, (kind, window) in enumerate(((GroupKind.SLIDING, 128), (GroupKind.SLIDING, 128),
                                                       (GroupKind.FULL, 0))))
    lay = HybridLayout(groups, CHUNK)
    ns = Namespace(model="bench-turn", kv_dtype=torch.bfloat16, layout=lay, kv_layout="bench", world_size=1, rank=0)
    worker = WorkerHalf(cfg, lay, ns, f"bench-{uuid.uuid4().hex}", NUM_BLOCKS, serves_lookups=True)
    buf = torch.randn((2, NUM_BLOCKS, 2 * 8, BLOCK * 128 // 8, 8)).to(torch.bfloat16)  # 2 layers per slot
    worker.register_kv_caches({name: buf[i % 2].view(NUM_BLOCKS, -1) for i, name in enumerate(lay.layer_names)})
    return worker, ns


def measure(worker, ns, rounds: int) -> dict:
    from lmcache_hma.core.keys import ChunkHasher
    from lmcache_hma.core.kinds import ObjectKind
    from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec

    hasher = ChunkHasher(ns)
    end = CHUNKS * CHUNK + OFFSET
    tokens = [(7 * i) % 1000 for i in range(end + 50)]
    hashes = hasher.chunk_hashes(tokens, CHUNKS + 1)
    per = CHUNK // BLOCK
    span = (CHUNKS + 1) * per
    table_ids = tuple(list(range(1 + g * span, 1 + (g + 1) * span)) for g in range(3))
    # the baseline prompt: 6 other chunks, stored the same way, with no turn end after them
    other = hasher.chunk_hashes([t + 1 for t in tokens], CHUNKS + 1)
    refs = []
    for h in (hashes, other):
        refs += [ObjectRef(ObjectKind.FULL, c, h[c]) for c in range(CHUNKS)]
        refs.append(ObjectRef(ObjectKind.TAIL, CHUNKS - 1, h[CHUNKS - 1]))
    turn_key = hasher.turn_digest(hashes[CHUNKS - 1], tokens, CHUNKS * CHUNK, end, None)
    turn = [ObjectRef(ObjectKind.TURN, CHUNKS, turn_key, end), ObjectRef(ObjectKind.TURNMARK, CHUNKS, hashes[CHUNKS - 1], end)]
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", table_ids, refs),
                                                     SaveSpec("w", table_ids, turn, finished=True)]))
    worker.drain()
    time.sleep(0.5)  # remote writes land
    n = [0]

    def lookup(**kw):
        n[0] += 1
        t0 = time.perf_counter()
        found = worker._answer_lookup(f"r{n[0]}", 1, 0, kw.pop("hashes"), time.monotonic() + 5, **kw)
        seconds = time.perf_counter() - t0
        if worker.held is not None:
            worker.held.release(f"r{n[0]}", 10)
        return found, seconds

    chunk_s, turn_s, key_s = [], [], []
    for _ in range(rounds):
        found, s = lookup(hashes=other[:CHUNKS], turn_limit=end + 40)
        assert found.chunks == CHUNKS and not found.marks and not found.turn_end, found
        chunk_s.append(s)
        first, s1 = lookup(hashes=hashes[:CHUNKS], turn_limit=end + 40)
        assert first.marks == (OFFSET,), first
        t0 = time.perf_counter()
        key = hasher.turn_digest(hashes[CHUNKS - 1], tokens, CHUNKS * CHUNK, end, None)
        key_s.append(time.perf_counter() - t0)
        second, s2 = lookup(hashes=hashes[:CHUNKS], turns=(CHUNKS, [(end, key)]))
        assert second.turn_end == end and second.chunks == CHUNKS, second
        turn_s.append(s1 + s2)
    return {"chunks_us": 1e6 * median(chunk_s), "turn_us": 1e6 * median(turn_s), "key_us": 1e6 * median(key_s),
            "held": worker.held is not None}


def run(quick: bool = False, rounds: int = 30) -> dict:
    rounds = 8 if quick else rounds
    out, rows = {}, []
    with torch_threads(1), tempfile.TemporaryDirectory() as d:
        work = Path(d)
        with RedisServer(work / "redis.log") as server:
            configs = {
                "cpu": lmcache_yaml(work / "cpu.yaml", local_cpu=True, max_local_cpu_size=0.5),
                "disk": lmcache_yaml(work / "disk.yaml", local_cpu=False, max_local_cpu_size=0.2,
                                     local_disk=f"file://{work}/disk/", max_local_disk_size=1),
                "redis": lmcache_yaml(work / "redis.yaml", base="redis", remote_url=server.url),
            }
            for tier, path in configs.items():
                worker, ns = make_worker(path)
                try:
                    m = measure(worker, ns, rounds)
                finally:
                    worker.shutdown()
                say(f"{tier}: chunks {m['chunks_us']:.0f} us, turn end {m['turn_us']:.0f} us")
                out[f"turn_lookup_{tier}_ratio"] = round(m["turn_us"] / m["chunks_us"], 3)
                out[f"turn_lookup_{tier}_extra_us"] = round(m["turn_us"] - m["chunks_us"], 1)
                rows.append([tier, f"{m['chunks_us']:.0f}", f"{m['turn_us']:.0f}", f"{m['turn_us'] / m['chunks_us']:.2f}",
                             f"{m['key_us']:.1f}", "yes" if m["held"] else "no"])
    out["table"] = table(["tier", "lookup, 6 chunks (us)", "lookup, 6 chunks + turn end, 2 phases (us)",
                          "ratio", "candidate key (us)", "held"], rows)
    out["notes"] = [f"median of {rounds} lookups each; torch 1 thread; objects: 6 chunks of 256 tokens "
                    f"(64 KiB pages, 3 groups x 2 layers, block 16) + a tail + a turn end {OFFSET} tokens in"]
    return out


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "TURN_LOOKUP", options=(("--rounds", {"type": int, "default": 30}),)))
