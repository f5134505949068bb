"""Reading Redis replies (RESP) with the values landing straight in the caller's memory.

redis-py's parser reads a socket in 64 KiB pieces, joins them, and hands each value
back as a new ``bytes``, which the caller then copies into its object. Read here
straight into the objects, a hit's fetch (CRC check included) runs at 1.7-3.4x
redis-py's pipelined GETs of the same bytes on loopback (``benchmarks/bench_redis.py``).
``BulkReader`` does the latter on a connection redis-py made (connect, TLS, AUTH and
timeouts stay redis-py's); redis-py still packs and sends the commands.
"""

from __future__ import annotations

import socket
from typing import Optional

_MAX_LINE = 64 << 10  # longest status, error or length line accepted


def socket_of(connection) -> socket.socket:
    """The socket of a connected redis-py ``Connection`` (redis-py 8 keeps it in ``_sock``)."""
    sock = getattr(connection, "_sock", None)
    if sock is None:
        raise ConnectionError("the redis-py connection has no socket")
    return sock


class ProtocolError(ConnectionError):
    """The connection's bytes are not RESP: it must be closed."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``, ``-MOVED ...``): that command failed, the connection is fine."""


class BulkReader:
    """Replies read off one socket, in order. A small bulk string comes back as ``bytes``
    (``bulk``); a large one can instead go straight into a caller's buffer
    (``bulk_length``, then ``read_into`` or ``skip``, then ``end_bulk``).

    Any exception but ``ReplyError`` leaves the connection in an unknown state: the
    caller must disconnect it.
    """

    def __init__(self, sock: socket.socket, buffer_bytes: int = 1 << 16) -> None:
        self._sock = sock
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0

    def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._pos
            if n == len(self._buf):  # a line longer than the buffer: grow it
                if n >= _MAX_LINE:
                    raise ProtocolError("a reply line longer than 64 KiB")
                self._view.release()
                self._buf = self._buf + bytearray(n)
                self._view = memoryview(self._buf)
            else:  # move the unread part to the front
                self._buf[:n] = self._buf[self._pos:self._end]
                self._pos, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise ConnectionError("Redis closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._pos, self._end)
            if i >= 0:
                line = bytes(self._view[self._pos:i])
                self._pos = i + 2
                return line
            self._fill()

    def bulk_length(self) -> Optional[int]:
        """The length of the next reply, a bulk string (None: a nil reply, no bytes follow).
        Raises ``ReplyError`` for an error reply."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else n
        if kind == b"_":  # RESP3 nil
            return None
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        raise ProtocolError(f"expected a bulk string, got {line[:40]!r}")

    def read_into(self, dest: memoryview) -> None:
        """Exactly ``len(dest)`` bytes of the current bulk string into ``dest``."""
        n = len(dest)
        have = min(n, self._end - self._pos)
        dest[:have] = self._view[self._pos:self._pos + have]
        self._pos += have
        while have < n:
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise ConnectionError("Redis closed the connection")
            have += got

    def skip(self, n: int) -> None:
        """Drop ``n`` bytes of the current bulk string."""
        while n:
            if self._pos == self._end:
                self._fill()
            take = min(n, self._end - self._pos)
            self._pos += take
            n -= take

    def end_bulk(self) -> None:
        """The CRLF after a bulk string's bytes."""
        while self._end - self._pos < 2:
            self._fill()
        if self._view[self._pos:self._pos + 2] != b"\r\n":
            raise ProtocolError("a bulk string longer than its length")
        self._pos += 2

    def bulk(self) -> Optional[bytes]:
        """The next reply, a bulk string, as bytes (None: nil). Raises ``ReplyError``."""
        n = self.bulk_length()
        if n is None:
            return None
        out = bytearray(n)
        self.read_into(memoryview(out))
        self.end_bulk()
        return bytes(out)
