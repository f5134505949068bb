"""A TCP proxy on 127.0.0.1 in front of a real Redis that misbehaves on the way back.

What the client sends reaches Redis unchanged; what Redis answers is passed on
according to ``mode``, which a test may change at any time (it applies to the
next bytes Redis sends, on every connection):

* ``pass``: unchanged;
* ``lie``: every bulk string's length (``$n``) replaced by ``LIE_BYTES`` (256 MiB),
  its bytes passed on as they are (a reader that trusts the length allocates it,
  then waits for bytes that never come);
* ``trickle``: one byte every ``TRICKLE_S`` seconds (each receive gets a byte well
  within any socket timeout, the reply never ends in useful time);
* ``close``: both connections closed halfway through the next reply;
* ``push``: a RESP3 push frame (``>``) before every reply (never negotiated: these
  connections speak RESP2).
"""

from __future__ import annotations

import re
import socket
import threading
import time

from tests.redis_server import free_port

LIE_BYTES = 256 << 20
TRICKLE_S = 0.3
PUSH_FRAME = b">3\r\n$7\r\nmessage\r\n$7\r\nchannel\r\n$5\r\nhello\r\n"
_LENGTH = re.compile(rb"\$(\d+)\r\n")
MODES = ("pass", "lie", "trickle", "close", "push")


class RedisProxy:
    """``RedisProxy(redis_port, mode)``: listens on ``self.port`` until ``close``."""

    def __init__(self, redis_port: int, mode: str = "pass") -> None:
        assert mode in MODES, mode
        self.redis_port, self.mode = redis_port, mode
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = threading.Event()
        self._socks: list = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True, name="redis-proxy").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> "RedisProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        for sock in [self._listener, *self._socks]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.redis_port))
            except OSError:
                return
            self.connections += 1
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if not replies or self.mode == "pass":
                    dst.sendall(data)
                elif not self._misbehave(data, dst):
                    break
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _misbehave(self, data: bytes, dst: socket.socket) -> bool:
        """Pass ``data`` (bytes from Redis) on the way ``mode`` says; False: end the connection."""
        if self.mode == "lie":
            dst.sendall(_LENGTH.sub(b"$%d\r\n" % LIE_BYTES, data))
        elif self.mode == "push":
            dst.sendall(PUSH_FRAME + data)
        elif self.mode == "close":
            dst.sendall(data[:max(1, len(data) // 2)])
            return False
        else:  # trickle
            for i in range(len(data)):
                if self._closed.wait(TRICKLE_S):
                    return False
                dst.sendall(data[i:i + 1])
        return True
