"""The scheduler half: lookups, per-request tracking, the step's metadata.

This class runs in vLLM's scheduler (EngineCore) process. It never touches KV
bytes: it keys each request's chunks (``request_keys``: prompt and answer), asks the
worker's lookup server how far a hit goes, plans which objects to load into which
blocks, and has each step's saves planned (``save_plan``: a chunk is stored in the step
that completes it, prefill or decode) and each finished request's turn end
(``turn_ends``).

A lookup (``get_num_new_matched_tokens``) goes in four steps: ``_plan`` decides what to
ask (a ``LookupPlan``; or ``WAIT`` for a turn end on its way: ``turn_end_landing``),
``_ask`` asks the worker within one deadline, ``_take`` records the answer as the
request's hit, ``_matched`` gives vLLM its two numbers (or None while a decode instance
waits for its producer's promise: ``promises``).

A hit whose objects the worker holds (``worker.held``) is promised as a
synchronous load: the request computes the rest in the same step. Any other hit
is an asynchronous load: the request waits a step while the worker loads, and a
failed load is reported as ``failed_recving`` so vLLM recomputes the request
(vLLM 0.32 refuses block-level load errors, ``invalid_block_ids``, for models with
several KV cache groups).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from lmcache_hma.config.settings import HMAConfig
from lmcache_hma.config.transfer_role import BOTH, TransferRole
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import NULL_BLOCK_ID, HybridLayout
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.scheduler.admission import Admission
from lmcache_hma.scheduler.kept_blocks import gives_back
from lmcache_hma.scheduler.lookup_client import LookupClient
from lmcache_hma.scheduler.promises import PromiseWaits, loadable_params, producer_promise, promise_of
from lmcache_hma.scheduler.request_keys import RequestKeys
from lmcache_hma.scheduler.request_state import RequestState
from lmcache_hma.scheduler.save_plan import StepSaves
from lmcache_hma.scheduler.turn_end_landing import WAIT, TurnEndLanding
from lmcache_hma.scheduler.turn_ends import turn_candidates, turn_end_save
from lmcache_hma.scheduler.vllm_fields import new_blocks, skips_save
from lmcache_hma.core.metadata import (HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, hit_objects,
                                       turn_hit_objects)
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class LookupPlan:
    """What a lookup asks for one request (``SchedulerHalf._plan``)."""

    first: int  # whole chunks vLLM's own cache holds: the lookup starts there
    last: int  # chunks with keys up to ``limit``: the lookup asks for [first, last)
    limit: int  # tokens a hit may reach (at least one left to compute)
    turns: bool  # turn ends may be asked for (the digest before ``first`` is known)
    settle: tuple[bytes, ...]  # markers of turn ends on their way, to let land first (turn_end_landing)
    chunk_size: int

    @property
    def asks(self) -> bool:
        """Whether there is anything to ask: chunks past vLLM's cache, or a turn end inside the
        chunk after them."""
        return self.last > self.first or (self.turns and self.last == self.first and bool(self.first)
                                           and self.limit > self.first * self.chunk_size)


class SchedulerHalf:
    def __init__(self, config: HMAConfig, layout: HybridLayout, namespace: Namespace, engine_id: str,
                 lookahead: int = 0, role: TransferRole = BOTH):
        self.config = config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.hasher = ChunkHasher(namespace)
        self.client = LookupClient(socket_address(engine_id), config.lookup_timeout_s)
        self.requests: dict[str, RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._turn_saves: list[SaveSpec] = []  # finished requests' turn ends, for the next step
        # kv_role (config.transfer_role): a producer never looks up, a consumer stores only answers
        self.role = role
        # hma_store_answers: answer chunks get keys and are stored (where this instance stores them)
        self.answers = config.answers_for(layout.has_state) and role.stores_answers
        # Turn ends (scheduler.turn_ends): stored with answers (a producer's at each prompt's
        # L - 1: save_plan); looked up wherever they may be stored (a decode instance: by its
        # producers).
        self.turn_ends = self.answers
        self.finds_turn_ends = config.answers_for(layout.has_state) or role.name == "kv_consumer"
        # vLLM keeps a finished request's blocks for its turn end (the connector sets it where its
        # runner writes KV before the connector's first call of a step: turn_ends)
        self.keep_blocks_for_turn_ends = False
        self.turn_saves_pending: set[str] = set()  # requests whose blocks vLLM keeps for them
        self._kept: dict[str, Any] = {}  # those requests (vLLM's), by id: give_back_kept_blocks
        # Turn ends not surely stored yet, and whether a prompt waits for one (turn_end_landing)
        self.landing = TurnEndLanding(self.chunk_size, config.lookup_timeout_s)
        self.on_turn_save = None  # KV cache events: called with (request, refs) of each turn end
        self._released: list[tuple[str, int]] = []  # (request, lookups up to this number) not to be used
        self._lookups = 0  # lookups sent, numbering them
        self._reset = False  # a cache reset for the next step's metadata
        self._epoch = 0  # cache resets so far (HMAConnectorMetadata.epoch)
        self._kv_cache_manager = None
        self.checkpoint_interval = layout.checkpoint_interval(config.checkpoint_interval)
        self.admission = Admission(config.tail_admission, self.chunk_size, self.checkpoint_interval,
                                   config.checkpoint_interval or layout.tail_interval(),
                                   spare=config.spares_tails)
        self.promises = PromiseWaits(self.chunk_size, config.lookup_timeout_s)  # kv_consumer
        self.saves = StepSaves(layout, role, self.admission, self.turn_ends, lookahead)  # each step's saves

    @property
    def lookahead(self) -> int:
        """Prompt tokens after a chunk that its key covers (a draft model's KV: config.speculative)."""
        return self.saves.lookahead

    @lookahead.setter
    def lookahead(self, tokens: int) -> None:
        self.saves.lookahead = tokens

    def bind_kv_cache_manager(self, manager) -> None:
        """vLLM's ``KVCacheManager``: the connector reads block tables from it, and gives back the
        blocks vLLM keeps for turn ends before a reset of its prefix cache that resets the
        connector too and succeeds once they are back (``scheduler.kept_blocks``: vLLM resets its
        own cache first, which fails while they are in use). The manager's reset is wrapped."""
        self._kv_cache_manager = manager
        reset = getattr(manager, "reset_prefix_cache", None)
        if reset is None or getattr(reset, "gives_back_kept_blocks", False):
            return

        def reset_prefix_cache(*args, **kwargs):
            if gives_back(manager, self._kept):  # vLLM's Scheduler.reset_prefix_cache is the caller
                self.give_back_kept_blocks()
            return reset(*args, **kwargs)

        reset_prefix_cache.gives_back_kept_blocks = True
        manager.reset_prefix_cache = reset_prefix_cache

    def give_back_kept_blocks(self) -> int:
        """Free the blocks vLLM keeps for turn ends now, storing none of those turn ends (a reset
        that resets the connector is coming: what they hold may be stale by the time a step
        could gather it). Each request is still reported in ``finished_sending`` (its save goes
        out without objects), where vLLM's second free of it finds nothing left to free; it is
        no longer a pending free (``has_pending_block_frees``: vLLM may preempt for room now).
        Returns how many requests."""
        if not self._kept:
            return 0
        for request in self._kept.values():
            self._kv_cache_manager.free(request)  # idempotent: vLLM pops the request's blocks
        self._drop_turn_saves(set(self._kept))
        self.turn_saves_pending.difference_update(self._kept)
        n, self._kept = len(self._kept), {}
        logger.info("LMCacheHMA: a cache reset gave back the blocks of %d finished requests; their turn "
                    "ends are not stored", n)
        return n

    def _drop_turn_saves(self, req_ids: Optional[set] = None) -> None:
        """Send none of the queued turn ends (of ``req_ids``; None: all): a request whose blocks
        vLLM keeps goes out without objects, so the workers report it in ``finished_sending``."""
        out = []
        for spec in self._turn_saves:
            if req_ids is not None and spec.req_id not in req_ids:
                out.append(spec)
                continue
            self.landing.dropped(spec)  # no lookup waits for it
            if spec.blocks_kept:
                out.append(SaveSpec(spec.req_id, (), [], finished=True, blocks_kept=True))
        self._turn_saves = out

    # lookup -----------------------------------------------------------------
    def _state(self, request) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            keys = RequestKeys(request, self.hasher, self.lookahead, self.answers)
            state = RequestState(request, keys, skip_save=skips_save(request), promise=promise_of(request, self.role))
            self.requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """vLLM's question at admission: how many tokens past ``num_computed_tokens`` (its own
        cache's) the store supplies, and whether they load asynchronously (a step later); None:
        ask again at the next step. Decide what to ask (``_plan``), ask within one deadline
        (``_ask``), and turn the answer into the request's hit (``_take``) and vLLM's two
        numbers (``_matched``)."""
        state = self._state(request)  # tracked whatever the role: its saves are planned from it
        plan = self._plan(state, num_computed_tokens)
        if plan is None:
            return 0, False
        if plan is WAIT:
            return None, False  # a turn end it would hit is on its way: vLLM asks again at its next step
        self._take(state, plan, self._ask(state, plan) if plan.asks else None)
        return self._matched(state, plan, num_computed_tokens)

    def _plan(self, state: RequestState, num_computed_tokens: int) -> Union["LookupPlan", str, None]:
        """What to ask the worker for this request (a ``LookupPlan``), ``WAIT``
        (``turn_end_landing``), or None: it looks up nothing (a kv_producer stores and a decode
        instance loads; a failed load is recomputed from scratch)."""
        if not self.role.loads or state.load_failed:
            return None
        first = num_computed_tokens // self.chunk_size
        # A hit must leave at least one token to compute.
        limit = min(state.request.num_prompt_tokens, state.request.num_tokens - 1)
        last = limit // self.chunk_size
        if last > first:
            last = state.keys.ensure(last)
        # Turn ends (turn_ends) end inside a chunk: after the last whole chunk, or inside an earlier
        # one where the run of whole chunks stops (so also where limit is a chunk boundary); they
        # need the digest before first.
        turns = self.finds_turn_ends and (not first or state.keys.ensure(first) == first)
        settle = self.landing.decide(state, max(first, last), limit, self._turn_saves) if turns else None
        if settle == WAIT:
            return WAIT
        return LookupPlan(first, last, limit, turns, tuple(settle or ()), self.chunk_size)

    def _ask(self, state: RequestState, plan: "LookupPlan"):
        """The worker's answer to ``plan``: the chunks, and where a marker follows their run, a
        second lookup for the turn ends it lists; one deadline over both (vLLM's ``schedule()``
        waits for them)."""
        deadline = time.monotonic() + self.config.lookup_timeout_s
        turn_prefix = state.hashes[plan.first - 1] if plan.turns and plan.first else None
        answer = self._lookup(state, plan.first, plan.last, turn_limit=plan.limit if plan.turns else 0,
                              turn_prefix=turn_prefix, settle=plan.settle)
        if answer.marks:  # a marker after the run of whole chunks: ask for its turn ends
            candidates = turn_candidates(state, answer.mark_chunk, answer.marks, plan.limit)
            if candidates and time.monotonic() < deadline:
                self._released.append((state.request.request_id, state.lookup))
                answer = self._lookup(state, plan.first, plan.last, turns=(answer.mark_chunk, candidates),
                                      deadline=deadline)
        return answer

    def _take(self, state: RequestState, plan: "LookupPlan", answer) -> None:
        """Record ``answer`` (None: nothing was asked) as the request's hit: ``hit``, ``held``,
        the tiers, the turn end it reaches, what the store had, the tails it loads."""
        found, state.held, state.hit_tiers, state.turn = 0, False, (), None
        if answer is not None:
            found, state.held = answer.chunks, answer.held
            state.stored_run = plan.first + max(answer.run, found)
            if self.layout.has_sliding:
                self.admission.found_branch(state.hashes, plan.first + found, state.stored_run)
            state.hit_tiers = answer.tiers[:answer.chunks + bool(answer.turn_end)]
            key = state.keys.turn_digest(answer.turn_end, answer.turn_on_tail) if answer.turn_end else None
            if key is not None:
                state.turn = ObjectRef(ObjectKind.TURN, answer.turn_end // self.chunk_size, key, answer.turn_end,
                                       answer.turn_on_tail)
                if not state.turn_counted:  # turn ends under its first chunk are read (scheduler.admission)
                    state.turn_counted = True
                    self.admission.turn_end_hit(state.hashes[0])
            elif answer.turn_end:  # cannot be: the candidates were this request's own keys
                state.hit_tiers = state.hit_tiers[:found]
            elif plan.turns and not state.turn_counted and self.admission.missed_turn_end(
                    state.hashes, plan.limit, state.keys.turn_digest) is not None:
                state.turn_counted = True  # it extends a turn end not stored: turn ends here are read
        state.hit = state.turn.end if state.turn else (plan.first + found) * self.chunk_size
        if found and state.turn is None and self.layout.has_sliding:
            state.tails.add(plan.first + found - 1)  # the hit's tail is stored
        elif state.turn is not None and state.turn.on_tail and state.turn.chunk > plan.first:
            state.tails.add(state.turn.chunk - 1)  # so is the one its turn end's hit loads

    def _matched(self, state: RequestState, plan: "LookupPlan", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """vLLM's two numbers for the request's hit: tokens beyond its own cache's, and whether
        they load a step later (held objects load in this very step). None while a decode
        instance waits for what its producer promised (``scheduler.promises``)."""
        if self.promises.on_its_way(state, plan.limit, num_computed_tokens):
            self._drop_hit(state)
            return None, False  # vLLM asks again at its next step
        if state.hit <= num_computed_tokens:
            self._drop_hit(state)
            return 0, False
        return state.hit - num_computed_tokens, not state.held

    def _drop_hit(self, state: RequestState) -> None:
        """The request takes no hit now: what the worker holds for its lookup goes back."""
        if state.held:
            self._released.append((state.request.request_id, state.lookup))
        state.hit, state.held = 0, False

    def _lookup(self, state: RequestState, first: int, last: int, **turns):
        """Send lookup ``state.lookup + 1`` of chunks ``[first, last)`` (and turn ends)."""
        self._lookups += 1
        state.lookup = self._lookups
        answer = self.client.lookup(state.request.request_id, state.lookup, first, state.hashes[first:last], **turns)
        if not answer.answered:  # a late answer may still hold objects for this lookup
            self._released.append((state.request.request_id, state.lookup))
        return answer

    def hit_tokens_by_tier(self, request, num_external_tokens: int) -> dict[str, int]:
        """The last hit's ``num_external_tokens`` (those before its boundary) split by the tier
        each chunk's objects were in (``kinds.TIERS``); sums to ``num_external_tokens``."""
        state = self.requests.get(request.request_id)
        if state is None or not num_external_tokens:
            return {}
        out: dict[str, int] = {}
        start, end = state.hit - num_external_tokens, state.hit
        first = -(-end // self.chunk_size) - len(state.hit_tiers)  # a turn end's partial chunk counts
        for i, tier in enumerate(state.hit_tiers):
            lo, hi = max(start, (first + i) * self.chunk_size), min(end, (first + i + 1) * self.chunk_size)
            if hi > lo:
                out[tier] = out.get(tier, 0) + hi - lo
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is None:
            return
        load_bytes = {}
        if num_external_tokens > 0:
            start = state.hit - num_external_tokens
            table = blocks.get_block_ids()
            first, end = start // self.chunk_size, state.hit // self.chunk_size
            if state.turn is not None:
                objects = turn_hit_objects(first, state.hashes[first:end], state.turn, self.layout.has_state)
            else:
                objects = hit_objects(first, state.hashes[first:end], self.layout.has_sliding,
                                      self.layout.has_state)
            self._loads.append(LoadSpec(request.request_id, table, start, state.hit, objects, state.held,
                                        state.lookup))
            state.saved_chunks = max(state.saved_chunks, state.hit // self.chunk_size)
            state.state_floor = max(state.state_floor, state.hit)
            load_bytes = self._bytes_by_kind(objects, table, start)
        elif state.held:  # vLLM did not take the hit (e.g. a longer local one)
            self._released.append((request.request_id, state.lookup))
        state.held = False
        if num_external_tokens > 0 or not state.logged:  # once, and at every load
            state.logged = True
            self._log_request(state, num_external_tokens, load_bytes)

    def _bytes_by_kind(self, objects, table, start: int) -> dict[str, int]:
        """Bytes the worker will load, by group kind: the blocks ``plan_rows`` keeps (not null,
        not before ``start``), counted without building the rows (this is in the step's path)."""
        out = {k.value: 0 for k in GroupKind}
        for ref in objects:
            if ref.kind is ObjectKind.STATE:
                out[GroupKind.STATE.value] += self.layout.state_bytes
                continue
            for seg in self.layout.segments(ref.kind, ref.chunk, ref.end, ref.on_tail):
                g = self.layout.groups[seg.group]
                ids = table[g.index]
                first = max(seg.first_block, -(-start // g.block_size))
                end = min(seg.first_block + seg.num_blocks, len(ids))
                blocks = sum(1 for j in range(first, end) if ids[j] != NULL_BLOCK_ID)
                out[g.kind.value] += blocks * len(g.layer_names) * g.page_bytes
        return out

    def _log_request(self, state: RequestState, need_to_load: int, b: dict[str, int]) -> None:
        req = state.request
        hit = state.hit if need_to_load else 0
        all_layers = sum(g.page_bytes * len(g.layer_names) * (need_to_load // g.block_size)
                         for g in self.layout.paged_groups)
        if self.layout.has_state:  # one state per recurrent layer, as here
            all_layers += self.layout.state_bytes if need_to_load else 0
        state = (f" recurrent_state={b.get(GroupKind.STATE.value, 0)}" if self.layout.has_state else "")
        logger.info(
            "Reqid: %s, Total tokens %d, LMCache hit tokens: %d, need to load: %d, "
            "bytes to load: full_attention=%d sliding_window=%d%s (all-layers connector: %d)",
            req.request_id, req.num_tokens, hit, need_to_load,
            b.get(GroupKind.FULL.value, 0), b.get(GroupKind.SLIDING.value, 0), state, all_layers,
        )

    # per step ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> HMAConnectorMetadata:
        meta = HMAConnectorMetadata(loads=self._loads, released=self._released,
                                    new_blocks=new_blocks(scheduler_output), reset=self._reset,
                                    epoch=self._epoch)
        meta.saves, self._turn_saves = self._turn_saves, []
        self._loads, self._released, self._reset = [], [], False
        self.landing.sent(meta.saves)  # the turn ends of requests that finished (all of meta.saves so far)
        if self.role.stores:  # not a kv_consumer's: nothing it computes is stored
            meta.saves += self.saves.plan(scheduler_output, self.requests,
                                          lambda req_id: self._kv_cache_manager.get_block_ids(req_id))
        return meta

    def on_failed_loads(self, req_ids) -> None:
        """A promised load failed: vLLM recomputes; store what it recomputes.

        The request gets no second external hit: a store that fails the same way
        again would make vLLM retry forever.
        """
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.saved_chunks = state.stored_run = 0
                state.load_failed = True
                state.state_floor = 0  # the recompute hands its states off again: store them
                state.saved_states.clear()

    def request_finished(self, request, block_ids=None) -> tuple[bool, Optional[dict]]:
        """Release what its lookups hold; store its turn end (``turn_ends``) with the next step
        (True where vLLM must keep its blocks for it until the workers report it in
        ``finished_sending``)."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if state.lookup >= 0:  # all its lookups, answered late ones too
            self._released.append((request.request_id, state.lookup))
        if self.role.prompt_turn_ends:  # kv_producer: what a decode instance can load, for the proxy
            promise = producer_promise(state, self.chunk_size, self.layout.has_state)
            return False, loadable_params(promise.tokens, promise.stored_from)
        save = (turn_end_save(state, block_ids, self.layout, self.turn_ends, self.keep_blocks_for_turn_ends,
                              boundary_tail=self.admission.mode == "branch",
                              on_tail=self.admission.mode == "branch" and not self.config.share_parallel_shapes)
                if block_ids else None)
        if save is not None and not self.admission.admits_turn_end(state.hashes[0] if state.hashes else None):
            turn = save.objects[0]  # single-turn traffic on this first chunk: its turn ends are not read
            if turn.kind is ObjectKind.TURN:  # remembered: a next turn that would have hit it counts
                self.admission.skipped_turn_end(state.hashes[0], state.hashes[turn.chunk - 1], turn.end,
                                                turn.chunk_hash, turn.on_tail)
            save = None
        logger.debug("LMCacheHMA: %s finished at %d tokens (%d in flight): turn end %s", request.request_id,
                     request.num_computed_tokens, getattr(request, "num_in_flight_tokens", 0),
                     save.objects[0].end if save else "not stored")
        if save is None:
            return False, None
        self._turn_saves.append(save)
        self.landing.queued(save)
        if self.on_turn_save is not None:
            self.on_turn_save(request, save.objects)
        if save.blocks_kept:
            self.turn_saves_pending.add(request.request_id)
            self._kept[request.request_id] = request
        return save.blocks_kept, None

    @property
    def turn_saves_due(self) -> bool:
        """Turn ends not sent to the workers yet: the engine must step once more for them."""
        return bool(self._turn_saves)

    def on_finished_sending(self, req_ids) -> None:
        self.turn_saves_pending.difference_update(req_ids)
        for req_id in req_ids:
            self._kept.pop(req_id, None)

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: the worker empties its CPU and
        disk tiers of this namespace (never Redis: the fleet's). Requests in flight store what
        they compute from now on as usual.

        Nothing computed before the reset is stored after it (after a weight update it would be
        served as old weights' KV; after an in-process sleep its blocks hold nothing): the turn
        ends not sent yet are dropped (their kept blocks reported free without a gather), and
        metadata built before it carries the older ``epoch``, whose saves a worker that applied
        the reset drops (``worker.gathers``)."""
        self._reset = True  # the other ranks' workers, with the next step's metadata
        self._epoch += 1
        self._drop_turn_saves()
        self.landing.clear()  # nothing on its way to the store may be waited for now
        return self.client.reset()

    def shutdown(self) -> None:
        self.client.close()
