"""Turn ends on the scheduler side: which finished request leaves one, and which stored
turn ends a new prompt can hit (``core.turn_ends`` has the marker; ``docs/design.md`` why).

* ``turn_end_save``: when a request finishes inside a chunk, its last partial chunk is kept:
  tokens ``[k*C, L)`` (``L``: the tokens whose KV it computed) of every full-attention layer
  plus the sliding tail at ``L``, and a marker entry for ``L``. The save goes with the next
  step, whose first call to the connector gathers it before vLLM writes any block of that
  step (``worker.gathers.gather_turn_ends``): vLLM may free the blocks at once, and the
  engine steps once more for it (``has_pending_push_work``). Where vLLM's runner writes KV
  before that call (``vllm_compat.gathers_may_defer``), vLLM keeps the request's blocks
  instead (``request_finished`` returns True) until the workers report it in
  ``finished_sending``. Not for a model with recurrent-state
  groups (vLLM keeps no state at a token inside a block), nor under speculative decoding
  (answers get no keys there, ``request_keys``), nor with ``hma_store_answers`` off or a
  request that skips saving.
* ``turn_candidates``: a lookup whose run of whole chunks ends at chunk ``k`` found a
  marker there; the turn ends it lists, as keys over the *new* prompt's tokens, longest
  first, leaving vLLM at least one token to compute.
"""

from __future__ import annotations

from typing import Optional

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef, SaveSpec


def turn_end_save(state, block_ids, chunk_size: int, enabled: bool, blocks_kept: bool) -> Optional[SaveSpec]:
    """The save of a finished request's turn end (``state``: its ``RequestState``), or None."""
    req = state.request
    if not enabled or state.skip_save or not state.keys.answers:
        return None
    # Under async scheduling a finished request may have a step in flight whose token is
    # counted already; vLLM trims the sliding window on the processed tokens, so do we.
    end = req.num_computed_tokens - getattr(req, "num_in_flight_tokens", 0)
    chunk = end // chunk_size
    if end % chunk_size == 0 or chunk < 1 or end <= state.hit:  # a chunk boundary, or what it hit
        return None
    digest = state.keys.turn_digest(end)
    if digest is None:
        return None
    refs = [ObjectRef(ObjectKind.TURN, chunk, digest, end),
            ObjectRef(ObjectKind.TURNMARK, chunk, state.hashes[chunk - 1], end)]
    return SaveSpec(req.request_id, tuple(list(ids) for ids in block_ids), refs, finished=True,
                    blocks_kept=blocks_kept)


def turn_candidates(state, chunk: int, offsets, limit: int) -> list[tuple[int, bytes]]:
    """``(end, key)`` of the turn ends at ``offsets`` after chunk ``chunk - 1`` that the
    request's tokens could hold (``end`` <= ``limit``), keyed over its own tokens, longest
    first."""
    out = []
    for offset in sorted(set(offsets), reverse=True):
        end = chunk * state.keys.chunk_size + offset
        if 0 < offset < state.keys.chunk_size and end <= limit:
            digest = state.keys.turn_digest(end)
            if digest is not None:
                out.append((end, digest))
    return out
