import uuid

from lmcache_hma.lookup import LookupClient, LookupServer, longest_hit, socket_address
from tests.fakes import digest


def test_longest_hit_backs_off_to_last_tail():
    hashes = [10, 11, 12, 13, 14]
    present = {10, 11, 12, 13}
    count = lambda hs: next((i for i, h in enumerate(hs) if h not in present), len(hs))
    assert longest_hit(hashes, count, None) == 4  # no sliding groups
    assert longest_hit(hashes, count, lambda h: h in {11, 13}) == 4
    assert longest_hit(hashes, count, lambda h: h in {11}) == 2  # tail at 4 missing
    assert longest_hit(hashes, count, lambda h: h in {14}) == 0  # 14 is past the full prefix
    assert longest_hit(hashes, count, lambda h: False) == 0


def test_lookup_rpc_roundtrip_and_timeout(tmp_path):
    addr = socket_address(f"unit-test-{uuid.uuid4().hex}")  # parallel runs never share it
    server = LookupServer(addr, lambda hs: len([h for h in hs if h in (digest(1), digest(3))]))
    client = LookupClient(addr, timeout_s=2)
    try:
        assert client.lookup([digest(1), digest(2), digest(3)]) == 2  # 32-byte digests survive
        assert client.lookup([]) == 0
    finally:
        client.close()
        server.close()
    lonely = LookupClient(socket_address(f"nobody-listens-{uuid.uuid4().hex}"), timeout_s=0.2)
    assert lonely.lookup([digest(1), digest(2)]) == 0  # a miss, not a hang
    lonely.close()
