"""EAGLE and EAGLE3 speculative decoding with the connector, on the real vLLM engine (CPU build).

EAGLE runs on tiny-gemma3 (sliding window + full attention) with a one-layer EAGLE Llama draft;
EAGLE3 on a tiny Llama whose layers alternate sliding and full attention (vLLM's Gemma models do
not support EAGLE3) with a one-layer EAGLE3 draft (``lmcache_hma.testing.tiny_drafts``). In both,
vLLM puts the draft's attention layer in the target's full-attention KV cache group, so the
connector stores and loads the draft's KV with the target's (see ``config/speculative.py``).

Per method, a reference engine with the same draft and no connector, and an engine with the
connector. Every run that must hit follows ``reset_prefix_cache`` (vLLM's own cache emptied):

* a repeated prompt is served by the connector, the draft's KV included (the full-attention
  bytes loaded are those of the target's full-attention layers plus the draft's layer); its
  greedy tokens equal the reference's, and so does the number of draft tokens accepted at each
  verify step (the draft proposes from its KV);
* a prompt equal to the stored one up to a chunk boundary ``h`` and different at token ``h``
  hits one chunk less: the stored draft KV at ``h - 1`` was computed from the stored prompt's
  token ``h`` (a hit at ``h`` would have served it).
"""

from __future__ import annotations

import json

import pytest

from lmcache_hma.testing.tiny_drafts import build_tiny_eagle, build_tiny_eagle3, build_tiny_llama_swa
from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import (diff, generate, make_llm, read_stats, same_greedy, settled_stats, shutdown,
                           turn_end_stored, write_yaml)

CHUNK = 256
TEXT = "Hello, how are you?" * 300 + "Tell me a very long story"  # 1807 tokens
TOKENS = 24  # decode steps enough for accepted proposals
ANSWER = 260  # a turn-1 answer that completes chunk 7 (1792-2048) and ends inside chunk 8
DIVERGE = 1024  # a chunk boundary: the second prompt's token there differs
KV_BYTES = 2**28


def _models(method: str):
    if method == "eagle":
        target = build_tiny_model("tiny-gemma3")
        return target, build_tiny_eagle(target)
    target = build_tiny_llama_swa()
    return target, build_tiny_eagle3(target)


def _engine(target, draft, method, yaml=None, extra=None):
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 2}
    return make_llm(target, yaml, extra, speculative_config=spec, kv_cache_memory_bytes=KV_BYTES,
                    per_request_spec_decode_metrics="detailed")


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def runs(request, tmp_path_factory):
    """Both engines' outputs for the two prompts, the connector's stats, the target's config."""
    method = request.param
    target, draft = _models(method)
    from transformers import AutoTokenizer

    stored = AutoTokenizer.from_pretrained(target)(TEXT).input_ids
    other = list(stored)
    other[DIVERGE] = stored[DIVERGE + 1]  # the text is periodic: a neighbour is another token
    assert other[DIVERGE] != stored[DIVERGE]
    prompts = {"stored": {"prompt_token_ids": stored}, "other": {"prompt_token_ids": other}}

    ref = _engine(target, draft, method)
    try:
        expected = {name: generate(ref, p, max_tokens=TOKENS)[0] for name, p in prompts.items()}
        expected["answer"] = generate(ref, prompts["stored"], max_tokens=ANSWER)[0]  # turn 1 of a conversation
    finally:
        shutdown(ref)
    d = tmp_path_factory.mktemp(method)
    yaml = write_yaml(d / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)
    stats_file = d / "stats.json"
    llm = _engine(target, draft, method, yaml, {"hma_stats_file": str(stats_file)})
    try:
        [cold] = generate(llm, prompts["stored"], max_tokens=TOKENS)
        llm.reset_prefix_cache()
        [hit] = generate(llm, prompts["stored"], max_tokens=TOKENS)
        after_hit = read_stats(stats_file)
        llm.reset_prefix_cache()
        [diverged] = generate(llm, prompts["other"], max_tokens=TOKENS)
        after_diverged = read_stats(stats_file)
        llm.reset_prefix_cache()
        before_answer = settled_stats(stats_file)
        [answer] = generate(llm, prompts["stored"], max_tokens=ANSWER)
        turn_end_stored(stats_file, before_answer, "turn 1's turn end")  # before the reset below
        # turn 2: turn 1's prompt and this engine's answer (the reference's may part from it at a
        # near tie), then a new message; its reference is this engine's cold run (a cache_salt:
        # keys nothing was stored under), after it
        turn2_prompt = stored + answer.tokens + stored[5:12]
        llm.reset_prefix_cache()
        before_turn2 = read_stats(stats_file)
        # at once: turn 1's turn end may not be stored yet when turn 2 reaches the scheduler
        [turn2] = generate(llm, {"prompt_token_ids": turn2_prompt}, max_tokens=TOKENS)
        turn2_loaded = read_stats(stats_file)["loaded_tokens"] - before_turn2["loaded_tokens"]
        llm.reset_prefix_cache()
        [expected["turn2"]] = generate(llm, {"prompt_token_ids": turn2_prompt, "cache_salt": "cold"},
                                       max_tokens=TOKENS)
    finally:
        shutdown(llm)
    config = json.loads((target / "config.json").read_text())
    return dict(method=method, n=len(stored), expected=expected, cold=cold, hit=hit,
                diverged=diverged, after_hit=after_hit, stats=after_diverged, config=config,
                answer=answer, turn2=turn2, turn2_loaded=turn2_loaded)


def test_repeated_prompt_loads_target_and_draft_kv_and_is_exact(runs):
    expected, cold, hit = runs["expected"]["stored"], runs["cold"], runs["hit"]
    boundary = (runs["n"] - 1) // CHUNK * CHUNK  # the last chunk boundary before the last token
    assert cold.cached == 0 and same_greedy(expected, cold), diff(expected, cold)
    assert hit.cached == boundary and runs["after_hit"]["loaded_tokens"] == boundary
    assert same_greedy(expected, hit), diff(expected, hit)
    # the draft proposed the same tokens: accepted as often, step by step, as without the connector
    assert hit.accepted == expected.accepted and sum(expected.accepted) > 0, (hit.accepted, expected.accepted)
    cfg = runs["config"]
    full_layers = cfg["layer_types"].count("full_attention") + 1  # the target's and the draft's
    page_per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V, float32
    assert runs["after_hit"]["loaded_bytes_full_attention"] == boundary * full_layers * page_per_token


def test_a_prompt_diverging_at_a_chunk_boundary_hits_one_chunk_less(runs):
    expected, diverged = runs["expected"]["other"], runs["diverged"]
    assert diverged.cached == DIVERGE - CHUNK, diverged.cached
    assert runs["stats"]["loaded_tokens"] - runs["after_hit"]["loaded_tokens"] == DIVERGE - CHUNK
    assert same_greedy(expected, diverged), diff(expected, diverged)
    assert diverged.accepted == expected.accepted


def test_the_next_turn_hits_the_answer_and_the_turn_end_with_the_drafts_kv(runs):
    """Turn 1's answer chunk (1792-2048) was stored once the token after it was accepted, and its
    turn end (every token it computed: 1807 + 259) when it finished, the draft's KV included, each
    keyed with the token after it. Turn 2 hits all of it; tokens and accepted drafts are the
    reference's (this engine's cold run of turn 2)."""
    expected, answer, turn2 = runs["expected"], runs["answer"], runs["turn2"]
    assert same_greedy(expected["answer"], answer), diff(expected["answer"], answer)
    assert expected["turn2"].cached == 0
    end = runs["n"] + ANSWER - 1
    assert end % CHUNK and turn2.cached == end and runs["turn2_loaded"] == end
    assert same_greedy(expected["turn2"], turn2), diff(expected["turn2"], turn2)
    assert turn2.accepted == expected["turn2"].accepted, (turn2.accepted, expected["turn2"].accepted)
