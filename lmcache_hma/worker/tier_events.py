"""The worker's side of KV cache events: what landed in and left each tier (``core.tier_events``).

Only built when vLLM publishes KV cache events (``--kv-events-config``); otherwise the
store has no listener and nothing here runs. Records are appended by whichever thread
saw the tier act: the store writer (puts into CPU memory and Redis), LMCache's disk
thread (a file written), the lookup server (an object read from disk or Redis kept in
CPU memory, a damaged object dropped, a reset), the gather thread (LMCache evicting to
make room). The step's thread takes them all in ``take`` for the step's
``KVConnectorOutput`` (``get_kv_connector_kv_cache_events``).

Nothing is recorded for an object that never became durable: a store the writer
dropped (queue full) or that failed, a tier that refused it (no room, Redis down or
bypassed), a disk write LMCache skipped. Such objects are simply never announced.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.tier_events import BUSY, CLEARED, REMOVED, STORED, TierReports


class TierEventCollector:
    # In a step the engine runs only to collect these records (nothing scheduled), wait at most
    # this long for the next one rather than have the engine spin (see scheduler.kv_events).
    IDLE_WAIT_S = 0.02

    def __init__(self, namespace, rename: Optional[Callable[[bytes], Optional[bytes]]] = None) -> None:
        """``rename``: the object a stored key stands for, or None for a key not to report
        (hma_share_parallel_shapes: parts of KV heads, ``canonical_objects.object_of``)."""
        self.rank = namespace.rank
        self._rename = rename
        # markers (TURNMARK) name no KV: nothing to announce
        fields = {namespace.model_field(k): k for k in ObjectKind}
        self._kind_of = lambda key: fields.get(key.model_name)  # until ``watch``: the store's keys
        self._records: deque = deque()
        self._arrived = threading.Event()
        self._busy_checks: tuple[Callable[[], bool], ...] = ()
        self._put_callbacks: dict[str, Callable] = {}

    def watch(self, store, writer, gathering: Callable[[], bool]) -> None:
        """Listen to ``store`` (``ChunkStore.watch``); ``writer`` and ``gathering`` (the
        worker's deferred gathers) say whether stores are still on their way."""
        store.watch(self)
        self._kind_of = store.keys.kind_of  # every weights generation the store names objects in
        self._busy_checks = (gathering, lambda: writer.pending() > 0, store.writes_pending)

    # called by the store, from any thread ------------------------------------------
    def put_callback(self, tier: str) -> Callable:
        """``on_complete_callback(key)`` for a put into ``tier``: LMCache calls it once the
        object is in (never for a put it skipped)."""
        callback = self._put_callbacks.get(tier)
        if callback is None:
            callback = self._put_callbacks[tier] = lambda key: self.stored(tier, key)
        return callback

    def stored(self, tier: str, key) -> None:
        self._add(STORED, tier, key)

    def removed(self, tier: str, key) -> None:
        self._add(REMOVED, tier, key)

    def cleared(self) -> None:
        """The local tiers were emptied (a cache reset; their removals were recorded one by one)."""
        self._records.append((self.rank, CLEARED, None, None, None))
        self._arrived.set()

    def _add(self, op: str, tier: str, key) -> None:
        kind = self._kind_of(key)
        if kind is None or kind is ObjectKind.TURNMARK:  # not this namespace's object; a marker names no KV
            return
        name = bytes(key.chunk_hash)
        if self._rename is not None:
            name = self._rename(name)
            if name is None:
                return
        self._records.append((self.rank, op, tier, int(kind), name))  # deque: thread-safe
        self._arrived.set()

    # the step ----------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether more records are coming: gathers, queued or writing stores, disk writes."""
        return any(check() for check in self._busy_checks)

    def take(self, idle: bool = False) -> Optional[TierReports]:
        """The records since the last call, and ``BUSY`` if more are coming (None: nothing).
        ``idle``: the step scheduled nothing (the engine steps only to collect these); then
        wait up to ``IDLE_WAIT_S`` for a record if one is coming."""
        if idle and not self._records and self.busy():
            self._arrived.wait(self.IDLE_WAIT_S)
        self._arrived.clear()
        records = []
        while True:
            try:
                records.append(self._records.popleft())
            except IndexError:
                break
        if self.busy():
            records.append((self.rank, BUSY, None, None, None))
        return TierReports(records) if records else None
