"""The disk tier keeps its room across removals, and a write that does not land is counted.

LMCache's real ``LocalDiskBackend`` under a ``ChunkStore`` (and the ``StoreWriter`` that counts
what it stores); no vLLM engine.
"""

import errno
import time

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import TRAILER_BYTES
from lmcache_hma.store.lmcache_storage import flat, release
from lmcache_hma.worker.store_writer import StoreWriter
from tests.fakes import digest
from tests.test_store import open_store
from tests.waiting import wait_for

OBJECT_BYTES = 64 << 10  # a whole number of pages: the size LMCache counts for an object
PAYLOAD = OBJECT_BYTES - TRAILER_BYTES
OBJECTS = 10  # the tier holds this many objects


def disk_store(tmp_path):
    """A disk-only store whose tier holds ``OBJECTS`` objects of ``PAYLOAD`` bytes."""
    return open_store(tmp_path, local_cpu=False, max_local_cpu_size=0.01,
                      local_disk=f"file://{tmp_path / 'disk'}/",
                      max_local_disk_size=(OBJECTS + 0.5) * OBJECT_BYTES / 2**30)


def disk(store):
    return store._manager.storage_backends["LocalDiskBackend"]


def settle(store):
    wait_for(lambda: not store.writes_pending(), what="the disk tier's writes")


def put(store, h, value=1.0):
    assert store.put(ObjectKind.FULL, digest(h), PAYLOAD, lambda p: p.fill_(value))


def loadable(store, h, value=1.0) -> bool:
    obj = store.get(ObjectKind.FULL, digest(h), PAYLOAD)
    if obj is None:
        return False
    try:
        return float(flat(obj)[0]) == value
    finally:
        release(obj)


class Removals:
    """A stand-in for the KV-event collector (``ChunkStore.watch``): what left which tier."""

    def __init__(self):
        self.keys: list = []

    def removed(self, label, key):
        self.keys.append((label, key.chunk_hash))

    def put_callback(self, label):
        return None


def room_is_true(store) -> bool:
    """LMCache's admission counter equals the bytes of what the disk tier holds."""
    backend = disk(store)
    return backend.current_cache_size == sum(meta.size for meta in backend.dict.values())


def test_a_cleared_disk_tier_stores_as_much_as_before(tmp_path):
    """After a reset of a full disk tier, and removals of a damaged and a vanished object, the
    tier stores as many new objects as it holds: LMCache 0.5.6's ``remove`` gave no room back,
    so not one was written. Evictions still give room back once, and every removal is still
    reported (``observe_removals`` wraps the same ``remove``)."""
    store = disk_store(tmp_path)
    removals = Removals()
    store.watch(removals)
    try:
        for h in range(OBJECTS + 3):  # three evictions
            put(store, h)
            settle(store)
        assert len(disk(store).dict) == OBJECTS and room_is_true(store)
        assert [h for _, h in removals.keys] == [digest(h) for h in range(3)]
        files = {f.name: f for f in (tmp_path / "disk").iterdir()}
        damaged, vanished = (next(f for n, f in files.items() if digest(h).hex() in n) for h in (3, 4))
        raw = bytearray(damaged.read_bytes())
        raw[100] ^= 0xFF
        damaged.write_bytes(bytes(raw))
        vanished.unlink()
        assert not loadable(store, 3) and not loadable(store, 4)
        assert store.clear_local() == OBJECTS - 2
        for h in range(100, 100 + OBJECTS):
            put(store, h, 2.0)
        settle(store)
        assert [h for h in range(100, 100 + OBJECTS) if not loadable(store, h, 2.0)] == []
        assert room_is_true(store) and store.counters().get("objects_not_on_disk", 0) == 0
        assert len(removals.keys) == 3 + OBJECTS  # the vanished file's too (LMCache dropped it unsaid)
    finally:
        store.close()


def test_a_write_the_disk_tier_refuses_is_counted_and_never_stored(tmp_path):
    """LMCache refuses a put it has no room for (here: larger than the tier) and says nothing to
    its caller: the object is counted as not written to disk and, in a disk-only store, as not
    stored (``objects_stored`` counts only what some tier took)."""
    store = disk_store(tmp_path)
    writer = StoreWriter(store, max_queued=8)
    try:
        for h, payload in ((1, PAYLOAD), (2, (OBJECTS + 1) * OBJECT_BYTES)):
            obj = store.allocate(payload)
            flat(obj).fill_(1.0)
            assert writer.submit(ObjectKind.FULL, digest(h), obj, "full_attention", payload)
        writer.drain()
        settle(store)
        counts = writer.counts()
        assert counts["objects_stored"] == 1 and counts["objects_not_stored"] == 1
        assert counts["stored_bytes_full_attention"] == PAYLOAD
        assert store.counters() == {"objects_not_on_disk": 1}
        assert loadable(store, 1) and room_is_true(store)
    finally:
        writer.close(5)
        store.close()


def test_a_failed_disk_write_gives_back_its_room_and_memory_and_is_counted(tmp_path):
    """A write that raises (no space left on the device) is counted, leaves no put task behind
    (LMCache's stayed forever: writes pending, a reset waiting for it), and gives back its room
    and its reference to the object."""
    store = disk_store(tmp_path)
    backend = disk(store)
    write_file = backend.write_file

    def full_device(buffer, path):
        with open(path, "wb") as f:
            f.write(bytes(buffer)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    backend.write_file = full_device
    try:
        obj = store.allocate(PAYLOAD)
        flat(obj).fill_(1.0)
        obj.ref_count_up()  # ours, to see that the tier gives its own back
        store.commit(ObjectKind.FULL, digest(1), obj)  # admitted: the write fails on the tier's thread
        settle(store)
        assert obj.get_ref_count() == 1 and backend.current_cache_size == 0
        assert store.counters() == {"objects_not_on_disk": 1} and not list((tmp_path / "disk").iterdir())
        release(obj)
        backend.write_file = write_file
        for h in range(10, 10 + OBJECTS):
            put(store, h)
        settle(store)
        assert all(loadable(store, h) for h in range(10, 10 + OBJECTS)) and room_is_true(store)
    finally:
        store.close()


def test_a_marker_rewritten_while_its_last_write_is_under_way_lands(tmp_path):
    """A turn end's marker is rewritten (another turn end after the same prefix) while the disk
    tier is still writing the previous one: LMCache refuses a put of a key it is writing
    ("already in progress"), so on 4d9fc3d the new marker was lost, counted as stored: a later
    lookup found the old offsets only. The rewrite waits for that write, then lands."""
    store = disk_store(tmp_path)
    backend = disk(store)
    write_file, slowed = backend.write_file, []

    def slow_first_write(buffer, path):
        if not slowed:
            slowed.append(path)
            time.sleep(0.3)
        return write_file(buffer, path)

    backend.write_file = slow_first_write
    try:
        key = digest(5)
        assert store.put(ObjectKind.TURNMARK, key, PAYLOAD, lambda p: p.fill_(1.0))
        wait_for(lambda: slowed, what="the first marker's write")
        assert store.put(ObjectKind.TURNMARK, key, PAYLOAD, lambda p: p.fill_(2.0))
        settle(store)
        obj = store.get(ObjectKind.TURNMARK, key, PAYLOAD)
        assert obj is not None
        try:
            assert float(flat(obj)[0]) == 2.0, "the rewritten marker was lost"
        finally:
            release(obj)
        assert room_is_true(store) and store.counters() == {}
    finally:
        store.close()


def test_stale_files_of_this_namespace_are_removed_at_start_and_others_left(tmp_path, caplog):
    """Files of this namespace in an earlier format (``hma2``: never indexed after the ``hma3``
    tag change, so never counted nor removed: disk use could reach twice ``max_local_disk_size``)
    or under a weights generation of an earlier process are removed at start, with an INFO line
    saying how many bytes; another namespace's files in the directory are left alone."""
    import json
    import logging

    from lmcache_hma.core.keys import keyed_sha256

    store = disk_store(tmp_path)
    ns = store.namespace
    name = store.key(ObjectKind.FULL, digest(1)).to_string() + ".pt"
    field = name.split("@")[0]
    store.close()
    tag, base, kind = field.split(".")
    hma2 = keyed_sha256(None, b"fingerprint:" + json.dumps({**ns.describe(), "format": "hma2"}, sort_keys=True,
                                                            default=str).encode())[:8].hex()
    stale = [name.replace(field, f"{tag}.{hma2}.{kind}"), name.replace(field, f"{tag}.{base}g3.{kind}")]
    other = [name.replace(field, f"other.{base}.{kind}"), name.replace(field, f"{tag}.{'0' * 16}.{kind}"),
             name.replace("@1@0@", "@2@1@").replace(field, f"{tag}.{hma2}.{kind}")]  # another rank's
    directory = tmp_path / "disk"
    for n in stale + other:
        (directory / n).write_bytes(b"\0" * OBJECT_BYTES)
    with caplog.at_level(logging.INFO, logger="lmcache_hma"):
        store = disk_store(tmp_path)
    try:
        assert sorted(p.name for p in directory.iterdir()) == sorted(other)
        assert store.foreign_files == len(other) and store.reindexed == 0
        assert any(f"removed 2 stale files of this model (an earlier format or weights generation: "
                   f"{2 * OBJECT_BYTES} bytes)" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        store.close()


def test_a_read_with_no_cpu_memory_to_read_into_is_a_miss_not_a_wait(tmp_path):
    """A load reads its objects from disk into CPU memory and holds them until it has them all.
    When they do not all fit (the CPU tier's memory holds 4, the hit is 8), LMCache's disk read
    waited for an eviction to free room, retrying every 0.1 s, forever: the objects filling the
    memory were the load's own (found by the simulator: the engine's step never ended). The
    objects past the room are misses (the load fails and vLLM recomputes), their files stay, and
    once the first are given back they read as before."""
    import threading

    store = open_store(tmp_path, local_cpu=False, max_local_cpu_size=4.5 * OBJECT_BYTES / 2**30,
                       local_disk=f"file://{tmp_path / 'disk'}/",
                       max_local_disk_size=(OBJECTS + 0.5) * OBJECT_BYTES / 2**30)
    try:
        for h in range(8):
            put(store, h, float(h))
            settle(store)
        assert len(disk(store).dict) == 8
        got = []
        reader = threading.Thread(target=lambda: got.append(
            store.get_many([(ObjectKind.FULL, digest(h), PAYLOAD) for h in range(8)])), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the read waited for CPU memory its own objects held"
        [pairs] = got
        read = [obj for obj, *_ in pairs if obj is not None]
        assert 0 < len(read) < 8 and pairs[-1][0] is None
        assert len(disk(store).dict) == 8  # a miss for want of memory is not damage: the files stay
        assert store.counters()["objects_not_read_no_memory"] == 8 - len(read)  # counted (a metric)
        for obj in read:
            release(obj)
        assert all(loadable(store, h, float(h)) for h in range(8))
    finally:
        store.close()
