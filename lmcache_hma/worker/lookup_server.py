"""The worker's lookup server: answers the scheduler's lookups on a thread (rank 0).

The answer itself (which chunks hit, holding their objects) is the worker's
(``worker.lookups``); this module is the socket, the message format, and surviving
every bad message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

from lmcache_hma.core.lookup_wire import socket_path
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


class LookupServer:
    """Answers ``{"req": id, "lookup": n, "first": c, "deadline": t, "hashes": [hex, ...]}`` (the
    digests of chunks ``c, c+1, ...``; ``n``: the scheduler's number of this lookup; ``t``: when
    the scheduler stops waiting, ``time.monotonic()``; turn ends: ``turn_limit``, ``turn_prefix``,
    ``turns``, ``settle`` [hex: the digests of markers to let land first], see
    ``lookups.LookupAnswers._answer_lookup``) with ``{"chunks": k, "held": bool, "tiers": [the tier
    of each chunk]}`` on a thread.

    ``held``: the worker fetched, verified and holds every object of the hit for this
    request and lookup (``held.HeldObjects``), so the scheduler may promise a synchronous
    load. Any failure while answering (a bad message, the store) is logged with its
    traceback and answered as a miss: the thread outlives every message.

    ``address``: ``lookup_wire.socket_address``; the socket file is made owner-only (0600)
    and removed on ``close``.
    """

    def __init__(self, address: str,
                 answer: Callable[..., Any],  # LookupAnswers._answer_lookup: a lookups.Found
                 reset: Callable[[], bool] = lambda: False):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        # Owner-only (0600) before serving. Not by a umask around bind: the umask is the
        # whole process's, and LMCache's and the writer's threads create files meanwhile.
        # The moment between bind and chmod exposes nothing: the socket's directory is
        # already 0700 and ours (lookup_wire.socket_dir), so no one else can reach it.
        self._path = socket_path(address)
        os.chmod(self._path, 0o600)
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
            prefix, turns = msg.get("turn_prefix"), msg.get("turns")
            found = self._answer(req, int(msg["lookup"]), int(msg["first"]),
                                 [bytes.fromhex(h) for h in msg["hashes"]], float(msg["deadline"]),
                                 turn_limit=int(msg.get("turn_limit", 0)),
                                 turn_prefix=bytes.fromhex(prefix) if prefix else None,
                                 turns=(int(turns[0]), [(int(end), bytes.fromhex(key), bool(on_tail))
                                                        for end, key, on_tail in turns[1]])
                                 if turns else None,
                                 settle=[bytes.fromhex(h) for h in msg.get("settle", ())])
            reply = {"chunks": found.chunks, "held": found.held, "tiers": list(found.tiers)}
            if found.marks:
                reply.update(marks=list(found.marks), mark_chunk=found.mark_chunk)
            if found.turn_end:
                reply["turn_end"] = found.turn_end
                if found.turn_on_tail:
                    reply["turn_on_tail"] = True
            if found.run > found.chunks:
                reply["run"] = found.run
        except Exception:  # a failed lookup is a miss
            self.errors += 1
            logger.exception("LMCacheHMA: lookup of %s failed; answered as a miss", req)
            reply = {"chunks": 0, "held": False, "tiers": []}
        logger.debug("LMCacheHMA: lookup of %s: %s in %.2f ms", req, reply, 1e3 * (time.perf_counter() - t0))
        return json.dumps(reply).encode()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # stuck in an answer: leave its socket to it, do not race it
            logger.warning("LMCacheHMA: the lookup server did not stop within 5 s")
        else:
            self._ctx.term()
        try:  # zmq leaves the file behind; no one answers there any more
            os.unlink(self._path)
        except FileNotFoundError:
            pass
