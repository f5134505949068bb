"""Every use of LMCache's internals, in one place, for the one LMCache release it was made for.

lmcache_hma builds on LMCache's public pieces (``StorageManager`` and its backends'
``contains`` / ``get_blocking`` / ``batched_put`` / ``remove``, ``CacheEngineKey``,
``RemoteMetadata``, ``LMCacheEngineConfig``). Where LMCache leaves something out or
has a bug, it reaches into private attributes; each such use is a function here,
with the reason at its caller (LMCache's config schema, read by the configuration, is
``config.lmcache_schema``). The version is checked once, at import: an LMCache
upgrade fails here with one message, not somewhere inside a serving engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

SUPPORTED_LMCACHE = "0.5.6"


def _check_version() -> None:
    try:
        found = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != SUPPORTED_LMCACHE:
        raise ImportError(
            f"lmcache_hma needs LMCache {SUPPORTED_LMCACHE} (it relies on internals of that release, "
            f"listed in lmcache_hma/store/lmcache_compat.py and lmcache_hma/config/lmcache_schema.py); found {found or 'none'}. "
            f"Install lmcache=={SUPPORTED_LMCACHE}"
        )


_check_version()


# storage manager and local backends -------------------------------------------------
def bypassed(manager) -> set:
    """The names of the backends ``StorageManager.set_backend_bypass`` turned off."""
    return manager._bypassed_backends


def is_cpu_tier(cpu_backend) -> bool:
    """Whether ``LocalCPUBackend`` keeps objects (``local_cpu: true``), not only stages them."""
    return getattr(cpu_backend, "use_hot", True)


def local_keys(backend) -> list:
    """Every key ``LocalCPUBackend`` or ``LocalDiskBackend`` holds (their index; no listing API)."""
    index = backend.hot_cache if hasattr(backend, "hot_cache") else backend.dict
    lock = getattr(backend, "cpu_lock", None) or getattr(backend, "disk_lock", None)
    if lock is None:
        return list(index)
    with lock:
        return list(index)


def backend_fill(backend):
    """How full ``LocalCPUBackend`` (its allocator's bytes handed out) or ``LocalDiskBackend`` (its
    ``usage``) is, a fraction of its size; None where it cannot tell (another allocator)."""
    if hasattr(backend, "hot_cache"):
        allocator = getattr(backend, "memory_allocator", None)
        pinned = getattr(allocator, "pin_allocator", allocator)
        used, size = getattr(pinned, "total_allocated_size", None), getattr(allocator, "size", None)
    else:
        used, size = getattr(backend, "usage", None), getattr(backend, "max_cache_size", None)
    return used / size if used is not None and size else None


def backend_index(backend):
    """``LocalCPUBackend``'s or ``LocalDiskBackend``'s index (key -> object or file metadata)."""
    return backend.hot_cache if hasattr(backend, "hot_cache") else backend.dict


def backend_lock(backend):
    """The lock ``LocalCPUBackend`` or ``LocalDiskBackend`` holds while it changes its index."""
    return getattr(backend, "cpu_lock", None) or backend.disk_lock


def disk_index_add(disk_backend, key, size: int, shape, dtype, fmt) -> bool:
    """Register a file already in ``LocalDiskBackend``'s directory; False when it has no room."""
    if disk_backend.current_cache_size + size > disk_backend.max_cache_size:
        return False
    disk_backend.insert_key(key, size, shape, dtype, fmt)
    disk_backend.current_cache_size += size
    return True


def observe_removals(backend, removed) -> None:
    """Call ``removed(key)`` whenever ``LocalCPUBackend`` or ``LocalDiskBackend`` drops ``key``
    from its index: its own evictions (LRU, to make room), a ``StorageManager.remove``, a reset.

    Workaround: LMCache 0.5.6 has no eviction hook. ``StorageBackendListener.on_evict``
    exists but no backend calls it, and the controller's ``batched_msg_sender`` (``OpType.EVICT``)
    is only built with a LMCache controller. Symptom without this: evictions are invisible, so a
    router keeps routing to KV this instance no longer holds. Both backends remove through
    ``self.remove(key, force)`` (their evictions via ``batched_remove``), so the instance's
    ``remove`` is wrapped; ``removed`` may run with the backend's lock held (an eviction in
    ``allocate``): it must only record.
    """
    original = backend.remove

    def remove(key, force: bool = True) -> bool:
        try:
            done = original(key, force)
        except OSError:  # the disk tier dropped its entry, then failed to delete the file
            removed(key)
            raise
        if done:
            removed(key)
        return done

    backend.remove = remove


class DiskRoom:
    """``LocalDiskBackend`` with its room kept true (``keep_disk_room``), and its puts told apart:
    taken (written, being written, already there) or not written (``not_written`` counts those:
    no room it could make, a write that failed)."""

    def __init__(self, disk_backend) -> None:
        self.backend = disk_backend
        self.not_written = 0
        self._warned = False

    def put(self, key, obj, on_stored=None) -> bool:
        """``submit_put_task``; whether the tier took the object. The backend's lock (reentrant,
        see ``keep_disk_room``) is held across the call, so no write completes or fails between
        LMCache's admission and the check: an admitted object is then in its put tasks."""
        backend = self.backend
        policy = backend.cache_policy
        with backend.disk_lock:
            if hasattr(policy, "expect"):  # the value policy: the write's parent is no leaf while it runs
                policy.expect(key)
            backend.submit_put_task(key, obj, on_complete_callback=on_stored)
            taken = key in backend.dict or backend.disk_worker.exists_in_put_tasks(key)
            if not taken and hasattr(policy, "unexpect"):
                policy.unexpect(key)
        if not taken:
            self.not_stored(key, "no room it could make (LMCache refused the write)")
        return taken

    def not_stored(self, key, why: str) -> None:
        """Count an object not written."""
        with self.backend.disk_lock:  # the tier's threads count too
            self.not_written += 1
            if self._warned:
                return
            self._warned = True
        from lmcache_hma.log import get_logger

        get_logger(__name__).warning(
            "LMCacheHMA: the disk tier did not write %s: %s; such objects are counted "
            "(objects_not_on_disk), this is said once", key.to_string(), why)


def keep_disk_room(disk_backend) -> DiskRoom:
    """Make ``LocalDiskBackend`` give its room back whenever an object leaves it or a write fails;
    call once, before the tier is used (it replaces the backend's lock).

    Workaround: LMCache 0.5.6's ``LocalDiskBackend`` admits a put against ``current_cache_size``,
    which only its eviction loop lowers: ``remove()`` (a reset's clear, a damaged object dropped)
    lowers ``usage`` but not it, ``read_file`` drops the entry of a vanished file lowering
    neither, and a write that raises (``write_file``: no space left, an I/O error) gives back
    neither the room nor its put task nor the memory object's reference. Symptom: every removal
    shrinks the tier for good; after one reset of a full tier no new object is written (LMCache
    logs "Insufficient evictable disk cache space" and the put does nothing) while the store
    counted them stored; a failed write also leaves ``disk_writes_pending`` true forever. Here:

    * ``remove(key)`` with ``force`` (every caller but the eviction loop, which lowers the size
      itself, holding the lock) lowers ``current_cache_size`` by the entry's size in the same
      hold of the lock that removes it (the lock becomes an ``RLock`` for that); a file already
      gone is removed all the same;
    * a read of a file that is gone raises ``FileNotFoundError`` before LMCache's ``read_file``
      drops the entry unaccounted; the reader then removes it (``LocalTier.fetch_many``);
    * a write that raises ``OSError`` gives back its room, put task and reference, deletes what
      it wrote and is counted (``DiskRoom.not_written``);
    * a read never waits for CPU memory: LMCache's ``load_bytes_from_disk`` allocates with
      ``busy_loop`` (retrying every 0.1 s until an eviction frees room) and drops the memory
      object when the read raises. Symptom: a load whose objects do not all fit beside what is
      held or queued for the store writer spun forever inside the engine's step (the objects it
      had read were its own: nothing else would free them; found by the simulator, tests/sim),
      and a file gone leaked its CPU memory. Here a read with no room raises ``NoMemoryForRead``
      (the reader answers a miss and keeps the entry: ``LocalTier.fetch_many``), and a read that
      fails gives its memory back.
    """
    room = DiskRoom(disk_backend)
    disk_backend.disk_lock = threading.RLock()
    original_remove, original_read = disk_backend.remove, disk_backend.read_file
    original_save = disk_backend.async_save_bytes_to_disk

    def remove(key, force: bool = True) -> bool:
        if not force:  # LMCache's eviction loop, under the lock: it lowered the size itself
            return original_remove(key, force)
        with disk_backend.disk_lock:
            meta = disk_backend.dict.get(key)
            try:
                return original_remove(key, force)
            except FileNotFoundError:  # popped, then the file was not there: removed all the same
                disk_backend.cache_policy.update_on_force_evict(key)
                return True
            finally:
                if meta is not None:  # the lock held since: this call removed it
                    disk_backend.current_cache_size -= meta.size

    def read_file(key, buffer, path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: the disk tier's file is gone")
        return original_read(key, buffer, path)

    def save(key, memory_obj, on_complete_callback=None):
        try:
            original_save(key, memory_obj, on_complete_callback=on_complete_callback)
            if hasattr(disk_backend.cache_policy, "landed"):
                with disk_backend.disk_lock:
                    disk_backend.cache_policy.landed(key)
        except OSError as exc:  # from write_file, before the key was indexed
            with disk_backend.disk_lock:  # before its put task goes: no new write of it meanwhile
                try:
                    os.remove(disk_backend._key_to_path(key))
                except OSError:
                    pass
                disk_backend.current_cache_size -= memory_obj.get_physical_size()
                disk_backend.usage -= len(memory_obj.byte_array)
                disk_backend.disk_worker.remove_put_task(key)
                disk_backend.cache_policy.update_on_force_evict(key)  # told of the put when it was admitted
            room.not_stored(key, f"the write failed ({exc})")
            memory_obj.ref_count_down()

    def load_bytes_from_disk(key, path, dtype, shape, fmt):
        memory_obj = disk_backend.local_cpu_backend.allocate(shape, dtype, fmt, busy_loop=False)
        if memory_obj is None:
            raise NoMemoryForRead(f"no CPU memory to read {key.to_string()} into")
        try:
            read_file(key, memory_obj.byte_array, path)
            memory_obj.metadata.cached_positions = disk_backend.dict[key].cached_positions
        except BaseException:
            memory_obj.ref_count_down()
            raise
        return memory_obj

    disk_backend.remove, disk_backend.read_file = remove, read_file
    disk_backend.load_bytes_from_disk = load_bytes_from_disk
    disk_backend.async_save_bytes_to_disk = save
    return room


class NoMemoryForRead(RuntimeError):
    """A disk read found no CPU memory to read into (nothing evictable now): a miss, not damage."""


def disk_writing(disk_backend, key) -> bool:
    """Whether ``LocalDiskBackend`` is writing ``key``'s file (a put task not indexed yet)."""
    return disk_backend.disk_worker.exists_in_put_tasks(key)


def disk_writes_pending(disk_backend) -> bool:
    """Whether ``LocalDiskBackend`` has files being written (its put tasks, not indexed yet)."""
    return bool(disk_backend.disk_worker.put_tasks)


def stop_storage_loop(manager) -> None:
    """Stop ``StorageManager``'s event-loop thread (not a daemon: a process with it running
    cannot exit) without closing its backends."""
    try:
        manager.loop.call_soon_threadsafe(manager.loop.stop)
    except RuntimeError:  # the loop is closed already
        pass


def close_storage_loop(manager) -> None:
    """Close ``StorageManager``'s event loop once its thread has ended.

    Workaround: LMCache's ``StorageManager.close()`` stops its loop and joins the thread but never
    closes the loop. Symptom: each closed store left an epoll descriptor and a socket pair open;
    a process that opens stores over and over (the simulator: one per schedule and per engine
    restart) ran into its open-files limit after a few thousand."""
    loop, thread = getattr(manager, "loop", None), getattr(manager, "thread", None)
    if loop is None or loop.is_closed() or loop.is_running() or (thread is not None and thread.is_alive()):
        return
    try:
        loop.close()
    except RuntimeError:  # running after all: left to the process's exit
        pass


# Redis connectors (RedisConnector, RedisClusterConnector) ------------------------------
def redis_connector(remote_backend):
    """The Redis connector inside a ``RemoteBackend`` (None when LMCache could not create it)."""
    conn = remote_backend.connection
    return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn


def pool_connection_kwargs(connector) -> dict:
    """The connection arguments of a ``RedisConnector``'s pool (read before its first connection)."""
    return connector.pool.connection_kwargs


def configure_cluster_client(connector, connection_kwargs: dict, retry) -> None:
    """Connection arguments, retry and coverage of a ``RedisClusterConnector``'s client."""
    cluster = connector.cluster
    cluster.connection_kwargs.update(connection_kwargs)  # shared with its NodesManager: nodes found later
    for node in cluster.nodes_manager.startup_nodes.values():  # built before: their own copies
        node.connection_kwargs.update(connection_kwargs)
    cluster.retry = retry
    cluster.nodes_manager.require_full_coverage = False


def reload_slot_map(loop, connector) -> None:
    """Make a ``RedisClusterConnector``'s client read the slot map before its next command."""
    cluster = getattr(connector, "cluster", None)
    if cluster is not None:
        loop.call_soon_threadsafe(setattr, cluster, "_initialize", True)


def stop_connector(connector) -> None:
    """Stop a Redis connector's priority-queue executor (its ``close()`` deadlocks on its own
    event loop); call it on that loop."""
    executor = connector.pq_executor
    executor._closed = True
    for worker in executor._workers:
        worker.cancel()
