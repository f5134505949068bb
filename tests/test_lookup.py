import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from lmcache_hma.config.errors import ConfigError
from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.lookup_wire import Found, socket_address
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
    server = LookupServer(addr, lambda req, lookup, first, hs, deadline, **turns: Found(
        asked.append((req, first, deadline)) or len([h for h in hs if h in (digest(1), digest(3))]),
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
        # a second lookup of one scheduling call keeps the call's deadline, never a fresh timeout
        call_deadline = time.monotonic() + 0.5
        client.lookup("r3", 4, 0, [digest(1)], turns=(1, [(300, digest(9), False)]), deadline=call_deadline)
        assert asked[-1] == ("r3", 0, call_deadline)
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

    def answer(req, lookup, first, hs, deadline, **turns):
        calls.append(req)
        if req == "boom":
            raise RuntimeError("injected")
        return Found(len(hs), False, ("cpu",) * len(hs))

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
        # the first waited out its timeout (zmq's RCVTIMEO counts whole ms of what the send left:
        # it may end a ms or so before 0.3 s); the 20 after it, together, took less
        assert waited >= 0.3 - 0.01 and time.monotonic() - t1 < waited
    finally:
        lonely.close()


@pytest.fixture
def temp_root(monkeypatch):
    """A temp dir of the test's own (what ``TMPDIR`` sets), so the real per-user directory is left
    alone; short (not pytest's tmp_path), as a socket's path must fit in 107 bytes."""
    root = tempfile.mkdtemp(prefix="hma-")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield pathlib.Path(root)
    shutil.rmtree(root)


def test_the_lookup_socket_is_owner_only_in_a_private_directory_even_with_umask_000(temp_root):
    """It answers resets and holds to whoever can connect: only this user may, whatever the umask."""
    old_umask = os.umask(0)
    try:
        addr = socket_address("engine-a")
        server = LookupServer(addr, lambda req, lookup, first, hs, deadline, **turns: Found(len(hs), False, ()))
    finally:
        os.umask(old_umask)
    client = LookupClient(addr, timeout_s=5)
    private = temp_root / f"lmcache_hma-{os.getuid()}"
    path = private / "engine-a.sock"
    try:
        f = os.lstat(addr[len("ipc://"):])
        assert stat.S_ISSOCK(f.st_mode) and stat.S_IMODE(f.st_mode) == 0o600 and f.st_uid == os.getuid()
        assert addr == f"ipc://{path}"
        d = os.lstat(private)
        assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.getuid()
        assert client.lookup("r", 1, 0, [digest(1), digest(2)]) == Answer(2, False)
        # the scheduler is another process of the same user, with the same environment: the same address
        other = subprocess.run([sys.executable, "-c", "from lmcache_hma.core.lookup_wire import Found, socket_address;"
                                "print(socket_address('engine-a'))"], env={**os.environ, "TMPDIR": str(temp_root)},
                               capture_output=True, text=True, check=True)
        assert other.stdout.strip() == addr
    finally:
        client.close()
        server.close()
    assert not path.exists()  # removed on close
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700  # kept for the next engine, still private


OTHER_UID = 12345


@pytest.mark.parametrize("mode, owner, message", [
    (0o777, None, "is writable by every user"),
    (0o750, None, "is open to other users \\(mode 0750\\)"),
    (0o701, None, "is open to other users \\(mode 0701\\)"),
    (0o700, OTHER_UID, f"is owned by another user \\(uid {OTHER_UID}\\)"),
])
def test_a_lookup_socket_directory_that_is_not_private_is_refused_by_both_halves(temp_root, mode, owner, message):
    if owner is not None and os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    private = temp_root / f"lmcache_hma-{os.getuid()}"
    private.mkdir()
    os.chmod(private, mode)
    if owner is not None:
        os.chown(private, owner, -1)
    # socket_address is what the worker binds and the scheduler connects to: neither gets one
    with pytest.raises(ConfigError, match=f"lookup socket's directory '{re.escape(str(private))}' {message}; remove it, or "
                                          f"point TMPDIR"):
        socket_address("engine-a")
    assert os.listdir(private) == []


def test_a_symbolic_link_in_place_of_the_lookup_socket_directory_is_refused(temp_root):
    """Its owner could point it elsewhere after the check, even at a directory of ours."""
    mine = temp_root / "mine"
    mine.mkdir(mode=0o700)
    (temp_root / f"lmcache_hma-{os.getuid()}").symlink_to(mine)
    with pytest.raises(ConfigError, match="lookup socket's directory .* is a symbolic link"):
        socket_address("engine-a")


def test_a_turn_end_on_tail_travels_both_ways(tmp_path):
    """A candidate turn end stored ``on_tail`` (``ObjectRef.on_tail``) reaches the worker as such,
    and the answer says the hit's turn end is one: the scheduler keys and loads it by that."""
    addr = socket_address(f"unit-test-{uuid.uuid4().hex}")
    asked = []

    def answer(req, lookup, first, hs, deadline, turns=None, **_):
        asked.append(turns)
        end, _, on_tail = turns[1][0]
        return Found(1, False, ("cpu", "disk"), turn_end=end, turn_on_tail=on_tail)

    server = LookupServer(addr, answer)
    client = LookupClient(addr, timeout_s=2)
    try:
        got = client.lookup("r", 1, 0, [digest(1)], turns=(1, [(300, digest(9), True), (290, digest(8), False)]))
        assert asked[-1] == (1, [(300, digest(9), True), (290, digest(8), False)])
        assert (got.turn_end, got.turn_on_tail, got.tiers) == (300, True, ("cpu", "disk"))
        got = client.lookup("r", 2, 0, [digest(1)], turns=(1, [(290, digest(8), False)]))
        assert (got.turn_end, got.turn_on_tail) == (290, False)
    finally:
        client.close()
        server.close()
