"""Turn ends on their way to the store, and whether a new prompt waits for one. Runs in vLLM's
scheduler process (EngineCore), as part of the scheduler half; it asks no one: it follows the
turn-end saves the scheduler half queues and sends, and answers from them.

A conversation's next turn can arrive as soon as the previous one finished, before the step that
gathers its turn end (``scheduler.turn_ends``): looked up then, it would hit only the chunk
boundary before it. ``TurnEndLanding`` records each turn end by the digest its marker is keyed by
(``queued``: its save is not sent yet; ``sent``: the number of the metadata that carried it), and
``decide`` tells the scheduler half, for a prompt, what its lookup does about them:

* ``WAIT``: vLLM asks again at its next step (``get_num_new_matched_tokens`` returns None): the
  save of a turn end this prompt would hit (its own key over its tokens, ending by its limit) is
  not sent yet, or one was sent with the last metadata built (its step may still run:
  asynchronous scheduling runs one step while planning the next);
* the digests of the markers of turn ends that may be landing: the lookup names them, and the
  worker lets those land first (``StoreWriter.wait_stored``: their own queue numbers, not the
  writer's backlog), within half its time;
* None: nothing on its way concerns this prompt.

Waiting costs a request one or two engine steps, never more:

* a save not sent yet is waited for only where this prompt would hit it: conversations on one
  system prompt that finish in every step keep marking its last chunk as landing;
* a save sent with the last metadata is older once the next is built (the steps between two
  lookups of a waiting request build one), unless another save with the same marker key finished
  meanwhile: the rule above decides then;
* a request waits for none once it arrived a lookup timeout ago: its previous turn ended before it
  arrived, and copies of one conversation could leave one in every step.

With more batches in flight (pipeline parallelism: vLLM's V2 runner runs pp + 1) the step of
metadata n may not have run when n + 1 is built: the lookup then settles without the turn end, a
miss (the chunk boundary before it), never a wait past its deadline. So is a turn end sent with
the last metadata whose marker key another save took meanwhile. An entry is forgotten three
metadata after the one that carried it (stored by then, the lookups meanwhile settled on it), when
its save is dropped, and at a cache reset. A writer slower than that still holds it back: the
worker's lookup lets the markers keyed by the chunks it asks about land in any case
(``LookupAnswers._let_land``).
"""

from __future__ import annotations

import time
from typing import Iterable, Union

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import SaveSpec

WAIT = "wait"

# metadata built after the one that carried a turn end, after which it is taken as stored
SETTLED_AFTER = 3


def marker_key(save: SaveSpec) -> bytes:
    """The digest a turn end's save is recorded by: its last object's (the ``TURNMARK``, written
    last; the ``TAIL`` of an answer that ends on a chunk boundary: ``turn_ends.turn_end_save``)."""
    return save.objects[-1].chunk_hash


class TurnEndLanding:
    def __init__(self, chunk_size: int, lookup_timeout_s: float):
        self.chunk_size = chunk_size
        self.lookup_timeout_s = lookup_timeout_s
        self._landing: dict[bytes, int] = {}  # marker digest -> number of the metadata that sent it (0: not yet)
        self._metas = 0  # metadata built, numbering them

    def queued(self, save: SaveSpec) -> None:
        """A finished request's turn end was queued for the next step."""
        self._landing[marker_key(save)] = 0

    def dropped(self, save: SaveSpec) -> None:
        """A queued turn end will not be sent (a reset): no lookup waits for it."""
        if save.objects:
            self._landing.pop(marker_key(save), None)

    def sent(self, saves: Iterable[SaveSpec]) -> None:
        """A metadata was built, carrying ``saves`` (the turn ends queued since the last one)."""
        self._metas += 1
        for key, n in list(self._landing.items()):
            if n and n + SETTLED_AFTER < self._metas:
                del self._landing[key]
        for save in saves:
            if save.objects:  # not one dropped by a reset
                self._landing[marker_key(save)] = self._metas

    def clear(self) -> None:
        """A cache reset: nothing on its way to the store may be waited for now."""
        self._landing.clear()

    def decide(self, state, chunks: int, limit: int, unsent: Iterable[SaveSpec]) -> Union[str, list[bytes], None]:
        """For a request (``state``: its ``RequestState``) whose lookup covers its first ``chunks``
        chunks and may hit up to token ``limit``: ``WAIT``, the marker digests to settle on, or
        None (see the module's docstring). ``unsent``: the turn-end saves queued, not sent yet."""
        if not self._landing:
            return None
        sent = {h: self._landing[h] for h in state.hashes[:chunks] if h in self._landing}
        if not sent:
            return None
        arrived = getattr(state.request, "arrival_time", None)
        if arrived is not None and time.time() - arrived >= self.lookup_timeout_s:
            return list(sent)
        if any(n and n >= self._metas for n in sent.values()):
            return WAIT
        for spec in unsent:  # (sent: 0)
            if _would_hit(spec, sent, state, limit, self.chunk_size):
                return WAIT
        return list(sent)


def _would_hit(spec: SaveSpec, sent: dict, state, limit: int, chunk_size: int) -> bool:
    """Whether the prompt of ``state`` would hit the unsent turn end ``spec`` (``sent``: the
    landing entries under its chunks)."""
    turn = spec.objects[0] if spec.objects else None
    if turn is None or sent.get(marker_key(spec)) != 0:
        return False
    if turn.kind is ObjectKind.TAIL:  # an answer ending on a boundary
        return (turn.chunk + 1) * chunk_size <= limit
    return turn.end <= limit and state.keys.turn_digest(turn.end, turn.on_tail) == turn.chunk_hash
