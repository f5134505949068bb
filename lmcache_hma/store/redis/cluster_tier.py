"""The Redis Cluster tier (``redis-cluster://h1:p1,h2:p2``): per-shard health, slot map, reads."""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from lmcache_hma.config.remote_url import CLUSTER_SCHEME
from lmcache_hma.log import get_logger
from lmcache_hma.store import lmcache_compat
from lmcache_hma.store.redis.node_tier import RedisTier
from lmcache_hma.store.redis.wire import TOPOLOGY_BYTES, TOPOLOGY_ITEMS, command, handshake

logger = get_logger(__name__)


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

    def keep_room(self, lineage, boundary_hits: bool) -> None:
        """Not for a cluster: each master evicts on its own, and the objects this instance knows
        of spread over all of them (making room on one would take the next candidate wherever it
        lives). A cluster keeps its masters' own eviction (docs/redis.md, "Eviction policy")."""

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
                                     redis_connect_func=handshake, **self._creds)
                self._nodes[name] = client
            return client

    def _topology(self):
        """(slot ranges [(first, last, master)], every node named, cluster_state), or (None, why)."""
        known = {n for _, _, n in self._slot_map[1]}
        order = list(dict.fromkeys([*([self._last_good] if self._last_good else []), *self._seeds, *sorted(known)]))
        why = "no node to ask"
        for name in order:
            try:  # a node that does not answer in time, or answers nonsense: ask the next one
                slots, info = self._call(self._node(name), [command(b"CLUSTER", b"SLOTS"), command(b"CLUSTER", b"INFO")],
                                         lambda reader: (reader.reply(TOPOLOGY_BYTES, TOPOLOGY_ITEMS),
                                                         reader.bulk(TOPOLOGY_BYTES)))
                found = parse_topology(name, slots, info)
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


def parse_topology(name: str, slots, info) -> tuple:
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
