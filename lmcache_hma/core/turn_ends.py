"""Turn ends: the marker object that tells a lookup where stored turn ends are.

A finished request's last partial chunk (tokens ``[k*C, L)``, ``L`` not a chunk boundary) is
stored as a ``TURN`` object keyed by ``ChunkHasher.turn_digest`` over those tokens, chained on
chunk ``k - 1``'s digest. A lookup cannot guess ``L``, so beside it a ``TURNMARK`` object,
keyed by chunk ``k - 1``'s digest, lists the offsets ``L - k*C`` of the turn ends stored after
that prefix (several conversations can share one); a negative offset names a turn object
``on_tail`` (``ObjectRef.on_tail``: its window before ``k*C`` is the tail there), keyed apart. The lookup reads the marker at the end of
a prompt's run of whole chunks and asks for the turn objects of those offsets, keyed over the
new prompt's own tokens: only a turn end the prompt really starts with can hit.

A marker is rewritten whole by each writer from the offsets it wrote itself and those it read
in that marker at a lookup (``TurnMarks``, newest first, at most ``MARK_SLOTS``): no read before a
write, so across instances the last writer wins, but a next turn that read the marker (on a
fresh instance, say) keeps the turn end it went on from listed: an edit of its message hits it. A lost offset only costs a miss; an offset that names nothing, or a marker that
fails its checks, is a miss too (markers are sealed like every object).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

MARK_SLOTS = 16  # offsets one marker lists
MARK_BYTES = 4 * MARK_SLOTS  # int32 each, 0: empty


def encode_marks(offsets: Sequence[int], payload: torch.Tensor) -> None:
    """Write ``offsets`` (newest first, at most ``MARK_SLOTS``) into a marker's payload."""
    out = np.zeros(MARK_SLOTS, dtype="<i4")
    values = list(offsets)[:MARK_SLOTS]
    out[:len(values)] = values
    payload.view(torch.uint8).numpy()[:MARK_BYTES] = out.view(np.uint8)


def decode_marks(payload: torch.Tensor, chunk_size: int) -> list[int]:
    """The offsets a marker lists: distinct, inside a chunk (1 .. chunk_size - 1; negative: a
    turn object ``on_tail``), longest first. Anything else in it is ignored."""
    raw = payload.view(torch.uint8).numpy()[:MARK_BYTES].view("<i4")
    return sorted({int(v) for v in raw if 0 < abs(int(v)) < chunk_size}, key=lambda v: (abs(v), v), reverse=True)


class TurnMarks:
    """The offsets this worker stored turn ends at, per chunk prefix (most recent prefixes kept).
    Thread-safe: the gather thread and the step's thread both write markers."""

    PREFIXES = 4096

    def __init__(self) -> None:
        self._by_prefix: OrderedDict[bytes, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, prefix: bytes, offset: int) -> list[int]:
        """Record a turn end at ``offset`` after ``prefix``; the marker's offsets, newest first."""
        with self._lock:
            offsets = [offset, *(o for o in self._by_prefix.pop(prefix, ()) if o != offset)][:MARK_SLOTS]
            self._by_prefix[prefix] = offsets
            while len(self._by_prefix) > self.PREFIXES:
                self._by_prefix.popitem(last=False)
            return offsets

    def learn(self, prefix: bytes, offsets: Sequence[int]) -> None:
        """A lookup read the marker after ``prefix``: its offsets (another instance's turn ends,
        or earlier ones of this worker) go after those this worker recorded there."""
        with self._lock:
            own = self._by_prefix.pop(prefix, [])
            self._by_prefix[prefix] = (own + [o for o in offsets if o not in own])[:MARK_SLOTS]
            while len(self._by_prefix) > self.PREFIXES:
                self._by_prefix.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._by_prefix.clear()
