"""Which objects each step's computed KV produces: the saves the scheduler half sends with a
step's metadata. Runs in vLLM's scheduler process (EngineCore), as part of the scheduler half;
it asks no one and touches no KV: it reads vLLM's ``SchedulerOutput`` and each request's
``RequestState`` (and moves what that records as stored).

A chunk is stored in the step that completes it, prefill or decode: its full-attention object,
and where ``scheduler.admission`` wants it the sliding tail at its end; recurrent states where
vLLM hands one over at a chunk boundary; a kv_producer's turn end at its prompt's ``L - 1``. A
finished request's turn end is not here (``turn_ends``: it goes with the next step).
"""

from __future__ import annotations

from typing import Callable

from lmcache_hma.config.transfer_role import TransferRole
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.layout import HybridLayout
from lmcache_hma.core.metadata import ObjectRef, SaveSpec
from lmcache_hma.scheduler.admission import SPARE, Admission
from lmcache_hma.scheduler.request_state import RequestState


class StepSaves:
    def __init__(self, layout: HybridLayout, role: TransferRole, admission: Admission, turn_ends: bool,
                 lookahead: int):
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.role = role
        self.admission = admission
        self.turn_ends = turn_ends  # answers end in turn ends (SchedulerHalf.turn_ends)
        self.lookahead = lookahead  # prompt tokens after a chunk that its key covers (config.speculative)
        self._state_group_pos = {g.index: i for i, g in enumerate(layout.state_groups)}

    def plan(self, scheduler_output, requests: dict[str, RequestState],
             block_ids: Callable[[str], tuple]) -> list[SaveSpec]:
        """The saves of the step ``scheduler_output`` schedules (``requests``: the scheduler
        half's, by id; ``block_ids``: vLLM's block table of a request)."""
        saves: list[SaveSpec] = []
        states = self._state_saves(scheduler_output, requests) if self.layout.has_state else {}
        for req_id, (objects, blocks) in states.items():
            saves.append(SaveSpec(req_id, (), objects, blocks))
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None or state.skip_save:
                continue
            before = state.request.num_computed_tokens
            if state.computed_from < 0:
                state.computed_from = before
            computed = (before + num_new) // self.chunk_size  # chunks whose KV is whole after this step
            prompt_turn = self._prompt_turn_end(state, before, before + num_new) if self.role.prompt_turn_ends else []
            if state.saved_chunks >= computed and not prompt_turn:
                continue
            # Chunks of the prompt, and with hma_store_answers of its output too (decode steps
            # complete one every chunk_size tokens), as far as they have keys (request_keys).
            done = state.keys.ensure(computed)
            # KV of chunks that ended before this step came from vLLM's local cache, or (no
            # lookahead) had keys when computed and were stored then: not stored again (their
            # sliding blocks may be gone). With a lookahead an answer's chunk gets its key a step
            # after it was computed (request_keys): this request's own chunks are stored then.
            floor = max(state.computed_from if self.lookahead else before, self._stored_from(state))
            todo = range(max(state.saved_chunks, floor // self.chunk_size), done)
            objects = []
            for c in todo:
                if c >= state.stored_run:  # a lookup just found the chunks before it stored
                    objects.append(ObjectRef(ObjectKind.FULL, c, state.hashes[c],
                                             parent=state.hashes[c - 1] if c else b""))
                want = self.wants_tail(c, state.hashes[c], state.request.num_prompt_tokens)
                if want:
                    spare = want == SPARE  # the worker may skip it: no turn end counts on it
                    objects.append(ObjectRef(ObjectKind.TAIL, c, state.hashes[c], gain=self.gain(state, c + 1),
                                             spare=spare))
                    if not spare:
                        state.tails.add(c)
            state.saved_chunks = max(state.saved_chunks, done)
            objects += prompt_turn
            if objects:
                table = block_ids(req_id)
                saves.append(SaveSpec(req_id, table, objects))
        return saves

    def _state_saves(self, scheduler_output, requests: dict) -> dict[str, tuple[list[ObjectRef], dict]]:
        """State objects from this step's boundary hand-offs: ``{req: (refs, state_blocks)}``.

        vLLM ("align" mode) keeps a recurrent state only where a prefill step ends, and of
        those only the ones its retention interval keeps (the connector sets it, see
        ``vllm_fields.arrange_state_retention``), plus the prompt's replay boundary and
        shared-prefix junctions; it names the exact block holding each
        (``boundary_state_offloads``: never inferred from block-table positions). The state is
        written by this step's forward and gathered in this step's ``wait_for_save``. Stored:
        every chunk-aligned boundary of the chunks with keys (the prompt's, and with
        ``hma_store_answers`` the answer's) that this request computed, once all state groups
        handed it off. A decode step hands one off only where vLLM caches a whole Mamba block
        (it exports no checkpoint inside a one-token step).
        """
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        handoffs = block_state.boundary_state_offloads if block_state is not None else None
        if not handoffs:
            return {}
        gone = set(scheduler_output.preempted_req_ids or ()) | set(scheduler_output.finished_req_ids or ())
        out = {}
        for req_id, entries in handoffs.items():
            state = requests.get(req_id)
            if state is None or state.skip_save or req_id in gone:
                continue  # gone: giving up its blocks this step, another request may write them
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block_id, boundary in entries:
                if group in self._state_group_pos:
                    by_boundary.setdefault(boundary, {})[self._state_group_pos[group]] = block_id
            for boundary, blocks in sorted(by_boundary.items()):
                chunk = boundary // self.chunk_size - 1
                if (boundary % self.chunk_size or not 0 <= chunk < state.keys.ensure(chunk + 1)
                        or boundary <= max(state.state_floor, self._stored_from(state)) or chunk in state.saved_states
                        or len(blocks) != len(self._state_group_pos)):
                    continue
                refs, state_blocks = out.setdefault(req_id, ([], {}))
                refs.append(ObjectRef(ObjectKind.STATE, chunk, state.hashes[chunk], gain=self.gain(state, chunk + 1)))
                state_blocks[chunk] = tuple(blocks[i] for i in range(len(blocks)))
                state.saved_states.add(chunk)
        return out

    def gain(self, state: RequestState, chunks: int) -> int:
        """Tokens a hit at ``chunks`` restores beyond the request's last boundary that was stored or
        hit (``ObjectRef.gain``); moves that boundary there."""
        boundary = chunks * self.chunk_size
        base = max(state.last_boundary, state.state_floor, state.computed_from, 0)
        state.last_boundary = max(state.last_boundary, boundary)
        return max(boundary - base, 1)

    def _prompt_turn_end(self, state: RequestState, before: int, after: int) -> list[ObjectRef]:
        """A kv_producer's turn end at its prompt's ``L - 1`` (``config.transfer_role``), in the step
        whose tokens ``[before, after)`` reach it: gathered after that step's forward, while vLLM
        still holds every block of the window before ``L - 1`` (it frees those that leave the
        window of the *next* token, ``L``, once the prompt is processed). Not where ``L - 1`` is a
        chunk boundary (its chunk and tail serve it) nor for recurrent-state models (vLLM keeps no
        state at ``L - 1``)."""
        end = state.request.num_prompt_tokens - 1
        if self.layout.has_state or not before < end <= after or not end % self.chunk_size or end < self.chunk_size:
            return []
        digest = state.keys.turn_digest(end)
        if digest is None:
            return []
        chunk = end // self.chunk_size
        state.prompt_turn = end
        # the marker after chunk - 1 names it, written once the turn object is queued (turn_ends)
        return [ObjectRef(ObjectKind.TURN, chunk, digest, end, parent=state.hashes[chunk - 1]),
                ObjectRef(ObjectKind.TURNMARK, chunk, state.hashes[chunk - 1], end)]

    def _stored_from(self, state: RequestState) -> int:
        """The first token whose KV this instance may store: 0, or for a kv_consumer (which stores
        only answers) the first past the prompt (the chunk that holds it is not whole at its
        producer, which computed the prompt alone)."""
        return 0 if self.role.stores_prompts else state.request.num_prompt_tokens

    def wants_tail(self, chunk: int, chunk_hash: bytes, num_prompt_tokens: int):
        """Whether the tail at chunk ``chunk``'s end is stored (``scheduler.admission``): where a
        repeat of this prompt hits (a hit leaves a token to compute: one chunk short when the
        prompt fills its last chunk), at the prompt's last full chunk (where a longer prompt
        extending it hits), at branch points lookups found, and with ``hma_tail_admission:
        interval`` every checkpoint interval and every chunk of the answer (without turn ends,
        under either rule: the next turn extends the answer and hits at its last stored chunk,
        which is not known until the request ends). ``SPARE``: on speculation (``admission``)."""
        return self.layout.has_sliding and self.admission.wants_boundary(chunk, chunk_hash, num_prompt_tokens,
                                                                         self.turn_ends)
