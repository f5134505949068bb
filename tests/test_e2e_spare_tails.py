"""Tails on speculation end to end (``hma_spare_tail_fill``, scheduler.admission): the first prompt
sharing about half of an earlier one hits where they part, to the checkpoint interval, exactly.

tiny-gemma3-5to1 (the Gemma-3 shape: 5 sliding layers to 1 full, window 1024, chunk 256): a tail
is a whole window of ten sliding layers, so ``branch`` admission keeps one only every sparse
interval (``HybridLayout.tail_interval``: several thousand tokens here) besides prompt ends and
branch points. The earlier prompt's tails at every checkpoint interval (1024) are stored on
speculation while the CPU tier is below the fill level (far below it here), so the second prompt,
sharing its first 2200 tokens, hits 2048 (branch admission alone: nothing, the earlier prompt
stored no tail before its end). vLLM's own prefix cache is emptied before it; its greedy tokens
are compared with an engine without the connector (float32).

Engines: the session's tiny-gemma3-5to1 reference; one CPU-tier engine.
"""

from __future__ import annotations

import random

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import Reference, generate, make_llm, read_stats, same_greedy, shutdown, write_yaml

MODEL, CHUNK, VOCAB = "tiny-gemma3-5to1", 256, 790
_rng = random.Random(5812)
FIRST = [_rng.randrange(10, VOCAB) for _ in range(4200)]
SHARED = 2200  # about half of FIRST
SECOND = FIRST[:SHARED] + [_rng.randrange(10, VOCAB) for _ in range(2000)]
REFERENCES = {name: Reference(MODEL, {"prompt_token_ids": p}) for name, p in (("first", FIRST), ("second", SECOND))}


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(MODEL)


def test_a_prompt_sharing_half_of_an_earlier_one_hits_its_interval_boundary_exactly(model, tmp_path):
    refs = {name: ref.get() for name, ref in REFERENCES.items()}  # before this module's engine
    yaml = write_yaml(tmp_path / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=1.0)
    stats = tmp_path / "stats.json"
    llm = make_llm(model, yaml, {"hma_stats_file": str(stats)})
    try:
        [first] = generate(llm, {"prompt_token_ids": FIRST})
        assert first.cached == 0 and same_greedy(refs["first"], first)
        llm.reset_prefix_cache()  # vLLM's own cache: the hit can only come from the connector
        [second] = generate(llm, {"prompt_token_ids": SECOND})
        assert second.cached == SHARED // 1024 * 1024 == 2048
        assert same_greedy(refs["second"], second)
        s = read_stats(stats)
        assert s.get("spare_tails_skipped", 0) == 0 and s["loaded_tokens"] == 2048
    finally:
        shutdown(llm)
