"""Turn ends on the scheduler side: which finished request leaves one, and which stored
turn ends a new prompt can hit (``core.turn_ends`` has the marker; ``docs/design.md`` why).

* ``turn_end_save``: when a request finishes inside a chunk, its last partial chunk is kept:
  tokens ``[k*C, L)`` (``L``: the tokens whose KV it computed) of every full-attention layer
  plus the sliding tail at ``L`` (``on_tail``: only its tokens from ``k*C`` on, where the
  request stored the tail at ``k*C``), and a marker entry for ``L``. The save goes with the next
  step, whose first call to the connector gathers it before vLLM writes any block of that
  step (``worker.gathers.gather_turn_ends``): vLLM may free the blocks at once, and the
  engine steps once more for it (``has_pending_push_work``). Where vLLM's runner writes KV
  before that call (``vllm_compat.first_call_before_kv_writes``), vLLM keeps the request's blocks
  instead (``request_finished`` returns True) until the workers report it in
  ``finished_sending``. With recurrent-state groups the states at ``L`` go beside it (a
  ``STATE`` object under the turn end's key): vLLM ("align" mode) keeps a running request's
  state in its block at ``(L - 1) // block_size``, and a hit of ``L`` tokens reads it from
  there. Under speculative decoding with a draft model's KV its key covers the token after
  ``L`` too (the draft's KV at ``L - 1`` was computed from it, ``request_keys``). Not with
  ``hma_store_answers`` off, nor for a request that skips saving.
  A turn end names the one its request's hit read and extended (``ObjectRef.supersedes``): the
  store's eviction ranks that one as never used from then on (``store.value_policy``).
* ``turn_candidates``: a lookup whose run of whole chunks ends at chunk ``k`` found a
  marker there; the turn ends it lists, as keys over the *new* prompt's tokens, longest
  first, leaving vLLM at least one token to compute.
"""

from __future__ import annotations

from typing import Optional

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.layout import NULL_BLOCK_ID, HybridLayout
from lmcache_hma.core.metadata import ObjectRef, SaveSpec, turn_hit_boundary, turn_state


def turn_end_save(state, block_ids, layout: HybridLayout, enabled: bool, blocks_kept: bool,
                  boundary_tail: bool = False, on_tail: bool = False) -> Optional[SaveSpec]:
    """The save of a finished request's turn end (``state``: its ``RequestState``), or None.

    ``boundary_tail``: where the answer ends on a chunk boundary, the tail there stands for the
    turn end (``scheduler.admission``: ``branch`` stores no tail at the answer's other chunks).
    ``on_tail``: where the window before the turn end reaches into the chunk before it and the
    request stored or hit the tail at that chunk's end (``state.tails``), the turn object holds
    only its own chunk's KV (``ObjectRef.on_tail``; the tail holds the rest): on a Gemma-3
    shape a fraction of a whole window's."""
    req = state.request
    if not enabled or state.skip_save or not state.keys.answers:
        return None
    # Under async scheduling a finished request may have a step in flight whose token is
    # counted already; vLLM trims the sliding window on the processed tokens, so do we.
    in_flight = getattr(req, "num_in_flight_tokens", 0)
    if in_flight and layout.has_state:
        return None  # that step advances the recurrent state in place, past the turn end
    computed = req.num_computed_tokens - in_flight
    # Under speculative decoding the last step may have computed accepted drafts past a stop
    # (max_tokens): their tokens are dropped, so the turn ends at the last token kept but one.
    end = min(computed, len(req.all_token_ids) - 1)
    if end != computed and layout.has_state:
        return None  # the state is the one after all the computed tokens
    chunk = end // layout.chunk_size
    if (boundary_tail and end % layout.chunk_size == 0 and chunk >= 1 and end > state.hit
            and end > req.num_prompt_tokens and layout.has_sliding and not layout.has_state
            and state.keys.ensure(chunk) >= chunk):
        tail = ObjectRef(ObjectKind.TAIL, chunk - 1, state.hashes[chunk - 1], gain=_gain(state, end),
                         supersedes=_superseded(state, layout, ()))
        return SaveSpec(req.request_id, tuple(list(ids) for ids in block_ids), [tail], finished=True,
                        blocks_kept=blocks_kept)
    if end % layout.chunk_size == 0 or chunk < 1 or end <= state.hit:  # a chunk boundary, or what it hit
        return None
    on_tail = (on_tail and layout.has_sliding and not layout.has_state and chunk - 1 in state.tails
               and layout.turn_needs_tail(chunk, end))
    digest = state.keys.turn_digest(end, on_tail)
    if digest is None:
        return None
    kept = ((ObjectKind.TAIL, state.hashes[chunk - 1]),) if on_tail else ()  # this turn end's own tail
    turn = ObjectRef(ObjectKind.TURN, chunk, digest, end, on_tail=on_tail,  # found by its marker
                     parent=state.hashes[chunk - 1], gain=_gain(state, end),
                     supersedes=_superseded(state, layout, kept))
    refs, state_blocks = [turn], {}
    if layout.has_state:
        blocks = tuple(block_ids[g.index][g.state_block(end)] if g.state_block(end) < len(block_ids[g.index])
                       else NULL_BLOCK_ID for g in layout.state_groups)
        if NULL_BLOCK_ID in blocks:  # not where vLLM keeps a running state: nothing to store
            return None
        refs.append(turn_state(turn))
        state_blocks[chunk] = blocks
    refs.append(ObjectRef(ObjectKind.TURNMARK, chunk, state.hashes[chunk - 1], end, on_tail))  # written last
    return SaveSpec(req.request_id, tuple(list(ids) for ids in block_ids), refs, state_blocks,
                    finished=True, blocks_kept=blocks_kept)


def _superseded(state, layout: HybridLayout, kept) -> tuple[ObjectRef, ...]:
    """What the turn end a request's hit read (``state.turn``) and its answer extended leaves for
    a request that diverges exactly there (``ObjectRef.supersedes``): the turn end, its tail, its
    states; not those of ``kept`` (``(kind, digest)``: what the new turn end needs itself)."""
    if state.turn is None:
        return ()
    k = state.turn.chunk - 1
    tail_hash = state.hashes[k] if 0 <= k < len(state.hashes) else None
    return tuple(ref for ref in turn_hit_boundary(state.turn, tail_hash, layout.has_state)
                 if (ref.kind, ref.chunk_hash) not in kept)


def _gain(state, end: int) -> int:
    """Tokens a hit at ``end`` restores beyond the request's last stored or hit boundary."""
    return max(end - max(state.last_boundary, state.hit, state.state_floor, 0), 1)


def turn_candidates(state, chunk: int, offsets, limit: int) -> list[tuple[int, bytes, bool]]:
    """``(end, key, on_tail)`` of the turn ends at ``offsets`` (a marker's: negative, a turn
    object ``on_tail``) after chunk ``chunk - 1`` that the request's tokens could hold (``end``
    <= ``limit``), keyed over its own tokens, longest first."""
    out = []
    for offset in sorted(set(offsets), key=lambda o: (abs(o), o), reverse=True):
        on_tail, offset = offset < 0, abs(offset)
        end = chunk * state.keys.chunk_size + offset
        if 0 < offset < state.keys.chunk_size and end <= limit:
            digest = state.keys.turn_digest(end, on_tail)
            if digest is not None:
                out.append((end, digest, on_tail))
    return out
