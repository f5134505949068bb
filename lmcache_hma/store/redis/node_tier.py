"""lmcache_hma's side of LMCache's Redis tier: what LMCache 0.5.6 leaves out for Redis.

A ``Tier`` of the chunk store (``store.chunk_store``). Nothing read from Redis is
unpickled: LMCache's ``naive`` serde passes the bytes through, its metadata key
is a fixed ``struct``, and the object trailer (``objects``) checks the rest.

Two flavours: one Redis (``redis://``, ``rediss://``, ``unix://``: ``RedisTier``)
and a Redis Cluster (``redis-cluster://h1:p1,h2:p2``: ``RedisClusterTier``).

Every call (``calls``; the connection's handshake included) runs against one
``resp.Deadline`` of ``hma_remote_timeout_s`` (plus the time its bytes take at
``MIN_BYTES_PER_S``), and reads replies with ``resp.BulkReader``, which allocates
or skips nothing longer than the reply may be: metadata at most ``META_BYTES``, a
value exactly its piece. A server (or a proxy) that breaks either rule costs that
call's objects (misses, counted in ``protocol_errors``) and its connection, never
more time; a longer value or metadata that Redis really holds (someone wrote it) costs
only its own object, which is damaged (``pipelined_reads``): the store counts it in
``integrity_failures`` and deletes it, and the lookup serves the prefix before it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional

from lmcache_hma.core.kinds import TIERS
from lmcache_hma.log import get_logger
from lmcache_hma.store import lmcache_compat
from lmcache_hma.store.redis import REMOTE_BACKEND, resp
from lmcache_hma.store.redis.calls import DeadlineCalls
from lmcache_hma.store.redis.health import HealthChecked
from lmcache_hma.store.redis.pipelined_reads import (DamagedReply, ShardFetch, batches, piece_bytes, pieces,
                                                     read_in_turn)
from lmcache_hma.store.redis.room import RedisRoom, memory_info, short_of
from lmcache_hma.store.redis.wire import (OBJECT_KEYS, SMALL_BUFFER, all_ok, broken_connection, command, connection,
                                          delete_commands, exists_commands, expiring, give_back, handshake,
                                          set_commands, siblings, touch_commands)
from lmcache_hma.store.tier import Tier

logger = get_logger(__name__)


class RedisTier(HealthChecked, DeadlineCalls, Tier):
    """lmcache_hma's side of LMCache's Redis tier (``RemoteBackend`` over ``redis://``).

    What LMCache 0.5.6 leaves out for Redis:

    * Credentials: ``config.remote_url`` takes them out of ``remote_url`` (LMCache
      logs its URL in several places); they are given to the Redis client of
      LMCache's connector here, before its first connection, and to our own client.
    * Health: redis-py fails a call at once while nothing listens, but waits a
      socket timeout per call while Redis hangs. A ping at start and then every
      ``PERIOD_S`` bypasses the tier while Redis does not answer (LMCache's
      ``StorageManager.set_backend_bypass``): lookups miss and writes are skipped
      at once, with one warning; the tier is used again when Redis answers.
    * Removal: LMCache's ``RedisConnector`` has no ``remove_sync``; a bad object's
      two keys (``<key>metadata``, ``<key>kv_bytes``) are deleted here.
    * Reads: ``fetch_many`` reads a hit's objects in pipelined round trips, and tells an
      object that is there but unreadable (its value's length disagrees with its
      metadata) from a miss.
    * Close: ``RedisConnector.close()`` deadlocks on its own event loop; ``close``
      stops its workers and closes its client (it queues no writes: ``store_many``).

    What a full Redis keeps (docs/redis.md#eviction-policy): every part of a turn end (its object,
    its states, the markers) is written with a TTL (``hma_redis_turn_end_ttl_s``) that a read
    renews, nothing else has one; ``touch`` tells
    Redis's eviction of hits another tier served, so a prefix's chunks are used at least as
    often as what follows them, in Redis too.
    """

    NAME = REMOTE_BACKEND
    label = TIERS[2]
    local = False  # the fleet's: a cache reset leaves it
    reads_into_new_memory = True
    PERIOD_S = 1.0
    PIPELINE_BYTES = 64 << 20  # writes: bytes of objects per pipelined round trip (bounds its memory)
    # Reads: an object comes in pieces of at most RANGE_BYTES (one GET, or GETRANGEs of equal
    # size), sent in batches of at most READ_BATCH_BYTES of pieces (or one piece),
    # ``ShardFetch.AHEAD`` batches in flight beyond the one being read. Redis copies every
    # reply into a buffer of the reply's size and builds a batch's replies before writing the
    # first; small pieces keep those buffers in pages Redis reuses, where a GET of 8 MiB or
    # more page-faults on every read (its allocator gives such pages back at once).
    RANGE_BYTES = 1 << 20
    READ_BATCH_BYTES = 1 << 20
    # In a Redis whose ``maxmemory`` the room has seen (``keep_room``), pieces and batches are at
    # most 1/READ_SHARE of it (not under MIN_READ_BYTES): the room kept free for reads
    # (``_fit_reads``) costs a small Redis 1/32 of itself, not 2 MiB
    READ_SHARE = 64
    MIN_READ_BYTES = 64 << 10
    TOUCH_PENDING = 1 << 16  # objects waiting to be touched; past it a touch is dropped (a hint)
    TOUCH_BATCH = 4096  # objects touched per call
    WHAT = "Redis tier"

    def __init__(self, manager, backend, url: str, auth, timeout_s: float, watch: bool = True,
                 turn_end_ttl_s: float = 0.0) -> None:
        """``backend``: LMCache's remote backend (its connector writes; None: this tier only reads
        and probes, as ``lmcache-hma check`` does). ``watch``: check health now and every second
        on a thread (the bypass); False: nothing runs until called. ``turn_end_ttl_s``:
        ``hma_redis_turn_end_ttl_s`` (0: turn ends never expire)."""
        self._manager = manager
        self.url = url.split("?", 1)[0]  # for messages: it holds no credentials
        self._creds = {}
        if auth is not None:
            self._creds["password"] = auth.password
            if auth.username:
                self._creds["username"] = auth.username
        self._timeout_s = timeout_s
        self._turn_ttl_ms = max(1, round(turn_end_ttl_s * 1000)) if turn_end_ttl_s > 0 else 0
        self._connector = lmcache_compat.redis_connector(backend) if backend is not None else None
        self._setup(url)
        self.up = True
        self.not_written = 0  # objects not written (shard down, errors): future misses
        self.protocol_errors = 0  # replies that broke RESP or their length limits (misses, dropped connections)
        self.health_errors = 0  # health checks that raised (logged with their traceback)
        self._counts_lock = threading.Lock()
        self._write_trouble = False
        self._stop = threading.Event()
        self._thread = None
        # ``touch``: key strings waiting (a dict as an ordered set), whether a call is under way,
        # the thread that sends them (started by the first touch)
        self._touch_cv = threading.Condition()
        self._touch_pending: dict = {}
        self._touch_busy = False
        self._toucher: Optional[threading.Thread] = None
        self._room: Optional[RedisRoom] = None  # keep_room
        self._no_limit_until = 0.0  # a Redis without maxmemory is asked again after ROOM_RECHECK_S
        self._read_cap = 1 << 62  # a read piece's and batch's bytes at most (_fit_reads)
        if watch:
            self._check(at_start=True)
            self._thread = threading.Thread(target=self._watch, name="lmcache-hma-redis-health", daemon=True)
            self._thread.start()

    # one Redis ------------------------------------------------------------------
    def _setup(self, url: str) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # A pooled connection broken by a Redis restart fails its next command; one retry,
        # on a fresh connection, makes that invisible (a dead Redis still fails at once).
        retry = dict(retry_on_error=[redis.exceptions.ConnectionError])
        if self._connector is not None:  # its pool has made no connection yet
            from redis.asyncio.retry import Retry as AsyncRetry

            lmcache_compat.pool_connection_kwargs(self._connector).update(
                self._creds, retry=AsyncRetry(NoBackoff(), 1), **retry)
        # the URL carries the socket timeouts (config.remote_url.prepare_remote_url)
        self._client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), redis_connect_func=handshake,
                                            **retry, **self._creds)

    def _probe(self) -> tuple[bool, str]:
        """(whether the tier can serve, why not)."""
        return self._ping(self._client)

    def _client_for(self, key_str: str):
        """The client holding ``key_str``'s object, or None when it cannot answer now."""
        return self._client if self.up else None

    async def _close_connector_client(self, conn) -> None:
        await conn.connection.aclose()

    def _close_clients(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass

    # the Tier interface ------------------------------------------------------------
    def usable(self) -> bool:
        return self.up

    def counters(self) -> dict:
        counts = {"objects_not_shared": self.not_written, "redis_protocol_errors": self.protocol_errors,
                  "redis_health_errors": self.health_errors,
                  "redis_room_deletes": self._room.deleted if self._room is not None else 0}
        return {k: n for k, n in counts.items() if n}

    def gauges(self) -> dict:
        return {"redis_bypassed": 0 if self.up else 1}

    def remove(self, key) -> None:
        k = key.to_string()
        client = self._client_for(k)
        if client is None:
            return
        if self._room is not None:
            self._room.gone([key])
        try:
            self._call(client, [delete_commands([k])], lambda reader: reader.integer())
        except Exception as exc:
            logger.warning("LMCacheHMA: removing %s from Redis failed: %s", k, exc)

    def present_many(self, keys) -> list[bool]:
        """Whether each object is in Redis: one pipelined round trip, every shard's sent before
        any is read (the shards answer at the same time), all within one deadline; trouble is
        a miss."""
        from redis.exceptions import RedisError

        found = [False] * len(keys)
        shards = self._by_client(keys)
        deadline = self._deadline()
        for attempt in (0, 1):
            sent, broken = [], []  # sent: [(client, connection, items)], none of it read yet
            try:
                for client, items in shards:
                    conn = None
                    try:
                        conn = connection(client, deadline)
                        resp.send(resp.socket_of(conn), [exists_commands(k for _, k in items)], deadline)
                    except (RedisError, OSError) as exc:  # the health check notices a Redis in trouble
                        give_back(client, conn, broken=True)
                        self._count(exc)
                        if broken_connection(exc):
                            broken.append((client, items))
                        continue
                    except BaseException:
                        give_back(client, conn, broken=True)
                        raise
                    sent.append((client, conn, items))
                while sent:
                    client, conn, items = sent[0]
                    try:
                        reader = resp.BulkReader(resp.socket_of(conn), deadline, SMALL_BUFFER)
                        flags = [reader.integer() for _ in items]
                    except (RedisError, OSError, resp.ReplyError) as exc:  # e.g. MOVED in a failover: misses
                        flags = None
                        self._count(exc)
                        if broken_connection(exc):
                            broken.append((client, items))
                    sent.pop(0)
                    give_back(client, conn, broken=flags is None or not reader.drained)  # never out of step
                    for (i, _), flag in zip(items, flags or ()):
                        found[i] = flag == OBJECT_KEYS  # one of its keys alone: a miss (exists_commands)
            finally:
                for client, conn, _ in sent:  # interrupted: unread replies
                    give_back(client, conn, broken=True)
            # a pooled connection broken by a Redis restart: once more on a fresh one
            shards = broken
            if not shards:
                break
        if self._room is not None:
            self._room.gone([key for key, f in zip(keys, found) if not f])
        return found

    def fetch_many(self, keys, object_bytes: list[int], allocate: Callable[[int], object],
                   check: Optional[Callable[[int, object], Optional[str]]] = None,
                   deadline: Optional[float] = None) -> list:
        """The objects under ``keys``, pipelined: per shard, on one connection, each object's
        metadata and its bytes in pieces (``pieces``), in batches of ``READ_BATCH_BYTES``, the
        next ones sent before one is read; the shards' batches are read in turn, so that every
        shard prepares and sends its replies while another's are read.

        ``object_bytes[i]`` is the size key ``i``'s object must have (a longer value, or
        metadata over ``META_BYTES``, that Redis holds makes that object damaged; a reply
        claiming more than Redis holds is a protocol error: the objects not yet read are
        misses: ``pipelined_reads``); ``allocate(i)`` gives a memory object of that size
        (or None when there is no room); ``check(i, obj)``, run on each object as soon as
        its bytes are in (while the next ones arrive), says why it is damaged (then it is
        released) or None. Per key: a filled memory object (the caller releases it), None
        (not there, Redis in trouble, no room: a miss), or why it is in Redis but
        unreadable or damaged (a str). An object's bytes go from the socket straight into
        its memory object (``resp``).

        Workaround: LMCache 0.5.6's Redis connectors read an object with two sequential
        GETs (metadata, then bytes) and a hit object by object: 2 round trips per object.
        The stored format is theirs (``<key>metadata``, ``<key>kv_bytes``), but for an object's
        last bytes, which follow its metadata (``wire.value_bytes``: values fitted to Redis's allocator).

        ``deadline`` (``time.monotonic()``; a lookup's): the whole call ends by then at the
        latest; objects not read by then are misses.

        A turn end read renews its TTL (``hma_redis_turn_end_ttl_s``) and its states' (``wire.siblings``),
        a marker read its own: both keys' ``PEXPIRE`` go with its metadata GET, in the same round trip.
        """
        out: list = [None] * len(keys)
        deadline = self._deadline(sum(object_bytes), by=deadline)
        renew = {i: (self._turn_ttl_ms, siblings(key)) for i, key in enumerate(keys)
                 if self._turn_ttl_ms and expiring(key)}

        def shard(client, items) -> ShardFetch:
            shard_pieces = pieces(items, object_bytes, min(self.RANGE_BYTES, self._read_cap))
            return ShardFetch(client, list(batches(shard_pieces, piece_bytes, min(self.READ_BATCH_BYTES, self._read_cap))),
                              out, deadline,
                              renew)

        shards = [shard(client, items) for client, items in self._by_client(keys)]
        first = True
        while shards:
            read_in_turn(shards, allocate, check)
            for s in shards:
                self._count(s.error)
            # the health check notices a Redis in trouble; a pooled connection broken by a
            # Redis restart: once more on a fresh one; a damaged object too long to drain cost
            # its connection: the rest on a fresh one (each such retry leaves one object out)
            shards = [shard(s.client, s.left) for s in shards if s.left and (
                isinstance(s.error, DamagedReply) or (first and broken_connection(s.error)))]
            first = False
        if self._room is not None:
            self._room.used([key for key, got in zip(keys, out) if got is not None and not isinstance(got, str)])
        return out

    def _by_client(self, keys) -> list:
        """``[(client, [(index, key string)])]``: the keys grouped by the client (shard) holding them."""
        groups: dict = {}
        for i, key in enumerate(keys):
            k = key.to_string()
            client = self._client_for(k)
            if client is not None:
                groups.setdefault(id(client), (client, []))[1].append((i, k))
        return list(groups.values())

    def store_many(self, keys, objs, on_stored: Optional[Callable] = None, expires=None) -> int:
        """Write objects as LMCache's two keys (``wire.set_commands``), each object's bytes before
        its metadata (a reader never finds metadata without bytes), in one pipelined round trip per shard (per
        ``PIPELINE_BYTES``). Returns how many were written; the rest (a shard not
        answering, an error) are future misses, logged once per outage.

        A batch is written within one deadline (``_deadline``); every reply must be ``+OK``.
        Every part of a turn end (``wire.expiring``: turn objects, markers; ``expires``: its states)
        is written with a TTL, ``hma_redis_turn_end_ttl_s`` (``SET ... PX``, both keys); a rewrite
        sets it anew, and any other object has none.

        Workaround: LMCache 0.5.6's Redis connectors write a batch as one coroutine per
        object with two sequential SETs each, on their event loop; a failed write (a shard
        failing over, a MOVED reply) vanishes there unlogged. Written here, on the caller's
        thread (the store writer's), with the slot map the health check keeps. ``on_stored(key)``
        runs for each object of a batch Redis acknowledged.
        """
        written, failures = 0, []
        for client, items in self._by_client(keys):
            for batch in batches(items, lambda item: objs[item[0]].tensor.nbytes, self.PIPELINE_BYTES):
                batch_keys = [keys[i] for i, _ in batch]
                try:
                    pieces = [p for i, k in batch for p in set_commands(
                        k, objs[i], self._turn_ttl_ms if expiring(keys[i]) or (expires and expires[i]) else 0)]
                    sizes = [objs[i].tensor.nbytes for i, _ in batch]
                    nbytes = sum(sizes)
                    self._make_room(client, sizes, batch_keys)
                    self._call(client, pieces, lambda reader, n=2 * len(batch): all_ok(reader, n),
                               self._deadline(nbytes))
                    written += len(batch)
                    if self._room is not None:
                        self._room.written(batch_keys)
                    if on_stored is not None:
                        for key in batch_keys:
                            on_stored(key)
                except Exception as exc:
                    if self._room is not None:
                        self._room.unexpect(batch_keys)
                    failures.append(f"{type(exc).__name__}: {exc}")
        if failures and not self._write_trouble:
            logger.warning("LMCacheHMA: writing to the %s failed (%s); those objects are not shared "
                           "(future misses)", self.WHAT, failures[0])
        self._write_trouble = bool(failures)
        self.not_written += len(keys) - written
        return written

    # room ---------------------------------------------------------------------------
    ROOM_TRIES = 4  # INFO, delete, INFO again...: an estimate that fell short is made good
    ROOM_RECHECK_S = 5.0

    def _fit_reads(self, maxmemory: int) -> int:
        """Fits this instance's reads to a Redis of ``maxmemory`` bytes and returns what they may
        hold in Redis's output buffers meanwhile: a hit's batches in flight (``ShardFetch.AHEAD``
        beyond the one read), a batch each, at most 1/``READ_SHARE`` of a small Redis. (With
        none kept, Redis still evicted 216 keys on the capacity benchmark beside 188 objects
        deleted here; with batches of 1 MiB a 20 MB Redis kept a tenth of itself for them.)"""
        self._read_cap = max(self.MIN_READ_BYTES, maxmemory // self.READ_SHARE)
        return (ShardFetch.AHEAD + 1) * min(self.READ_BATCH_BYTES, self._read_cap)

    def keep_room(self, lineage, boundary_hits: bool) -> None:
        """``hma_eviction: value``: make room in a Redis under ``maxmemory`` before each write,
        deleting what this instance knows is there, prefix-closed and by value (``room``)."""
        self._room = RedisRoom(lineage, boundary_hits)

    def _make_room(self, client, sizes: list, keys: list) -> None:
        """Before writing the objects ``keys`` (of ``sizes`` bytes each) to
        ``client``'s Redis: where that would take it past its ``maxmemory``, delete the objects
        least worth keeping first, all within one deadline. Any trouble leaves it to Redis's own
        eviction (the write goes ahead as before).

        Besides the objects, the room holds what Redis's clients take meanwhile (counted in
        ``used_memory``, evicted for): after receiving a value of 32 KiB or more Redis gives the
        connection a spare query buffer as big, expecting another (``networking.c``), so a batch
        takes its largest value once more while it is written (measured: client memory peaked at
        1.6 MB writing 1.3 MB tails); and this instance's reads' output buffers (``_fit_reads``)."""
        room = self._room
        if room is None or time.monotonic() < self._no_limit_until:
            return
        need = room.footprint(sizes + [max(sizes, default=0)])
        deadline = self._deadline()
        try:
            tries = 0
            while tries < self.ROOM_TRIES:
                used, maxmemory = memory_info(self._call(client, [command(b"INFO", b"memory")],
                                                         lambda reader: reader.bulk(1 << 16) or b"", deadline))
                short = short_of(used, maxmemory, need + self._fit_reads(maxmemory))
                if short is None:  # no maxmemory (any more): reads in whole pieces again
                    self._no_limit_until = time.monotonic() + self.ROOM_RECHECK_S
                    self._read_cap = 1 << 62
                    return
                if short <= 0:
                    return
                victims = room.choose(short, coming=keys)
                if not victims:
                    return
                # one DEL per object: its reply says whether it was there. Objects this instance
                # knew of that were gone (Redis evicted them, another instance deleted them) free
                # nothing and cost no try: without that, a few stale ones used up the tries and the
                # write went ahead short of room (Redis then evicted by its own policy)
                deleted = self._call(client, [delete_commands(k.to_string() for k in victims)],
                                     lambda reader, n=len(victims): [reader.integer() for _ in range(n)], deadline)
                freed = sum(1 for n in deleted if n)
                room.deleted += freed
                tries += freed > 0
        except Exception as exc:
            logger.debug("LMCacheHMA: making room in the %s: %s", self.WHAT, exc)

    # touches ------------------------------------------------------------------------
    def touch(self, keys) -> None:
        """Tell Redis that a hit used the objects under ``keys`` although another tier served
        them (CPU memory, disk): ``TOUCH`` of both keys of each (``wire.touch_commands``),
        which Redis's eviction counts as a read (the LFU counter, or the last use for LRU).

        Why: an instance serves what it reads often from its own CPU memory (and vLLM's prefix
        cache holds a hit's first chunks), so Redis would see few reads of the chunks every
        request shares, count them as little used and evict them first, leaving every chunk after
        them unreachable (a hit needs all of them from the first). Touched on each hit, a prefix's
        chunks are used in Redis at least as often as anything that follows them, so its
        leaves (a rare document's tail, a turn end nobody read) go first.

        Sent by a thread, never on the caller's path (a hit served from CPU memory does not wait
        for Redis, nor for a Redis that hangs); coalesced, at most ``TOUCH_PENDING`` objects
        waiting (past it touches are dropped: a hint), skipped while the tier is bypassed.
        A touch of an object Redis does not hold does nothing."""
        if not keys or not self.up or self._stop.is_set():
            return
        if self._room is not None:
            self._room.used(keys, read=False)
        with self._touch_cv:
            for key in keys:
                if len(self._touch_pending) >= self.TOUCH_PENDING:
                    break
                self._touch_pending[key.to_string()] = None
            if self._toucher is None:
                self._toucher = threading.Thread(target=self._touch_loop, name="lmcache-hma-redis-touch", daemon=True)
                self._toucher.start()
            self._touch_cv.notify()

    def wait_touched(self, timeout_s: float) -> bool:
        """Wait until every touch asked for so far was sent (tests, benchmarks); False on timeout."""
        with self._touch_cv:
            return self._touch_cv.wait_for(lambda: not self._touch_pending and not self._touch_busy, timeout_s)

    def _touch_loop(self) -> None:
        while True:
            with self._touch_cv:
                self._touch_busy = False
                self._touch_cv.notify_all()
                self._touch_cv.wait_for(lambda: self._touch_pending or self._stop.is_set())
                if self._stop.is_set():
                    return
                pending, self._touch_pending = list(self._touch_pending), {}
                self._touch_busy = True
            try:
                self._touch_now(pending)
            except Exception:  # a hint: what was not touched is evicted a little sooner
                logger.debug("LMCacheHMA: touching %d objects in the %s failed", len(pending), self.WHAT,
                             exc_info=True)

    def _touch_now(self, key_strings: list) -> None:
        """``TOUCH`` the objects, pipelined per shard, ``TOUCH_BATCH`` objects per call."""
        groups: dict = {}
        for k in key_strings:
            client = self._client_for(k)
            if client is not None:
                groups.setdefault(id(client), (client, []))[1].append(k)
        for client, keys in groups.values():
            for at in range(0, len(keys), self.TOUCH_BATCH):
                batch = keys[at:at + self.TOUCH_BATCH]
                try:
                    self._call(client, [touch_commands(batch)], lambda reader, n=len(batch): [
                        reader.integer() for _ in range(n)])
                except Exception as exc:  # e.g. MOVED while a cluster fails over: the next hit touches them
                    logger.debug("LMCacheHMA: touching %d objects in the %s: %s", len(batch), self.WHAT, exc)

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        with self._touch_cv:
            self._touch_cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._toucher is not None:
            self._toucher.join(timeout_s)
        conn = self._connector

        async def shut() -> None:
            lmcache_compat.stop_connector(conn)
            await self._close_connector_client(conn)

        if conn is not None:
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._manager.loop).result(timeout_s)
            except Exception as exc:
                logger.warning("LMCacheHMA: closing the Redis tier: %s", exc or type(exc).__name__)
        if self._manager is not None:
            self._manager.storage_backends.pop(self.NAME, None)  # closed: LMCache's close would hang
        self._close_clients()

