"""lmcache_hma's side of LMCache's Redis tier: what LMCache 0.5.6 leaves out for Redis.

Runs in the worker, beside ``store.ChunkStore``. Nothing read from Redis is
unpickled: LMCache's ``naive`` serde passes the bytes through, its metadata key
is a fixed ``struct``, and the object trailer (``objects``) checks the rest.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from lmcache_hma.config import remote_auth
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class RedisTier:
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
    def attach(cls, manager, lmcache_config) -> Optional["RedisTier"]:
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
