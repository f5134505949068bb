"""The chunk store: LMCache's StorageManager with its CPU, disk and remote tiers.

Runs in the worker (rank 0 also answers the scheduler's lookups from it, on a
thread). Tiers are LMCache's own, searched in its order: LocalCPUBackend, then
LocalDiskBackend, then RemoteBackend (``remote_url``, e.g. ``redis://``).

Every object is sealed with an integrity trailer (``objects``) on put and
checked on get; an object that fails is removed from every tier and reported
as a miss, so it can neither reach the KV cache nor be served again.

The Redis tier gets extra care (``_RedisTier``): credentials, a health check that
bypasses an unreachable Redis, removal of bad objects, and a close that does not
hang. Nothing read from Redis is unpickled: LMCache's ``naive`` serde passes the
bytes through, its metadata key is a fixed ``struct``, and the trailer checks the rest.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Callable, Optional, Sequence

import torch

from lmcache_hma.config import remote_auth
from lmcache_hma.keys import Namespace, short_key
from lmcache_hma.objects import IntegrityError, ObjectKind, object_elems, payload_of, seal, verify
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0


class ChunkStore:
    """Objects by (kind, chunk hash) in LMCache's tiers."""

    def __init__(self, lmcache_config, namespace: Namespace, verify_checksums: bool = True):
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        self.namespace = namespace
        self.dtype = namespace.kv_dtype
        self.verify_checksums = verify_checksums
        n_layers = len(namespace.layout.layer_names)
        metadata = LMCacheMetadata(
            model_name=namespace.model_field(ObjectKind.FULL),
            world_size=namespace.world_size,
            local_world_size=namespace.world_size,
            worker_id=namespace.rank,
            local_worker_id=namespace.rank,
            kv_dtype=namespace.kv_dtype,
            kv_shape=(n_layers, 2, lmcache_config.chunk_size, 1, 1),
            role="worker",
            chunk_size=lmcache_config.chunk_size,
        )
        self._manager = StorageManager(lmcache_config, metadata, EventManager())
        self.tiers = tuple(self._manager.storage_backends.keys())
        self._redis = _RedisTier.attach(self._manager, lmcache_config)
        self.reindexed = self._reindex_disk()
        self._lock = threading.Lock()  # one put/get sequence at a time per store
        self.integrity_failures = 0

    def _reindex_disk(self) -> int:
        """Register this namespace's objects already on the disk tier; returns how many.

        Workaround: LMCache 0.5.6's LocalDiskBackend keeps its index in memory only,
        so a restarted engine sees an empty disk tier although the files are there
        (``contains`` is False for every key written by the previous process). The
        file names are ``key.to_string() + ".pt"`` and the bytes are the raw object,
        so the index is rebuilt from the directory; the trailer still checks every
        object on load.
        """
        from lmcache.v1.memory_management import MemoryFormat

        disk = self._manager.storage_backends.get("LocalDiskBackend")
        path = getattr(disk, "path", None)
        if disk is None or not path or not os.path.isdir(path):
            return 0
        kinds = {self.namespace.model_field(k): k for k in ObjectKind}
        elem = torch.empty(0, dtype=self.dtype).element_size()
        entries = []
        for name in os.listdir(path):
            parts = name[:-3].split("@") if name.endswith(".pt") else []
            if len(parts) != 5 or parts[0] not in kinds:
                continue
            if parts[1:3] != [str(self.namespace.world_size), str(self.namespace.rank)]:
                continue
            full = os.path.join(path, name)
            size = os.path.getsize(full)
            if size % elem:
                continue  # truncated mid-element: leave it, it can never verify
            entries.append((os.path.getmtime(full), kinds[parts[0]], int(parts[3], 16), size))
        count = 0
        for _, kind, chunk_hash, size in sorted(entries):  # oldest first: LRU order
            if disk.current_cache_size + size > disk.max_cache_size:
                break
            disk.insert_key(self.key(kind, chunk_hash), size, torch.Size([1, 1, size // elem]),
                            self.dtype, MemoryFormat.KV_2LTD)
            disk.current_cache_size += size
            count += 1
        if count:
            logger.info("LMCacheHMA: found %d stored objects on the disk tier (%s)", count, path)
        return count

    # keys -----------------------------------------------------------------
    def key(self, kind: ObjectKind, chunk_hash: int):
        from lmcache.utils import CacheEngineKey

        ns = self.namespace
        return CacheEngineKey(ns.model_field(kind), ns.world_size, ns.rank, chunk_hash, ns.kv_dtype)

    # lookups ----------------------------------------------------------------
    def count_full_prefix(self, chunk_hashes: Sequence[int]) -> int:
        """How many of ``chunk_hashes``, from the first, have a full object."""
        if not chunk_hashes:
            return 0
        keys = [self.key(ObjectKind.FULL, h) for h in chunk_hashes]
        hit, _ = self._manager.batched_contains(keys)
        return hit

    def has(self, kind: ObjectKind, chunk_hash: int) -> bool:
        return self._manager.contains(self.key(kind, chunk_hash)) is not None

    # put / get --------------------------------------------------------------
    def put(self, kind: ObjectKind, chunk_hash: int, payload_bytes: int,
            fill: Callable[[torch.Tensor], None]) -> bool:
        """Allocate an object, let ``fill`` write its payload, seal and store it.

        Returns False (nothing stored) when the CPU tier has no room left.
        """
        elems = object_elems(payload_bytes, self.dtype)
        # 3-D because LMCache's KV_2LTD bookkeeping (get_num_tokens) reads shape[2].
        obj = self._manager.allocate(torch.Size([1, 1, elems]), self.dtype, eviction=True, busy_loop=False)
        if obj is None:
            logger.debug("no room to store %s chunk %x", kind.name, chunk_hash)
            return False
        tensor = flat(obj)
        fill(payload_of(tensor))
        seal(tensor, self.namespace.fingerprint, short_key(chunk_hash), kind)
        self._manager.batched_put([self.key(kind, chunk_hash)], [obj])
        return True

    def get(self, kind: ObjectKind, chunk_hash: int, payload_bytes: int) -> Optional["MemoryObj"]:
        """The verified object, or None (missing, or failed its checks and removed).

        The caller must ``release()`` a returned object.
        """
        key = self.key(kind, chunk_hash)
        try:
            obj = self._manager.get(key)
        except Exception as exc:  # a tier failing mid-read is a miss, not a crash
            logger.warning("LMCacheHMA: reading %s chunk %x failed: %s", kind.name, chunk_hash, exc)
            obj = None
        if obj is None:
            why = self._redis.unreadable(key, self._object_bytes(payload_bytes)) if self._redis else None
            if why:  # in Redis but not readable (e.g. truncated): LMCache returned None
                self.integrity_failures += 1
                logger.warning("LMCacheHMA: dropping %s chunk %x: %s", kind.name, chunk_hash, why)
                self.remove(kind, chunk_hash)
                return None
            self.remove(kind, chunk_hash, remote=False)  # drop a stale index entry (e.g. a deleted file)
            return None
        try:
            if flat(obj).dtype != self.dtype:
                raise IntegrityError(f"object has dtype {flat(obj).dtype}, expected {self.dtype}")
            verify(flat(obj), object_elems(payload_bytes, self.dtype), self.namespace.fingerprint,
                   short_key(chunk_hash), kind, check_crc=self.verify_checksums)
        except (IntegrityError, RuntimeError) as exc:
            self.integrity_failures += 1
            logger.warning("LMCacheHMA: dropping %s chunk %x: %s", kind.name, chunk_hash, exc)
            release(obj)
            self.remove(kind, chunk_hash)
            return None
        return obj

    def remove(self, kind: ObjectKind, chunk_hash: int, remote: bool = True) -> None:
        """Remove an object from every tier (local tiers only when ``remote`` is False)."""
        key = self.key(kind, chunk_hash)
        local = [t for t in self.tiers if t != _RedisTier.NAME]
        try:
            # LMCache's RedisConnector cannot remove (no remove_sync): _RedisTier does.
            self._manager.remove(key, locations=None if remote and self._redis is None else local)
        except Exception as exc:
            logger.warning("LMCacheHMA: removing chunk %x failed: %s", chunk_hash, exc)
        if remote and self._redis is not None:
            self._redis.delete(key)

    def _object_bytes(self, payload_bytes: int) -> int:
        return object_elems(payload_bytes, self.dtype) * torch.empty(0, dtype=self.dtype).element_size()

    def close(self) -> None:
        """Close the tiers, never waiting more than a few seconds.

        Workaround: LMCache's ``StorageManager.close()`` hangs forever with the
        Redis remote backend (its connector awaits a blocking executor shutdown on
        its own event loop), and its event-loop thread is not a daemon, so the
        process could not exit either. ``_RedisTier.close`` closes that connector
        first; the rest still runs on a daemon thread with a timeout.
        """
        if self._redis is not None:
            self._redis.close(_CLOSE_TIMEOUT_S / 2)
            self._redis = None
        t = threading.Thread(target=self._manager.close, name="lmcache-hma-close", daemon=True)
        t.start()
        t.join(_CLOSE_TIMEOUT_S)
        if t.is_alive():
            logger.warning("LMCacheHMA: LMCache storage did not close within %.0f s", _CLOSE_TIMEOUT_S)


def flat(obj) -> torch.Tensor:
    """An LMCache memory object's tensor as the 1-D object (a view)."""
    return obj.tensor.reshape(-1)


def release(obj) -> None:
    """Give a fetched LMCache memory object back to its allocator."""
    obj.ref_count_down()


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class _RedisTier:
    """lmcache_hma's side of LMCache's Redis tier (``RemoteBackend`` over ``redis://``).

    What LMCache 0.5.6 leaves out for Redis, measured here:

    * Credentials: ``config.load_config`` takes them out of ``remote_url`` (LMCache
      logs its URL in several places); they are given to the Redis client of
      LMCache's connector here, before its first connection, and to our own client.
    * Health: redis-py fails a call at once while nothing listens, but waits a
      socket timeout per call while Redis hangs. A ping at start and then every
      ``PERIOD_S`` bypasses the tier while Redis does not answer (LMCache's
      ``StorageManager.set_backend_bypass``): lookups miss and writes are skipped
      at once, with one warning; the tier is used again when Redis answers.
    * Removal: LMCache's ``RedisConnector`` has no ``remove_sync``; a bad object's
      two keys (``<key>metadata``, ``<key>kv_bytes``) are deleted here.
    * Unreadable objects: LMCache returns None (after logging) for a value whose
      length disagrees with its metadata; ``unreadable`` tells that from a miss.
    * Close: ``RedisConnector.close()`` deadlocks on its own event loop; ``close``
      drains queued writes (bounded), stops its workers and closes its client.
    """

    NAME = "RemoteBackend"
    PERIOD_S = 1.0

    @classmethod
    def attach(cls, manager, lmcache_config) -> Optional["_RedisTier"]:
        url = lmcache_config.remote_url or ""
        backend = manager.storage_backends.get(cls.NAME)
        if backend is None or not url.startswith(_REDIS_SCHEMES):
            return None
        return cls(manager, backend, url, remote_auth(lmcache_config))

    def __init__(self, manager, backend, url: str, auth) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._manager = manager
        self.url = url.split("?", 1)[0]  # for messages: it holds no credentials
        creds = {}
        if auth is not None:
            creds["password"] = auth.password
            if auth.username:
                creds["username"] = auth.username
        # A pooled connection broken by a Redis restart fails its next command; one retry,
        # on a fresh connection, makes that invisible (a dead Redis still fails at once).
        retry = dict(retry_on_error=[redis.exceptions.ConnectionError])
        conn = backend.connection  # None when LMCache could not create it
        self._connector = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
        if self._connector is not None:  # its pool has made no connection yet
            from redis.asyncio.retry import Retry as AsyncRetry

            self._connector.pool.connection_kwargs.update(creds, retry=AsyncRetry(NoBackoff(), 1), **retry)
        self._client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), **retry, **creds)  # URL: timeouts
        self.up = True
        self._stop = threading.Event()
        self._check(at_start=True)
        self._thread = threading.Thread(target=self._watch, name="lmcache-hma-redis-health", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self._check()

    def _check(self, at_start: bool = False) -> None:
        try:
            self._client.ping()
            ok, why = True, ""
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok == self.up and not (at_start and not ok):
            return
        self.up = ok
        self._manager.set_backend_bypass(self.NAME, not ok)
        if not ok:
            logger.warning(
                "LMCacheHMA: Redis tier %s %s (%s); serving continues without it: lookups miss "
                "and writes are skipped until it answers again",
                self.url, "is unreachable at start" if at_start else "stopped answering", why,
            )
        else:
            logger.warning("LMCacheHMA: Redis tier %s answers again; sharing resumes", self.url)

    def delete(self, key) -> None:
        if not self.up:
            return
        k = key.to_string()
        try:
            self._client.delete(k + "metadata", k + "kv_bytes")
        except Exception as exc:
            logger.warning("LMCacheHMA: removing %s from Redis failed: %s", k, exc)

    def unreadable(self, key, expected_bytes: int) -> Optional[str]:
        """Why the object under ``key`` is present in Redis but cannot be read, or None."""
        from lmcache.v1.protocol import RemoteMetadata

        if not self.up:
            return None
        k = key.to_string()
        try:
            pipe = self._client.pipeline(transaction=False)
            meta, size = pipe.get(k + "metadata").strlen(k + "kv_bytes").execute()
        except Exception:
            return None  # Redis trouble is a miss; the health check handles it
        if meta is None:
            return None  # not there: a plain miss
        try:
            length = RemoteMetadata.deserialize(meta).length
        except Exception:
            return "its metadata in Redis is malformed"
        if length != expected_bytes:
            return f"its metadata in Redis says {length} bytes, expected {expected_bytes}"
        if size != length:
            return f"its value in Redis is {size} bytes, its metadata says {length}"
        return None

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        conn, drain = self._connector, self.up

        async def shut() -> None:
            executor = conn.pq_executor
            if drain:  # let queued writes reach Redis
                try:
                    await asyncio.wait_for(executor._queue.join(), timeout_s / 2)
                except asyncio.TimeoutError:
                    logger.warning("LMCacheHMA: Redis writes still queued at close are dropped")
            executor._closed = True
            for worker in executor._workers:
                worker.cancel()
            await conn.connection.aclose()

        if conn is not None:
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._manager.loop).result(timeout_s)
            except Exception as exc:
                logger.warning("LMCacheHMA: closing the Redis tier: %s", exc or type(exc).__name__)
        self._manager.storage_backends.pop(self.NAME, None)  # closed: LMCache's close would hang
        # LMCache copies what it reads from Redis into the CPU buffer even with local_cpu:
        # false, and its clear() skips the buffer then: release those copies here.
        cpu = self._manager.storage_backends.get("LocalCPUBackend")
        if cpu is not None and not getattr(cpu, "use_hot", True):
            try:
                cpu.batched_remove(list(cpu.hot_cache.keys()))
            except Exception as exc:
                logger.debug("releasing CPU copies of Redis objects: %s", exc)
        try:
            self._client.close()
        except Exception:
            pass
