"""Faults on the real engine: whatever goes wrong in the cache, tokens stay exact.

One engine with the disk tier and a vLLM KV cache small enough to preempt, one with a disk
tier too small for a prompt; the references without the connector come from the session's
tiny-gemma3 reference engine (``tests.engines.Reference``).
"""

from __future__ import annotations

import os

import pytest

from lmcache_hma.core.objects import TRAILER_BYTES
from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import (LONG_PROMPT, Reference, diff, generate, hold, make_llm, read_stats, same_greedy, shutdown,
                           write_yaml)
from tests.waiting import wait_for

# 16 prompts in one batch, in 8 pairs that share a ~500-token prefix, ~1700 tokens each
BATCH = [f"Topic {i % 8}: " + "Hello, how are you?" * 80 + f" Question {i}: " + "Tell me a very long story" * 200
         for i in range(16)]
# The same 16 prompts, longer: each hits what the first run stored, then prefills ~800 more
# tokens in chunks, so the batch outgrows the cache again while its requests hold loaded KV.
LONGER = [p + " And then: " + "Hello, how are you?" * 130 for p in BATCH]
SMALL_KV_CACHE = 16 * 2**20  # 128 blocks of 128 tokens (float32): the batch needs more -> preemption
BATCH_TOKENS = 32
# A full-attention object on disk: 2 layers x 2 blocks of 128 tokens (1 KV head of 64, float32)
FULL_OBJECT_BYTES = 2 * 2 * (128 * 2 * 64 * 4) + TRAILER_BYTES
LONG_PROMPT_CHUNKS = 23  # full chunks of 256 tokens


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-gemma3")


# Without the connector, each batch as the tests run it, from an empty prefix cache.
REFERENCES = [Reference("tiny-gemma3", [LONG_PROMPT]), Reference("tiny-gemma3", BATCH, BATCH_TOKENS),
              Reference("tiny-gemma3", LONGER, BATCH_TOKENS)]


@pytest.fixture(scope="module")
def reference():
    prompts = [LONG_PROMPT] + BATCH + LONGER
    return dict(zip(prompts, [out for ref in REFERENCES for out in ref.get()]))


@pytest.fixture(scope="module")
def engine(model, reference, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("faults")
    disk = d / "disk"
    yaml = write_yaml(d / "disk.yaml", chunk_size=256, local_cpu=False, max_local_cpu_size=0.2,
                      local_disk=f"file://{disk}/", max_local_disk_size=1)
    stats = d / "stats.json"
    llm = hold(make_llm(model, yaml, {"hma_stats_file": str(stats)}, kv_cache_memory_bytes=SMALL_KV_CACHE,
                        disable_log_stats=False, scheduler_reserve_full_isl=False,  # over-admit
                        max_num_batched_tokens=512))  # prefill in chunks: admitted requests outgrow the cache
    yield llm, disk, stats
    shutdown(llm)


def preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def test_batch_of_16_with_preemption_is_exact(engine, reference):
    llm, _, stats = engine
    outs = generate(llm, BATCH, BATCH_TOKENS)  # stores while vLLM preempts and recomputes
    bad = {i: diff(reference[p], o) for i, (p, o) in enumerate(zip(BATCH, outs)) if not same_greedy(reference[p], o)}
    assert not bad
    assert preemptions(llm) > 0
    llm.reset_prefix_cache()
    preempted_before, loaded_before = preemptions(llm), read_stats(stats).get("loaded_tokens", 0)
    outs = generate(llm, LONGER, BATCH_TOKENS)  # now with hits, and preemption again
    bad = {i: diff(reference[p], o) for i, (p, o) in enumerate(zip(LONGER, outs)) if not same_greedy(reference[p], o)}
    assert not bad
    assert preemptions(llm) > preempted_before  # this run preempted too (the counter is cumulative)
    assert all(o.cached >= 1536 for o in outs)  # the chunks the first run stored
    # vLLM's cache was emptied and pairs share only ~500 tokens: the hits came from the connector
    assert read_stats(stats)["loaded_tokens"] - loaded_before >= 16 * (1536 - 512)
    assert read_stats(stats).get("loads_failed", 0) == 0


def _full_objects(disk) -> set[str]:
    return {f for f in os.listdir(disk) if f.split("@")[0].endswith(".full")}


def _written(disk, before: set[str], n: int) -> set[str]:
    """The ``n`` full objects on disk that are not in ``before``, once every one is complete
    (LMCache writes the files asynchronously, each in one write)."""
    def complete():
        new = _full_objects(disk) - before
        return len(new) == n and all((disk / f).stat().st_size == FULL_OBJECT_BYTES for f in new) and new

    return wait_for(complete, timeout=30, what=f"{n} complete full objects on disk")


def test_damaged_disk_objects_shorten_the_hit_then_heal(engine, reference):
    llm, disk, stats = engine
    llm.reset_prefix_cache()
    before_files = _full_objects(disk)
    generate(llm, LONG_PROMPT)
    new = sorted(_written(disk, before_files, LONG_PROMPT_CHUNKS))  # no other prompt has these chunks
    # Damage three objects the next hit needs, before anything read them back (a
    # read leaves a copy in CPU memory): flip a byte, truncate, delete.
    raw = bytearray((disk / new[0]).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (disk / new[0]).write_bytes(bytes(raw))
    (disk / new[1]).write_bytes((disk / new[1]).read_bytes()[:-1000])
    (disk / new[2]).unlink()
    before = read_stats(stats)
    llm.reset_prefix_cache()
    [toks] = generate(llm, LONG_PROMPT)
    after = read_stats(stats)
    assert same_greedy(reference[LONG_PROMPT], toks)
    # The lookup reads (and verifies) a hit before promising it: the damage shortens the hit
    # (the request computes from there), no load fails.
    assert toks.cached < 5888 and after.get("loads_failed", 0) == before.get("loads_failed", 0)
    assert after["integrity_failures"] >= before.get("integrity_failures", 0) + 1
    # The damaged objects were dropped and the recompute stored them again.
    llm.reset_prefix_cache()
    [toks] = generate(llm, LONG_PROMPT)
    assert toks.cached == 5888 and same_greedy(reference[LONG_PROMPT], toks)


def test_tiny_disk_tier_stays_exact(model, reference, tmp_path):
    disk = tmp_path / "disk"
    yaml = write_yaml(tmp_path / "tiny.yaml", chunk_size=256, local_cpu=False, max_local_cpu_size=0.2,
                      local_disk=f"file://{disk}/", max_local_disk_size=0.002)  # ~2 MB: full at once
    llm = make_llm(model, yaml)
    try:
        for _ in range(2):
            outs = generate(llm, [LONG_PROMPT])
            assert same_greedy(reference[LONG_PROMPT], outs[0])
            llm.reset_prefix_cache()
    finally:
        shutdown(llm)
