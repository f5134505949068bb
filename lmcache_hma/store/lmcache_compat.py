"""Every use of LMCache's internals, in one place, for the one LMCache release it was made for.

lmcache_hma builds on LMCache's public pieces (``StorageManager`` and its backends'
``contains`` / ``get_blocking`` / ``batched_put`` / ``remove``, ``CacheEngineKey``,
``RemoteMetadata``, ``LMCacheEngineConfig``). Where LMCache leaves something out or
has a bug, it reaches into private attributes; each such use is a function here,
with the reason at its caller. The version is checked once, at import: an LMCache
upgrade fails here with one message, not somewhere inside a serving engine.
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED_LMCACHE = "0.5.6"


def _check_version() -> None:
    try:
        found = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != SUPPORTED_LMCACHE:
        raise ImportError(
            f"lmcache_hma needs LMCache {SUPPORTED_LMCACHE} (it relies on internals of that release, "
            f"all listed in lmcache_hma/store/lmcache_compat.py); found {found or 'none'}. "
            f"Install lmcache=={SUPPORTED_LMCACHE}"
        )


_check_version()


# config ---------------------------------------------------------------------------
def config_keys() -> set[str]:
    """Every key an LMCache YAML file may hold (names and their aliases)."""
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS

    return set(_CONFIG_DEFINITIONS) | set(_CONFIG_ALIASES)


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


def disk_writes_pending(disk_backend) -> bool:
    """Whether ``LocalDiskBackend`` has files being written (its put tasks, not indexed yet)."""
    return bool(disk_backend.disk_worker.put_tasks)


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
