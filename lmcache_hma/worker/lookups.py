"""Answering the scheduler's lookups on the worker (the lookup server's thread): which
chunks hit, and holding their objects for a synchronous load."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional, Sequence

from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.kinds import ObjectKind, slowest_tier
from lmcache_hma.core.lookup_wire import Found
from lmcache_hma.core.metadata import ObjectRef, hit_objects, turn_hit_objects
from lmcache_hma.core.objects import payload_of
from lmcache_hma.core.turn_ends import MARK_BYTES, decode_marks
from lmcache_hma.log import get_logger
from lmcache_hma.store.chunk_store import past
from lmcache_hma.store.lmcache_storage import flat, release
from lmcache_hma.worker.held import Hold, release_all

logger = get_logger(__name__)


class LookupAnswers:
    """The ``WorkerHalf`` part that answers lookups (``worker.lookup_server`` calls it).

    Uses the worker's ``config``, ``layout``, ``store``, ``writer``, ``held``, ``disabled``,
    ``faults``, ``stats``, ``tier_events`` and (to let stores land before a reset) ``gathers_under_way``."""

    def _answer_lookup(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
                       deadline: Optional[float] = None, turn_limit: int = 0,
                       turn_prefix: Optional[bytes] = None, turns: Optional[tuple] = None,
                       settle: Sequence[bytes] = ()) -> "Found":
        """How far ``hashes`` (chunks ``first, ...``) hit (``Found``): whole chunks, whether
        their objects are now held for ``req_id`` under ``lookup``, the tier each of them is in.
        Wherever they are (CPU memory, disk, Redis), a hit's objects are fetched and verified
        here and held, so the scheduler can promise a synchronous load: no engine step waits
        for the fetch, and a damaged object shortens the hit instead of failing the load.
        Not past the budget, nor when the fetch does not end ``LATE_S`` (or a quarter of the
        timeout) before the scheduler's ``deadline`` (``time.monotonic``; it may have given
        up on the answer, and nobody would take what is held): the fetch is given only that
        much time, and a hit it could not bring in by then is answered as a hit loaded
        asynchronously (fetched in a later step while the engine goes on scheduling); so is a
        hit still stored whose fetch came short twice (no CPU memory to fetch it into now).

        Turn ends (``core.turn_ends``): with ``turn_limit``, a marker after the run of whole
        chunks (``turn_prefix``: chunk ``first - 1``'s digest, for a run of none) is read and
        its offsets of turn ends up to token ``turn_limit`` answered, holding nothing: the scheduler asks again with ``turns`` = ``(chunk,
        [(end, key), ...])``, and the longest of those stored after a run reaching ``chunk``
        is the hit. ``settle``: the digests the markers (or, for an answer ending on a chunk
        boundary, the tails) of turn ends the scheduler sent are keyed by; one may still be in the
        store writer's queue, and lands first, as do the chunks asked about that are queued
        (``_let_land``: those objects' own numbers, not the backlog queued behind them), for
        at most half the time the fetch has (see above), so the marker read and the fetch keep
        the rest.
        """
        answer = self._find_hit(req_id, lookup, first, hashes, deadline, turn_limit, turn_prefix, turns, settle)
        if self.faults:  # TEST ONLY: the answer reaches the scheduler late
            self.faults.delay_answer()
        return answer

    def _find_hit(self, req_id: str, lookup: int, first: int, hashes: list[bytes], deadline: Optional[float],
                  turn_limit: int = 0, turn_prefix: Optional[bytes] = None,
                  turns: Optional[tuple] = None, settle: Sequence[bytes] = ()) -> "Found":
        if self.disabled:
            return Found(0, False, ())
        hold_by = None if deadline is None else deadline - min(self.LATE_S, self.config.lookup_timeout_s / 4)
        if self.writer is not None:
            self._let_land(req_id, hold_by, hashes, settle)
        if self.held is not None:
            hold = self.held.reuse(req_id, lookup, first, hashes, turn_ends=bool(turn_limit or turns))
            if hold is not None:  # vLLM asks again (it could not allocate): what is held still serves
                return Found(len(hold.hashes), True, hold.tiers, turn_end=hold.turn_end,
                             turn_on_tail=hold.turn_on_tail)
            self.held.release(req_id, lookup - 1)  # a new lookup supersedes the earlier ones
        for attempt in range(2):  # a damaged object is dropped by the fetch: look again once
            run, tiers, turn, mark = self._stored_prefix(first, hashes, turn_prefix, bool(turn_limit), turns)
            marks_unread = False
            if mark is not None:
                base = (first + run) * self.layout.chunk_size
                read = self._read_marks(mark, hold_by)
                marks_unread = not read  # late or damaged: a hold without its turn ends
                # negative: a turn object on_tail (never written in the parallelism-free format)
                offsets = [o for o in read if base + abs(o) <= turn_limit and (o > 0 or self.canonical is None)]
                if offsets:
                    return Found(len(tiers), False, tiers, marks=tuple(offsets), mark_chunk=first + run, run=run)
            chunks = len(tiers) - bool(turn)
            if not tiers or self.held is None or (self.faults and self.faults.forces_async):
                return Found(chunks, False, tiers, turn_end=turn.end if turn else 0,
                             turn_on_tail=bool(turn and turn.on_tail), run=run)
            if turn is not None:
                refs = turn_hit_objects(first, hashes[:chunks], turn, self.layout.has_state)
            else:
                refs = hit_objects(first, hashes[:chunks], self.layout.has_sliding, self.layout.has_state)
            refs = [ref for ref, _ in self._stored_refs(refs)]  # hma_share_parallel_shapes: their parts
            sizes = [self._payload_bytes(r.kind, r.chunk, r.end, r.on_tail) for r in refs]
            if self.canonical is None:  # (parts of the parallelism-free format have no lineage)
                self.store.note_lineage(refs, sizes)  # what is read from disk or Redis stays in CPU memory
            found = Found(chunks, False, tiers, turn_end=turn.end if turn else 0,
                          turn_on_tail=bool(turn and turn.on_tail), run=run)
            if not self.held.room_for(sum(sizes)):
                return found
            got = self._fetch_in_time([(r.kind, r.chunk_hash, size) for r, size in zip(refs, sizes)], hold_by)
            objects = {(r.kind, r.chunk_hash): pair for r, pair in zip(refs, got or ()) if pair[0] is not None}
            if got is None or past(hold_by):  # not fetched in time: the load fetches it, a step later
                self.stats["lookups_not_held_in_time"] += 1
                logger.info("LMCacheHMA: the hit of %s (%d chunks, %d bytes) was not fetched within the "
                            "lookup's time; it is loaded asynchronously", req_id, chunks, sum(sizes))
                release_all(objects)
                return found
            if len(objects) < len(refs):
                release_all(objects)
                if attempt:  # still short, though stored: no CPU memory to fetch into now (what
                    # is held and read fills it): loaded asynchronously, as past the held budget
                    return found
                continue
            hold = Hold(lookup, first, tuple(hashes[:chunks]), objects, sum(sizes), tiers, deadline=hold_by,
                        turn_end=found.turn_end, turn_on_tail=found.turn_on_tail, marks_unread=marks_unread)
            return found._replace(held=self.held.hold(req_id, hold))
        return Found(0, False, ())  # not reached

    def _read_marks(self, prefix: bytes, by: Optional[float]) -> list[int]:
        """The offsets the marker after ``prefix`` lists ([] if it is gone, damaged or late)."""
        got = self._fetch_in_time([(ObjectKind.TURNMARK, prefix, MARK_BYTES)], by)
        obj = got[0][0] if got else None
        if obj is None:
            return []
        try:
            offsets = decode_marks(payload_of(flat(obj)), self.layout.chunk_size)
        finally:
            release(obj)
        self.turn_marks.learn(prefix, offsets)  # a rewrite here keeps them (core.turn_ends)
        return offsets

    def _fetch_in_time(self, wanted: list, by: Optional[float]) -> Optional[list]:
        """``store.get_many(wanted)`` if it ends by ``by`` (``time.monotonic()``), else None.

        The fetch runs on the lookup fetch thread and this thread waits for it only until
        ``by``: a tier read that blocks (a slow disk) cannot hold the answer past the
        scheduler's deadline. A fetch that ends later gives back what it brought (the tiers
        were told ``by`` too: Redis stops reading then; what was read stays in CPU memory,
        where the load finds it)."""
        if by is None:
            return self.store.get_many(wanted)
        fetch = self._lookup_fetcher.submit(self.store.get_many, wanted, by)
        try:
            return fetch.result(timeout=max(0.0, by - time.monotonic()))
        except FutureTimeout:
            fetch.add_done_callback(_give_back_fetched)
            return None

    def _let_land(self, req_id: str, hold_by: Optional[float], hashes: Sequence[bytes],
                  settle: Sequence[bytes]) -> None:
        """Let the objects this lookup may hit that are still in the store writer's queue land
        first: the chunks asked about and the markers after them (a prompt repeated right after
        the request that computed it: its saves are queued, not stored yet; a turn end written
        last of its save, the marker) and the turn ends the scheduler sent whose
        markers ``settle`` names (each written last of its turn end: turn_ends.turn_end_save).
        Only those objects' own numbers are waited for (``StoreWriter.wait_stored``: the puts
        queued ahead of them, never the backlog behind), nothing when none is queued, and half
        the time left at most: the presence pass, the marker read and the fetch need the rest."""
        # a marker keyed by a chunk asked about too: a turn end whose save the scheduler stopped
        # naming (``TurnEndLanding`` takes one as stored three metadata after it was sent) may
        # still be queued behind a slow writer
        kinds = (ObjectKind.FULL, ObjectKind.TAIL, ObjectKind.STATE, ObjectKind.TURNMARK)
        landing = [(kind, h) for h in hashes for kind in kinds]
        landing += [(kind, d) for d in settle for kind in (ObjectKind.TURNMARK, ObjectKind.TAIL)]
        now = time.monotonic()
        by = now + self.config.lookup_timeout_s / 2 if hold_by is None else (now + hold_by) / 2
        if not self.gather_for_lookup(by, landing):  # its objects still being gathered are queued after
            logger.info("LMCacheHMA: the gathers the lookup of %s waited for did not end within half its "
                        "time", req_id)
        if not self.writer.wait_stored(by, landing):
            logger.info("LMCacheHMA: the stores the lookup of %s waited for (its chunks, the turn ends "
                        "it may hit) did not land within half its time", req_id)

    def _stored_prefix(self, first: int, hashes: list[bytes], turn_prefix: Optional[bytes], marks: bool,
                       turns: Optional[tuple]) -> tuple:
        """``(run, tiers, turn, mark)``: ``run``, the chunks of ``hashes`` with a full object, from
        the first; ``tiers``, the tier of each chunk of the longest restorable prefix
        (``longest_hit``): where its full-attention object is, or, for the hit's last chunk, the
        slowest tier of it and the boundary objects (sliding tail, recurrent states) a hit there
        loads; with a turn end hit (``turn``: its ``ObjectRef``, one of ``turns`` right after
        the run) the run's tiers and the slowest of the turn end's objects (``turn_hit_objects``). ``mark``: with ``marks``, the digest the
        marker after the run is keyed by, if there is one. Every kind of every chunk is asked
        in one pass (one round trip to Redis)."""
        boundary_kinds = [k for k, needed in ((ObjectKind.TAIL, self.layout.has_sliding),
                                              (ObjectKind.STATE, self.layout.has_state)) if needed]
        kinds = (ObjectKind.FULL, *boundary_kinds)
        pairs = [(kind, h) for kind in kinds for h in hashes]
        mark_keys = [turn_prefix, *hashes] if marks else []  # the marker after a run of i chunks: [i]
        pairs += [(ObjectKind.TURNMARK, h) for h in mark_keys if h is not None]
        candidates = turns[1] if turns is not None else []
        turn_kinds = (ObjectKind.TURN, ObjectKind.STATE) if self.layout.has_state else (ObjectKind.TURN,)
        pairs += [(kind, key) for _, key, _ in candidates for kind in turn_kinds]  # a turn end's objects
        flags = self._present(pairs)
        n = len(hashes)
        found = {kind: flags[j * n:(j + 1) * n] for j, kind in enumerate(kinds)}
        run = longest_hit([f is not None for f in found[ObjectKind.FULL]], None)
        at = len(kinds) * n
        mark = None
        if marks:
            present = dict(zip([h for h in mark_keys if h is not None], flags[at:]))
            at += len(present)
            if mark_keys[run] is not None and present.get(mark_keys[run]):
                mark = mark_keys[run]
        if turns is not None and turns[0] == first + run:
            for i, (end, key, on_tail) in enumerate(candidates):  # longest first
                where = flags[at + i * len(turn_kinds):at + (i + 1) * len(turn_kinds)]
                if on_tail and run:  # the tail at the turn end's chunk start (no run: vLLM's cache has it)
                    where = [*where, found[ObjectKind.TAIL][run - 1] if self.layout.has_sliding else None]
                if None not in where:
                    return (run, (*found[ObjectKind.FULL][:run], slowest_tier(*where)),
                            ObjectRef(ObjectKind.TURN, turns[0], key, end, on_tail), None)
        boundaries = ([all(f is not None for f in fs) for fs in zip(*(found[k] for k in boundary_kinds))]
                      if boundary_kinds else None)
        chunks = longest_hit([f is not None for f in found[ObjectKind.FULL]], boundaries)
        tiers = list(found[ObjectKind.FULL][:chunks])
        if chunks:
            tiers[-1] = slowest_tier(tiers[-1], *(found[k][chunks - 1] for k in boundary_kinds))
        return run, tuple(tiers), None, mark

    def _present(self, pairs: list) -> list:
        """``store.present_pairs(pairs)``; with hma_share_parallel_shapes an attention object is
        present where every part of this rank's KV heads is (in the slowest tier of them). The
        other ranks' parts are not asked for: a rank that misses one fails its load, and
        vLLM recomputes the request."""
        if self.canonical is None:
            return self.store.present_pairs(pairs)
        asked, counts = [], []
        for kind, h in pairs:
            keys = self._stored_keys(kind, h)
            asked += [(kind, key) for _, key in keys]
            counts.append(len(keys))
        flags, out, at = self.store.present_pairs(asked), [], 0
        for n in counts:
            got = flags[at:at + n]
            at += n
            out.append(None if None in got else slowest_tier(*got))
        return out

    # a reset waits at most this share of hma_lookup_timeout_s for the stores under way
    RESET_WAIT_SHARE = 0.5

    def reset(self) -> bool:
        """Empty this worker's CPU and disk tiers of this namespace (vLLM's ``reset_prefix_cache``
        with the connector, through the lookup server's thread), and name objects in the next
        weights generation (``ChunkStore.new_generation``: the resets so far), so that no tier,
        Redis included, serves KV computed before the reset (docs/design.md#resets-and-weight-updates).

        What a step already promised is kept: held hits stay held until their own load takes
        them (under vLLM's async scheduling the reset can come between scheduling a step with
        a synchronous load and that load) or the scheduler releases them, but serve no new
        lookup (``HeldObjects.forget_for_new_lookups``).

        Saves planned before the reset and not started yet are never stored (``resets``,
        ``Gathers.built_before_reset``). Stores under way (being gathered, queued for the writer,
        being written) are let land first, for up to ``RESET_WAIT_SHARE`` of ``hma_lookup_timeout_s``: one that landed
        after the reset would be a hit nobody expects after it. Past that the reset goes on,
        with a warning. The scheduler waits ``RESET_ANSWER_TIMEOUTS`` lookup timeouts for
        the answer (``scheduler.lookup_client``), which covers the wait and the removal.

        With KV cache events on, each removed object is announced as removed by the tiers'
        own removal records, then ``cleared`` marks the reset's end (no ``AllBlocksCleared``:
        vLLM's own cache, and Redis, may still hold what a router knows of)."""
        with self.reset_fence:  # saves planned before now are under way, or will never start
            self.resets += 1
            # what they read reaches no tier after now, and objects are named in the next weights
            # generation: nothing named before serves a lookup (Redis included)
            self.store.new_generation(weights=self.resets)
        if self.held is not None:
            self.held.forget_for_new_lookups()
        self.turn_marks.clear()
        budget_s = self.RESET_WAIT_SHARE * self.config.lookup_timeout_s
        deadline = time.monotonic() + budget_s
        while self._stores_under_way() and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._stores_under_way():
            logger.warning("LMCacheHMA: cache reset: stores still under way after %.1f s are not stored "
                           "(no tier takes KV read before the reset)", budget_s)
        removed = self.store.clear_local()
        if self.tier_events is not None:
            self.tier_events.cleared()
        logger.info("LMCacheHMA: cache reset: %d objects removed from CPU memory and disk", removed)
        return True

    def _stores_under_way(self) -> bool:
        """Whether a store that started before now has not landed yet (nor been dropped)."""
        return self.gathers_under_way() or self.writer.pending() > 0 or self.store.writes_pending()


def _give_back_fetched(fetch: Future) -> None:
    """Release the objects of a lookup's fetch that ended after the lookup answered."""
    if fetch.cancelled() or fetch.exception() is not None:
        return
    release_all({n: pair for n, pair in enumerate(fetch.result()) if pair[0] is not None})
