"""Answering the scheduler's lookups on the worker (the lookup server's thread): which
chunks hit, and holding their objects for a synchronous load."""

from __future__ import annotations

import time
from typing import Optional

from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.kinds import ObjectKind, slowest_tier
from lmcache_hma.core.metadata import hit_objects
from lmcache_hma.log import get_logger
from lmcache_hma.worker.held import Hold, release_all

logger = get_logger(__name__)


class LookupAnswers:
    """The ``WorkerHalf`` part that answers lookups (``worker.lookup_server`` calls it).

    Uses the worker's ``config``, ``layout``, ``store``, ``writer``, ``held``, ``disabled``,
    ``faults``, ``tier_events`` and (to let stores land before a reset) ``_gathering``."""

    def _answer_lookup(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
                       deadline: Optional[float] = None) -> tuple[int, bool, tuple[str, ...]]:
        """(chunks of ``hashes`` (chunks ``first, ...``) that can be restored, whether their
        objects are now held for ``req_id`` under ``lookup``, the tier each of them is in).

        Wherever they are (CPU memory, disk, Redis), a hit's objects are fetched and verified
        here and held, so the scheduler can promise a synchronous load: no engine step waits
        for the fetch, and a damaged object shortens the hit instead of failing the load.
        Not past the budget (then an asynchronous load), nor when the answer would come
        within ``LATE_S`` (or a quarter of the timeout) of the scheduler's ``deadline``
        (``time.monotonic``; it may have given up on the answer, and nobody would take what
        is held).
        """
        answer = self._find_hit(req_id, lookup, first, hashes, deadline)
        if self.faults:  # TEST ONLY: the answer reaches the scheduler late
            self.faults.delay_answer()
        return answer

    def _find_hit(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
                  deadline: Optional[float]) -> tuple[int, bool, tuple[str, ...]]:
        if self.disabled:
            return 0, False, ()
        if self.held is not None:
            hold = self.held.reuse(req_id, lookup, first, hashes)
            if hold is not None:  # vLLM asks again (it could not allocate): what is held still serves
                return len(hold.hashes), True, hold.tiers
            self.held.release(req_id, lookup - 1)  # a new lookup supersedes the earlier ones
        for _ in range(2):  # a damaged object is dropped by the fetch: look again once
            tiers = self._stored_prefix(hashes)
            chunks = len(tiers)
            if chunks == 0 or self.held is None or (self.faults and self.faults.forces_async):
                return chunks, False, tiers
            refs = hit_objects(first, hashes[:chunks], self.layout.has_sliding, self.layout.has_state)
            sizes = [self._payload_bytes(r.kind, r.chunk) for r in refs]
            if not self.held.room_for(sum(sizes)):
                return chunks, False, tiers
            got = self.store.get_many([(r.kind, r.chunk_hash, size) for r, size in zip(refs, sizes)])
            objects = {(r.kind, r.chunk_hash): pair for r, pair in zip(refs, got) if pair[0] is not None}
            if len(objects) < len(refs):
                release_all(objects)
                continue
            late = min(self.LATE_S, self.config.lookup_timeout_s / 4)
            if deadline is not None and time.monotonic() > deadline - late:
                logger.warning("LMCacheHMA: fetching the hit of %s took until %.2f s before the "
                               "lookup's deadline; not held", req_id, deadline - time.monotonic())
                release_all(objects)
                return chunks, False, tiers
            hold = Hold(lookup, first, tuple(hashes[:chunks]), objects, sum(sizes), tiers)
            return chunks, self.held.hold(req_id, hold), tiers
        return 0, False, ()

    def _stored_prefix(self, hashes: list[bytes]) -> tuple[str, ...]:
        """The tier of each chunk of the longest restorable prefix of ``hashes`` (``longest_hit``):
        where its full-attention object is, or, for the hit's last chunk, the slowest tier of it
        and the boundary objects (sliding tail, recurrent states) a hit there loads. Every kind
        of every chunk is asked in one pass (one round trip to Redis)."""
        boundary_kinds = [k for k, needed in ((ObjectKind.TAIL, self.layout.has_sliding),
                                              (ObjectKind.STATE, self.layout.has_state)) if needed]
        found = self.store.present_kinds((ObjectKind.FULL, *boundary_kinds), hashes)
        boundaries = [all(flags) for flags in zip(*(found[k] for k in boundary_kinds))] if boundary_kinds else None
        chunks = longest_hit(found[ObjectKind.FULL], boundaries)
        tiers = list(found[ObjectKind.FULL][:chunks])
        if chunks:
            tiers[-1] = slowest_tier(tiers[-1], *(found[k][chunks - 1] for k in boundary_kinds))
        return tuple(tiers)

    # a reset waits at most this share of hma_lookup_timeout_s for the stores under way
    RESET_WAIT_SHARE = 0.5

    def reset(self) -> bool:
        """Empty this worker's CPU and disk tiers of this namespace (vLLM's ``reset_prefix_cache``
        with the connector, through the lookup server's thread): held hits first.

        Stores under way (being gathered, queued for the writer, being written) are let land
        first, for up to ``RESET_WAIT_SHARE`` of the scheduler's wait for the answer: one that
        landed after the reset would be a hit nobody expects after it. Past that the reset goes
        on, with a warning."""
        if self.held is not None:
            self.held.release_everything()
        budget_s = self.RESET_WAIT_SHARE * self.config.lookup_timeout_s
        deadline = time.monotonic() + budget_s
        while self._stores_under_way() and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._stores_under_way():
            logger.warning("LMCacheHMA: cache reset: stores still under way after %.1f s may land after it",
                           budget_s)
        if self.tier_events is not None:
            self.tier_events.cleared()
        removed = self.store.clear_local()
        logger.info("LMCacheHMA: cache reset: %d objects removed from CPU memory and disk", removed)
        return True

    def _stores_under_way(self) -> bool:
        """Whether a store that started before now has not landed yet (nor been dropped)."""
        gathering = self._gathering
        return ((gathering is not None and not gathering.done()) or self.writer.pending() > 0
                or self.store.writes_pending())
