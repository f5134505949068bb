"""Connections and commands on the wire: RESP packing, the handshake, reply checks.

Every connection is taken from a redis-py pool and handshaken here (AUTH, ``HELLO 2``)
against the call's ``resp.Deadline``; a reply that breaks RESP or its length limits
is a protocol error, and the connection is dropped, never returned with unread replies.
"""

from __future__ import annotations

import struct
import threading
from typing import Optional

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.store.redis import resp


def command(*args: bytes) -> bytes:
    """One command, packed (RESP). redis-py's ``pack_commands`` took several microseconds per
    command, more than Redis takes to answer an EXISTS."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


OBJECT_KEYS = 2  # LMCache's format: an object is two keys, ``<key>metadata`` and ``<key>kv_bytes``


def exists_commands(key_strings) -> bytes:
    """``EXISTS <key>metadata <key>kv_bytes`` for each key string, packed in one buffer: an
    object is there where the reply is ``OBJECT_KEYS``. Redis evicts keys one at a time, so a
    full Redis can hold one key of an object without the other: that is a miss here, not a
    fetch that fails."""
    return b"".join(command(b"EXISTS", k.encode() + b"metadata", k.encode() + b"kv_bytes") for k in key_strings)


META_BYTES = 4 << 10  # longest metadata value read (LMCache's RemoteMetadata, ~100 bytes, and a spill)


# Values fitted to Redis's allocator. Redis holds a string in one allocation of its length plus
# its header, its NUL and (a value of 32 KiB or more, kept as it arrived) the bulk's CRLF: 12 bytes
# on Redis 7, measured with MEMORY USAGE; that allocation is rounded up to jemalloc's next size
# class (four per power of two: 2^k times 1, 1.25, 1.5, 1.75). KV objects are pages times the
# layers they hold, which is exactly a class far more often than not, and the object's trailer
# tips each into the next class: on the capacity benchmark's Gemma-3 shape a chunk took 1.25x its
# bytes in Redis, a sliding tail 1.20x. So an object's last bytes, at most SPILL_BYTES, go after
# its metadata struct in ``<key>metadata`` (a small value, in a small class), and ``<key>kv_bytes``
# holds the rest, exactly a class less VALUE_OVERHEAD (``value_bytes``): the same memory holds a
# sixth more objects. A reader finds the split from the object's size alone.
VALUE_OVERHEAD = 16  # Redis's 12 bytes per string allocation, and a margin
SPILL_BYTES = 2048  # most bytes an object moves into its metadata value
MIN_FITTED = 32 << 10  # smaller objects are written whole (their rounding is a few hundred bytes)
_META_STRUCT_BYTES = 128  # LMCache's RemoteMetadata of one group (2 + 5 ints), rounded up: for sizes only


def size_class(n: int) -> int:
    """The jemalloc size class an allocation of ``n`` bytes takes (n > 16)."""
    step = max(1 << ((n - 1).bit_length() - 3), 16)
    return -(-n // step) * step


def _class_below(n: int) -> int:
    """The largest jemalloc size class under ``n``."""
    c = size_class(n)
    return c - max(1 << ((c - 1).bit_length() - 3), 16)


def value_bytes(nbytes: int) -> int:
    """How many of an object's ``nbytes`` go in ``<key>kv_bytes`` (the rest, its last bytes, after
    its metadata): a size class less ``VALUE_OVERHEAD`` where at most ``SPILL_BYTES`` are left over."""
    if nbytes < MIN_FITTED:
        return nbytes
    fit = _class_below(nbytes + VALUE_OVERHEAD) - VALUE_OVERHEAD
    return fit if nbytes - fit <= SPILL_BYTES else nbytes


def redis_bytes(nbytes: int) -> int:
    """What an object of ``nbytes`` takes in a Redis on jemalloc: both values as allocated, less
    the keys and their entries (the room adds those)."""
    value = value_bytes(nbytes)
    return size_class(value + VALUE_OVERHEAD) + size_class(_META_STRUCT_BYTES + nbytes - value + VALUE_OVERHEAD)


SMALL_BUFFER = 4 << 10  # reader buffer for replies without values (statuses, integers)


TOPOLOGY_BYTES = 64 << 10  # longest string in CLUSTER SLOTS or CLUSTER INFO


TOPOLOGY_ITEMS = 1 << 17  # most elements in CLUSTER SLOTS (16384 ranges, a few holders each)


_CALLS = threading.local()  # .deadline: the deadline of the call connecting now (``handshake``)


def connection(client, deadline: resp.Deadline):
    """A connection of ``client``'s pool, connected and authenticated before ``deadline``
    (a new one's handshake runs in ``handshake``)."""
    _CALLS.deadline = deadline
    try:
        return client.connection_pool.get_connection()
    finally:
        _CALLS.deadline = None


def handshake(conn) -> None:
    """redis-py's ``on_connect`` (given as ``redis_connect_func``) on ``resp``, within the
    deadline of the call connecting: AUTH and SELECT where needed, RESP2, no CLIENT SETINFO.
    redis-py's own reads each wait a socket timeout, however many there are."""
    import redis

    deadline = getattr(_CALLS, "deadline", None) or resp.Deadline(conn.socket_timeout or 2.0)
    conn._parser.on_connect(conn)
    commands = []
    if conn.password:
        auth = (conn.username, conn.password) if conn.username else (conn.password,)
        commands.append(command(b"AUTH", *(str(a).encode() for a in auth)))
    if conn.db:
        commands.append(command(b"SELECT", b"%d" % int(conn.db)))
    if not commands:
        return
    try:
        resp.send(conn._sock, commands, deadline)
        reader = resp.BulkReader(conn._sock, deadline, SMALL_BUFFER)
        for _ in commands:
            reader.status()
    except resp.ReplyError as exc:
        if str(exc).startswith(("WRONGPASS", "ERR invalid password", "NOAUTH")):
            raise redis.exceptions.AuthenticationError(str(exc)) from None
        raise redis.exceptions.ConnectionError(f"handshake: {exc}") from None
    except resp.CallTimeout as exc:
        raise redis.exceptions.TimeoutError(f"handshake: {exc}") from exc
    except OSError as exc:  # redis-py drops the connection after a RedisError only
        raise redis.exceptions.ConnectionError(f"handshake: {type(exc).__name__}: {exc}") from exc


def protocol_error(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or what caused it, in a handshake) is a ``resp.ProtocolError``."""
    return isinstance(exc, resp.ProtocolError) or isinstance(getattr(exc, "__cause__", None), resp.ProtocolError)


def set_commands(key_str: str, obj, ttl_ms: int = 0) -> list:
    """The two SETs that write ``obj`` (its bytes first, then its metadata), as pieces to send:
    ``<key>kv_bytes`` its first ``value_bytes`` bytes, sent from its memory, not copied, and
    ``<key>metadata`` LMCache's ``RemoteMetadata`` (the whole object's length, shapes, dtypes),
    then the object's last bytes (``value_bytes``). ``ttl_ms``: both keys expire after that many
    milliseconds (``SET ... PX``; a turn end's, ``expiring``)."""
    from lmcache.v1.protocol import RemoteMetadata

    data = obj.byte_array
    value = value_bytes(len(data))
    meta = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()).serialize()
    key = (key_str + "kv_bytes").encode()
    px = (b"PX", b"%d" % ttl_ms) if ttl_ms else ()
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(px), len(key), key, value)
    tail = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in px)
    flat = data.cast("B")  # LMCache's view is ctypes' '<B'
    body, spill = (data, b"") if value == len(data) else (flat[:value], bytes(flat[value:]))
    return [head, body, b"\r\n" + tail + command(b"SET", (key_str + "metadata").encode(), meta + spill, *px)]


def split_metadata(meta: bytes, nbytes: int) -> tuple[bytes, bytes]:
    """``<key>metadata``'s value for an object of ``nbytes``: (LMCache's ``RemoteMetadata``, the
    object's last bytes). Raises ``ValueError`` where it is not that long."""
    from lmcache.v1 import protocol

    spill = nbytes - value_bytes(nbytes)
    if protocol.REMOTE_METADATA_FMT is None or len(meta) != struct.calcsize(protocol.REMOTE_METADATA_FMT) + spill:
        raise ValueError(f"its metadata in Redis is {len(meta)} bytes, not the metadata and {spill} bytes of its object")
    return meta[:len(meta) - spill], meta[len(meta) - spill:]


# The kind of an object is the last dot-separated part of its key's ``model_name``
# (``core.keys.Namespace.model_field``: ``<model tag>.<fingerprint>.<kind>``), whatever the namespace.
_TURN_FIELD_END = "." + ObjectKind.TURN.name.lower()
_EXPIRING_ENDS = (_TURN_FIELD_END, "." + ObjectKind.TURNMARK.name.lower())
_STATE_FIELD_END = "." + ObjectKind.STATE.name.lower()


def expiring(key) -> bool:
    """Whether ``key`` (an LMCache key) names a part of a turn end that its key tells: the turn
    object (``ObjectKind.TURN``) or a marker (``TURNMARK``, which lists turn ends). Every part of a
    turn end is given the TTL in Redis (``hma_redis_turn_end_ttl_s``), both keys of each: these, and
    its recurrent states (a ``STATE`` object under the turn end's digest, which the writer names:
    ``RedisTier.store_many``'s ``expires``; a read renews them with the turn object, ``siblings``).
    A turn end serves only its own conversation's next turn, and most are never read again; the
    rest stay until Redis evicts them. A marker is rewritten with each turn end after its prefix
    and read by every lookup that finds one: it outlives the last of them by at most the TTL."""
    return str(getattr(key, "model_name", "")).endswith(_EXPIRING_ENDS)


def siblings(key) -> tuple:
    """The key strings a read of ``key`` renews besides its own: a turn object's states (the
    ``STATE`` object under the same digest: only a turn end's states are named by a turn digest)."""
    name = str(getattr(key, "model_name", ""))
    if not name.endswith(_TURN_FIELD_END):
        return ()
    return (name[:-len(_TURN_FIELD_END)] + _STATE_FIELD_END + key.to_string()[len(name):],)


def renew_commands(key_strs, ttl_ms: int) -> bytes:
    """``PEXPIRE`` of both keys of each object of ``key_strs`` (a key string, or several): a read
    of a turn end renews its TTL (and its states'), pipelined with the read (two integer replies
    per object, 0 for a key that is gone). PEXPIRE rather than GETEX (Redis 6.2+): every Redis the
    connector runs with has it."""
    ms = b"%d" % ttl_ms
    return b"".join(command(b"PEXPIRE", k.encode() + b"metadata", ms) + command(b"PEXPIRE", k.encode() + b"kv_bytes", ms)
                    for k in ((key_strs,) if isinstance(key_strs, str) else key_strs))


def delete_commands(key_strings) -> bytes:
    """``DEL <key>metadata <key>kv_bytes`` per object (an integer reply each: 0 where the object
    was gone already), packed in one buffer."""
    return b"".join(command(b"DEL", k.encode() + b"metadata", k.encode() + b"kv_bytes") for k in key_strings)


def touch_commands(key_strings) -> bytes:
    """``TOUCH <key>metadata <key>kv_bytes`` per object (an integer reply each): Redis counts a use
    of both keys for its eviction (``maxmemory-policy``: their LFU counter, or their last use for
    LRU), as a GET would, without reading them. One command per object: both keys are in one slot
    of a cluster (``core.keys.hash_tag_configs``), two objects need not be."""
    return b"".join(command(b"TOUCH", k.encode() + b"metadata", k.encode() + b"kv_bytes") for k in key_strings)


def all_ok(reader: resp.BulkReader, n: int) -> None:
    """``n`` replies, each ``+OK`` (raises ``ReplyError`` for an error reply)."""
    for _ in range(n):
        reply = reader.status()
        if reply != b"OK":
            raise resp.ProtocolError(f"expected +OK, got {reply[:40]!r}")


def give_back(client, conn, broken: bool = False) -> None:
    """Return ``conn`` to ``client``'s pool (disconnected first when ``broken``: its state is unknown)."""
    if conn is None:
        return
    if broken:
        conn.disconnect()
    client.connection_pool.release(conn)


def broken_connection(exc: Exception) -> bool:
    """A connection that broke (worth one retry on a fresh one), not a timeout, a refused
    password, nor a reply that broke the protocol."""
    import redis

    if protocol_error(exc) or isinstance(exc, redis.exceptions.AuthenticationError):
        return False
    return isinstance(exc, (ConnectionError, redis.exceptions.ConnectionError))
