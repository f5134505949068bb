"""lmcache_hma's side of LMCache's Redis tier: what LMCache 0.5.6 leaves out for Redis.

Runs in the worker, beside ``store.ChunkStore``. Nothing read from Redis is
unpickled: LMCache's ``naive`` serde passes the bytes through, its metadata key
is a fixed ``struct``, and the object trailer (``objects``) checks the rest.

Two flavours: one Redis (``redis://``, ``rediss://``, ``unix://``: ``RedisTier``)
and a Redis Cluster (``redis-cluster://h1:p1,h2:p2``: ``RedisClusterTier``).

Every call (the connection's handshake included) runs against one ``resp.Deadline``
of ``hma_remote_timeout_s`` (plus the time its bytes take at ``MIN_BYTES_PER_S``),
and reads replies with ``resp.BulkReader``, which allocates or skips nothing longer
than the reply may be: metadata at most ``META_BYTES``, a value exactly its piece.
A server (or a proxy) that breaks either rule costs that call's objects (misses,
counted in ``protocol_errors``) and its connection, never more time.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from lmcache_hma.store import lmcache_compat

from lmcache_hma.store.redis import resp
from lmcache_hma.config.settings import CLUSTER_SCHEME, REDIS_SCHEMES, remote_auth, remote_timeout_s
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


# Redis Cluster: LMCache stores an object as two keys, ``<key>metadata`` and
# ``<key>kv_bytes``. With a hash tag (``{...}``, the first one in the key) in
# ``<key>``, Redis hashes only the tag, so both keys of an object are always in the
# same slot, hence on the same shard. LMCache's ``CacheEngineKey.to_string()``
# appends ``@<tag>%<value>`` for each ``request_configs`` entry named
# ``lmcache.tag.<tag>``; the model field before it is file-name safe (no braces),
# so this tag is the key's first ``{``.
SLOT_TAG = "lmcache.tag.slot"


def uses_hash_tags(lmcache_config) -> bool:
    """Whether object keys carry a Redis Cluster hash tag (only with a ``redis-cluster://`` tier)."""
    return (getattr(lmcache_config, "remote_url", None) or "").startswith(CLUSTER_SCHEME)


def hash_tag_configs(chunk_hash: bytes) -> dict:
    """``request_configs`` of an object's ``CacheEngineKey``: its hash tag, from its own digest.

    Objects spread over all slots (the digest is uniform); an object's two keys share one.
    """
    return {SLOT_TAG: "{" + chunk_hash[:8].hex() + "}"}


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
    * Reads: ``fetch_many`` reads a hit's objects in pipelined round trips, and tells an
      object that is there but unreadable (its value's length disagrees with its
      metadata) from a miss.
    * Close: ``RedisConnector.close()`` deadlocks on its own event loop; ``close``
      stops its workers and closes its client (it queues no writes: ``store_many``).
    """

    NAME = "RemoteBackend"
    PERIOD_S = 1.0
    PIPELINE_BYTES = 64 << 20  # writes: bytes of objects per pipelined round trip (bounds its memory)
    # Reads: an object comes in pieces of at most RANGE_BYTES (one GET, or GETRANGEs of equal
    # size), sent in batches of at most READ_BATCH_BYTES of pieces (or one piece),
    # ``_ShardFetch.AHEAD`` batches in flight beyond the one being read. Redis copies every
    # reply into a buffer of the reply's size and builds a batch's replies before writing the
    # first; those buffers come from fresh pages whenever the memory Redis freed last went to
    # values written since (every read right after a store). Measured here (``fetch_many``
    # with its checks, a 26 MiB hit of 32 objects of 512 KiB and one of 10 MiB, read right
    # after it was stored, then again; 8 rounds interleaved): 4 MiB pieces and batches
    # 18.5 ms, ~1650 page faults in Redis, again 14.8 ms; 1 MiB 15.4 ms, ~460, again 13.3 ms.
    # A GET of 8 MiB or more faults on every read: Redis's jemalloc serves it from an arena
    # that gives the pages back at once.
    RANGE_BYTES = 1 << 20
    READ_BATCH_BYTES = 1 << 20
    # A call's deadline: hma_remote_timeout_s, plus its objects' bytes at this rate (the slowest
    # a Redis that is not in trouble may be; a 64 MiB write batch gets 1 s more).
    MIN_BYTES_PER_S = 64 << 20
    WHAT = "Redis tier"

    @classmethod
    def attach(cls, manager, lmcache_config) -> Optional["RedisTier"]:
        url = lmcache_config.remote_url or ""
        backend = manager.storage_backends.get(cls.NAME)
        if backend is None:
            return None
        if url.startswith(CLUSTER_SCHEME):
            tier = RedisClusterTier
        elif url.startswith(REDIS_SCHEMES):
            tier = RedisTier
        else:
            return None
        return tier(manager, backend, url, remote_auth(lmcache_config), remote_timeout_s(lmcache_config))

    def __init__(self, manager, backend, url: str, auth, timeout_s: float) -> None:
        self._manager = manager
        self.url = url.split("?", 1)[0]  # for messages: it holds no credentials
        self._creds = {}
        if auth is not None:
            self._creds["password"] = auth.password
            if auth.username:
                self._creds["username"] = auth.username
        self._timeout_s = timeout_s
        self._connector = lmcache_compat.redis_connector(backend)
        self._setup(url)
        self.up = True
        self.not_written = 0  # objects not written (shard down, errors): future misses
        self.protocol_errors = 0  # replies that broke RESP or their length limits (misses, dropped connections)
        self.health_errors = 0  # health checks that raised (logged with their traceback)
        self._counts_lock = threading.Lock()
        self._write_trouble = False
        self._stop = threading.Event()
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
        # the URL carries the socket timeouts (config._prepare_remote_url)
        self._client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), redis_connect_func=_handshake,
                                            **retry, **self._creds)

    def _probe(self) -> tuple[bool, str]:
        """(whether the tier can serve, why not)."""
        return self._ping(self._client)

    def _ping(self, client) -> tuple[bool, str]:
        """(whether ``client``'s Redis answers PING within the deadline, why not)."""
        try:
            reply = self._call(client, [_resp(b"PING")], lambda reader: reader.status())
        except resp.ReplyError as exc:  # named as redis-py names it
            auth = str(exc).startswith(("NOAUTH", "WRONGPASS"))
            return False, f"{'AuthenticationError' if auth else 'ResponseError'}: {exc}"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return (True, "") if reply == b"PONG" else (False, f"PING answered {reply[:40]!r}")

    def _deadline(self, nbytes: int = 0) -> resp.Deadline:
        """The deadline of one call that moves ``nbytes`` of objects."""
        return resp.Deadline(self._timeout_s + nbytes / self.MIN_BYTES_PER_S)

    def _call(self, client, pieces: list, read: Callable, deadline: Optional[resp.Deadline] = None):
        """Send ``pieces`` (packed commands) on a connection of ``client``'s pool and return
        ``read(reader)`` (its replies), all within ``deadline``. A pooled connection found
        broken (a restarted Redis) is replaced once; any failure drops the connection."""
        deadline = deadline or self._deadline()
        for attempt in (0, 1):
            conn = None
            try:
                conn = _connection(client, deadline)
                sock = resp.socket_of(conn)
                resp.send(sock, pieces, deadline)
                reader = resp.BulkReader(sock, deadline, _SMALL_BUFFER)
                out = read(reader)
            except BaseException as exc:
                _give_back(client, conn, broken=True)
                self._count(exc)
                if attempt or not _broken_connection(exc):
                    raise
                continue
            _give_back(client, conn, broken=not reader.drained)
            return out

    def _count(self, exc: BaseException) -> None:
        """Count (and log, now and then) a reply that broke RESP or its length limits."""
        if not _protocol_error(exc):
            return
        with self._counts_lock:
            self.protocol_errors += 1
            n = self.protocol_errors
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
            logger.warning("LMCacheHMA: the %s %s sent a reply that is not what was asked for (%s); its "
                           "connection was dropped and the call's objects are misses (%d such replies so far)",
                           self.WHAT, self.url, exc, n)

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

    # shared ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Health checks every ``PERIOD_S`` until ``close``. A check that raises is logged and
        counted, and the next one runs; should the thread end anyway, the tier is bypassed
        for good (misses, no writes), said once."""
        try:
            while not self._stop.wait(self.PERIOD_S):
                try:
                    self._check()
                except Exception:
                    self.health_errors += 1
                    logger.exception("LMCacheHMA: a health check of the %s %s failed (%d so far); the next "
                                     "one runs in %g s", self.WHAT, self.url, self.health_errors, self.PERIOD_S)
        finally:
            if not self._stop.is_set():
                self._give_up()

    def _give_up(self) -> None:
        """The health thread ended: nothing checks Redis any more, so it is never used again."""
        self.up = False
        logger.error("LMCacheHMA: the %s %s health thread stopped; the tier is bypassed until the engine "
                     "restarts (lookups miss, writes are skipped)", self.WHAT, self.url)
        try:
            self._manager.set_backend_bypass(self.NAME, True)
        except Exception:  # the tier's own calls already skip Redis (``up`` is False)
            logger.exception("LMCacheHMA: bypassing the %s", self.WHAT)

    def _check(self, at_start: bool = False) -> None:
        ok, why = self._probe()
        if ok == self.up and not (at_start and not ok):
            return
        self.up = ok
        self._manager.set_backend_bypass(self.NAME, not ok)
        if not ok:
            logger.warning(
                "LMCacheHMA: %s %s %s (%s); serving continues without it: lookups miss "
                "and writes are skipped until it answers again",
                self.WHAT, self.url, "is unreachable at start" if at_start else "stopped answering", why,
            )
        else:
            logger.warning("LMCacheHMA: %s %s answers again; sharing resumes", self.WHAT, self.url)

    def delete(self, key) -> None:
        k = key.to_string()
        client = self._client_for(k)
        if client is None:
            return
        try:
            self._call(client, [_resp(b"DEL", (k + "metadata").encode(), (k + "kv_bytes").encode())],
                       lambda reader: reader.integer())
        except Exception as exc:
            logger.warning("LMCacheHMA: removing %s from Redis failed: %s", k, exc)

    def exists_many(self, keys) -> list[bool]:
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
                        conn = _connection(client, deadline)
                        resp.send(resp.socket_of(conn), [_exists_commands(k for _, k in items)], deadline)
                    except (RedisError, OSError) as exc:  # the health check notices a Redis in trouble
                        _give_back(client, conn, broken=True)
                        self._count(exc)
                        if _broken_connection(exc):
                            broken.append((client, items))
                        continue
                    except BaseException:
                        _give_back(client, conn, broken=True)
                        raise
                    sent.append((client, conn, items))
                while sent:
                    client, conn, items = sent[0]
                    try:
                        reader = resp.BulkReader(resp.socket_of(conn), deadline, _SMALL_BUFFER)
                        flags = [reader.integer() for _ in items]
                    except (RedisError, OSError, resp.ReplyError) as exc:  # e.g. MOVED in a failover: misses
                        flags = None
                        self._count(exc)
                        if _broken_connection(exc):
                            broken.append((client, items))
                    sent.pop(0)
                    _give_back(client, conn, broken=flags is None or not reader.drained)  # never out of step
                    for (i, _), flag in zip(items, flags or ()):
                        found[i] = bool(flag)
            finally:
                for client, conn, _ in sent:  # interrupted: unread replies
                    _give_back(client, conn, broken=True)
            # a pooled connection broken by a Redis restart: once more on a fresh one
            shards = broken
            if not shards:
                break
        return found

    def fetch_many(self, keys, object_bytes: list[int], allocate: Callable[[int], object],
                   check: Optional[Callable[[int, object], Optional[str]]] = None) -> list:
        """The objects under ``keys``, pipelined: per shard, on one connection, each object's
        metadata and its bytes in pieces (``_pieces``), in batches of ``READ_BATCH_BYTES``, the
        next ones sent before one is read; the shards' batches are read in turn, so that every
        shard prepares and sends its replies while another's are read.

        ``object_bytes[i]`` is the size key ``i``'s object must have (a reply claiming more
        is a protocol error: the objects not yet read are misses); ``allocate(i)``
        gives a memory object of that size (or None when there is no room); ``check(i,
        obj)``, run on each object as soon as its bytes are in (while the next ones
        arrive), says why it is damaged (then it is released) or None. Per key: a filled
        memory object (the caller releases it), None (not there, Redis in trouble, no
        room: a miss), or why it is in Redis but unreadable or damaged (a str). An
        object's bytes go from the socket straight into its memory object (``resp``).

        Workaround: LMCache 0.5.6's Redis connectors read an object with two sequential
        GETs (metadata, then bytes) and a hit object by object: 2 round trips per object.
        The stored format is theirs (``<key>metadata``, ``<key>kv_bytes``).
        """
        out: list = [None] * len(keys)
        deadline = self._deadline(sum(object_bytes))

        def shard(client, items) -> _ShardFetch:
            pieces = _pieces(items, object_bytes, self.RANGE_BYTES)
            return _ShardFetch(client, list(_batches(pieces, _piece_bytes, self.READ_BATCH_BYTES)), out, deadline)

        shards = [shard(client, items) for client, items in self._by_client(keys)]
        for attempt in (0, 1):
            _read_in_turn(shards, allocate, check)
            for s in shards:
                self._count(s.error)
            # the health check notices a Redis in trouble; a pooled connection broken by a
            # Redis restart: once more on a fresh one
            shards = [shard(s.client, s.left) for s in shards
                      if s.left and not attempt and _broken_connection(s.error)]
            if not shards:
                break
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

    def store_many(self, keys, objs, on_written: Optional[Callable] = None) -> int:
        """Write objects in LMCache's format, each object's bytes before its metadata (a reader
        never finds metadata without bytes), in one pipelined round trip per shard (per
        ``PIPELINE_BYTES``). Returns how many were written; the rest (a shard not
        answering, an error) are future misses, logged once per outage.

        A batch is written within one deadline (``_deadline``); every reply must be ``+OK``.

        Workaround: LMCache 0.5.6's Redis connectors write a batch as one coroutine per
        object with two sequential SETs each, on their event loop; a failed write (a shard
        failing over, a MOVED reply) vanishes there unlogged. Written here, on the caller's
        thread (the store writer's), with the slot map the health check keeps. ``on_written``
        gets the keys of each batch once Redis acknowledged it (KV cache events).
        """
        written, failures = 0, []
        for client, items in self._by_client(keys):
            for batch in _batches(items, lambda item: objs[item[0]].tensor.nbytes, self.PIPELINE_BYTES):
                try:
                    pieces = [p for i, k in batch for p in _set_commands(k, objs[i])]
                    nbytes = sum(objs[i].tensor.nbytes for i, _ in batch)
                    self._call(client, pieces, lambda reader, n=2 * len(batch): _all_ok(reader, n),
                               self._deadline(nbytes))
                    written += len(batch)
                    if on_written is not None:
                        on_written([keys[i] for i, _ in batch])
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
        if failures and not self._write_trouble:
            logger.warning("LMCacheHMA: writing to the %s failed (%s); those objects are not shared "
                           "(future misses)", self.WHAT, failures[0])
        self._write_trouble = bool(failures)
        self.not_written += len(keys) - written
        return written

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        conn = self._connector

        async def shut() -> None:
            lmcache_compat.stop_connector(conn)
            await self._close_connector_client(conn)

        if conn is not None:
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._manager.loop).result(timeout_s)
            except Exception as exc:
                logger.warning("LMCacheHMA: closing the Redis tier: %s", exc or type(exc).__name__)
        self._manager.storage_backends.pop(self.NAME, None)  # closed: LMCache's close would hang
        self._close_clients()


class RedisClusterTier(RedisTier):
    """The same for LMCache's ``RedisClusterConnector`` (``redis-cluster://h1:p1,h2:p2``).

    Besides what ``RedisTier`` does (credentials, bypass, removal, close), per shard:

    * Keys: both keys of an object carry one hash tag (``hash_tag_configs``), so they
      live in one slot: an object's metadata and bytes are never on different shards.
    * Health, every ``PERIOD_S``: the slot map (``CLUSTER SLOTS``) from the first node
      that answers, ``CLUSTER INFO``, and a ping of every node in it (in parallel, each
      bounded by ``hma_remote_timeout_s``). The whole tier is bypassed only when the
      cluster cannot serve: no node answers, no master answers, or ``cluster_state`` is
      ``fail`` (servers with ``cluster-require-full-coverage yes`` refuse every command
      while one shard is down). A master that does not answer makes only its own
      objects misses and skips writes to it (``_guard``); the other shards keep
      serving. When the slot map changes (a replica took over), LMCache's client is
      told to reload it.
    * Removal and reads go straight to the master of the key's slot.
    """

    WHAT = "Redis Cluster"

    def _setup(self, url: str) -> None:
        self._seeds = [s for s in url[len(CLUSTER_SCHEME):].split(",") if s]
        self._nodes: dict = {}  # "host:port" -> redis.Redis (health, removal, reads)
        self._nodes_lock = threading.Lock()
        # (first slots, [(first, last, master)]), sorted; replaced whole (read by other threads)
        self._slot_map: tuple[list, list] = ([], [])
        self._down: frozenset = frozenset()  # nodes that did not answer the last ping
        self._last_good: Optional[str] = None
        self._pinger = ThreadPoolExecutor(max_workers=8, thread_name_prefix="lmcache-hma-cluster-ping")
        if self._connector is not None:
            self._guard(self._connector)

    def _guard(self, connector) -> None:
        """Configure LMCache's connector and its ``redis.asyncio.RedisCluster`` before any connection.

        Workaround (LMCache 0.5.6 ``RedisClusterConnector``, seen with a SIGSTOPped master
        on loopback): it builds its client with redis-py's defaults, 5 s socket timeouts
        and 10 retries per command (each re-reading the slot map): one lookup of an object
        on a hung master took 63 s here, and a lookup walks such calls one key at a time.
        It gets no credentials either (``config`` keeps them out of the URL LMCache sees
        and logs). Here: our credentials and timeouts, one retry (enough to follow a
        failover), no full-coverage requirement. (Lookups, reads and writes go through
        this tier's own per-node clients, which skip a master the health check found
        not answering; LMCache's client is configured for whatever else may use it.)
        """
        from redis.asyncio.retry import Retry as AsyncRetry
        from redis.backoff import NoBackoff

        kwargs = dict(self._creds, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s)
        lmcache_compat.configure_cluster_client(connector, kwargs, AsyncRetry(NoBackoff(), 1))

    def _master_of(self, key_str: str) -> Optional[str]:
        """The master serving ``key_str``'s object by the last slot map (None: unknown)."""
        from redis.crc import key_slot

        slot = key_slot((key_str + "metadata").encode())
        starts, ranges = self._slot_map
        i = bisect.bisect_right(starts, slot) - 1
        if 0 <= i < len(ranges) and ranges[i][0] <= slot <= ranges[i][1]:
            return ranges[i][2]
        return None

    def _shard_down(self, key) -> bool:
        return bool(self._down) and self._master_of(key.to_string()) in self._down

    def _node(self, name: str):
        client = self._nodes.get(name)  # every key of every lookup asks: no lock once it exists
        if client is not None:
            return client
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        with self._nodes_lock:
            client = self._nodes.get(name)
            if client is None:
                host, _, port = name.rpartition(":")
                # one retry after a broken pooled connection (a restarted node), none after a
                # timeout (a hung node costs one timeout per call)
                retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
                client = redis.Redis(host=host.strip("[]"), port=int(port), socket_timeout=self._timeout_s,
                                     socket_connect_timeout=self._timeout_s, retry=retry,
                                     redis_connect_func=_handshake, **self._creds)
                self._nodes[name] = client
            return client

    def _topology(self):
        """(slot ranges [(first, last, master)], every node named, cluster_state), or (None, why)."""
        known = {n for _, _, n in self._slot_map[1]}
        order = list(dict.fromkeys([*([self._last_good] if self._last_good else []), *self._seeds, *sorted(known)]))
        why = "no node to ask"
        for name in order:
            try:  # a node that does not answer in time, or answers nonsense: ask the next one
                slots, info = self._call(self._node(name), [_resp(b"CLUSTER", b"SLOTS"), _resp(b"CLUSTER", b"INFO")],
                                         lambda reader: (reader.reply(_TOPOLOGY_BYTES, _TOPOLOGY_ITEMS),
                                                         reader.bulk(_TOPOLOGY_BYTES)))
                found = _parse_topology(name, slots, info)
            except Exception as exc:
                why = f"{name}: {type(exc).__name__}: {exc}"
                continue
            self._last_good = name
            return found, ""
        return None, why

    def _ping_node(self, name: str) -> str:
        """Why node ``name`` does not answer ("" when it does)."""
        return self._ping(self._node(name))[1]

    def _probe(self) -> tuple[bool, str]:
        found, why = self._topology()
        if found is None:
            self._down = frozenset()
            return False, f"no node answers ({why})"
        ranges, nodes, state = found
        names = sorted(nodes)
        failing = {n: w for n, w in zip(names, self._pinger.map(self._ping_node, names)) if w}
        self._update(ranges, failing)
        masters = {m for _, _, m in ranges}
        if not masters:
            return False, "the cluster has no slots assigned"
        if masters <= set(failing):
            return False, "no master answers (" + "; ".join(f"{m}: {failing[m]}" for m in sorted(masters)) + ")"
        if state != "ok":
            return False, (f"cluster_state is {state or 'unknown'}: it refuses every command (a shard without "
                           f"an answering master and cluster-require-full-coverage yes?)")
        return True, ""

    def _update(self, ranges: list, failing: dict) -> None:
        """Take the new slot map and the nodes that did not answer; log what changed."""
        old_ranges, old_down = self._slot_map[1], self._down
        down = frozenset(failing)
        masters = {}
        for first, last, master in ranges:
            masters.setdefault(master, []).append(f"{first}-{last}")
        for name in sorted(down - old_down):
            if name in masters:
                logger.warning(
                    "LMCacheHMA: Redis Cluster master %s (slots %s) does not answer (%s); its objects are misses "
                    "and writes to it are skipped until it answers or a replica takes over; the other shards "
                    "keep serving", name, ",".join(masters[name]), failing[name])
        for name in sorted(old_down - down):
            if name in masters:
                logger.warning("LMCacheHMA: Redis Cluster master %s answers again", name)
        self._down = down
        self._slot_map = ([r[0] for r in ranges], ranges)
        if old_ranges and ranges != old_ranges:
            moved = sorted({f"{f}-{l} -> {m}" for f, l, m in ranges} - {f"{f}-{l} -> {m}" for f, l, m in old_ranges})
            logger.warning("LMCacheHMA: Redis Cluster slot map changed (failover?): %s", ", ".join(moved))
            self._reload_slot_map()

    def _reload_slot_map(self) -> None:
        """Make LMCache's client read the slot map again before its next command."""
        if self._connector is None:
            return
        try:
            lmcache_compat.reload_slot_map(self._manager.loop, self._connector)
        except RuntimeError:  # its loop is closed: nothing left to tell
            pass

    def _client_for(self, key_str: str):
        master = self._master_of(key_str) if self.up else None
        return None if master is None or master in self._down else self._node(master)

    async def _close_connector_client(self, conn) -> None:
        await conn.cluster.aclose()

    def _close_clients(self) -> None:
        self._pinger.shutdown(wait=False, cancel_futures=True)
        with self._nodes_lock:
            clients, self._nodes = list(self._nodes.values()), {}
        for client in clients:
            try:
                client.close()
            except Exception:
                pass


_META_LENGTHS: dict = {}  # metadata bytes -> the length they give (a hit's objects share a few)


def _why_unreadable(meta, expected_bytes: int) -> Optional[str]:
    """Why an object whose metadata is ``meta`` cannot be read as an object of
    ``expected_bytes``, or None (its value is checked as it is read)."""
    from lmcache.v1.protocol import RemoteMetadata

    length = _META_LENGTHS.get(meta)
    if length is None:
        try:
            length = RemoteMetadata.deserialize(meta).length
        except Exception:
            return "its metadata in Redis is malformed"
        if len(_META_LENGTHS) >= 256:
            _META_LENGTHS.clear()
        _META_LENGTHS[meta] = length
    if length != expected_bytes:
        return f"its metadata in Redis says {length} bytes, expected {expected_bytes}"
    return None


def _parts(nbytes: int, range_bytes: int) -> list[tuple[int, int]]:
    """How an object of ``nbytes`` is read: ``[(0, nbytes)]`` (one GET), or the byte ranges
    of its GETRANGEs, as few as fit in ``range_bytes`` each, of equal size (the last one
    shorter by what does not divide)."""
    count = -(-nbytes // range_bytes)
    if count <= 1:
        return [(0, nbytes)]
    size = -(-nbytes // count)
    return [(lo, min(nbytes, lo + size)) for lo in range(0, nbytes, size)]


def _pieces(items: list, object_bytes: list[int], range_bytes: int) -> list[tuple]:
    """``[(index, key string, lo, hi, object's bytes)]``: every object of ``items``
    (``[(index, key string)]``) as the pieces it is read in (``_parts``), in order."""
    return [(i, k, lo, hi, object_bytes[i]) for i, k in items for lo, hi in _parts(object_bytes[i], range_bytes)]


def _piece_bytes(piece: tuple) -> int:
    return piece[3] - piece[2]


def _bad_value(size: Optional[int], lo: int, length: int, ranged: bool) -> str:
    """Why a value whose read at byte ``lo`` gave ``size`` bytes (None: nil or an error reply)
    is not the ``length``-byte object its metadata says (read whole, or ``ranged``)."""
    if not size and lo == 0:
        return "its metadata is in Redis without its bytes"
    if ranged:
        return f"its value in Redis is shorter than its metadata says ({length} bytes)"
    return f"its value in Redis is {size} bytes, its metadata says {length}"


def _resp(*args: bytes) -> bytes:
    """One command, packed (RESP). redis-py's ``pack_commands`` took several microseconds per
    command here, more than Redis takes to answer an EXISTS (a hit's fetch: 0.3 of 15.6 ms)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _exists_commands(key_strings) -> bytes:
    """``EXISTS <key>metadata`` for each key string, packed in one buffer."""
    return b"".join(_resp(b"EXISTS", k.encode() + b"metadata") for k in key_strings)


META_BYTES = 4 << 10  # longest metadata value read (LMCache's RemoteMetadata: a fixed struct, ~100 bytes)
_SMALL_BUFFER = 4 << 10  # reader buffer for replies without values (statuses, integers)
_TOPOLOGY_BYTES = 64 << 10  # longest string in CLUSTER SLOTS or CLUSTER INFO
_TOPOLOGY_ITEMS = 1 << 17  # most elements in CLUSTER SLOTS (16384 ranges, a few holders each)
_CALLS = threading.local()  # .deadline: the deadline of the call connecting now (``_handshake``)


def _connection(client, deadline: resp.Deadline):
    """A connection of ``client``'s pool, connected and authenticated before ``deadline``
    (a new one's handshake runs in ``_handshake``)."""
    _CALLS.deadline = deadline
    try:
        return client.connection_pool.get_connection()
    finally:
        _CALLS.deadline = None


def _handshake(conn) -> None:
    """redis-py's ``on_connect`` (given as ``redis_connect_func``) on ``resp``, within the
    deadline of the call connecting: AUTH and SELECT where needed, RESP2, no CLIENT SETINFO.
    redis-py's own reads each wait a socket timeout, however many there are."""
    import redis

    deadline = getattr(_CALLS, "deadline", None) or resp.Deadline(conn.socket_timeout or 2.0)
    conn._parser.on_connect(conn)
    commands = []
    if conn.password:
        auth = (conn.username, conn.password) if conn.username else (conn.password,)
        commands.append(_resp(b"AUTH", *(str(a).encode() for a in auth)))
    if conn.db:
        commands.append(_resp(b"SELECT", b"%d" % int(conn.db)))
    if not commands:
        return
    try:
        resp.send(conn._sock, commands, deadline)
        reader = resp.BulkReader(conn._sock, deadline, _SMALL_BUFFER)
        for _ in commands:
            reader.status()
    except resp.ReplyError as exc:
        if str(exc).startswith(("WRONGPASS", "ERR invalid password", "NOAUTH")):
            raise redis.exceptions.AuthenticationError(str(exc)) from None
        raise redis.exceptions.ConnectionError(f"handshake: {exc}") from None
    except resp.CallTimeout as exc:
        raise redis.exceptions.TimeoutError(f"handshake: {exc}") from exc
    except OSError as exc:  # redis-py drops the connection after a RedisError only
        raise redis.exceptions.ConnectionError(f"handshake: {type(exc).__name__}: {exc}") from exc


def _protocol_error(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or what caused it, in a handshake) is a ``resp.ProtocolError``."""
    return isinstance(exc, resp.ProtocolError) or isinstance(getattr(exc, "__cause__", None), resp.ProtocolError)


def _set_commands(key_str: str, obj) -> list:
    """The two SETs that write ``obj`` in LMCache's format (its bytes first, then its metadata),
    as pieces to send: the object's bytes are sent from its memory, not copied."""
    from lmcache.v1.protocol import RemoteMetadata

    data = obj.byte_array
    meta = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()).serialize()
    key = (key_str + "kv_bytes").encode()
    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(data))
    return [head, data, b"\r\n" + _resp(b"SET", (key_str + "metadata").encode(), meta)]


def _all_ok(reader: resp.BulkReader, n: int) -> None:
    """``n`` replies, each ``+OK`` (raises ``ReplyError`` for an error reply)."""
    for _ in range(n):
        reply = reader.status()
        if reply != b"OK":
            raise resp.ProtocolError(f"expected +OK, got {reply[:40]!r}")


def _parse_topology(name: str, slots, info) -> tuple:
    """(slot ranges [(first, last, master)], every node named, cluster_state) from node
    ``name``'s replies to CLUSTER SLOTS and CLUSTER INFO (raises on any other shape)."""
    ranges, nodes = [], set()
    for entry in slots:
        first, last, *holders = entry
        names = []
        for holder in holders:
            host = holder[0].decode() if isinstance(holder[0], bytes) else str(holder[0])
            names.append(f"{host or name.rpartition(':')[0]}:{int(holder[1])}")
        ranges.append((int(first), int(last), names[0]))
        nodes.update(names)
    text = info.decode() if isinstance(info, bytes) else str(info)
    state = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("cluster_state:")), "")
    return sorted(ranges), nodes, state


def _give_back(client, conn, broken: bool = False) -> None:
    """Return ``conn`` to ``client``'s pool (disconnected first when ``broken``: its state is unknown)."""
    if conn is None:
        return
    if broken:
        conn.disconnect()
    client.connection_pool.release(conn)


def _broken_connection(exc: Exception) -> bool:
    """A connection that broke (worth one retry on a fresh one), not a timeout, a refused
    password, nor a reply that broke the protocol."""
    import redis

    if _protocol_error(exc) or isinstance(exc, redis.exceptions.AuthenticationError):
        return False
    return isinstance(exc, (ConnectionError, redis.exceptions.ConnectionError))


class _ShardFetch:
    """One shard's part of ``fetch_many``: ``batches`` of pieces (``_pieces``), sent by
    redis-py on a connection from ``client``'s pool (connected, authenticated, nothing
    unread), ``AHEAD`` batches beyond the one being read; replies read by
    ``resp.BulkReader`` into the objects in ``out`` (shared by the shards), all before
    ``deadline`` (shared by the shards too).

    After a failure ``left`` holds the objects (``[(index, key string)]``) not read whole
    and ``error`` why; their memory objects are released, their entries None, and the
    connection is closed (never back to the pool with unread replies).
    """

    AHEAD = 1

    def __init__(self, client, batches: list, out: list, deadline: resp.Deadline) -> None:
        self.client, self.batches, self.out, self.deadline = client, batches, out, deadline
        self.conn = self.reader = None
        self.sent = self.done = 0
        self.filling: dict = {}  # index -> (memory object, its bytes): pieces still to read
        self.left: list = []
        self.error: Optional[Exception] = None

    def begin(self) -> None:
        self.conn = _connection(self.client, self.deadline)
        self.reader = resp.BulkReader(resp.socket_of(self.conn), self.deadline)
        self._send()

    def _send(self) -> None:
        while self.sent < min(self.done + 1 + self.AHEAD, len(self.batches)):
            commands = []
            for _, k, lo, hi, length in self.batches[self.sent]:
                key = k.encode()
                if lo == 0:
                    commands.append(_resp(b"GET", key + b"metadata"))
                commands.append(_resp(b"GET", key + b"kv_bytes") if hi - lo == length else
                                _resp(b"GETRANGE", key + b"kv_bytes", b"%d" % lo, b"%d" % (hi - 1)))
            resp.send(resp.socket_of(self.conn), [b"".join(commands)], self.deadline)
            self.sent += 1

    def step(self, allocate: Callable, check: Optional[Callable]) -> bool:
        """Read the next batch (sending the ones after it); False when all are read."""
        for piece in self.batches[self.done]:
            self._read(piece, allocate, check)
        self.done += 1
        self._send()
        return self.done < len(self.batches)

    def _read(self, piece: tuple, allocate: Callable, check: Optional[Callable]) -> None:
        """One piece's replies: at an object's first piece its metadata, then the piece's bytes.

        The GETs of an object are not atomic (they never were: metadata and bytes are two
        keys); an object rewritten between them fails its trailer check, a miss.
        """
        out, reader = self.out, self.reader
        i, _, lo, hi, length = piece
        if lo == 0:
            try:
                meta = reader.bulk(META_BYTES)
            except resp.ReplyError:
                meta = None  # e.g. MOVED while a cluster fails over: a miss
            # None: a miss (no metadata) or no room; a str: in Redis but unreadable
            why = None if meta is None else _why_unreadable(meta, length)
            obj = allocate(i) if meta is not None and why is None else None
            out[i] = obj if obj is not None else why
            if obj is not None:  # its bytes as plain bytes (LMCache's view is ctypes' '<B')
                self.filling[i] = (obj, obj.byte_array.cast("B"))
        error = False
        try:
            size = reader.bulk_length(hi - lo)  # longer: a ProtocolError, nothing of it read
        except resp.ReplyError:  # e.g. MOVED while a cluster fails over: a miss, not damage
            size, error = None, True
        held = self.filling.get(i)
        if held is not None and (error or size != hi - lo):  # else: not what its metadata says
            out[i] = None if error else _bad_value(size, lo, length, ranged=hi - lo != length)
            del self.filling[i]
            held[0].ref_count_down()
            held = None
        if size is not None:
            if held is None:
                reader.skip(size)
            else:
                reader.read_into(held[1][lo:hi])
            reader.end_bulk()
        if held is not None and hi == length:
            del self.filling[i]
            # checked while the next replies arrive (the socket buffers them meanwhile)
            why = check(i, held[0]) if check is not None else None
            if why is not None:
                held[0].ref_count_down()
                out[i] = why

    def fail(self, exc: Exception) -> None:
        if self.conn is not None:
            self.conn.disconnect()  # unread replies: never back to the pool like this
        left = [(i, k) for batch in self.batches[self.done:] for i, k, *_ in batch]
        # the objects not read whole: none of them is given out, each is read again or a miss
        for i in set(self.filling) | {i for i, _ in left}:
            if self.out[i] is not None and not isinstance(self.out[i], str):
                self.out[i].ref_count_down()
            self.out[i] = None
        self.filling.clear()
        self.left = list(dict.fromkeys(left))
        self.error = exc

    def finish(self) -> None:
        if self.conn is not None:
            _give_back(self.client, self.conn, broken=self.error is None and not self.reader.drained)
            self.conn = None


def _read_in_turn(shards: list, allocate: Callable, check: Optional[Callable]) -> None:
    """Every shard's batches, one batch of each shard in turn (``_ShardFetch``)."""
    active = []
    for shard in shards:
        try:
            shard.begin()
            active.append(shard)
        except Exception as exc:
            shard.fail(exc)
            shard.finish()
    try:
        while active:
            for shard in list(active):
                try:
                    more = shard.step(allocate, check)
                except Exception as exc:
                    shard.fail(exc)
                    more = False
                if not more:
                    shard.finish()
                    active.remove(shard)
    except BaseException as exc:  # interrupted: no connection goes back with unread replies
        for shard in active:
            shard.fail(exc)
            shard.finish()
        raise


def _batches(items: list, size_of: Callable, limit: int):
    """``items`` in consecutive runs of at most ``limit`` total size (at least one item each)."""
    batch, total = [], 0
    for item in items:
        if batch and total + size_of(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size_of(item)
    if batch:
        yield batch
