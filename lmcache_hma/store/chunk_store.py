"""The chunk store: objects by (kind, chunk hash) over LMCache's StorageManager.

Runs in the worker (rank 0 also answers the scheduler's lookups from it, on a
thread). It iterates its tiers (``tier.Tier``: CPU memory, local disk, a remote
tier) in LMCache's order and never names one; LMCache's allocator gives every
object its memory.

Every object is sealed with an integrity trailer (``core.objects``) on put and
checked on get; an object that fails is removed from every tier and reported
as a miss, so it can neither reach the KV cache nor be served again.

Objects are named in a weights generation (``new_generation``), which every cache reset moves:
nothing named before a reset is found after it, in any tier, and nothing gathered before it
is written after it (docs/design.md#resets-and-weight-updates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from lmcache_hma.config.remote_url import uses_hash_tags
from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import IntegrityError, object_elems, payload_of, seal, verify_bytes
from lmcache_hma.log import get_logger
from lmcache_hma.store import lmcache_compat, local_tiers
from lmcache_hma.store.lmcache_storage import flat, open_storage_manager, release
from lmcache_hma.store.object_keys import ObjectKeys
from lmcache_hma.store.tier import Tier, tiers_of
from lmcache_hma.store.value_policy import Line, Lineage, ValuePolicy

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_REWRITE_WAIT_S = 2.0  # a marker's rewrite waits at most this long for its last disk write


class ChunkStore:
    """Objects by (kind, chunk hash) in LMCache's tiers."""

    events = None  # KV cache events: worker.tier_events.TierEventCollector (see watch), else None

    def __init__(self, lmcache_config, namespace: Namespace, verify_checksums: bool = True, eviction: str = "lru"):
        """``eviction``: ``hma_eviction``; ``value`` gives the CPU and disk tiers ``ValuePolicy``, and
        has the writer make room in a Redis under ``maxmemory`` by it (``redis.room``)."""
        self.namespace = namespace
        self.dtype = namespace.kv_dtype
        local_tiers.prepare_disk_dir(lmcache_config.local_disk)
        self.verify_checksums = verify_checksums
        self.keys = ObjectKeys(namespace, hash_tags=uses_hash_tags(lmcache_config))
        self._manager = open_storage_manager(lmcache_config, namespace)
        self.tiers: tuple[Tier, ...] = tuple(tiers_of(self._manager, lmcache_config))
        self._memory = next((t for t in self.tiers if t.memory), None)
        self.reindexed = self.foreign_files = 0
        for tier in self.tiers:
            if tier.label == "disk":
                self.reindexed, self.foreign_files = local_tiers.reindex_disk(tier, self.keys.of_file, self.dtype,
                                                                                self.keys.stale_file)
        self.lineage = Lineage()  # where each stored object sits in its prefix (value_policy)
        if eviction == "value":
            self._install_value_policy()
        self.integrity_failures = 0
        # objects a tier that reads into new memory (Redis) held but that were not read: no CPU
        # memory for them (a miss; the disk tier counts its own). Under the lock.
        self._not_read_no_memory = 0
        self._counts_lock = threading.Lock()
        self.closed = False
        # The generation of the local tiers, moved by every cache reset (``new_generation``, then
        # ``clear_local``): a read that began before a move keeps nothing in CPU memory after it
        # (it would put back an object the clear removed from disk), and KV read before one goes
        # to no local tier (``commit_many``). Under the lock.
        self.clears = 0
        self._clear_fence = threading.Lock()

    def _install_value_policy(self) -> None:
        """``hma_eviction: value``: the local tiers' backends call ``ValuePolicy`` where they would
        call their LRU; what the disk tier already holds is adopted as old."""
        layout = self.namespace.layout
        local = [t for t in self.tiers if t.local]
        for tier in local:
            others = [t for t in local if t is not tier]
            policy = ValuePolicy(self.lineage, self.keys.kind_of, layout.has_sliding or layout.has_state,
                                 elsewhere=lambda key, others=others: any(t.holds(key) for t in others))
            policy.adopt(lmcache_compat.local_keys(tier.backend))
            tier.backend.cache_policy = policy
        for tier in local:  # what one drops may orphan what the others hold
            others = [t.backend.cache_policy for t in local if t is not tier]
            if others:
                tier.observe_removals(lambda key, others=others: [p.left_elsewhere(key) for p in others])
        for tier in self.tiers:  # Redis: room made before each write (store.redis.room)
            if not tier.local and hasattr(tier, "keep_room"):
                tier.keep_room(self.lineage, layout.has_sliding or layout.has_state)

    @property
    def tier_labels(self) -> tuple[str, ...]:
        return tuple(t.label for t in self.tiers)

    def tier(self, label: str) -> Optional[Tier]:
        """The tier counted as ``label`` (``kinds.TIERS``), if this store has one."""
        return next((t for t in self.tiers if t.label == label), None)

    def key(self, kind: ObjectKind, chunk_hash: bytes):
        return self.keys.key(kind, chunk_hash)

    # lookups ----------------------------------------------------------------
    def count_full_prefix(self, chunk_hashes: Sequence[bytes]) -> int:
        """How many of ``chunk_hashes``, from the first, have a full object."""
        return longest_hit(self.present(ObjectKind.FULL, chunk_hashes), None)

    def present(self, kind: ObjectKind, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``chunk_hashes`` have an object of ``kind`` in some tier."""
        return [tier is not None for tier in self.present_kinds((kind,), chunk_hashes)[kind]]

    def present_kinds(self, kinds: Sequence[ObjectKind], chunk_hashes: Sequence[bytes]) -> dict:
        """``{kind: [the tier (``TIERS``) holding chunk_hashes[i]'s object of kind, or None]}``.

        One pass over the tiers for all of them (a lookup asks for every kind of
        every boundary at once): local tiers answer from memory, a remote tier in one
        round trip.
        """
        n = len(chunk_hashes)
        found = self.present_pairs([(kind, h) for kind in kinds for h in chunk_hashes])
        return {kind: found[j * n:(j + 1) * n] for j, kind in enumerate(kinds)}

    def present_pairs(self, pairs: Sequence[tuple[ObjectKind, bytes]]) -> list:
        """For each (kind, chunk hash), the tier (``TIERS``) holding its object, or None; in one
        pass like ``present_kinds``."""
        keys = [self.key(kind, h) for kind, h in pairs]
        found: list = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            if not tier.usable():
                continue
            for i, flag in zip(todo, tier.present_many([keys[i] for i in todo])):
                found[i] = tier.label if flag else None
        return found

    def has(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        return self.present(kind, [chunk_hash])[0]

    # put / get --------------------------------------------------------------
    def put(self, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int,
            fill: Callable[[torch.Tensor], None]) -> bool:
        """Allocate an object, let ``fill`` write its payload, seal and store it.

        Returns False (nothing stored) when the CPU tier has no room left or no tier took it.
        """
        obj = self.allocate(payload_bytes)
        if obj is None:
            logger.debug("no room to store %s chunk %s", kind.name, chunk_hash.hex()[:16])
            return False
        try:
            fill(payload_of(flat(obj)))
        except BaseException:
            release(obj)  # give it back, or a failing fill drains the allocator
            raise
        return self.commit(kind, chunk_hash, obj)

    def allocate(self, payload_bytes: int):
        """A new object with room for ``payload_bytes`` (evicting if needed), or None.

        Hand it to ``commit`` or ``release`` it.
        """
        elems = object_elems(payload_bytes, self.dtype)
        # 3-D because LMCache's KV_2LTD bookkeeping (get_num_tokens) reads shape[2].
        return self._manager.allocate(torch.Size([1, 1, elems]), self.dtype, eviction=True, busy_loop=False)

    def _allocate_free(self, sizes: Sequence[int]) -> list:
        """Objects for payloads of ``sizes`` from free memory, one LMCache batched allocation per
        size; None where there is none free (``allocate`` then evicts for it): a hit's remote
        fetch is bound by the reader's CPU, and allocating its objects one by one is a
        visible part of it.

        Workaround: LMCache 0.5.6's batched allocation cannot evict our objects (it evicts by
        layer keys, ``split_layers``), so it is asked only for free memory.
        """
        out: list = [None] * len(sizes)
        by_size: dict = {}
        for n, size in enumerate(sizes):
            by_size.setdefault(size, []).append(n)
        for size, ns in by_size.items():
            shape = torch.Size([1, 1, object_elems(size, self.dtype)])
            objs = self._manager.batched_allocate(shape, self.dtype, len(ns), eviction=False, busy_loop=False)
            for n, obj in zip(ns, objs or ()):
                out[n] = obj
        return out

    def commit(self, kind: ObjectKind, chunk_hash: bytes, obj) -> bool:
        """Seal an allocated object whose payload is written and store it; takes the reference.
        False: no tier took it."""
        return self.commit_many([(kind, chunk_hash, obj)])[0]

    def commit_many(self, items: Sequence[tuple[ObjectKind, bytes, object]], shared: bool = True,
                    clears: Optional[Sequence[int]] = None, refs: Optional[Sequence] = None,
                    expires: Optional[Sequence[bool]] = None) -> list[bool]:
        """``commit`` for several objects: one put into each tier (the local tiers only when not
        ``shared``: another rank puts the same object into the shared one); takes every
        reference, also when sealing or a tier fails. Returns, per object, whether some tier
        took it (False: a disk-only store whose tier refused it, say: never stored).

        ``clears``: per object, what ``self.clears`` was when its KV was gathered; an object
        gathered before a later cache reset goes to no tier at all, whenever the writer gets to
        it (after the reset it would be named in the next weights generation: old weights' KV
        served as new). Objects are named and sealed under the generation their ``clears`` check
        passed in: one that a reset overtakes on its way to Redis lands under the old names,
        which no lookup after the reset asks for; the local tiers check again as they put.
        ``refs``: per object, its ``ObjectRef`` or None: where it sits in its prefix, for the
        local tiers' eviction (``value_policy``). ``expires``: per object, whether it is a part of
        a turn end that its key does not name as one (a turn end's states): a Redis tier gives it
        the turn ends' TTL."""
        with self._clear_fence:  # one generation for the check, the names and the seal
            now, namespace = self.clears, self.namespace
            live = [i for i in range(len(items)) if clears is None or clears[i] == now]
            keys = [self.key(items[i][0], items[i][1]) for i in live]
        taken = [False] * len(items)
        if len(live) < len(items):  # gathered before a reset: written nowhere
            for i in set(range(len(items))).difference(live):
                release(items[i][2])
            items = [items[i] for i in live]
            refs = None if refs is None else [refs[i] for i in live]
            expires = None if expires is None else [expires[i] for i in live]
            if not items:
                return taken
        for i, t in zip(live, self._put_all(items, keys, namespace, now, shared, refs, expires)):
            taken[i] = t
        return taken

    def _put_all(self, items, keys, namespace, now: int, shared: bool, refs, expires) -> list[bool]:
        """``commit_many`` of objects named and checked under ``namespace`` and ``clears`` ``now``."""
        try:
            for kind, chunk_hash, obj in items:
                seal(flat(obj), namespace.fingerprint, chunk_hash, kind, namespace.secret)
        except BaseException:
            for _, _, obj in items:
                release(obj)
            raise
        objs = [obj for _, _, obj in items]
        for key, ref, obj in zip(keys, refs or (), objs):
            if ref is not None:
                self.lineage.record(key, self._line(ref, flat(obj).nbytes))
        marks = [i for i, (kind, _, _) in enumerate(items) if kind is ObjectKind.TURNMARK]
        # a marker rewritten twice in one batch (turn ends after one prefix finished together):
        # only the last goes (it lists every offset; a local tier keeps the first put of a key)
        last = {keys[i]: i for i in marks}
        dups = {i for i in marks if last[keys[i]] != i}
        marks = [i for i in marks if i not in dups]
        fresh = [i for i in range(len(items)) if i not in dups]
        if marks:  # a rewrite waits for the marker's last write still under way (not under the fence)
            by = time.monotonic() + _REWRITE_WAIT_S
            for tier in self.tiers:
                if tier.local:
                    for i in marks:
                        tier.wait_written(keys[i], by)
        taken = [i in dups for i in range(len(items))]
        try:
            for tier in self.tiers:  # each takes its own references; a tier that is down writes nothing
                if not (shared or tier.local):
                    continue
                with self._clear_fence if tier.local else contextlib.nullcontext():
                    if tier.local and self.clears != now:  # a reset since they were named: not here
                        continue
                    for i in marks:  # rewritten: LMCache's local tiers ignore a put of a key they hold
                        tier.make_way(keys[i])
                    took = tier.store_many([keys[i] for i in fresh], [objs[i] for i in fresh], self._on_stored(tier),
                                           expires=None if expires is None else [expires[i] for i in fresh])
                # the tier cannot tell which it took: a remote tier counts its own failures
                for i, t in zip(fresh, took if isinstance(took, list) else [True] * len(fresh)):
                    taken[i] = taken[i] or t
        finally:
            for obj in objs:
                release(obj)
        return taken

    def note_lineage(self, refs: Sequence, payload_bytes: Sequence[int]) -> None:
        """Where a hit's objects sit in their prefixes, for those the store has no line of (written
        by another instance, or before a restart): kept in CPU memory after a read from disk or
        Redis, they are ranked by it (``value_policy``). Never replaces a line."""
        for ref, size in zip(refs, payload_bytes):
            key = self.key(ref.kind, ref.chunk_hash)
            if self.lineage.get(key) is None:
                self.lineage.record(key, self._line(ref, self._object_bytes(size)))

    def _line(self, ref, nbytes: int) -> Line:
        """Where ``ref``'s object sits: its parent's key and the tokens a hit through it restores
        (``value_policy``; ``ObjectRef.gain``, a chunk's size where unknown). A chunk's parent is the chunk before it; a tail's, a boundary state's
        and a marker's, the chunk they end (a marker written for a turn end ``on_tail``: the tail
        there, which its hits read); a turn end's, its marker; a turn end's states', the turn
        object."""
        kind, tokens = ref.kind, ref.gain or self.namespace.layout.chunk_size  # a chunk: its own tokens
        if kind is ObjectKind.FULL:
            parent = self.key(kind, ref.parent) if ref.parent else None
        elif kind is ObjectKind.TURN:
            parent = self.key(ObjectKind.TURNMARK, ref.parent) if ref.parent else None
        elif kind is ObjectKind.STATE and ref.end:
            parent = self.key(ObjectKind.TURN, ref.chunk_hash)
        elif kind is ObjectKind.TURNMARK and ref.on_tail:  # its turn ends need the tail there too
            parent, tokens = self.key(ObjectKind.TAIL, ref.chunk_hash), 0
        else:
            parent = self.key(ObjectKind.FULL, ref.chunk_hash)
            tokens = 0 if kind is ObjectKind.TURNMARK else tokens
        return Line(parent, tokens, kind, nbytes, tuple(self.key(r.kind, r.chunk_hash) for r in ref.supersedes),
                    spare=ref.spare)

    def has_room(self, fill: float) -> bool:
        """Whether every local tier is below ``fill`` (a fraction of its size): a tail stored on
        speculation (``ObjectRef.spare``) then takes room nothing else needs. False without a
        local tier: a Redis is shared with the fleet, and this instance sees only its own
        writes to it (``redis.room``), not how full it is."""
        fills = [tier.fill() for tier in self.tiers if tier.local and tier.usable()]
        return bool(fills) and all(f is not None and f < fill for f in fills)

    def in_memory(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        """Whether the CPU tier holds the object (a get then costs no I/O)."""
        return self._memory is not None and self._memory.present_many([self.key(kind, chunk_hash)])[0]

    def get(self, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int):
        """The verified object, or None (missing, or failed its checks and removed).

        The caller must ``release()`` a returned object.
        """
        return self.get_many([(kind, chunk_hash, payload_bytes)])[0][0]

    def get_many(self, wanted: Sequence[tuple[ObjectKind, bytes, int]],
                 deadline: Optional[float] = None) -> list[tuple]:
        """``get`` for each (kind, chunk hash, payload bytes): (verified object, the label of the
        tier that served it), (None, None) where missing or damaged. The caller must
        ``release()`` every returned object.

        ``deadline`` (``time.monotonic()``): no tier is asked, and no object is read, past it;
        what is not in by then is (None, None) like a miss (``past`` tells the two apart).

        Tiers in LMCache's order, each asked once for what the ones before it lacked. The
        CPU tier holds only objects sealed here or verified on their way in, so its objects
        get the trailer check without a pass over the payload (CRC32 and the MAC are most
        of a hit's lookup otherwise). An object read from another tier is verified, then
        kept in the CPU tier, as LMCache's own reads keep it.

        Workaround: reads go to each tier here, not through ``StorageManager.get``, which
        copies what it reads into the CPU tier before we can verify it (another thread
        could then take it there unverified), and with ``local_cpu: false`` into LMCache's
        staging buffer, where it is never evicted (the next read then busy-waits for
        memory forever: the engine hangs).
        """
        out: list = [(None, None)] * len(wanted)
        keys = [self.key(kind, chunk_hash) for kind, chunk_hash, _ in wanted]
        clears = self.clears
        for tier in self.tiers:
            todo = [i for i, (obj, _) in enumerate(out) if obj is None]
            if not todo or past(deadline):
                break
            if not tier.usable():
                continue
            fetched = self._fetch(tier, [keys[i] for i in todo], [wanted[i] for i in todo], deadline)
            if tier.memory:  # a use, for its eviction (the other tiers count their own reads)
                tier.touch([keys[i] for i, got in zip(todo, fetched) if got is not None and not isinstance(got, str)])
            for i, got in zip(todo, fetched):
                if isinstance(got, str):  # there but unreadable (e.g. truncated) or damaged
                    self._drop(*wanted[i][:2], got)
                elif got is not None:  # verified
                    if not tier.memory and self._memory is not None:
                        self._keep_in_memory(keys[i], got, clears)
                    out[i] = (got, tier.label)
        for tier in self.tiers:  # the fleet's tier hears of hits the others served (redis.md#eviction-policy)
            if not tier.local and tier.usable():
                tier.touch([keys[i] for i, (obj, label) in enumerate(out) if obj is not None and label != tier.label])
        return out

    def _keep_in_memory(self, key, obj, clears: int) -> None:
        """Keep an object read from another tier in the CPU tier, unless the local tiers were
        cleared since the read began (``clears``: what ``self.clears`` was then): a lookup's
        fetch past its deadline, or an asynchronous load, would otherwise put back after a
        cache reset an object the reset removed from disk. The caller still gets the object:
        a load promised before the reset is kept, as the reset promises."""
        with self._clear_fence:
            if self.clears == clears:
                self._memory.keep(key, obj, self._on_stored(self._memory))

    def _fetch(self, tier: Tier, keys: list, wanted: list, deadline: Optional[float]) -> list:
        """``tier.fetch_many`` with each object checked as it arrives; a tier that reads into new
        memory is given objects from free memory in one batched allocation per size first
        (``_allocate_free``)."""
        sizes = [payload_bytes for _, _, payload_bytes in wanted]

        def check(n: int, obj) -> Optional[str]:
            return self._damage(obj, *wanted[n], trusted=tier.trusted)

        if not tier.reads_into_new_memory:
            return tier.fetch_many(keys, [self._object_bytes(n) for n in sizes], lambda n: None, check, deadline)
        ready = self._allocate_free(sizes)
        given: set = set()
        no_room: set = set()  # in the tier, but nothing evictable to read them into

        def allocate(n: int):  # the fetch owns what it is given (and may ask again after a retry)
            obj = ready[n] if n not in given else None
            given.add(n)
            obj = obj if obj is not None else self.allocate(sizes[n])
            if obj is None:
                no_room.add(n)
            return obj

        got: list = []
        try:
            got = tier.fetch_many(keys, [self._object_bytes(n) for n in sizes], allocate, check, deadline)
            return got
        finally:
            for n, obj in enumerate(ready):
                if obj is not None and n not in given:  # not in the tier after all
                    release(obj)
            missed = sum(1 for n in no_room if n >= len(got) or got[n] is None)  # (a retry may have read it)
            if missed:
                with self._counts_lock:
                    self._not_read_no_memory += missed
                logger.info("LMCacheHMA: no CPU memory to read %d objects from %s into; they are misses now",
                            missed, tier.label)

    def _damage(self, obj, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int,
                trusted: bool = False) -> Optional[str]:
        """Why ``obj`` is not the intact object of (kind, chunk hash), or None."""
        # on the object's bytes: a tensor view per object cost more than the CRC pass
        try:
            dtype = obj.get_dtype()
            if dtype != self.dtype:
                raise IntegrityError(f"object has dtype {dtype}, expected {self.dtype}")
            raw, expected = obj.byte_array, self._object_bytes(payload_bytes)
            if raw.nbytes != expected:
                raise IntegrityError(f"object has {raw.nbytes} bytes, expected {expected}")
            verify_bytes(raw, self.namespace.fingerprint, chunk_hash, kind, check_crc=self.verify_checksums,
                         secret=self.namespace.secret, trusted=trusted)
        except (IntegrityError, RuntimeError) as exc:
            return str(exc)
        return None

    def _drop(self, kind: ObjectKind, chunk_hash: bytes, why) -> None:
        """Count and remove a damaged object from every tier."""
        self.integrity_failures += 1
        logger.warning("LMCacheHMA: dropping %s chunk %s: %s", kind.name, chunk_hash.hex()[:16], why)
        # Under the key computed here (this namespace's, keyed by the shared secret if any),
        # never a name a tier gave: an object whose MAC could not even be checked (one too
        # long to read) is removed only where this deployment would look for it.
        self.remove(kind, chunk_hash)

    def remove(self, kind: ObjectKind, chunk_hash: bytes, remote: bool = True) -> None:
        """Remove an object from every tier (local tiers only when ``remote`` is False)."""
        key = self.key(kind, chunk_hash)
        for tier in self.tiers:
            if remote or tier.local:
                tier.remove(key)
                if not tier.local and self.events is not None:  # local tiers report their own (watch)
                    self.events.removed(tier.label, key)

    def new_generation(self, weights: Optional[int] = None) -> None:
        """A cache reset begins: from now on nothing read before it reaches a local tier, nothing
        gathered before it any tier (``commit_many``). ``weights``: the weights generation objects
        are named in from now on: every key changes, so no tier (Redis included) serves an object
        named before, and the store's lookups and writes meet only those of instances in the same
        generation (docs/design.md#resets-and-weight-updates)."""
        with self._clear_fence:
            self.clears += 1
            if weights is not None and weights != self.namespace.generation:
                self.namespace = dataclasses.replace(self.namespace, generation=weights)
                self.keys.set_namespace(self.namespace)
                logger.info("LMCacheHMA: objects are named in weights generation %d from now on", weights)

    @property
    def generation(self) -> int:
        """The weights generation objects are named in (``Namespace.generation``)."""
        return self.namespace.generation

    def clear_local(self) -> int:
        """Remove every object of this namespace and rank from the local tiers (nothing else:
        another deployment's objects in a shared directory stay). Returns how many. Shared
        tiers are not cleared: their objects are the fleet's."""
        with self._clear_fence:
            self.clears += 1
            return sum(tier.clear(self.keys.ours) for tier in self.tiers if tier.local)

    # KV cache events --------------------------------------------------------
    def watch(self, events) -> None:
        """Tell ``events`` (``worker.tier_events``) what becomes durable in each tier (the puts
        the tiers complete) and what leaves it (evictions, removals)."""
        self.events = events
        for tier in self.tiers:
            tier.observe_removals(lambda key, label=tier.label: events.removed(label, key))

    def _on_stored(self, tier: Tier):
        return None if self.events is None else self.events.put_callback(tier.label)

    def writes_pending(self) -> bool:
        """Whether a tier is still writing (stores not durable yet)."""
        return any(tier.writes_pending() for tier in self.tiers)

    def counters(self) -> dict:
        """The tiers' counters (non-zero ones)."""
        out: dict = {}
        for tier in self.tiers:
            out.update(tier.counters())
        with self._counts_lock:
            not_read = self._not_read_no_memory
        if not_read:
            out["objects_not_read_no_memory"] = out.get("objects_not_read_no_memory", 0) + not_read
        return out

    def gauges(self) -> dict:
        out: dict = {}
        for tier in self.tiers:
            out.update(tier.gauges())
        return out

    def _object_bytes(self, payload_bytes: int) -> int:
        return object_elems(payload_bytes, self.dtype) * self.dtype.itemsize

    def close(self) -> None:
        """Close the tiers, never waiting more than a few seconds; the disk tier's writes in
        flight land first.

        Workaround: LMCache's ``StorageManager.close()`` can hang forever (with the Redis
        remote backend its connector awaits a blocking executor shutdown on its own event
        loop), and its event-loop thread is not a daemon, so the process could not exit
        either. The tiers close first (a remote tier closes LMCache's connector); the rest
        runs on a daemon thread with a timeout.
        """
        if self.closed:
            return
        self.closed = True
        if self._memory is not None:  # freed now, not by GC (which can deadlock: open_storage_manager)
            self._memory.clear(lambda key: True)
        for tier in self.tiers:
            tier.close(_CLOSE_TIMEOUT_S / 2)
        if self.writes_pending():
            # Workaround: LMCache's ``StorageManager.close()`` closes its CPU backend, which frees
            # the memory allocator, before the disk backend, whose writes in flight still read
            # their objects from that memory. Symptom: a segfault in the disk writer's
            # ``write_file`` when a store closes while it writes. Past the deadline LMCache's
            # backends stay open (their memory is freed at exit, not under the writes) and only
            # its event loop stops, whose thread would keep the process from exiting: writes
            # already running finish (the interpreter joins their threads at exit); writes still
            # queued on that loop are not made (no file: a miss, never a damaged object).
            logger.warning("LMCacheHMA: disk writes still under way after %.0f s; LMCache's storage "
                           "is left open for them", _CLOSE_TIMEOUT_S / 2)
            lmcache_compat.stop_storage_loop(self._manager)
            return
        t = threading.Thread(target=self._manager.close, name="lmcache-hma-close", daemon=True)
        t.start()
        t.join(_CLOSE_TIMEOUT_S)
        if t.is_alive():
            logger.warning("LMCacheHMA: LMCache storage did not close within %.0f s", _CLOSE_TIMEOUT_S)
        else:
            lmcache_compat.close_storage_loop(self._manager)


def past(deadline: Optional[float]) -> bool:
    """Whether ``deadline`` (``time.monotonic()``, None: none) has passed."""
    return deadline is not None and time.monotonic() >= deadline
