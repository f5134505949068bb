"""Reading Redis replies (RESP) with the values landing straight in the caller's memory.

redis-py's parser reads a socket in 64 KiB pieces, joins them, and hands each value
back as a new ``bytes``, which the caller then copies into its object: a second copy
of every byte of a hit. ``BulkReader`` reads values straight into the objects, on a
connection redis-py made (connect and TLS stay redis-py's); ``benchmarks/bench_redis.py``
compares the two.

Nothing a server sends is trusted: every call runs against one ``Deadline`` (each
send and receive gets the time left, so a server that sends a byte now and then
cannot keep a call alive), and every length is checked against what the caller
expects before anything is allocated or skipped (a longer one is ``TooLong``: the
caller decides whether draining it is worth its time).
"""

from __future__ import annotations

import socket
import time
from typing import Optional

_MAX_LINE = 64 << 10  # longest status, error or length line accepted


def socket_of(connection) -> socket.socket:
    """The socket of a connected redis-py ``Connection`` (redis-py 8 keeps it in ``_sock``)."""
    sock = getattr(connection, "_sock", None)
    if sock is None:
        raise ConnectionError("the redis-py connection has no socket")
    return sock


class ProtocolError(ConnectionError):
    """The connection's bytes are not RESP, or not the reply asked for (a length larger than
    the caller allows, a RESP3 push frame on a RESP2 connection): it must be closed."""


class TooLong(ProtocolError):
    """A bulk string longer than the caller allows: its length line is read, none of its
    ``length`` bytes. A caller that drains them (``skip``, then ``end_bulk``) has the
    connection in step again; any other must close it, as for every ``ProtocolError``."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"a bulk string of {length} bytes where at most {limit} are expected")
        self.length, self.limit = length, limit


class CallTimeout(TimeoutError):
    """A call's ``Deadline`` passed: the connection is mid-reply and must be closed."""


class Deadline:
    """The time by which a whole call (connect, every send, every receive) must be over."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left (> 0); raises ``CallTimeout`` once there are none."""
        left = self._at - time.monotonic()
        if left <= 0:
            raise CallTimeout(f"no complete answer within {self.seconds:g} s")
        return left


def send(sock: socket.socket, pieces, deadline: Deadline) -> None:
    """Every piece of ``pieces`` (bytes-like) onto ``sock`` before ``deadline``."""
    for piece in pieces:
        sock.settimeout(deadline.remaining())
        try:
            sock.sendall(piece)
        except socket.timeout as exc:  # one sendall waits for the whole piece
            raise CallTimeout(f"could not send within {deadline.seconds:g} s") from exc


class ReplyError(Exception):
    """An error reply (``-ERR ...``, ``-MOVED ...``): that command failed, the connection is fine."""


class BulkReader:
    """Replies read off one socket, in order. A small bulk string comes back as ``bytes``
    (``bulk``); a large one can instead go straight into a caller's buffer
    (``bulk_length``, then ``read_into`` or ``skip``, then ``end_bulk``).

    Every receive waits at most what is left of ``deadline``. Any exception but
    ``ReplyError`` leaves the connection in an unknown state: the caller must
    disconnect it.
    """

    def __init__(self, sock: socket.socket, deadline: Deadline, buffer_bytes: int = 1 << 16) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0

    @property
    def drained(self) -> bool:
        """Whether nothing read off the socket is left unread: only then may the connection
        serve another call (bytes past the replies asked for mean it is out of step)."""
        return self._pos == self._end

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
        self._end += self._recv_into(self._view[self._end:])

    def _recv_into(self, dest: memoryview) -> int:
        self._sock.settimeout(self._deadline.remaining())
        try:
            got = self._sock.recv_into(dest)
        except socket.timeout as exc:
            raise CallTimeout(f"no complete answer within {self._deadline.seconds:g} s") from exc
        if not got:
            raise ConnectionError("Redis closed the connection")
        return got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._pos, self._end)
            if i >= 0:
                line = bytes(self._view[self._pos:i])
                self._pos = i + 2
                return line
            self._fill()

    def _header(self, kinds: bytes) -> tuple[bytes, bytes]:
        """(kind, rest) of the next reply's first line, a kind in ``kinds``; raises
        ``ReplyError`` for an error reply, ``ProtocolError`` for any other kind."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        if not kind or kind not in kinds:
            raise ProtocolError(f"expected one of {kinds!r}, got {line[:40]!r}")
        return kind, rest

    def bulk_length(self, limit: int) -> Optional[int]:
        """The length of the next reply, a bulk string of at most ``limit`` bytes (None: a
        nil reply, no bytes follow). Raises ``ReplyError`` for an error reply and
        ``TooLong`` for a longer one (nothing of its bytes is read)."""
        kind, rest = self._header(b"$_")
        if kind == b"_":  # RESP3 nil
            return None
        n = _number(rest)
        if n > limit:
            raise TooLong(n, limit)
        return None if n < 0 else n

    def integer(self) -> int:
        """The next reply, an integer (``:1``). Raises ``ReplyError``."""
        return _number(self._header(b":")[1])

    def status(self) -> bytes:
        """The next reply, a status (``+OK``). Raises ``ReplyError``."""
        return self._header(b"+")[1]

    def reply(self, max_bytes: int, max_items: int, depth: int = 4):
        """The next reply, any RESP2 type (bulk strings of at most ``max_bytes``, arrays of
        at most ``max_items`` elements in all, nested ``depth`` deep), as redis-py gives it
        without decoding: ``bytes``, ``int``, ``list`` or None."""
        budget = [max_items]

        def one(level: int):
            kind, rest = self._header(b"+:$*")
            if kind == b"+":
                return rest
            if kind == b":":
                return _number(rest)
            if kind == b"$":
                n = _number(rest)
                if n > max_bytes:
                    raise ProtocolError(f"a bulk string of {n} bytes where at most {max_bytes} are expected")
                return None if n < 0 else self._bytes(n)
            n = _number(rest)
            budget[0] -= max(n, 0)
            if budget[0] < 0 or level >= depth:
                raise ProtocolError(f"an array larger or deeper than expected ({n} elements)")
            return None if n < 0 else [one(level + 1) for _ in range(n)]

        return one(0)

    def _bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        self.end_bulk()
        return bytes(out)

    def read_into(self, dest: memoryview) -> None:
        """Exactly ``len(dest)`` bytes of the current bulk string into ``dest``."""
        n = len(dest)
        have = min(n, self._end - self._pos)
        dest[:have] = self._view[self._pos:self._pos + have]
        self._pos += have
        while have < n:
            have += self._recv_into(dest[have:])

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

    def bulk(self, limit: int) -> Optional[bytes]:
        """The next reply, a bulk string of at most ``limit`` bytes, as bytes (None: nil).
        Raises ``ReplyError``, or ``TooLong`` for a longer one."""
        n = self.bulk_length(limit)
        return None if n is None else self._bytes(n)


def _number(text: bytes) -> int:
    """The integer of a reply's first line (a length, a count, an integer reply)."""
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"expected a number, got {text[:40]!r}") from None
