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

A busy store queue (CPU tier): a next turn's lookup right after its turn end was queued, as
the scheduler sends it (``settle``: the turn end lands first), while the writer never runs
dry: each put takes ``BUSY_PUT_S`` (a Redis round trip under load) and another thread queues
an object every ``BUSY_EVERY_S``. The settle wait of the rule in the code (the turn end's marker
lands: what was queued ahead of it, not the backlog behind it) against the rule before issue 47,
emulated in the same run (until the
queue is empty, at most to the hold deadline: half a second before the default 5 s
lookup timeout), and whether each lookup served the turn end.

    python benchmarks/bench_turn_lookup.py [--rounds 30] [--quick]

Prints the tables and a last line ``TURN_LOOKUP {json}`` (turn end / chunks per tier, the
busy queue's settle waits).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RedisServer, bench_main, lmcache_yaml, median, say, table, torch_threads  # noqa: E402

CHUNK, BLOCK, CHUNKS, OFFSET = 256, 16, 6, 100
NUM_BLOCKS = 1 + 3 * (CHUNKS + 1) * (CHUNK // BLOCK)  # every group's blocks of 7 chunks, apart
BUSY_PUT_S, BUSY_EVERY_S, BUSY_OBJECT = 0.005, 0.001, 4096  # the busy queue: put time, queue interval, bytes


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


def block_table():
    """Each group's blocks of ``CHUNKS + 1`` chunks, apart from the other groups'."""
    span = (CHUNKS + 1) * (CHUNK // BLOCK)
    return tuple(list(range(1 + g * span, 1 + (g + 1) * span)) for g in range(3))


def measure(worker, ns, rounds: int) -> dict:
    from lmcache_hma.core.keys import ChunkHasher
    from lmcache_hma.core.kinds import ObjectKind
    from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec

    hasher = ChunkHasher(ns)
    end = CHUNKS * CHUNK + OFFSET
    tokens = [(7 * i) % 1000 for i in range(end + 50)]
    hashes = hasher.chunk_hashes(tokens, CHUNKS + 1)
    table_ids = block_table()
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
        second, s2 = lookup(hashes=hashes[:CHUNKS], turns=(CHUNKS, [(end, key, False)]))
        assert second.turn_end == end and second.chunks == CHUNKS, second
        turn_s.append(s1 + s2)
    return {"chunks_us": 1e6 * median(chunk_s), "turn_us": 1e6 * median(turn_s), "key_us": 1e6 * median(key_s),
            "held": worker.held is not None}


class BusyQueue:
    """Keeps ``worker``'s store writer busy (see the module docstring) while entered."""

    def __init__(self, worker):
        self.worker, self.stop = worker, threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)

    def _put(self, items, shared=True, **kw):
        time.sleep(BUSY_PUT_S)
        return self._commit_many(items, shared, **kw)

    def _feed(self) -> None:
        from lmcache_hma.core.kinds import ObjectKind

        n = 0
        while not self.stop.wait(BUSY_EVERY_S):
            n += 1
            obj = self.worker.store.allocate(BUSY_OBJECT)
            if obj is not None:
                key = hashlib.sha256(b"busy %d" % n).digest()
                self.worker.writer.submit(ObjectKind.FULL, key, obj, "full_attention", BUSY_OBJECT)

    def __enter__(self):
        self._commit_many = self.worker.store.commit_many
        self.worker.store.commit_many = self._put
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.worker.store.commit_many = self._commit_many


def wait_until_empty(writer, by: float) -> bool:
    """The settle wait before issue 47: until the writer's queue is empty, at most until ``by``."""
    while writer.pending() and time.monotonic() < by:
        time.sleep(0.0005)
    return not writer.pending()


def busy_lookup(worker, ns, n: int, old_rule: bool) -> tuple[float, float, bool]:
    """A next turn's two lookups right after its turn end (round ``n``'s own prompt) was queued
    behind the busy queue: (seconds of the settle wait, seconds of both lookups, whether the
    second hit the turn end)."""
    from lmcache_hma.core.keys import ChunkHasher
    from lmcache_hma.core.kinds import ObjectKind
    from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec

    hasher, writer = ChunkHasher(ns), worker.writer
    tokens = [(7 * i + 1009 * n) % 50000 for i in range(2 * CHUNK)]
    hashes, end = hasher.chunk_hashes(tokens, 1), CHUNK + OFFSET
    key = hasher.turn_digest(hashes[0], tokens, CHUNK, end, None)
    chunk = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", block_table(), chunk)]))
    writer.wait_stored(time.monotonic() + 10)  # the prefix is stored; the turn end is what lands now
    turn = [ObjectRef(ObjectKind.TURN, 1, key, end), ObjectRef(ObjectKind.TURNMARK, 1, hashes[0], end)]
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", block_table(), turn, finished=True)]))
    timeout = worker.config.lookup_timeout_s
    deadline = time.monotonic() + timeout  # one deadline over both lookups, as the scheduler's
    hold_by = deadline - min(worker.LATE_S, timeout / 4)
    waits, wait_stored = [], writer.wait_stored

    def timed_wait(by, objects=None):
        t0 = time.perf_counter()
        try:
            return wait_until_empty(writer, hold_by) if old_rule else wait_stored(by, objects)
        finally:
            waits.append(time.perf_counter() - t0)

    writer.wait_stored = timed_wait
    try:
        t0 = time.perf_counter()
        first = worker._answer_lookup(f"busy{n}", 1, 0, hashes[:1], deadline, turn_limit=end + 40, settle=[hashes[0]])
        served = False
        if first.marks == (OFFSET,) and time.monotonic() < deadline:
            second = worker._answer_lookup(f"busy{n}", 2, 0, hashes[:1], deadline, turns=(1, [(end, key, False)]))
            served = second.turn_end == end
        seconds = time.perf_counter() - t0
    finally:
        writer.wait_stored = wait_stored
    if worker.held is not None:
        worker.held.release(f"busy{n}", 10)
    return waits[0], seconds, served


def measure_busy(worker, ns, rounds: int, old_rounds: int) -> dict:
    """The busy queue's lookups under the rule in the code, then under the old one."""
    runs = {}
    with BusyQueue(worker):
        for rule, n in (("new", rounds), ("old", old_rounds)):
            runs[rule] = [busy_lookup(worker, ns, len(runs) * 1000 + i, rule == "old") for i in range(n)]
    return {rule: {"settle_ms": 1e3 * median(r[0] for r in got), "lookup_ms": 1e3 * median(r[1] for r in got),
                   "served": sum(r[2] for r in got), "rounds": len(got)} for rule, got in runs.items()}


def run(quick: bool = False, rounds: int = 30) -> dict:
    rounds = 8 if quick else rounds
    out, rows, busy = {}, [], None
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
                    if tier == "cpu":  # each old-rule lookup waits out its deadline: a few
                        busy = measure_busy(worker, ns, rounds, 1 if quick else 3)
                finally:
                    worker.shutdown()
                say(f"{tier}: chunks {m['chunks_us']:.0f} us, turn end {m['turn_us']:.0f} us")
                out[f"turn_lookup_{tier}_ratio"] = round(m["turn_us"] / m["chunks_us"], 3)
                out[f"turn_lookup_{tier}_extra_us"] = round(m["turn_us"] - m["chunks_us"], 1)
                rows.append([tier, f"{m['chunks_us']:.0f}", f"{m['turn_us']:.0f}", f"{m['turn_us'] / m['chunks_us']:.2f}",
                             f"{m['key_us']:.1f}", "yes" if m["held"] else "no"])
    out["table"] = table(["tier", "lookup, 6 chunks (us)", "lookup, 6 chunks + turn end, 2 phases (us)",
                          "ratio", "candidate key (us)", "held"], rows)
    for rule, b in busy.items():
        say(f"busy queue, {rule} rule: settle wait {b['settle_ms']:.1f} ms, turn end served "
            f"{b['served']}/{b['rounds']}")
        out[f"busy_settle_{rule}_ms"] = round(b["settle_ms"], 2)
        out[f"busy_turn_served_{rule}"] = f"{b['served']}/{b['rounds']}"
    out["table"] += "\n\nThe next turn's lookup with the store queue kept busy (CPU tier):\n\n" + table(
        ["settle wait rule", "settle wait (ms)", "both lookups (ms)", "turn end served"],
        [["the turn end's marker lands (the code)", busy["new"]["settle_ms"], busy["new"]["lookup_ms"],
          f"{busy['new']['served']}/{busy['new']['rounds']}"],
         ["the queue is empty (before issue 47)", busy["old"]["settle_ms"], busy["old"]["lookup_ms"],
          f"{busy['old']['served']}/{busy['old']['rounds']}"]])
    out["notes"] = [f"median of {rounds} lookups each; torch 1 thread; objects: 6 chunks of 256 tokens "
                    f"(64 KiB pages, 3 groups x 2 layers, block 16) + a tail + a turn end {OFFSET} tokens in",
                    f"busy queue: each put {1e3 * BUSY_PUT_S:.0f} ms, an object queued every {1e3 * BUSY_EVERY_S:.0f} ms; "
                    f"medians over the rounds of each rule"]
    return out


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "TURN_LOOKUP", options=(("--rounds", {"type": int, "default": 30}),)))
