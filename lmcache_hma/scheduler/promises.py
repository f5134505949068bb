"""Disaggregated prefill's promise: what a prefill instance says it stored, and how long a decode
instance waits for it. Runs in vLLM's scheduler process (EngineCore), as part of the scheduler
half; it asks no one, it only reads a request's ``kv_transfer_params`` and the last lookup's answer.

* A producer (``kv_producer``) answers each prompt with ``kv_transfer_params`` =
  ``{"lmcache_hma": {"loadable_tokens": n, "stored_from": k}}`` (``loadable_params``): a decode
  instance sent the same prompt can load its first ``n`` tokens once the producer's stores
  landed, of which the producer stored ``[k, n)`` itself; the KV before ``k`` came from vLLM's own
  prefix cache there (stored earlier, by it or another instance, if at all: it cannot vouch for it).
* A proxy passes them on with the decode request (as vLLM's disaggregated proxies do). Only a
  ``kv_consumer`` honours them (``promise_of``): the params are whatever the client sent, and on a
  ``kv_both`` server any client could make requests wait. A claim is capped at what a hit may
  cover (the prompt, less the token vLLM computes).
* ``PromiseWaits.on_its_way``: while the store (the last lookup's hit) and vLLM's own cache hold
  fewer tokens than promised, the decode instance asks again at its next step (its producer's
  writer may still be putting the last objects: its answer leaves as its step ends), for at most
  ``PROMISE_WAIT_S`` after the request arrived (and a lookup timeout). Not at all once the store's
  run of whole chunks stops short of ``k``: what the producer did not store is missing, and no
  wait brings it.
* A promise the wait ends short of (the time ran out, or that gap) is not kept: counted
  (``take_not_kept``: the ``promises_not_kept`` metric) and logged, once per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lmcache_hma.config.transfer_role import TransferRole
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

PARAMS_KEY = "lmcache_hma"


@dataclass(frozen=True)
class Promise:
    tokens: int = 0  # a decode instance can load the prompt's first ``tokens`` (0: no promise)
    stored_from: int = 0  # the producer stored [stored_from, tokens) itself


NONE = Promise()


def loadable_params(tokens: int, stored_from: int = 0):
    """The ``kv_transfer_params`` a producer returns for a prompt whose first ``tokens`` a decode
    instance can load, of which it stored those from ``stored_from`` on (None: nothing)."""
    if tokens <= 0:
        return None
    ours = {"loadable_tokens": tokens}
    if stored_from > 0:
        ours["stored_from"] = min(stored_from, tokens)
    return {PARAMS_KEY: ours}


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def read_promise(request) -> Promise:
    """A request's ``kv_transfer_params`` as a ``Promise`` (``NONE``: none, or not counts)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(ours, dict):
        return NONE
    tokens = _count(ours.get("loadable_tokens"))
    return Promise(tokens, min(_count(ours.get("stored_from")), tokens)) if tokens else NONE


def promise_of(request, role: TransferRole) -> Promise:
    """The promise a request carries that this instance honours: a ``kv_consumer``'s, capped at
    the prompt's tokens a hit may cover; ``NONE`` on any other role."""
    if role.name != "kv_consumer":
        return NONE
    promise = read_promise(request)
    cap = max(0, min(request.num_prompt_tokens, request.num_tokens - 1))
    if promise.tokens <= cap:
        return promise
    return Promise(cap, min(promise.stored_from, cap)) if cap else NONE


class PromiseWaits:
    """A decode instance's waits for its producers' stores (see the module's docstring)."""

    # At most this long after the request arrived (and at most a lookup timeout): the stores land
    # milliseconds after the producer's step on an idle machine; one still missing after a few
    # seconds was evicted or its tier is down, and every request would otherwise stall for it. One
    # second was too short on a loaded host: a 777-token prompt's stores (two engines and a test
    # suite on 2 cores) were not in Redis 1001 ms after the decode request arrived, and it
    # computed all of them.
    PROMISE_WAIT_S = 3.0

    def __init__(self, chunk_size: int, lookup_timeout_s: float):
        self.chunk_size = chunk_size
        self.lookup_timeout_s = lookup_timeout_s
        self._not_kept = 0

    def on_its_way(self, state, limit: int, computed: int) -> bool:
        """Whether ``state``'s request (a ``RequestState`` after its lookup: ``hit``,
        ``stored_run``, ``promise``, ``waits``) should ask again at vLLM's next step: the store and
        vLLM's cache (``computed``) hold less than promised (at most ``limit``), and what is
        missing may still be on its way. A promise decided (kept, or not) is dropped from
        ``state``: a later call for the request (vLLM could not allocate) does not wait again."""
        promise = state.promise
        if not promise.tokens:
            return False
        arrived = getattr(state.request, "arrival_time", None)
        since = time.time() - arrived if arrived is not None else None
        have = max(state.hit, computed)
        if have >= min(promise.tokens, limit):
            if state.waits:
                logger.info("LMCacheHMA: %s: %d lookups found less than its producer stored before it had "
                            "landed (%.0f ms after arrival)", state.request.request_id, state.waits,
                            (since or 0.0) * 1e3)
            self._decided(state)
            return False
        if max(state.stored_run * self.chunk_size, computed) < promise.stored_from:
            self._not_kept_by(state, since, f"the store lacks tokens before {promise.stored_from}, which its "
                              "producer did not store itself (evicted, or never stored)")
            return False
        if since is None or since >= min(self.PROMISE_WAIT_S, self.lookup_timeout_s):
            self._not_kept_by(state, since, "its producer's stores were not all there")
            return False
        state.waits += 1
        return True

    def _not_kept_by(self, state, since, why: str) -> None:
        self._not_kept += 1
        logger.info("LMCacheHMA: %s: promised %d tokens, %d found after %d lookups (%.0f ms after arrival): "
                    "%s; it computes the rest", state.request.request_id, state.promise.tokens, state.hit,
                    state.waits + 1, (since or 0.0) * 1e3, why)
        self._decided(state)

    @staticmethod
    def _decided(state) -> None:
        state.promise, state.waits = NONE, 0

    def take_not_kept(self) -> int:
        """Promises not kept since the last call."""
        n, self._not_kept = self._not_kept, 0
        return n


def producer_promise(state, chunk_size: int, has_state: bool) -> Promise:
    """A producer's promise for a finished request (``state``: its ``RequestState``): the tokens
    of its prompt a decode instance can load once its stores landed (the turn end at ``L - 1``,
    else the last boundary with a tail stored), ``NONE`` where it cannot tell (recurrent-state
    models, a request that stored nothing); ``stored_from``: the first chunk it stored itself
    (those before came from vLLM's prefix cache)."""
    if state.skip_save or has_state:
        return NONE
    stored_from = max(state.computed_from, 0) // chunk_size * chunk_size
    if state.prompt_turn:
        return Promise(state.prompt_turn, min(stored_from, state.prompt_turn))
    repeat_hit = (state.request.num_prompt_tokens - 1) // chunk_size  # its tail is stored (save_plan.StepSaves.wants_tail)
    if state.saved_chunks < repeat_hit or not repeat_hit:
        return NONE
    tokens = repeat_hit * chunk_size
    return Promise(tokens, min(stored_from, tokens))
