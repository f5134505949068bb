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
    """Answers ``{"req": id, "first": c, "deadline": t, "hashes": [hex, ...]}`` (the digests of chunks
    ``c, c+1, ...``; ``t``: when the scheduler stops waiting, ``time.monotonic()``)
    with ``{"chunks": n, "held": bool}`` on a thread.

    ``held``: the worker fetched, verified and holds every object of the hit for
    this request (``held.HeldObjects``), so the scheduler may promise a
    synchronous load.
    """

    def __init__(self, address: str, answer: Callable[[str, int, list[bytes], float], tuple[int, bool]]):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-hma-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                msg = json.loads(self._sock.recv())
                t0 = time.perf_counter()
                try:
                    chunks, held = self._answer(str(msg["req"]), int(msg["first"]),
                                                [bytes.fromhex(h) for h in msg["hashes"]], float(msg["deadline"]))
                except Exception as exc:  # a failed lookup is a miss
                    logger.warning("LMCacheHMA: lookup failed: %s", exc)
                    chunks, held = 0, False
                logger.debug("LMCacheHMA: lookup of %s: %d chunks%s in %.2f ms", msg["req"], chunks,
                             ", held" if held else "", 1e3 * (time.perf_counter() - t0))
                self._sock.send(json.dumps({"chunks": chunks, "held": held}).encode())
        finally:
            self._sock.close()  # by the thread that owns it (zmq sockets are not thread-safe)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # stuck in an answer: leave its socket to it, do not race it
            logger.warning("LMCacheHMA: the lookup server did not stop within 5 s")
            return
        self._ctx.term()


class LookupClient:
    """The scheduler's side; a timeout or error is a miss, never a stall."""

    def __init__(self, address: str, timeout_s: float):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._address = address
        self._timeout_ms = int(timeout_s * 1000)
        self._sock = None

    def _socket(self):
        if self._sock is None:
            zmq = self._zmq
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            self._sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            self._sock.connect(self._address)
        return self._sock

    def lookup(self, req_id: str, first: int, hashes: Sequence[bytes]) -> tuple[int, bool]:
        """(chunks of ``hashes`` (chunks ``first, first+1, ...``) that hit, whether the worker
        holds their objects for ``req_id``)."""
        if not hashes:
            return 0, False
        sock = self._socket()
        try:
            # time.monotonic() is the same clock in every process of this machine
            deadline = time.monotonic() + self._timeout_ms / 1000
            sock.send(json.dumps({"req": req_id, "first": first, "deadline": deadline,
                                  "hashes": [h.hex() for h in hashes]}).encode())
            reply = json.loads(sock.recv())
            return int(reply["chunks"]), bool(reply["held"])
        except self._zmq.ZMQError as exc:
            logger.warning("LMCacheHMA: lookup got no answer (%s); treating as a miss", exc)
            sock.close()  # a REQ socket that missed its reply cannot be reused
            self._sock = None
            return 0, False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
