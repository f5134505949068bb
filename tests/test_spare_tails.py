"""Tails on speculation (``hma_spare_tail_fill``, issue 58 item 12): ``branch`` admission also
plans the prompt's interval tails it would skip, marked ``spare``; the worker stores them while
its local tiers are below the fill level, and the value policy drops them first.

The real ``SchedulerHalf`` plans (tests/test_scheduler.py's engine: layout "SSF", chunk 8,
window 8: the checkpoint interval is a chunk, the sparse interval 16 tokens), a real
``WorkerHalf`` on a 2 MB LMCache CPU tier stores and answers the lookups (tests/test_worker.py).
"""

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.scheduler.admission import SPARE
from tests.fakes import digest
from tests.test_scheduler import OTHER, TOKENS, Engine, request
from tests.test_worker import make_worker

A = TOKENS[:48]  # tails: 16, 32 (sparse interval), 40, 48 (its end); on speculation 8 and 24
B = TOKENS[:24] + OTHER[:24]  # shares half of A


def store_prompt(e: Engine, worker, req) -> list:
    """Plan ``req``'s prefill and have the worker store it; the planned objects."""
    e.admit(req)
    refs = []
    for meta in e.prefill(req):
        worker.wait_for_save(meta)
        refs += [ref for spec in meta.saves for ref in spec.objects]
    worker.drain()
    return refs


def hit_tokens(e: Engine, worker, tokens, req_id) -> int:
    """How far the worker serves ``tokens`` (a hit leaves a token to compute)."""
    hashes = e.hashes(tokens)[: (len(tokens) - 1) // 8]
    found = worker._answer_lookup(req_id, 1, 0, hashes)
    worker.held.release(req_id, 1)  # nothing loads it
    return found[0] * 8


def spare_names(refs) -> list[str]:
    return [f"T{r.chunk}" for r in refs if r.kind is ObjectKind.TAIL and r.spare]


def test_a_prompt_sharing_half_of_another_hits_where_they_part_while_the_tier_has_room(tmp_path):
    """B shares A's first 24 tokens. ``branch`` alone stores A's tails at 16 and 32, so B hits 16;
    with tails on speculation A's tail at 24 is stored too and B hits all 24 it shares."""
    for spare, want in ((False, 16), (True, 24)):
        e = Engine(tmp_path, admission="branch")
        worker, *_ = make_worker(tmp_path)
        try:
            e.sched.admission.spare = spare  # hma_spare_tail_fill 0 / the default
            refs = store_prompt(e, worker, request("a", A))
            assert spare_names(refs) == (["T0", "T2"] if spare else [])
            assert e.sched.admission.wants_boundary(2, e.hashes(A)[2], 48, True) == (SPARE if spare else False)
            assert worker.counters().get("spare_tails_skipped", 0) == 0
            assert hit_tokens(e, worker, B, "b") == want, spare
            key = worker.store.key(ObjectKind.TAIL, e.hashes(A)[2])
            assert (worker.store.lineage.get(key) is not None) == spare  # a Line marked spare
            assert not spare or worker.store.lineage.get(key).spare
        finally:
            worker.shutdown()
            e.close()


def test_above_the_fill_level_tails_on_speculation_are_not_stored(tmp_path):
    """The CPU tier is over half full (the default fill): A's spare tails are skipped (counted),
    its other objects stored; B hits at the sparse interval, as with ``branch`` alone."""
    e = Engine(tmp_path, admission="branch")
    worker, *_ = make_worker(tmp_path)
    try:
        i = 0
        while not worker.store.tier("cpu").fill() > 0.6:
            assert worker.store.put(ObjectKind.FULL, digest(5000 + i), 64 << 10, lambda p: p.fill_(0))
            i += 1
        refs = store_prompt(e, worker, request("a", A))
        assert spare_names(refs) == ["T0", "T2"]  # planned: the worker decides
        assert worker.counters()["spare_tails_skipped"] == 2
        assert not worker.store.has(ObjectKind.TAIL, e.hashes(A)[2])
        assert worker.store.has(ObjectKind.TAIL, e.hashes(A)[1])
        assert hit_tokens(e, worker, B, "b") == 16
    finally:
        worker.shutdown()
        e.close()


def test_tails_on_speculation_are_the_first_of_a_prompt_to_be_evicted(tmp_path):
    """Stored while the tier had room; other prompts then fill it: the first of A's objects the
    value policy drops are its spare tails (never read), before the tails at its sparse
    interval and end and before its chunks."""
    e = Engine(tmp_path, admission="branch")
    worker, *_ = make_worker(tmp_path)
    try:
        refs = store_prompt(e, worker, request("a", A))
        assert worker.counters().get("spare_tails_skipped", 0) == 0
        mine = {(r.kind, r.chunk_hash): f"{r.kind.name}{r.chunk}" for r in refs}
        assert all(worker.store.has(kind, h) for kind, h in mine)
        gone: list = []
        for i in range(200):
            worker.store.put(ObjectKind.FULL, digest(9000 + i), 64 << 10, lambda p: p.fill_(0))
            gone = sorted(name for (kind, h), name in mine.items() if not worker.store.has(kind, h))
            if gone:
                break
        assert gone and set(gone) <= {"TAIL0", "TAIL2"}, gone
    finally:
        worker.shutdown()
        e.close()


def test_the_fill_level_is_a_fraction_and_tails_on_speculation_need_the_value_policy(tmp_path):
    from lmcache_hma.config.settings import ConfigError, load_config
    from tests.engines import write_yaml

    path = write_yaml(tmp_path / "c.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.01)

    def config(**extra):
        return load_config({"lmcache_config_file": str(path), **extra})

    assert config().spare_tail_fill == 0.5 and config().spares_tails
    assert not config(hma_spare_tail_fill=0).spares_tails
    assert not config(hma_eviction="lru").spares_tails
    assert not config(hma_tail_admission="interval").spares_tails
    assert not config(hma_share_parallel_shapes=True).spares_tails
    for wrong in (1.5, -0.1):
        try:
            config(hma_spare_tail_fill=wrong)
        except ConfigError as err:
            assert "hma_spare_tail_fill" in str(err) and "kv_connector_extra_config" in str(err)
        else:
            raise AssertionError(f"hma_spare_tail_fill {wrong} was accepted")
