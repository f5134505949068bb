import time
import uuid

from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.scheduler.lookup_client import Answer, LookupClient
from lmcache_hma.worker.lookup_server import LookupServer
from tests.fakes import digest


def test_longest_hit_backs_off_to_last_tail():
    full = [True, True, True, True, False]  # chunks 0-3 have their full objects, 4 not

    def tails(stored):
        return [i in stored for i in range(len(full))]

    assert longest_hit(full, None) == 4  # no sliding groups
    assert longest_hit(full, tails({1, 3})) == 4
    assert longest_hit(full, tails({1})) == 2  # tail at 4 missing
    assert longest_hit(full, tails({4})) == 0  # chunk 4's tail is past the full prefix
    assert longest_hit(full, tails(set())) == 0
    assert longest_hit([], []) == 0


def test_lookup_rpc_roundtrip_and_timeout(tmp_path):
    addr = socket_address(f"unit-test-{uuid.uuid4().hex}")  # parallel runs never share it
    asked = []
    server = LookupServer(addr, lambda req, lookup, first, hs, deadline: (asked.append((req, first, deadline)) or
                                                                  len([h for h in hs if h in (digest(1), digest(3))]),
                                                                  req == "r-held", ()))
    client = LookupClient(addr, timeout_s=2)
    try:
        t0 = time.monotonic()
        assert client.lookup("r1", 1, 4, [digest(1), digest(2), digest(3)]) == Answer(2, False)  # 32-byte digests
        assert client.lookup("r-held", 2, 0, [digest(1)]) == Answer(1, True)
        assert client.lookup("r2", 3, 0, []) == Answer(0, False)
        assert [a[:2] for a in asked] == [("r1", 4), ("r-held", 0)]
        # the scheduler's deadline, on the clock both processes share
        assert all(t0 + 2 <= a[2] <= time.monotonic() + 2 for a in asked)
    finally:
        client.close()
        server.close()
    lonely = LookupClient(socket_address(f"nobody-listens-{uuid.uuid4().hex}"), timeout_s=0.2)
    assert lonely.lookup("r", 1, 0, [digest(1), digest(2)]) == Answer(0, False, answered=False)  # a miss, not a hang
    lonely.close()


def test_the_lookup_server_outlives_bad_messages_and_failing_answers():
    """A message it cannot read, or an answer that raises, is answered as a miss; the next
    lookup is answered as usual."""
    import zmq

    addr = socket_address(f"unit-test-{uuid.uuid4().hex}")
    calls = []

    def answer(req, lookup, first, hs, deadline):
        calls.append(req)
        if req == "boom":
            raise RuntimeError("injected")
        return len(hs), False, ("cpu",) * len(hs)

    server = LookupServer(addr, answer)
    client = LookupClient(addr, timeout_s=5)
    raw = zmq.Context.instance().socket(zmq.REQ)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        for bad in (b"not json", b'{"req": "x"}', b'{"req": "x", "lookup": 1, "first": 0, "deadline": 0, "hashes": ["zz"]}'):
            raw.send(bad)
            assert raw.recv() == b'{"chunks": 0, "held": false, "tiers": []}'
        assert client.lookup("boom", 1, 0, [digest(1)]) == Answer(0, False)
        assert client.lookup("ok", 2, 0, [digest(1), digest(2)]) == Answer(2, False, tiers=("cpu", "cpu"))
        assert server.errors == 4 and calls == ["boom", "ok"]
    finally:
        raw.close()
        client.close()
        server.close()


def test_a_silent_worker_costs_one_timeout_per_back_off_not_one_per_lookup():
    lonely = LookupClient(socket_address(f"nobody-listens-{uuid.uuid4().hex}"), timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert lonely.lookup("r", 1, 0, [digest(1)]) == Answer(0, False, answered=False)
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        for n in range(20):  # within the back-off: misses without asking
            assert lonely.lookup("r", 2 + n, 0, [digest(1)]) == Answer(0, False, answered=False)
        assert waited >= 0.3 and time.monotonic() - t1 < waited
    finally:
        lonely.close()
