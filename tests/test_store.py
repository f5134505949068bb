"""ChunkStore on LMCache's real CPU and disk tiers (no vLLM engine)."""

import os
import time

import pytest
import torch

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import payload_of
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import flat, release
from tests.engines import write_yaml
from tests.fakes import digest, layout
from tests.waiting import on_disk, wait_for

PAYLOAD = 4096


def namespace(model="tiny", rank=0, kinds="SSF"):
    return Namespace(model=model, kv_dtype=torch.bfloat16, layout=layout(kinds), kv_layout="LBHNC/test",
                     world_size=1, rank=rank)


def open_store(tmp_path, ns=None, eviction="lru", **yaml_keys):
    keys = dict(chunk_size=8, local_cpu=True, max_local_cpu_size=0.01)
    keys.update(yaml_keys)
    cfg = load_config({"lmcache_config_file": str(write_yaml(tmp_path / f"c{time.time_ns()}.yaml", **keys))})
    return ChunkStore(cfg.lmcache, ns or namespace(), eviction=eviction)


def put(store, kind, h, value):
    return store.put(kind, digest(h), PAYLOAD, lambda p: p.fill_(value))


def wait_for_files(store, path, hashes, kind=ObjectKind.FULL):
    """The files of ``path`` once ``store`` wrote the ``kind`` objects of ``hashes`` there."""
    wait_for(lambda: on_disk(store, [(kind, digest(h)) for h in hashes]), what=f"disk writes of {hashes}")
    return os.listdir(path)


def test_cpu_roundtrip_and_kinds_are_separate(tmp_path):
    store = open_store(tmp_path)
    try:
        assert put(store, ObjectKind.FULL, 7, 1.5)
        assert store.has(ObjectKind.FULL, digest(7)) and not store.has(ObjectKind.TAIL, digest(7))
        obj = store.get(ObjectKind.FULL, digest(7), PAYLOAD)
        assert obj is not None and float(flat(obj)[0]) == 1.5
        release(obj)
        assert store.get(ObjectKind.TAIL, digest(7), PAYLOAD) is None
        assert store.count_full_prefix([digest(7), digest(8)]) == 1
    finally:
        store.close()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors through /proc")
def test_a_closed_store_leaves_no_descriptor_open(tmp_path):
    """LMCache's ``StorageManager.close`` stops its event loop without closing it: each closed
    store left an epoll descriptor and a socket pair open (the simulator, which opens one per
    schedule, ran out of descriptors after a few thousand)."""
    open_store(tmp_path).close()  # LMCache's lazily made objects exist from here
    before = open_descriptors()
    for _ in range(3):
        store = open_store(tmp_path)
        assert put(store, ObjectKind.FULL, 7, 1.5)
        store.close()
        assert store._manager.loop.is_closed()
    assert open_descriptors() <= before


def test_namespaces_never_share_objects(tmp_path):
    disk = tmp_path / "disk"
    a = open_store(tmp_path, namespace("model-a"), local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    put(a, ObjectKind.FULL, 7, 1.0)
    wait_for_files(a, disk, [7])
    a.close()
    for other in (namespace("model-b"), namespace(kinds="SFS"), namespace(rank=1)):
        b = open_store(tmp_path, other, local_disk=f"file://{disk}/", max_local_disk_size=0.01)
        try:
            assert not b.has(ObjectKind.FULL, digest(7)) and b.get(ObjectKind.FULL, digest(7), PAYLOAD) is None
        finally:
            b.close()


def test_disk_tier_survives_restart_and_rejects_damage(tmp_path):
    disk = tmp_path / "disk"
    yaml_keys = dict(local_cpu=False, local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    store = open_store(tmp_path, **yaml_keys)
    for h in (1, 2, 3, 4):
        assert put(store, ObjectKind.FULL, h, float(h))
    files = sorted(wait_for_files(store, disk, (1, 2, 3, 4)))
    store.close()
    assert len(files) == 4
    # damage two files the way a crash or a bad disk would
    by_hash = {n: disk / f for f in files for n in (1, 2, 3, 4) if f.split("@")[3] == digest(n).hex()}
    raw = bytearray(by_hash[2].read_bytes())
    raw[100] ^= 0xFF
    by_hash[2].write_bytes(bytes(raw))
    by_hash[3].write_bytes(by_hash[3].read_bytes()[:-64])
    store = open_store(tmp_path, **yaml_keys)  # a fresh process would see the same
    by_hash[4].unlink()  # deleted after the index was built
    try:
        assert store.reindexed == 4
        obj = store.get(ObjectKind.FULL, digest(1), PAYLOAD)
        assert obj is not None and float(flat(obj)[0]) == 1.0
        release(obj)
        assert store.get(ObjectKind.FULL, digest(2), PAYLOAD) is None  # checksum
        assert store.get(ObjectKind.FULL, digest(3), PAYLOAD) is None  # truncated
        assert store.integrity_failures == 2
        assert not store.has(ObjectKind.FULL, digest(2))  # removed, not served again
        assert store.get(ObjectKind.FULL, digest(4), PAYLOAD) is None  # the file is gone: a miss
        assert not store.has(ObjectKind.FULL, digest(4))  # and its stale index entry is dropped
    finally:
        store.close()


def test_a_store_closed_while_its_disk_writes_run_lets_them_land(tmp_path):
    """LMCache's ``StorageManager.close`` frees the CPU memory its disk writes in flight still read
    from (its CPU backend closes first): a store closed right after its puts crashed the process
    (a segfault in ``write_file``). The writes land first, whole: a restart reads each back."""
    disk = tmp_path / "disk"
    yaml_keys = dict(local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    store = open_store(tmp_path, **yaml_keys)
    backend = store.tier("disk").backend
    write_file = backend.write_file

    def slow_write(buffer, path):  # a busy disk: the writes are still under way at close
        time.sleep(0.2)
        write_file(buffer, path)

    backend.write_file = slow_write
    for h in (1, 2, 3, 4):
        assert put(store, ObjectKind.FULL, h, float(h))
    assert store.writes_pending()
    store.close()
    store = open_store(tmp_path, **yaml_keys)
    try:
        assert store.reindexed == 4
        for h in (1, 2, 3, 4):
            obj = store.get(ObjectKind.FULL, digest(h), PAYLOAD)
            assert obj is not None and bool((payload_of(flat(obj)) == float(h)).all())
            release(obj)
    finally:
        store.close()


def test_disk_writes_slower_than_the_close_deadline_still_land(tmp_path, monkeypatch):
    """Past its deadline a store's close leaves LMCache's backends open for the writes still under
    way (their memory is not freed under them) and stops only its event loop, whose thread would
    keep the process from exiting; the writes already running (both, here: LMCache's disk tier
    runs four at once) land after, whole."""
    from lmcache_hma.store import chunk_store

    monkeypatch.setattr(chunk_store, "_CLOSE_TIMEOUT_S", 0.2)
    disk = tmp_path / "disk"
    yaml_keys = dict(local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    store = open_store(tmp_path, **yaml_keys)
    backend = store.tier("disk").backend
    write_file = backend.write_file

    def slow_write(buffer, path):
        time.sleep(0.5)
        write_file(buffer, path)

    backend.write_file = slow_write
    assert put(store, ObjectKind.FULL, 1, 1.0) and put(store, ObjectKind.FULL, 2, 2.0)
    store.close()
    assert store.writes_pending()
    wait_for(lambda: not store._manager.thread.is_alive(), what="LMCache's event loop to stop")
    wait_for(lambda: not store.writes_pending(), what="the writes")
    store = open_store(tmp_path, **yaml_keys)
    try:
        assert store.reindexed == 2
        for h in (1, 2):
            obj = store.get(ObjectKind.FULL, digest(h), PAYLOAD)
            assert obj is not None and bool((payload_of(flat(obj)) == float(h)).all())
            release(obj)
    finally:
        store.close()


def test_hashes_are_process_independent_and_namespaced(tmp_path):
    import subprocess
    import sys

    code = (
        "from tests.test_store import namespace; from lmcache_hma.core.keys import ChunkHasher;"
        "print([h.hex() for h in ChunkHasher(namespace('a')).chunk_hashes(list(range(40)), 5)])"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        for seed in ("0", "12345")
    }
    assert len(outs) == 1
    a = ChunkHasher(namespace("a")).chunk_hashes(list(range(40)), 5)
    assert len(outs) == 1 and outs == {str([h.hex() for h in a])}
    b = ChunkHasher(namespace("b")).chunk_hashes(list(range(40)), 5)
    assert a != b and len(set(a)) == 5 and all(len(h) == 32 for h in a)  # full 256-bit digests
    # prefix chaining: same first chunk, different second chunk
    c = ChunkHasher(namespace("a")).chunk_hashes(list(range(8)) + [99] * 32, 5)
    assert c[0] == a[0] and c[1] != a[1]


def test_reads_through_a_small_staging_buffer_never_block(tmp_path):
    """With local_cpu: false, reading more than the CPU buffer holds must not hang.

    LMCache keeps a copy of every object read from a lower tier in that buffer and
    never evicts it there; the store drops the copy (see ChunkStore.get).
    """
    import threading

    disk = tmp_path / "disk"
    store = open_store(tmp_path, local_cpu=False, max_local_cpu_size=0.01,
                       local_disk=f"file://{disk}/", max_local_disk_size=0.1)
    big = 2**20  # 20 objects of 1 MiB through a 10 MB buffer
    try:
        for h in range(20):
            assert store.put(ObjectKind.FULL, digest(h), big, lambda p: p.fill_(1.0))
            wait_for_files(store, disk, [h])
        done = []

        def reads():
            for h in range(20):
                obj = store.get(ObjectKind.FULL, digest(h), big)
                done.append(obj is not None)
                if obj is not None:
                    release(obj)

        t = threading.Thread(target=reads, daemon=True)
        t.start()
        t.join(60)
        assert done == [True] * 20, f"reads blocked or missed after {len(done)}"
    finally:
        store.close()


def test_disk_directory_is_private_and_others_files_are_left_alone(tmp_path):
    from lmcache_hma.config.settings import ConfigError

    disk = tmp_path / "disk"
    keys = dict(local_cpu=False, local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    a = open_store(tmp_path, namespace("model-a"), **keys)
    try:
        assert put(a, ObjectKind.FULL, 1, 1.0)
        wait_for_files(a, disk, [1])
    finally:
        a.close()
    assert os.stat(disk).st_mode & 0o777 == 0o700  # created private
    ours = os.listdir(disk)[0]
    strays = {"notes.txt": b"hello", ours.replace(digest(1).hex(), "zz" * 32): b"x",  # not hex
              ours.replace(digest(1).hex(), "ab" * 8): b"x"}  # a 64-bit key of an old format
    for name, data in strays.items():
        (disk / name).write_bytes(data)
    (disk / "subdir.pt").mkdir()
    b = open_store(tmp_path, namespace("model-b"), **keys)  # another namespace: a's file is foreign too
    try:
        assert b.reindexed == 0 and b.foreign_files == 5
        assert not b.has(ObjectKind.FULL, digest(1))
    finally:
        b.close()
    a = open_store(tmp_path, namespace("model-a"), **keys)
    try:
        assert a.reindexed == 1 and a.foreign_files == 4 and get_value(a, 1) == 1.0
    finally:
        a.close()
    assert sorted(os.listdir(disk)) == sorted([ours, "subdir.pt", *strays])  # nothing removed
    os.chmod(disk, 0o777)
    with pytest.raises(ConfigError, match="writable by every user"):
        open_store(tmp_path, **keys)
    os.chmod(disk, 0o700)
    os.chown(disk, 12345, -1)
    with pytest.raises(ConfigError, match="owned by another user"):
        open_store(tmp_path, **keys)


def get_value(store, h):
    obj = store.get(ObjectKind.FULL, digest(h), PAYLOAD)
    try:
        return None if obj is None else float(flat(obj)[0])
    finally:
        if obj is not None:
            release(obj)


def test_failed_fill_gives_the_object_back(tmp_path):
    store = open_store(tmp_path)
    allocated = []
    allocate = store._manager.allocate
    store._manager.allocate = lambda *a, **k: allocated.append(allocate(*a, **k)) or allocated[-1]
    try:
        def boom(payload):
            raise RuntimeError("copy failed")

        with pytest.raises(RuntimeError):
            store.put(ObjectKind.FULL, digest(1), PAYLOAD, boom)
        assert len(allocated) == 1 and allocated[0].get_ref_count() == 0  # back in the pool
        assert not store.has(ObjectKind.FULL, digest(1))
        assert put(store, ObjectKind.FULL, 2, 2.0) and get_value(store, 2) == 2.0
    finally:
        store.close()


def test_another_lmcache_release_fails_at_import_with_one_message(monkeypatch):
    import importlib
    import importlib.metadata

    import lmcache_hma.store.lmcache_compat as compat

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0")
    with pytest.raises(ImportError, match=r"needs LMCache 0\.5\.6 .* found 0\.6\.0\. Install lmcache==0\.5\.6"):
        importlib.reload(compat)
    monkeypatch.undo()
    importlib.reload(compat)  # the installed release imports


@pytest.mark.parametrize("disk", [False, True])
def test_a_rewritten_turn_end_marker_replaces_the_one_stored(tmp_path, disk):
    """A marker lists the turn ends after a chunk and is rewritten as turn ends are added; LMCache's
    CPU and disk tiers ignore a put of a key they hold, so the store removes the old one first
    (else every conversation after a shared system prompt but the first one found no turn end)."""
    keys = dict(local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.01, local_cpu=False) if disk else {}
    store = open_store(tmp_path, **keys)
    try:
        assert put(store, ObjectKind.TURNMARK, 3, 1.0)
        if disk:
            wait_for_files(store, tmp_path / "disk", [3], ObjectKind.TURNMARK)
        assert put(store, ObjectKind.TURNMARK, 3, 2.0)
        if disk:
            wait_for(lambda: not store.writes_pending(), what="the rewrite")
        obj = store.get(ObjectKind.TURNMARK, digest(3), PAYLOAD)
        assert obj is not None and float(flat(obj)[0]) == 2.0
        release(obj)
    finally:
        store.close()
