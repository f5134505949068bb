"""Speculative decoding with vLLM's n-gram proposer and the connector, and vLLM's cache reset
reaching it (EAGLE and EAGLE3: ``test_e2e_eagle.py``; the methods refused: ``test_speculative.py``).

Users of other offload connectors report hits that are stored but never served once a
speculative method is on, or wrong tokens. Here: a repeated prompt gets a real external
hit (loaded by the connector after vLLM's own prefix cache was emptied), and its greedy
tokens equal the model's own greedy tokens: those of the session's tiny-gemma3 reference
engine, with no connector and no speculation (speculative greedy decoding accepts a proposed
token only where it is the model's greedy choice, so it must give the same tokens; only a
near-tie, decided by rounding in another compute split, may end a comparison early).
"""

from __future__ import annotations

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import LONG_PROMPT, Reference, generate, make_llm, read_stats, same_greedy, shutdown, write_yaml

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TOKENS = 20  # enough decode steps for proposals to be made and checked
REFERENCE = Reference("tiny-gemma3", LONG_PROMPT, max_tokens=TOKENS)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-gemma3")


def test_ngram_speculation_hits_and_is_exact(model, tmp_path):
    expected = REFERENCE.get()
    yaml = write_yaml(tmp_path / "cpu.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.5)
    stats = tmp_path / "stats.json"
    llm = make_llm(model, yaml, {"hma_stats_file": str(stats)}, speculative_config=NGRAM)
    try:
        [cold] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
        llm.reset_prefix_cache()
        [hit] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
        # vLLM's reset with the connector's (POST /reset_prefix_cache?reset_external=true): both empty
        assert llm.reset_prefix_cache(reset_connector=True)
        [after_reset] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
    finally:
        shutdown(llm)
    assert cold.cached == 0 and same_greedy(expected, cold)
    assert hit.cached == 5888 and read_stats(stats)["loaded_tokens"] == 5888  # served by the connector
    assert same_greedy(expected, hit)
    assert after_reset.cached == 0 and read_stats(stats)["loaded_tokens"] == 5888  # a miss
    assert same_greedy(expected, after_reset)
