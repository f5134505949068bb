"""Lookup: the longest boundary whose KV can be restored for every group.

``longest_hit`` is the rule; ``LookupServer`` (worker, rank 0, a thread) answers
it from the chunk store; ``LookupClient`` (scheduler) asks over a local ZMQ IPC
socket. vLLM's CPU platform runs the scheduler and the worker in different
processes, so the scheduler cannot read the worker's CPU tier directly.

The rule (the hybrid fixed point vLLM's own coordinator computes locally): a
hit at boundary ``k * C`` needs the full-attention objects of chunks
``[first, k)`` (chunks before ``first`` are in vLLM's local prefix cache) and,
when the model has sliding-window groups, the tail object at ``k * C``. Where
the tail is missing the hit backs off to the last boundary that has one.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


def longest_hit(full: Sequence[bool], boundaries: Optional[Sequence[bool]]) -> int:
    """Chunks (from the first) that can be restored.

    ``full[i]``: chunk ``first + i`` has its full-attention object; ``boundaries[i]``:
    every boundary object at that chunk's end (sliding tail, recurrent states) is
    stored (they are keyed by the chunk's hash); None for a model with full
    attention only.
    """
    n = next((i for i, found in enumerate(full) if not found), len(full))
    if boundaries is None:
        return n
    return next((k for k in range(n, 0, -1) if boundaries[k - 1]), 0)


def socket_address(engine_id: str) -> str:
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache_hma-{safe}.sock')}"


class LookupServer:
    """Answers ``{"req": id, "lookup": n, "first": c, "deadline": t, "hashes": [hex, ...]}`` (the
    digests of chunks ``c, c+1, ...``; ``n``: the scheduler's number of this lookup; ``t``: when
    the scheduler stops waiting, ``time.monotonic()``) with ``{"chunks": k, "held": bool, "tiers": [the tier of each chunk]}`` on a
    thread.

    ``held``: the worker fetched, verified and holds every object of the hit for this
    request and lookup (``held.HeldObjects``), so the scheduler may promise a synchronous
    load. Any failure while answering (a bad message, the store) is logged with its
    traceback and answered as a miss: the thread outlives every message.
    """

    def __init__(self, address: str,
                 answer: Callable[[str, int, int, list[bytes], float], tuple[int, bool, Sequence[str]]],
                 reset: Callable[[], bool] = lambda: False):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._answer = answer
        self._reset = reset  # {"op": "reset"}: empty this worker's local tiers
        self.errors = 0  # messages answered as a miss because answering failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-hma-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    self._sock.send(self._reply(self._sock.recv()))
        except Exception:  # the socket itself failed: lookups time out, and the scheduler stops asking
            logger.exception("LMCacheHMA: the lookup server stopped; every lookup is a miss from now on")
        finally:
            self._sock.close()  # by the thread that owns it (zmq sockets are not thread-safe)

    def _reply(self, raw: bytes) -> bytes:
        t0 = time.perf_counter()
        req = "?"
        try:
            msg = json.loads(raw)
            if msg.get("op") == "reset":
                return json.dumps({"reset": bool(self._reset())}).encode()
            req = str(msg["req"])
            chunks, held, tiers = self._answer(req, int(msg["lookup"]), int(msg["first"]),
                                               [bytes.fromhex(h) for h in msg["hashes"]], float(msg["deadline"]))
        except Exception:  # a failed lookup is a miss
            self.errors += 1
            logger.exception("LMCacheHMA: lookup of %s failed; answered as a miss", req)
            chunks, held, tiers = 0, False, ()
        logger.debug("LMCacheHMA: lookup of %s: %d chunks%s in %.2f ms", req, chunks,
                     ", held" if held else "", 1e3 * (time.perf_counter() - t0))
        return json.dumps({"chunks": chunks, "held": held, "tiers": list(tiers)}).encode()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # stuck in an answer: leave its socket to it, do not race it
            logger.warning("LMCacheHMA: the lookup server did not stop within 5 s")
            return
        self._ctx.term()


@dataclass(frozen=True)
class Answer:
    chunks: int  # chunks that hit
    held: bool  # the worker holds their objects for this lookup
    answered: bool = True  # False: no answer in time (a miss; anything held for it must be released)
    tiers: tuple[str, ...] = ()  # the tier each chunk's objects are in (kinds.TIERS)


class LookupClient:
    """The scheduler's side; a timeout or error is a miss, never a stall.

    After a lookup goes unanswered, lookups are answered as misses here, without asking,
    for a back-off that doubles with each further unanswered one (from the timeout up to
    ``MAX_BACKOFF_S``): a worker whose lookup server is stuck or gone costs the scheduler
    one timeout per back-off, not one per step. Said once, and once when it answers again.
    """

    MAX_BACKOFF_S = 60.0

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

    def lookup(self, req_id: str, lookup: int, first: int, hashes: Sequence[bytes]) -> Answer:
        """How many of ``hashes`` (chunks ``first, first+1, ...``) hit, and whether the worker
        holds their objects for ``req_id`` under lookup number ``lookup``."""
        if not hashes:
            return Answer(0, False)
        if self._backoff_s and time.monotonic() < self._quiet_until:
            return Answer(0, False, answered=False)
        sock = self._socket()
        try:
            # time.monotonic() is the same clock in every process of this machine
            deadline = time.monotonic() + self._timeout_ms / 1000
            sock.send(json.dumps({"req": req_id, "lookup": lookup, "first": first, "deadline": deadline,
                                  "hashes": [h.hex() for h in hashes]}).encode())
            # one deadline over the whole call: the reply gets what the send left of it
            sock.setsockopt(self._zmq.RCVTIMEO, max(1, int(1000 * (deadline - time.monotonic()))))
            reply = json.loads(sock.recv())
            answer = Answer(int(reply["chunks"]), bool(reply["held"]), tiers=tuple(reply.get("tiers", ())))
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
        answer in time or could not."""
        sock = self._socket()
        try:
            sock.send(json.dumps({"op": "reset"}).encode())
            sock.setsockopt(self._zmq.RCVTIMEO, self._timeout_ms)
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
