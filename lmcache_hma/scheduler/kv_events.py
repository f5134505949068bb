"""KV cache events for routers: the connector's tiers in vLLM's own event types.

Only built when vLLM publishes KV cache events (``--kv-events-config``); vLLM's scheduler
publishes what ``take_events`` returns beside its own prefix-cache events, through its own
publisher (ZMQ, ``KVEventBatch``). Per stored object and tier:

* ``BlockStored`` once the object is durable in the tier (the worker's put succeeded), with
  **vLLM's block hashes** of the blocks the object covers, in each KV cache group it covers
  (``group_idx``, ``block_size``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``):
  a chunk's full-attention object, its blocks in every full-attention group; a sliding-window
  tail, the window's blocks before the boundary in every sliding group; a recurrent state,
  the boundary's block in every state group. ``token_ids``, ``parent_block_hash``,
  ``extra_keys`` (LoRA name, multimodal identifiers, cache_salt: per block, as vLLM's block
  pool publishes them), ``lora_id``/``lora_name`` as vLLM's own events carry them. A router
  hashing a prompt as vLLM does (same ``--prefix-caching-hash-algo``; ``sha256_cbor`` is
  reproducible across processes and languages) finds these hashes.
* ``BlockRemoved`` (same hashes and groups) once it left the tier: LMCache evicted it, a
  damaged object was dropped.
* On a hybrid model (sliding-window or recurrent-state groups), a chunk's full-attention
  blocks are announced in a tier only while a lookup serves through them: the chunk is
  whole there and a boundary object (its tail and/or state, or a turn end after it) sits at
  it or at a later chunk of the same prefix whose chunks are all held; when the last such
  boundary leaves, ``BlockRemoved`` for the chunks past the new last one. An index that
  matches full-attention blocks alone (Dynamo's, llm-d's) then credits at most the rest of
  the chunk a prompt diverges in beyond what the lookup serves, not a whole sparse interval.
  CPU memory and disk count as one prefix (a lookup reads each object from whichever holds
  it); Redis apart. Announcements go parents first: an index refuses a block whose parent it
  does not hold. Full objects keep their event templates while resident for this.
* After a cache reset with the connector, ``BlockRemoved`` for every object it had announced
  in its CPU and disk tiers, never ``AllBlocksCleared``: vLLM resets the connector even when
  its own reset failed (requests running), and Redis is not emptied (the fleet's), so
  entries a router holds for vLLM's device cache and for Redis stay valid.

Tiers: CPU memory ``medium="CPU", locality="LOCAL"``; the local disk ``STORAGE``, ``LOCAL``;
Redis ``STORAGE``, ``REMOTE`` (vLLM's ``Medium`` / ``Locality`` of its offloading tiers).
``ownership`` stays None: vLLM documents it as the identifier of a *secondary* offloading
tier, and an existing router's index (NVIDIA Dynamo's) drops every event that carries one,
so a tier announced with it is never credited (docs/fleet.md).

The mapping: when the scheduler plans a save (or a hit, whose objects a fetch from disk
or Redis keeps in CPU memory), it snapshots each object's event payload from the request
(bounded: ``SNAPSHOTS``, newest kept). Workers report per-tier records
(``core.tier_events``) in their step output; an object is announced in a tier once every
parallel rank stored its share, with the snapshot's payload, and its hashes are kept
(``RESIDENT``) to announce its removal. A store that was dropped or failed produces no
record, hence no event; a record without a snapshot is counted, not announced.

Not announced: objects found at start (the disk tier's files: no request, no block hashes);
what another instance wrote to Redis (it announces it); Redis's own evictions (``maxmemory``)
and other instances' deletes, which this instance never sees: REMOTE entries can outlive the
object, and a router should treat them as hints (a miss costs only the prefill).

Records travel with steps. So that an engine going idle still announces its last stores,
``pending_work`` (vLLM's ``has_pending_push_work``) keeps the engine stepping while a
worker says stores are under way (``BUSY``) or a reset's record is due, at most
``KEEPALIVE_S`` past the last record; such idle steps wait for the next record
(``worker.tier_events.TierEventCollector.IDLE_WAIT_S``) instead of spinning.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Iterable, Optional

import msgspec
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef, hit_objects, turn_hit_objects
from lmcache_hma.core.tier_events import BUSY, CLEARED, STORED, TierReports
from lmcache_hma.log import get_logger
from lmcache_hma.vllm_compat import block_hashes, event_block_hash, event_extra_keys, group_event_spec

logger = get_logger(__name__)

# tier -> (medium, locality) of its events
TIER_MEDIUM = {"cpu": (MEDIUM_CPU, "LOCAL"), "disk": (MEDIUM_STORAGE, "LOCAL"), "redis": (MEDIUM_STORAGE, "REMOTE")}
LOCAL_TIERS = ("cpu", "disk")  # what a reset empties
# A lookup reads a prefix from whichever local tier holds each object; Redis is read apart.
DOMAINS = {"local": LOCAL_TIERS, "redis": ("redis",)}
DOMAIN_OF = {"cpu": "local", "disk": "local", "redis": "redis"}


class _Resident:
    """An object stored in some tier: per tier, the ranks holding it (a bit mask); the tiers
    its ``BlockStored`` were announced in (``shown``); the (group, hashes) its events named,
    for its ``BlockRemoved``. A full object of a gated layout also keeps its event templates
    (announced when a boundary comes) and its place in the chain: the full-attention block
    hash before it (``parent_block``: None at chunk 0) and its own last one."""

    __slots__ = ("tiers", "removal", "shown", "ok", "templates", "parent_block", "last_block", "after")

    def __init__(self) -> None:
        self.tiers: dict[str, int] = {}
        self.removal: dict[tuple, None] = {}  # (group_idx, tuple of hashes) -> None (ordered set)
        self.shown: set = set()
        self.ok: set = set()  # the domains (DOMAINS) a lookup serves through it in
        self.templates: Optional[tuple] = None
        self.parent_block = None
        self.last_block = None
        self.after = None  # a turn end: the chunk hash of the chunk before it (None at chunk 0)


class KVEventAnnouncer:
    SNAPSHOTS = 4096  # objects whose whole payload (token ids included) is kept until stored
    RESIDENT = 1 << 16  # objects announced somewhere whose hashes are kept for their removal
    KEEPALIVE_S = 10.0  # the engine keeps stepping for records at most this long after the last

    def __init__(self, layout, kv_cache_config, world_size: int, hash_block_size: int) -> None:
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self._all_ranks = (1 << world_size) - 1
        self._hash_block_size = hash_block_size
        self._specs = {g.index: group_event_spec(kv_cache_config.kv_cache_groups[g.index]) for g in layout.groups}
        self._snapshots: OrderedDict = OrderedDict()  # (kind, chunk hash) -> tuple of BlockStored templates
        self._resident: OrderedDict = OrderedDict()  # (kind, chunk hash) -> _Resident
        # Restorable gating (docs/fleet.md): a hybrid layout's full chunk is announced in a tier
        # only while a lookup there serves through it: the chain from chunk 0 to it whole in the
        # tier, and a boundary object (tail and/or state, or a turn end) at it or further on.
        self._gated = layout.has_sliding or layout.has_state
        self._boundary_kinds = tuple(k for k, on in ((ObjectKind.TAIL, layout.has_sliding),
                                                       (ObjectKind.STATE, layout.has_state)) if on)
        self._full_group = next((g.index for g in layout.full_groups), None)
        self._by_last: dict = {}  # a full object's last full-attention block hash -> its chunk hash
        self._children: dict = {}  # parent block hash -> {chunk hash of the full objects after it}
        self._turns: Counter = Counter()  # (tier, chunk hash) -> turn ends whole in tier after that chunk
        self._block_refs: Counter = Counter()  # (tier, group, block hash) -> announced objects holding it
        self._events: list = []
        self._busy = False  # a worker's last output said more records are coming
        self._busy_seen = False  # ... in this step's output
        self._clear_due = 0.0  # until then (time.monotonic()), a reset's CLEARED record is due
        self._last_news = 0.0  # time.monotonic() of the last record, save or reset
        self.counters: Counter = Counter()  # stores_unmapped, removals_forgotten
        self._warned = False

    # what the scheduler plans ------------------------------------------------------
    def on_saves(self, saves, requests: dict) -> None:
        """The step's ``SaveSpec``s (``requests``: the scheduler half's states by request id)."""
        for spec in saves:
            state = requests.get(spec.req_id)
            if state is not None:
                self.remember(state.request, spec.objects)
        if saves:
            self._last_news = time.monotonic()

    def on_hit(self, state, num_computed_tokens: int) -> None:
        """A lookup's hit: its objects, fetched from disk or Redis, are kept in CPU memory."""
        first, end = num_computed_tokens // self.chunk_size, state.hit // self.chunk_size
        if state.hit > num_computed_tokens and state.turn is not None:  # a turn end's hit
            self.remember(state.request, turn_hit_objects(first, state.hashes[first:end], state.turn,
                                                          self.layout.has_state))
        elif state.hit > num_computed_tokens and end > first:
            self.remember(state.request, hit_objects(first, state.hashes[first:end], self.layout.has_sliding,
                                                     self.layout.has_state))

    def remember(self, request, refs: Iterable[ObjectRef]) -> None:
        """Snapshot the event payload of each object (``refs``) from ``request`` (one already
        snapshot is kept: equal chunk keys mean equal tokens and extra keys)."""
        views: dict = {}
        for ref in refs:
            key = (ref.kind, ref.chunk_hash)
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
                continue
            templates = self._templates(request, ref, views)
            if templates is not None:
                turn_after = ref.parent if ref.kind is ObjectKind.TURN and ref.chunk else None
                self._snapshots[key] = (templates, turn_after)
        while len(self._snapshots) > self.SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def _templates(self, request, ref: ObjectRef, views: dict) -> Optional[tuple]:
        """One ``BlockStored`` per group the object covers, without medium/locality."""
        out = []
        lora = request.lora_request
        if ref.kind is ObjectKind.TURNMARK:
            return None
        for seg in self.layout.segments(ref.kind, ref.chunk, ref.end, ref.on_tail):
            g = self.layout.groups[seg.group]
            size = g.block_size
            view = views.get(size)
            if view is None:
                view = views[size] = block_hashes(request, self._hash_block_size, size)
            first, end = seg.first_block, seg.first_block + seg.num_blocks
            if ref.end:  # a turn end (its KV, its states) announces the whole blocks it covers
                end = min(end, ref.end // size)
                if end <= first:
                    continue
            if end > len(view):  # vLLM hashed no such block (prefix caching off)
                if not self._warned:
                    self._warned = True
                    logger.warning("LMCacheHMA: KV cache events: vLLM has no block hashes for %s (prefix "
                                   "caching off?); the connector's tiers are not announced", request.request_id)
                return None
            kind, window = self._specs[g.index]
            tokens = views.get((first * size, end * size))  # one list for the groups of a tail
            if tokens is None:
                tokens = views[(first * size, end * size)] = list(request.all_token_ids[first * size:end * size])
            out.append(BlockStored(
                block_hashes=[event_block_hash(view[j]) for j in range(first, end)],
                parent_block_hash=event_block_hash(view[first - 1]) if first else None,
                token_ids=tokens,
                block_size=size,
                lora_id=lora.adapter_id if lora else None,
                medium=None,
                lora_name=lora.name if lora else None,
                extra_keys=event_extra_keys(request, first, end, size),
                group_idx=g.index,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                session_id=getattr(request, "session_id", None),
            ))
        return tuple(out)

    def expect_clear(self) -> None:
        """The worker emptied its local tiers: announce it when rank 0's record comes."""
        self._last_news = time.monotonic()
        self._clear_due = self._last_news + self.KEEPALIVE_S

    # what the workers report -------------------------------------------------------
    def on_reports(self, reports) -> None:
        if not isinstance(reports, TierReports):
            return
        for rank, op, tier, kind, chunk_hash in reports.records:
            if op == BUSY:  # a stretch of BUSY alone counts from its start (KEEPALIVE_S)
                if not (self._busy or self._busy_seen):
                    self._last_news = time.monotonic()
                self._busy_seen = True
                continue
            self._last_news = time.monotonic()
            if op == CLEARED:
                self._cleared(rank)
            elif op == STORED:
                self._stored(1 << rank, tier, (ObjectKind(kind), chunk_hash))
            else:
                self._removed(1 << rank, tier, (ObjectKind(kind), chunk_hash))

    def _stored(self, bit: int, tier: str, key: tuple) -> None:
        snap = self._snapshots.get(key)
        res = self._resident.get(key)
        if res is None:
            if snap is None:
                self.counters["stores_unmapped"] += 1
                return
            res = self._resident[key] = _Resident()
            res.after = snap[1]
            self._adopt(key, res, snap)
            if len(self._resident) > self.RESIDENT:
                old_key, old = self._resident.popitem(last=False)
                for old_tier in old.shown:  # its blocks are no longer counted as held by it
                    self._unref(old_tier, old.removal)
                self._forget(old_key, old)
                self.counters["removals_forgotten"] += 1
        else:
            self._resident.move_to_end(key)
        mask = res.tiers.get(tier, 0)
        res.tiers[tier] = mask | bit
        if mask == self._all_ranks or mask | bit != self._all_ranks:
            return  # whole already, or some rank has not stored its share yet
        if snap is None and res.templates is None and key[0] is not ObjectKind.FULL:
            self.counters["stores_unmapped"] += 1
            return
        kind, chunk_hash = key
        if kind is ObjectKind.FULL and self._gated:
            if res.templates is None:
                self.counters["stores_unmapped"] += 1
                return
            self._refresh(tier, chunk_hash)
            return
        if kind is ObjectKind.TURN and res.after is not None:
            self._turns[(tier, res.after)] += 1
            self._refresh(tier, res.after)  # the chain before it first (parents first)
        elif kind in self._boundary_kinds and self._gated:
            self._refresh(tier, chunk_hash)
        templates = res.templates if res.templates is not None else (snap[0] if snap is not None else None)
        if templates is None:
            self.counters["stores_unmapped"] += 1
            return
        self._show(tier, res, templates)

    def _adopt(self, key: tuple, res: _Resident, snap) -> None:
        """A new resident: a full object of a gated layout keeps its templates and chain links."""
        if key[0] is not ObjectKind.FULL or not self._gated or snap is None:
            return
        res.templates = snap[0]
        main = next((t for t in snap[0] if t.group_idx == self._full_group), None)
        if main is None or not main.block_hashes:
            return
        res.parent_block, res.last_block = main.parent_block_hash, main.block_hashes[-1]
        self._by_last[res.last_block] = key[1]
        self._children.setdefault(res.parent_block, set()).add(key[1])

    def _forget(self, key: tuple, res: _Resident) -> None:
        if res.after is not None:  # a turn end forgotten while held (RESIDENT): no longer counted
            for t, mask in res.tiers.items():
                if mask == self._all_ranks:
                    self._untally_turn(t, res.after)
        if res.last_block is None:
            return
        if self._by_last.get(res.last_block) == key[1]:
            del self._by_last[res.last_block]
        kids = self._children.get(res.parent_block)
        if kids is not None:
            kids.discard(key[1])
            if not kids:
                del self._children[res.parent_block]

    def _show(self, tier: str, res: _Resident, templates) -> None:
        medium, locality = TIER_MEDIUM[tier]
        res.shown.add(tier)
        for t in templates:
            res.removal[(t.group_idx, tuple(t.block_hashes))] = None
            self._events.append(msgspec.structs.replace(t, medium=medium, locality=locality))
            for h in t.block_hashes:
                self._block_refs[(tier, t.group_idx, h)] += 1

    def _hide(self, tier: str, res: _Resident) -> None:
        res.shown.discard(tier)
        medium, locality = TIER_MEDIUM[tier]
        for group_idx, hashes in self._unref(tier, res.removal):
            self._events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx,
                                             locality=locality))

    def _removed(self, bit: int, tier: str, key: tuple) -> None:
        res = self._resident.get(key)
        mask = res.tiers.get(tier, 0) if res is not None else 0
        if not mask & bit:
            return
        if mask & ~bit:
            res.tiers[tier] = mask & ~bit
        else:
            del res.tiers[tier]
        if mask == self._all_ranks:  # it was whole: no longer in this tier
            if tier in res.shown:
                self._hide(tier, res)
            kind, chunk_hash = key
            if kind is ObjectKind.FULL and self._gated:
                self._refresh(tier, chunk_hash)
            elif kind is ObjectKind.TURN:
                if res.after is not None and self._untally_turn(tier, res.after):
                    self._refresh(tier, res.after)
            elif kind in self._boundary_kinds and self._gated:
                self._refresh(tier, chunk_hash)
        if not res.tiers:
            del self._resident[key]
            self._forget(key, res)

    # restorable gating -------------------------------------------------------------
    def _untally_turn(self, tier: str, after) -> bool:
        """A turn end after chunk ``after`` is no longer whole in ``tier``; whether one was counted."""
        n = self._turns.get((tier, after), 0)
        if not n:
            return False
        if n == 1:
            del self._turns[(tier, after)]
        else:
            self._turns[(tier, after)] = n - 1
        return True

    def _full(self, chunk_hash) -> Optional[_Resident]:
        return self._resident.get((ObjectKind.FULL, chunk_hash))

    def _whole(self, tier: str, res: Optional[_Resident]) -> bool:
        return (res is not None and res.templates is not None and res.last_block is not None
                and res.tiers.get(tier, 0) == self._all_ranks)

    def _in_domain(self, domain: str, res: Optional[_Resident]) -> bool:
        return any(self._whole(t, res) for t in DOMAINS[domain])

    def _boundary(self, domain: str, chunk_hash) -> bool:
        """A lookup in ``domain`` can end after this chunk: its boundary objects, or a turn end after it."""
        if any(self._turns.get((t, chunk_hash)) for t in DOMAINS[domain]):
            return True
        for kind in self._boundary_kinds:
            res = self._resident.get((kind, chunk_hash))
            if res is None or not any(res.tiers.get(t, 0) == self._all_ranks for t in DOMAINS[domain]):
                return False
        return True

    def _restorable(self, domain: str, chunk_hash, res: _Resident) -> bool:
        if not self._in_domain(domain, res):
            return False
        if self._boundary(domain, chunk_hash):
            return True
        for kid in self._children.get(res.last_block, ()):
            r = self._full(kid)
            if r is not None and domain in r.ok:
                return True
        return False

    def _refresh(self, tier: str, chunk_hash) -> None:
        """A change in ``tier`` at the chunk ``chunk_hash`` (its full object, a boundary object
        after it): recompute whether it and the chunks before it are restorable in the tier's
        domain, and announce or withdraw them in each tier of it that holds them whole. Stores
        go parents first (an index refuses a block whose parent it does not hold)."""
        domain = DOMAIN_OF[tier]
        res = self._full(chunk_hash)
        if res is None or res.last_block is None:
            return
        path = [res]
        h = chunk_hash
        while True:
            ok = self._restorable(domain, h, res)
            if ok == (domain in res.ok) and len(path) > 1:
                path.pop()  # unchanged: nothing before it changes either
                break
            (res.ok.add if ok else res.ok.discard)(domain)
            up = self._by_last.get(res.parent_block) if res.parent_block is not None else None
            res = self._full(up) if up is not None else None
            if res is None:
                break
            h = up
            path.append(res)
        for r in reversed(path):  # chunk 0's side first
            for t in DOMAINS[domain]:
                want = domain in r.ok and self._whole(t, r)
                if want and t not in r.shown:
                    self._show(t, r, r.templates)
                elif not want and t in r.shown:
                    self._hide(t, r)

    def _unref(self, tier: str, removal) -> list:
        """Count the blocks of an object's events (``removal``) as no longer held by it in ``tier``;
        ``[(group, hashes)]`` of those no other announced object holds there. Objects can share a
        block (a turn end and the tail before it, tails of windows longer than a chunk): a block
        is announced removed only when the last of them leaves."""
        gone = []
        for group_idx, hashes in removal:
            left = []
            for h in hashes:
                ref = (tier, group_idx, h)
                self._block_refs[ref] -= 1
                if self._block_refs[ref] <= 0:
                    del self._block_refs[ref]
                    left.append(h)
            if left:
                gone.append((group_idx, left))
        return gone

    def _cleared(self, rank: int) -> None:
        """Rank ``rank`` emptied its local tiers. Its removal records came before this one; an
        object still resident in a local tier for it (a removal its tier did not report) is
        announced removed here, so exactly what left is announced. Rank 0's record (the rank
        that answers the reset) ends the reset's keep-alive."""
        bit = 1 << rank
        for key in list(self._resident):
            for tier in LOCAL_TIERS:
                if key in self._resident and self._resident[key].tiers.get(tier, 0) & bit:
                    self._removed(bit, tier, key)
        if rank == 0:
            self._clear_due = 0.0

    # vLLM's calls ------------------------------------------------------------------
    def take_events(self) -> list:
        """The events since the last call (vLLM calls this once per step, after the step's output)."""
        events, self._events = self._events, []
        self._busy, self._busy_seen = self._busy_seen, False
        return events

    def pending_work(self) -> bool:
        """Whether the engine should keep stepping to collect records (``has_pending_push_work``)."""
        now = time.monotonic()
        return (self._busy and now - self._last_news < self.KEEPALIVE_S) or now < self._clear_due
