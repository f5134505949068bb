from lmcache_hma.lookup import LookupClient, LookupServer, longest_hit, socket_address


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
    addr = socket_address("unit-test-engine")
    server = LookupServer(addr, lambda hs: len([h for h in hs if h > 2**62]))
    client = LookupClient(addr, timeout_s=2)
    try:
        assert client.lookup([2**63 + 5, 1, 2**63 + 7]) == 2  # big ints survive
        assert client.lookup([]) == 0
    finally:
        client.close()
        server.close()
    lonely = LookupClient(socket_address("nobody-listens"), timeout_s=0.2)
    assert lonely.lookup([1, 2]) == 0  # a miss, not a hang
    lonely.close()
