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
from typing import Callable, Optional, Sequence
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


def longest_hit(hashes: Sequence[bytes], count_full_prefix: Callable[[Sequence[bytes]], int],
                has_tail: Optional[Callable[[bytes], bool]]) -> int:
    """Chunks of ``hashes`` (from the first) that can be restored.

    ``hashes[i]`` names chunk ``first + i``; the tail at that chunk's end is
    keyed by the same hash. ``has_tail`` is None for a model without sliding
    windows.
    """
    n = count_full_prefix(hashes)
    if has_tail is None:
        return n
    for k in range(n, 0, -1):
        if has_tail(hashes[k - 1]):
            return k
    return 0


def socket_address(engine_id: str) -> str:
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache_hma-{safe}.sock')}"


class LookupServer:
    """Answers ``{"hashes": [hex, ...]}`` with ``{"chunks": n}`` on a thread."""

    def __init__(self, address: str, answer: Callable[[list[bytes]], int]):
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
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = self._sock.recv()
            try:
                hashes = [bytes.fromhex(h) for h in json.loads(msg)["hashes"]]
                reply = {"chunks": self._answer(hashes)}
            except Exception as exc:  # a failed lookup is a miss
                logger.warning("LMCacheHMA: lookup failed: %s", exc)
                reply = {"chunks": 0}
            self._sock.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
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

    def lookup(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0
        sock = self._socket()
        try:
            sock.send(json.dumps({"hashes": [h.hex() for h in hashes]}).encode())
            return int(json.loads(sock.recv())["chunks"])
        except self._zmq.ZMQError as exc:
            logger.warning("LMCacheHMA: lookup got no answer (%s); treating as a miss", exc)
            sock.close()  # a REQ socket that missed its reply cannot be reused
            self._sock = None
            return 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
