"""Pipelined reads of a hit's objects, shard by shard (``RedisTier.fetch_many``).

Each object is read as its metadata and then its value in pieces (one GET, or GETRANGEs
of equal size), sent in batches, the next batch sent before one is read; the shards'
batches are read in turn, so every shard prepares its replies while another's are read.
An object's bytes go from the socket straight into its memory object, its last few from its
metadata (``wire.value_bytes``: the value fits a size class of Redis's allocator).

A reply longer than any object of its key can have (metadata over ``META_BYTES``, a
value longer than the object) is what Redis holds when someone wrote it there: that
object is damaged (the store counts and deletes it), not the connection. Such a reply
is drained when it is at most ``SKIP_BYTES``; a longer one costs its connection, Redis
confirms its length (``STRLEN``), and the shard's other objects are read again on a
fresh connection. A length Redis does not confirm is a protocol error.
"""

from __future__ import annotations

from typing import Callable, Optional

from lmcache_hma.store.redis import resp
from lmcache_hma.store.redis.wire import (SMALL_BUFFER, command, META_BYTES, connection, give_back, renew_commands,
                                          split_metadata, value_bytes)

# The longest over-long reply drained (its connection kept): 1/16 s at the slowest rate a
# call allows for (``DeadlineCalls.MIN_BYTES_PER_S``). Redis values go up to 512 MiB.
SKIP_BYTES = 4 << 20


class DamagedReply(Exception):
    """An object's reply was too long to drain and Redis confirmed its length: the object is
    damaged; its shard's connection is dropped and the shard's other objects are read again."""


class ShardFetch:
    """One shard's part of ``fetch_many``: ``batches`` of pieces (``pieces``), sent by
    redis-py on a connection from ``client``'s pool (connected, authenticated, nothing
    unread), ``AHEAD`` batches beyond the one being read; replies read by
    ``resp.BulkReader`` into the objects in ``out`` (shared by the shards), all before
    ``deadline`` (shared by the shards too).

    After a failure ``left`` holds the objects (``[(index, key string)]``) not read whole
    and ``error`` why; their memory objects are released, their entries None, and the
    connection is closed (never back to the pool with unread replies). Objects found
    damaged by a reply's length (``damaged``) keep their entry (why) and are not in ``left``.

    ``renew``: ``{index: (milliseconds, key strings of its siblings)}`` of the objects whose TTL a
    read renews (``wire.expiring``, ``wire.siblings``): both keys' ``PEXPIRE`` of the object and of
    each sibling follow the object's metadata GET in the same batch.
    """

    AHEAD = 1

    def __init__(self, client, batches: list, out: list, deadline: resp.Deadline,
                 renew: Optional[dict] = None) -> None:
        self.client, self.batches, self.out, self.deadline = client, batches, out, deadline
        self.renew = renew or {}
        self.conn = self.reader = None
        self.sent = self.done = 0
        self.filling: dict = {}  # index -> (memory object, its bytes): pieces still to read
        self.damaged: set = set()  # indices whose metadata or value in Redis is over-long
        self.left: list = []
        self.error: Optional[Exception] = None

    def begin(self) -> None:
        self.conn = connection(self.client, self.deadline)
        self.reader = resp.BulkReader(resp.socket_of(self.conn), self.deadline)
        self._send()

    def _send(self) -> None:
        while self.sent < min(self.done + 1 + self.AHEAD, len(self.batches)):
            commands = []
            for i, k, lo, hi, value, _ in self.batches[self.sent]:
                key = k.encode()
                if lo == 0:
                    commands.append(command(b"GET", key + b"metadata"))
                    if i in self.renew:
                        commands.append(renew_commands((k, *self.renew[i][1]), self.renew[i][0]))
                commands.append(command(b"GET", key + b"kv_bytes") if hi - lo == value else
                                command(b"GETRANGE", key + b"kv_bytes", b"%d" % lo, b"%d" % (hi - 1)))
            resp.send(resp.socket_of(self.conn), [b"".join(commands)], self.deadline)
            self.sent += 1

    def step(self, allocate: Callable, check: Optional[Callable]) -> bool:
        """Read the next batch (sending the ones after it); False when all are read."""
        for piece in self.batches[self.done]:
            self._read(piece, allocate, check)
        self.done += 1
        self._send()
        return self.done < len(self.batches)

    def _read(self, piece: tuple, allocate: Callable, check: Optional[Callable]) -> None:
        """One piece's replies: at an object's first piece its metadata, then the piece's bytes.

        The GETs of an object are not atomic (they never were: metadata and bytes are two
        keys); an object rewritten between them fails its trailer check, a miss.
        """
        out, reader = self.out, self.reader
        i, k, lo, hi, value, length = piece
        if lo == 0:
            try:
                meta = reader.bulk(META_BYTES)
            except resp.ReplyError:
                meta = None  # e.g. MOVED while a cluster fails over: a miss
            except resp.TooLong as exc:  # LMCache's metadata is ~100 bytes: someone wrote this
                meta = None
                self._over_long(i, k.encode() + b"metadata", exc,
                                f"its metadata in Redis is {exc.length} bytes, at most {META_BYTES} expected")
            if i in self.renew:  # its PEXPIREs' replies (how many keys were there: not needed)
                for _ in range(2 * (1 + len(self.renew[i][1]))):
                    try:
                        reader.integer()
                    except resp.ReplyError:
                        pass
            if i not in self.damaged:
                # None: a miss (no metadata) or no room; a str: in Redis but unreadable
                why, spill = (None, b"") if meta is None else why_unreadable(meta, length)
                obj = allocate(i) if meta is not None and why is None else None
                out[i] = obj if obj is not None else why
                if obj is not None:  # its bytes as plain bytes (LMCache's view is ctypes' '<B')
                    view = obj.byte_array.cast("B")
                    view[value:] = spill
                    self.filling[i] = (obj, view)
        error = False
        try:
            size = reader.bulk_length(hi - lo)
        except resp.ReplyError:  # e.g. MOVED while a cluster fails over: a miss, not damage
            size, error = None, True
        except resp.TooLong as exc:
            if hi - lo != value:  # a GETRANGE never answers more than it asks for: not Redis's answer
                raise
            # one GET of the whole value: it must be ``value`` bytes, whatever its metadata
            self._over_long(i, k.encode() + b"kv_bytes", exc, bad_value(exc.length, lo, value, ranged=False))
            return
        held = self.filling.get(i)
        if held is not None and (error or size != hi - lo):  # else: not what its metadata says
            out[i] = None if error else bad_value(size, lo, value, ranged=hi - lo != value)
            del self.filling[i]
            held[0].ref_count_down()
            held = None
        if size is not None:
            if held is None:
                reader.skip(size)
            else:
                reader.read_into(held[1][lo:hi])
            reader.end_bulk()
        if held is not None and hi == value:
            del self.filling[i]
            # checked while the next replies arrive (the socket buffers them meanwhile)
            why = check(i, held[0]) if check is not None else None
            if why is not None:
                held[0].ref_count_down()
                out[i] = why

    def _over_long(self, i: int, key: bytes, exc: resp.TooLong, why: str) -> None:
        """Object ``i``'s reply for ``key`` is ``exc.length`` bytes, longer than any object's:
        drain it (when it is at most ``SKIP_BYTES``) or drop the connection and ask Redis the
        value's length; once the bytes or Redis confirm it, the object is damaged (``why``).

        Nothing of the claim is allocated, and nothing is damaged on a claim alone: a lying
        server or proxy (a length Redis does not confirm, bytes that do not end where their
        length says, or not in time) is a protocol error, its objects misses. The store deletes
        a damaged object under the key it computed for it, never a name read from Redis: with
        ``hma_shared_secret`` the trailer's MAC of an over-long object is never checked, yet
        the key is this deployment's own (an HMAC under the secret), so only what this
        deployment would read is deleted, and whoever wrote it could have deleted it anyway.
        """
        if exc.length <= SKIP_BYTES:
            self.reader.skip(exc.length)
            self.reader.end_bulk()  # the bytes ended where their length said: Redis holds them
        else:
            self.conn.disconnect()  # its unread reply is never read: never back to the pool
            held = self._length_in_redis(key)
            if held != exc.length:
                raise resp.ProtocolError(f"a reply of {exc.length} bytes for {key[-8:].decode()}, "
                                         f"which Redis says holds {held}")
        held = self.filling.pop(i, None)
        if held is not None:  # its memory object: given back
            held[0].ref_count_down()
            self.out[i] = None
        if not isinstance(self.out[i], str):  # else: found unreadable already
            self.out[i] = why
        self.damaged.add(i)
        if exc.length > SKIP_BYTES:
            raise DamagedReply(why)

    def _length_in_redis(self, key: bytes) -> int:
        """``STRLEN key`` on another connection of the pool (within the deadline)."""
        conn = connection(self.client, self.deadline)
        try:
            sock = resp.socket_of(conn)
            resp.send(sock, [command(b"STRLEN", key)], self.deadline)
            reader = resp.BulkReader(sock, self.deadline, SMALL_BUFFER)
            n = reader.integer()
        except BaseException:
            give_back(self.client, conn, broken=True)
            raise
        give_back(self.client, conn, broken=not reader.drained)
        return n

    def fail(self, exc: Exception) -> None:
        if self.conn is not None:
            self.conn.disconnect()  # unread replies: never back to the pool like this
        left = [(i, k) for batch in self.batches[self.done:] for i, k, *_ in batch if i not in self.damaged]
        # the objects not read whole: none of them is given out, each is read again or a miss
        for i in set(self.filling) | {i for i, _ in left}:
            if self.out[i] is not None and not isinstance(self.out[i], str):
                self.out[i].ref_count_down()
            self.out[i] = None
        self.filling.clear()
        self.left = list(dict.fromkeys(left))
        self.error = exc

    def finish(self) -> None:
        if self.conn is not None:
            give_back(self.client, self.conn, broken=self.error is None and not self.reader.drained)
            self.conn = None


def read_in_turn(shards: list, allocate: Callable, check: Optional[Callable]) -> None:
    """Every shard's batches, one batch of each shard in turn (``ShardFetch``)."""
    active = []
    for shard in shards:
        try:
            shard.begin()
            active.append(shard)
        except Exception as exc:
            shard.fail(exc)
            shard.finish()
    try:
        while active:
            for shard in list(active):
                try:
                    more = shard.step(allocate, check)
                except Exception as exc:
                    shard.fail(exc)
                    more = False
                if not more:
                    shard.finish()
                    active.remove(shard)
    except BaseException as exc:  # interrupted: no connection goes back with unread replies
        for shard in active:
            shard.fail(exc)
            shard.finish()
        raise


def batches(items: list, size_of: Callable, limit: int):
    """``items`` in consecutive runs of at most ``limit`` total size (at least one item each)."""
    batch, total = [], 0
    for item in items:
        if batch and total + size_of(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size_of(item)
    if batch:
        yield batch


_META_LENGTHS: dict = {}  # metadata bytes -> the length they give (a hit's objects share a few)


def why_unreadable(meta: bytes, expected_bytes: int) -> tuple[Optional[str], bytes]:
    """(why an object whose metadata value is ``meta`` cannot be read as an object of
    ``expected_bytes``, or None; the object's last bytes, which follow its metadata there:
    ``wire.split_metadata``). Its value is checked as it is read, the whole object by its trailer."""
    from lmcache.v1.protocol import RemoteMetadata

    try:
        meta, spill = split_metadata(meta, expected_bytes)
    except ValueError as exc:
        return str(exc), b""
    length = _META_LENGTHS.get(meta)
    if length is None:
        try:
            length = RemoteMetadata.deserialize(meta).length
        except Exception:
            return "its metadata in Redis is malformed", b""
        if len(_META_LENGTHS) >= 256:
            _META_LENGTHS.clear()
        _META_LENGTHS[meta] = length
    if length != expected_bytes:
        return f"its metadata in Redis says {length} bytes, expected {expected_bytes}", b""
    return None, spill


def parts(nbytes: int, range_bytes: int) -> list[tuple[int, int]]:
    """How an object of ``nbytes`` is read: ``[(0, nbytes)]`` (one GET), or the byte ranges
    of its GETRANGEs, as few as fit in ``range_bytes`` each, of equal size (the last one
    shorter by what does not divide)."""
    count = -(-nbytes // range_bytes)
    if count <= 1:
        return [(0, nbytes)]
    size = -(-nbytes // count)
    return [(lo, min(nbytes, lo + size)) for lo in range(0, nbytes, size)]


def pieces(items: list, object_bytes: list[int], range_bytes: int) -> list[tuple]:
    """``[(index, key string, lo, hi, value's bytes, object's bytes)]``: every object of ``items``
    (``[(index, key string)]``) as the pieces its value is read in (``parts`` of its
    ``wire.value_bytes``), in order."""
    out = []
    for i, k in items:
        value = value_bytes(object_bytes[i])
        out += [(i, k, lo, hi, value, object_bytes[i]) for lo, hi in parts(value, range_bytes)]
    return out


def piece_bytes(piece: tuple) -> int:
    return piece[3] - piece[2]


def bad_value(size: Optional[int], lo: int, length: int, ranged: bool) -> str:
    """Why a value whose read at byte ``lo`` gave ``size`` bytes (None: nil or an error reply)
    is not the ``length``-byte value its metadata says (read whole, or ``ranged``)."""
    if not size and lo == 0:
        return "its metadata is in Redis without its bytes"
    if ranged:
        return f"its value in Redis is shorter than its metadata says ({length} bytes)"
    return f"its value in Redis is {size} bytes, its metadata says {length}"
