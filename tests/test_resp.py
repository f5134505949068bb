"""resp.BulkReader: replies cut at every size, values straight into caller memory."""

import random
import socket
import threading
import time

import numpy as np
import pytest

from lmcache_hma.store.redis import resp

LIMIT = 1 << 20  # longest value these tests expect


def _reader_over(data: bytes, piece_sizes, buffer_bytes: int = 64):
    """A reader whose socket delivers ``data`` in pieces of the given sizes (cycled)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def feed():
        pos, sizes = 0, iter(piece_sizes)
        try:
            while pos < len(data):
                n = next(sizes)
                theirs.sendall(data[pos:pos + n])
                pos += n
        except OSError:  # the reader gave up (a refused reply) and closed its end
            pass
        finally:
            theirs.close()

    threading.Thread(target=feed, daemon=True).start()
    return resp.BulkReader(ours, resp.Deadline(5), buffer_bytes)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.mark.parametrize("piece", [1, 3, 64, 1000, 1 << 20])
def test_values_land_in_caller_memory_whatever_the_cuts(piece):
    rng = random.Random(piece)
    values = [rng.randbytes(n) for n in (0, 1, 63, 64, 65, 200, 5000)]  # around the 64-byte buffer
    data = b"".join(_bulk(v) for v in values) + b"$-1\r\n" + b"-MOVED 12 127.0.0.1:7001\r\n" + _bulk(b"meta")
    reader = _reader_over(data, [piece] * len(data))
    for v in values:
        n = reader.bulk_length(LIMIT)
        assert n == len(v)
        dest = np.zeros(n, dtype=np.uint8)
        reader.read_into(dest.data)
        reader.end_bulk()
        assert dest.tobytes() == v
    assert reader.bulk_length(LIMIT) is None
    with pytest.raises(resp.ReplyError, match="MOVED"):
        reader.bulk_length(LIMIT)
    assert reader.bulk(LIMIT) == b"meta"  # the connection is still in step after an error reply


def test_skipped_values_keep_the_reader_in_step():
    values = [bytes([i]) * (i * 37) for i in range(1, 9)]
    reader = _reader_over(b"".join(_bulk(v) for v in values), [7] * 10_000, buffer_bytes=16)
    for i, v in enumerate(values):
        n = reader.bulk_length(LIMIT)
        if i % 2:
            reader.skip(n)
            reader.end_bulk()
        else:
            dest = bytearray(n)
            reader.read_into(memoryview(dest))
            reader.end_bulk()
            assert bytes(dest) == v


@pytest.mark.parametrize("data, error", [
    (b"+OK\r\n", resp.ProtocolError),  # not a bulk string
    (b"$5\r\nabcdefg\r\n", resp.ProtocolError),  # longer than its length
    (b"$10\r\nabc", ConnectionError),  # cut off: the server closed the connection
    (b"$" + b"9" * 70_000, resp.ProtocolError),  # a length line that never ends
])
def test_broken_streams_raise_connection_errors(data, error):
    reader = _reader_over(data, [4096] * 100)
    with pytest.raises(error):
        n = reader.bulk_length(LIMIT)
        reader.read_into(memoryview(bytearray(n)))
        reader.end_bulk()
    assert issubclass(error, ConnectionError)  # callers drop the connection for all of them


def test_lines_longer_than_the_buffer_grow_it():
    error = b"-MOVED 16000 " + b"x" * 300 + b"\r\n"
    reader = _reader_over(error + _bulk(b"after"), [5] * 1000, buffer_bytes=16)
    with pytest.raises(resp.ReplyError, match="MOVED 16000 x"):
        reader.bulk_length(LIMIT)
    assert reader.bulk(LIMIT) == b"after"


def test_a_trickling_reply_ends_at_the_deadline():
    """One byte every 50 ms: each receive gets one in time, the call still ends at its deadline."""
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def drip():
        theirs.sendall(b"$100\r\n")
        while not stop.wait(0.05):
            theirs.sendall(b"x")

    threading.Thread(target=drip, daemon=True).start()
    reader = resp.BulkReader(ours, resp.Deadline(0.3))
    t0 = time.monotonic()
    try:
        with pytest.raises(resp.CallTimeout):
            n = reader.bulk_length(LIMIT)
            reader.read_into(memoryview(bytearray(n)))
    finally:
        stop.set()
    assert time.monotonic() - t0 < 1.0
    assert issubclass(resp.CallTimeout, TimeoutError)


@pytest.mark.parametrize("data, read", [
    (b"$17\r\n" + b"x" * 17 + b"\r\n", lambda r: r.bulk_length(16)),  # longer than the caller allows
    (b"$268435456\r\n", lambda r: r.bulk(4096)),  # a huge claim: nothing of it allocated
    (b"*2\r\n$5\r\nhello\r\n$99999\r\n", lambda r: r.reply(1024, 16)),  # a long string inside an array
    (b"*100000\r\n", lambda r: r.reply(1024, 16)),  # more elements than allowed
    (b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", lambda r: r.reply(1024, 16)),  # nested too deep
    (b">3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n:1\r\n", lambda r: r.integer()),  # RESP3 push on RESP2
    (b"$12x\r\n", lambda r: r.bulk(4096)),  # not a number
])
def test_replies_past_their_limits_are_protocol_errors(data, read):
    reader = _reader_over(data, [4096] * 10)
    with pytest.raises(resp.ProtocolError):
        read(reader)


def test_any_reply_within_its_limits():
    data = b"*2\r\n*3\r\n:0\r\n:5460\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n$-1\r\n+OK\r\n:7\r\n"
    reader = _reader_over(data, [3] * 100)
    assert reader.reply(1024, 16) == [[0, 5460, [b"127.0.0.1", 7000]], None]
    assert reader.status() == b"OK" and reader.integer() == 7 and reader.drained


def test_a_longer_bulk_string_says_its_length_and_can_be_drained():
    """``TooLong`` (a ``ProtocolError`` to callers that do not handle it) names the length before
    any of its bytes is read; draining them leaves the reader in step for the next reply."""
    long_value = b"v" * 5000
    reader = _reader_over(_bulk(long_value) + _bulk(b"next"), [7] * 2000, buffer_bytes=16)
    with pytest.raises(resp.TooLong) as err:
        reader.bulk_length(4096)
    assert (err.value.length, err.value.limit) == (5000, 4096) and isinstance(err.value, resp.ProtocolError)
    reader.skip(err.value.length)
    reader.end_bulk()
    assert reader.bulk(4096) == b"next" and reader.drained
