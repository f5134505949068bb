"""The scheduler's side of a lookup: ask the worker's lookup server, never stall.

A timeout or error is a miss; an unanswered lookup starts a back-off.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from lmcache_hma.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Answer:
    chunks: int  # chunks that hit
    held: bool  # the worker holds their objects for this lookup
    answered: bool = True  # False: no answer in time (a miss; anything held for it must be released)
    tiers: tuple[str, ...] = ()  # the tier each chunk's objects are in (kinds.TIERS)
    # Turn ends (scheduler.turn_ends): the offsets a marker lists after the run of whole
    # chunks that ends at chunk ``mark_chunk`` (nothing is held then: ask again with them) ...
    marks: tuple[int, ...] = ()
    mark_chunk: int = 0
    turn_end: int = 0  # ... and the turn end the hit reaches (its last tier is the turn object's)
    turn_on_tail: bool = False  # ... stored ``on_tail`` (ObjectRef.on_tail)
    # whole chunks with a full object (>= chunks; 0 when not told): where it is longer no tail or
    # state is stored at its end, a branch point (scheduler.admission)
    run: int = 0


class LookupClient:
    """The scheduler's side; a timeout or error is a miss, never a stall.

    After a lookup goes unanswered, lookups are answered as misses here, without asking,
    for a back-off that doubles with each further unanswered one (from the timeout up to
    ``MAX_BACKOFF_S``): a worker whose lookup server is stuck or gone costs the scheduler
    one timeout per back-off, not one per step. Said once, and once when it answers again.
    """

    MAX_BACKOFF_S = 60.0
    # A reset's answer is awaited this many lookup timeouts: the worker may first finish a lookup
    # (one timeout), then lets stores under way land (worker.lookups.RESET_WAIT_SHARE of one),
    # then removes the objects. vLLM's callers (pause, sleep, reset_prefix_cache) wait for it.
    RESET_ANSWER_TIMEOUTS = 3

    def __init__(self, address: str, timeout_s: float):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._address = address
        self._timeout_ms = int(timeout_s * 1000)
        self._sock = None
        self._backoff_s = 0.0  # 0: the server answers
        self._quiet_until = 0.0  # time.monotonic() before which lookups are not sent

    def _socket(self):
        if self._sock is None:
            zmq = self._zmq
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            self._sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            self._sock.connect(self._address)
        return self._sock

    def lookup(self, req_id: str, lookup: int, first: int, hashes: Sequence[bytes],
               turn_limit: int = 0, turn_prefix: Optional[bytes] = None,
               turns: Optional[tuple[int, Sequence[tuple[int, bytes, bool]]]] = None,
               deadline: Optional[float] = None, settle: Sequence[bytes] = ()) -> Answer:
        """How many of ``hashes`` (chunks ``first, first+1, ...``) hit, and whether the worker
        holds their objects for ``req_id`` under lookup number ``lookup``.

        Turn ends: ``turn_limit`` > 0 asks for the offsets of a marker after the run of whole
        chunks (turn ends up to that token); ``turn_prefix`` (chunk ``first - 1``'s digest)
        names the marker after a run of none; ``turns`` is ``(chunk,
        [(end, key, on_tail), ...])``: the candidate turn ends after ``chunk - 1`` to hit, longest first.
        ``deadline`` (``time.monotonic()``): the whole call's, when this lookup follows another
        for the same scheduling decision (never later than one timeout from now). ``settle``:
        the digests of the markers of turn ends on their way to the store that this prompt could
        hit; the worker first lets those land (nothing else its writer has queued)."""
        if not hashes and not turn_limit and turns is None:
            return Answer(0, False)
        if self._backoff_s and time.monotonic() < self._quiet_until:
            return Answer(0, False, answered=False)
        sock = self._socket()
        try:
            # time.monotonic() is the same clock in every process of this machine
            # the caller's deadline when this lookup is the second of one scheduling call
            own = time.monotonic() + self._timeout_ms / 1000
            deadline = own if deadline is None else min(own, deadline)
            msg = {"req": req_id, "lookup": lookup, "first": first, "deadline": deadline,
                   "hashes": [h.hex() for h in hashes]}
            if turn_limit:
                msg["turn_limit"] = turn_limit
            if turn_prefix is not None:
                msg["turn_prefix"] = turn_prefix.hex()
            if turns is not None:
                msg["turns"] = [turns[0], [[end, key.hex(), on_tail] for end, key, on_tail in turns[1]]]
            if settle:
                msg["settle"] = [h.hex() for h in settle]
            sock.send(json.dumps(msg).encode())
            # one deadline over the whole call: the reply gets what the send left of it
            sock.setsockopt(self._zmq.RCVTIMEO, max(1, int(1000 * (deadline - time.monotonic()))))
            reply = json.loads(sock.recv())
            answer = Answer(int(reply["chunks"]), bool(reply["held"]), tiers=tuple(reply.get("tiers", ())),
                            marks=tuple(int(m) for m in reply.get("marks", ())),
                            mark_chunk=int(reply.get("mark_chunk", 0)), turn_end=int(reply.get("turn_end", 0)),
                            turn_on_tail=bool(reply.get("turn_on_tail", False)),
                            run=int(reply.get("run", 0)))
        except (self._zmq.ZMQError, ValueError, KeyError, TypeError) as exc:
            sock.close()  # a REQ socket that missed its reply cannot be reused
            self._sock = None
            self._back_off(exc)
            return Answer(0, False, answered=False)
        if self._backoff_s:
            logger.warning("LMCacheHMA: the worker answers lookups again")
            self._backoff_s = 0.0
        return answer

    def reset(self) -> bool:
        """Ask the worker to empty its local tiers (``{"op": "reset"}``); False if it did not
        answer within ``RESET_ANSWER_TIMEOUTS`` lookup timeouts, or could not."""
        sock = self._socket()
        try:
            sock.send(json.dumps({"op": "reset"}).encode())
            sock.setsockopt(self._zmq.RCVTIMEO, self.RESET_ANSWER_TIMEOUTS * self._timeout_ms)
            return bool(json.loads(sock.recv()).get("reset"))
        except (self._zmq.ZMQError, ValueError, AttributeError) as exc:
            logger.warning("LMCacheHMA: the worker did not confirm the cache reset (%s)", exc)
            sock.close()
            self._sock = None
            return False

    def _back_off(self, exc: Exception) -> None:
        if not self._backoff_s:
            logger.warning("LMCacheHMA: a lookup got no answer (%s); lookups are misses without asking "
                           "for %.1f s, longer while the worker stays silent", exc, self._timeout_ms / 1000)
        self._backoff_s = min(self.MAX_BACKOFF_S, 2 * self._backoff_s or self._timeout_ms / 1000)
        self._quiet_until = time.monotonic() + self._backoff_s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
