"""Admission: at which chunk boundaries a request stores the boundary objects (sliding-window
tails, recurrent states) beside its chunks' full-attention objects.

A hit at a boundary needs every chunk before it *and* that boundary's objects; a tail is a
whole window of every sliding layer, several times a chunk's full-attention object, so the
boundaries that get one decide most of the bytes stored. Two rules (``hma_tail_admission``):

* ``branch`` (the default): where a later hit is likely to land:

  - the prompt's end: its last whole chunk (a longer prompt extending it hits there) and the
    chunk before its last token (a repeat of the prompt hits there: a hit leaves a token to
    compute);
  - a branch point: a lookup found a run of stored chunks past the last boundary with its
    objects (the run ends where this prompt and the ones stored before it part), so a third
    prompt sharing that run would hit there too. The request that looked up computes that
    boundary and stores its objects; the boundary is remembered (``BRANCHES_KEPT`` of them), so
    any request computing it stores them too (after an eviction, say);
  - the end of an answer: the turn end (``scheduler.turn_ends``), or where a request finishes on
    a chunk boundary, that boundary's tail; not every chunk of the answer. A turn end serves only
    a next turn of the same conversation, and is as big as a tail: turn ends are counted per
    first chunk (a system prompt: requests on it are chats or not, by deployment) and, once
    ``TURN_PROBE`` were stored under one with fewer than one in ``TURN_PROBE`` of them hit, only a
    probe is (single-turn traffic: RAG, batch jobs). A stored turn end counts there only once
    ``TURN_JUDGED_AFTER`` more requests under that first chunk finished: its conversation's next
    turn comes after the other conversations' turns (several users starting on one system prompt
    at once, a batch of conversations), and a turn end judged unread before then was dropped
    from the very conversation that would have read it. Once judged: one in ``TURN_PROBE`` requests, then one in
    twice as many after each probe, up to one in ``TURN_PROBE_MAX``, until enough are hit again. A
    turn end not stored is remembered (``SKIPPED_KEPT``): a lookup whose prompt extends it counts
    as a hit (``skipped_turn_end``, ``missed_turn_end``), so traffic that turns into conversations
    is seen at its first next turn, not at the next probe. A turn end after a tail the request
    stored holds its own chunk only (``turn_ends``: ``on_tail``).

  - every ``sparse_interval`` tokens (``HybridLayout.tail_interval``: the span whose
    full-attention KV weighs as much as a tail; ``hma_checkpoint_interval`` when set): the first
    prompt sharing part of another hits at the last of those before they part, at most that many
    tokens short, and stores the tail where they part for the next one. Tails then at most
    double the bytes stored (on a Gemma-3 shape one every five windows; where a tail is small,
    every chunk).
  - on speculation (``SPARE``, with ``hma_spare_tail_fill``): the prompt's other boundaries at
    every checkpoint interval (``interval``'s), stored only while the local tiers are below that
    fill (the worker decides: ``worker.gathers``) and worth nothing until read
    (``ObjectRef.spare``, ``store.value_policy``: dropped first). While a tier has room the first
    prompt sharing part of another then hits where they part, to the interval; once it fills,
    ``branch`` alone.

* ``interval``: besides the above, every ``hma_checkpoint_interval`` tokens and at every chunk of
  an answer (the rule before ``branch``: a second prompt through any interval boundary hits).

Recurrent states are stored wherever vLLM hands one over, under either rule: vLLM keeps a state
only where a prefill step ends on a multiple of its retention interval, and at a prompt's replay
boundary (``vllm_fields.arrange_state_retention``), already few; it keeps none at a branch point a
lookup finds, so there is nothing this rule could add there.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

BRANCH, INTERVAL = "branch", "interval"
SPARE = "spare"  # wants_boundary: stored on speculation, while the tiers have room


@dataclass
class _TurnCounts:
    """``Admission.admits_turn_end``'s counts for one first chunk."""

    stored: int = 0  # turn ends stored there and judged (TURN_JUDGED_AFTER requests finished since)
    hit: int = 0  # lookups that hit one of them (or would have: missed_turn_end)
    skipped: int = 0  # requests not stored since the last probe
    gap: int = 0  # requests between probes
    finished: int = 0  # requests finished under the first chunk
    pending: deque = field(default_factory=deque)  # when (in ``finished``) each turn end not judged yet was stored


class Admission:
    """Which boundaries get their objects stored; remembers the branch points lookups found."""

    BRANCHES_KEPT = 1 << 14  # chunk digests remembered as branch points (least recently found go first)
    TURN_PROBE = 2  # turn ends stored under a first chunk before their hits decide (then one in this many)
    TURN_PROBE_MAX = 64  # ... the gap between probes doubles after each up to this many requests
    TURN_JUDGED_AFTER = 8  # requests finished under its first chunk before a stored turn end counts as unread
    PREFIXES_KEPT = 1 << 12  # first chunks whose turn ends are counted
    SKIPPED_KEPT = 1 << 12  # turn ends not stored, remembered for missed_turn_end (oldest go first)

    def __init__(self, mode: str, chunk_size: int, interval: int, sparse_interval: int = 0, spare: bool = False):
        """``interval``: the checkpoint interval (``interval``'s tails); ``sparse_interval``:
        ``branch``'s (0: none); ``spare``: ``branch`` also wants the prompt's other interval
        boundaries, as ``SPARE`` (``hma_spare_tail_fill`` above 0)."""
        if mode not in (BRANCH, INTERVAL):
            raise ValueError(f"tail admission {mode!r} is not {BRANCH!r} or {INTERVAL!r}")
        self.mode, self.chunk_size, self.interval = mode, chunk_size, interval
        self.sparse_interval = sparse_interval
        self.spare = spare and mode == BRANCH
        self._branches: OrderedDict[bytes, None] = OrderedDict()
        # first chunk -> admits_turn_end's counts (_TurnCounts)
        self._turns: OrderedDict[bytes, _TurnCounts] = OrderedDict()
        # turn ends not stored: the digest of the chunk before each -> {(end, key, on_tail): first chunk}
        self._skipped: OrderedDict[bytes, dict] = OrderedDict()
        self._n_skipped = 0

    def found_branch(self, hashes: list[bytes], hit_chunks: int, run: int) -> int:
        """A lookup: the request's chunk digests (``hashes``, from chunk 0), full objects stored
        for its first ``run`` chunks, a hit of ``hit_chunks``. Where the run goes past the hit,
        the boundary at its end is a branch point: remembered. Returns that boundary (in chunks),
        0 for none."""
        if run <= hit_chunks or run > len(hashes):
            return 0
        at = run
        key = hashes[at - 1]
        self._branches[key] = None
        self._branches.move_to_end(key)
        while len(self._branches) > self.BRANCHES_KEPT:
            self._branches.popitem(last=False)
        return at

    def admits_turn_end(self, first_chunk: Optional[bytes]) -> bool:
        """Whether a finished request whose first chunk's digest is ``first_chunk`` stores its turn
        end: always with ``interval``; with ``branch`` while fewer than ``TURN_PROBE`` stored under
        that first chunk were judged (``TURN_JUDGED_AFTER`` requests there finished after it) or
        at least one in ``TURN_PROBE`` of those was hit, else a probe (the traffic may turn into
        conversations): one request in ``TURN_PROBE``, the gap doubling after each probe up to
        ``TURN_PROBE_MAX``, until again at least one in ``TURN_PROBE`` of those judged was hit (or
        would have been: ``missed_turn_end``)."""
        if self.mode == INTERVAL or first_chunk is None:
            return True
        c = self._turns.get(first_chunk)
        if c is None:
            c = self._turns[first_chunk] = _TurnCounts(gap=self.TURN_PROBE)
            while len(self._turns) > self.PREFIXES_KEPT:
                self._turns.popitem(last=False)
        self._turns.move_to_end(first_chunk)
        c.finished += 1
        while c.pending and c.pending[0] <= c.finished - self.TURN_JUDGED_AFTER:
            c.pending.popleft()
            c.stored += 1
        if c.stored < self.TURN_PROBE or c.hit * self.TURN_PROBE >= c.stored:
            c.skipped, c.gap = 0, self.TURN_PROBE
        elif c.skipped + 1 >= c.gap:
            c.skipped, c.gap = 0, min(2 * c.gap, self.TURN_PROBE_MAX)
        else:
            c.skipped += 1
            return False
        c.pending.append(c.finished)
        return True

    def turn_end_hit(self, first_chunk: Optional[bytes]) -> None:
        """A lookup hit a turn end of a request whose first chunk is ``first_chunk``: turn ends
        there are read (conversations)."""
        counts = self._turns.get(first_chunk) if first_chunk is not None else None
        if counts is not None:
            counts.hit += 1

    def skipped_turn_end(self, first_chunk: bytes, anchor: bytes, end: int, key: bytes, on_tail: bool) -> None:
        """A finished request's turn end (``end``, its digest ``key``, the digest of the chunk
        before its chunk ``anchor``) was not stored (``admits_turn_end`` said no): remembered, so
        a next turn that would have hit it counts (``missed_turn_end``)."""
        entries = self._skipped.setdefault(anchor, {})
        if (end, key, on_tail) not in entries:
            entries[(end, key, on_tail)] = first_chunk
            self._n_skipped += 1
        self._skipped.move_to_end(anchor)
        while self._n_skipped > self.SKIPPED_KEPT:
            _, dropped = self._skipped.popitem(last=False)
            self._n_skipped -= len(dropped)

    def missed_turn_end(self, hashes: list[bytes], limit: int, turn_digest) -> Optional[int]:
        """A lookup found no turn end: whether its prompt (``hashes``: its chunk digests from chunk
        0; ``limit``: the most tokens a hit may cover; ``turn_digest(end, on_tail)``: its key of a
        turn end at ``end``) extends a turn end not stored. If so that counts as a hit of turn ends
        under its first chunk (``turn_end_hit``), is forgotten, and its end is returned."""
        if not self._skipped:
            return None
        for c in range(min(len(hashes), limit // self.chunk_size), 0, -1):  # the turn end in chunk c
            entries = self._skipped.get(hashes[c - 1])
            for (end, key, on_tail), first in list((entries or {}).items()):
                if end // self.chunk_size == c and end <= limit and turn_digest(end, on_tail) == key:
                    del entries[(end, key, on_tail)]
                    self._n_skipped -= 1
                    if not entries:
                        del self._skipped[hashes[c - 1]]
                    self.turn_end_hit(first)
                    return end
        return None

    def is_branch(self, chunk_hash: bytes) -> bool:
        return chunk_hash in self._branches

    def wants_boundary(self, chunk: int, chunk_hash: bytes, num_prompt_tokens: int, answers_end_in_turns: bool):
        """Whether the boundary at chunk ``chunk``'s end (its digest ``chunk_hash``) gets its
        objects: the prompt's end, a branch point, and with ``interval`` every interval and every
        chunk of the answer (``answers_end_in_turns`` False: no turn end stands for the answer's
        end, so ``branch`` stores the answer's chunks' tails too). True, False, or ``SPARE``
        (truthy): an interval boundary of the prompt ``branch`` skips, stored on speculation."""
        boundary = (chunk + 1) * self.chunk_size
        repeat_hit = (num_prompt_tokens - 1) // self.chunk_size
        last_full = num_prompt_tokens // self.chunk_size
        if chunk + 1 in (repeat_hit, last_full) or chunk_hash in self._branches:
            return True
        if self.mode == BRANCH:
            if self.sparse_interval and boundary % self.sparse_interval == 0:
                return True
            if boundary > num_prompt_tokens:
                return not answers_end_in_turns
            return SPARE if self.spare and boundary % self.interval == 0 else False
        return boundary > num_prompt_tokens or boundary % self.interval == 0
