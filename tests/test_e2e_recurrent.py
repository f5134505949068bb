"""Exactness for recurrent-state hybrids: a tiny Qwen3-Next (3 gated-delta-net layers + 1 full
attention layer, MoE) on the real vLLM engine (CPU build), real LMCache tiers.

A hit at boundary h restores the full-attention KV of [0, h) and every GDN layer's state after
h tokens (one ``state`` object, from the block vLLM handed off for h). vLLM keeps a state where a
prefill step ends (every 2048 tokens here, ``max_num_batched_tokens``) on a multiple of the
retention interval (the connector sets it), and at the prompt's replay boundary: LONG_PROMPT
stores states at 2048, 4096 and 5888. Every check empties vLLM's own prefix cache
(``reset_prefix_cache``) before the run that must hit, and asserts what the connector loaded.

Engines: the reference (no connector, ``tests.engines.Reference``); the CPU tier (writing through
to Redis), which a second engine on Redis alone shares states with, both alive; the
corrupted-loads engine, which also writes the disk tier a fresh engine then reads; the
reproduction's two.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import (BF16_TIE_TOL, LONG_PROMPT, MAX_TOKENS, Gen, Reference, Writer, cached_by_source,
                           counting_repro_starts, diff, generate, hold, make_llm, read_stats, same_greedy,
                           same_logprobs, settled_stats, shutdown, source_delta, turn_end_stored, write_yaml)
from tests.redis_server import write_redis_yaml

CHUNK = 256
SHARED_PREFIX = "Hello, how are you?" * 500  # 3000 tokens + BOS shared with LONG_PROMPT
PREFIX_PROMPT = SHARED_PREFIX + "Once upon a time there was a king"
SHORT_PREFIX = "Hello, how are you?" * 700  # 4201 tokens: vLLM keeps the state at 4096 (a step end)
OTHER_PROMPT = "Tell me a very long story" * 1000  # no prefix shared with the others
VARIANT = "Tell" + LONG_PROMPT[5:]  # LONG_PROMPT with another first word
STATE_BYTES = 3 * (3 * 768 * 2 + 2 * 128 * 128 * 4)  # 3 GDN layers: conv bf16 + recurrent fp32
FULL_PAGE = 256 * 2 * 2 * 128 * 2  # one 256-token block of the full-attention layer
# vLLM's CPU build runs gated-delta-net models in bf16 only (docs/design.md). A run that splits
# a prompt as the reference did (both cold; or both a hit at the same boundary: a connector hit
# against vLLM's own prefix-cache hit in the reference engine) computes the same positions in the
# same steps from the same bytes: its log-probabilities must be bit-identical (``same_logprobs``).
# A hit where the reference computed everything (the boundary vLLM's own cache cannot hit here:
# 2048, or a batch whose mates differ) changes the matmul shapes; in bf16 that moves a logit by up
# to a few bf16 steps, so those comparisons stop at a reference near-tie of BF16_TIE_TOL.
HIT = "hit"  # reference[prompt, HIT]: the reference engine's own prefix-cache hit of the prompt


def bf16_llm(model_dir, *args, **kwargs):
    return make_llm(model_dir, *args, dtype="bfloat16", **kwargs)


def recomputed_same(ref, out) -> bool:
    """``out`` against a reference that split the prompt otherwise (see BF16_TIE_TOL above)."""
    return same_greedy(ref, out, BF16_TIE_TOL)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-qwen3next")


# -- conversations: a turn end inside a Mamba block --------------------------------------------

TURN1 = "Hello, how are you? I am telling a story about a king." * 65  # 1106 tokens with BOS
ANSWER1 = 100  # turn 1 computes 1106 + 99 = 1205 tokens: its turn end is inside chunk 4 (1024-1280)
CONTINUED = "continued"  # reference[TURN1, CONTINUED]: turn 1 answered on, ANSWER1 + MAX_TOKENS tokens

# Tokens of every prompt used below, from an engine with no connector: cold, and for LONG_PROMPT,
# OTHER_PROMPT and VARIANT also a hit of vLLM's own prefix cache at 5888 (vLLM keeps the state at
# a prompt's last block boundary); and TURN1's answer run on past ANSWER1.
REFERENCES = {**{p: Reference("tiny-qwen3next", p, dtype="bfloat16")
                 for p in (LONG_PROMPT, PREFIX_PROMPT, OTHER_PROMPT, VARIANT)},
              **{(p, HIT): Reference("tiny-qwen3next", p, hit=True, dtype="bfloat16")
                 for p in (LONG_PROMPT, OTHER_PROMPT, VARIANT)},
              (TURN1, CONTINUED): Reference("tiny-qwen3next", TURN1, ANSWER1 + MAX_TOKENS, dtype="bfloat16")}


@pytest.fixture(scope="module")
def reference(model):
    refs = {key: ref.get() for key, ref in REFERENCES.items()}
    for p in (LONG_PROMPT, OTHER_PROMPT, VARIANT):
        assert refs[p, HIT].cached == 5888, refs[p, HIT].cached
    return refs


def cpu_yaml(path: Path) -> Path:
    return write_yaml(path, chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)


@pytest.fixture(scope="module")
def redis(module_redis):
    return module_redis


@pytest.fixture(scope="module")
def cpu_engine(model, reference, redis, tmp_path_factory):  # after the reference: one engine at a time
    """The CPU tier, which serves its hits; it writes through to Redis, where engine B of
    test_two_engines_share_states_through_redis finds what it stored (and B's stores for it)."""
    d = tmp_path_factory.mktemp("cpu")
    stats = d / "stats.json"
    yaml = write_yaml(d / "cpu_redis.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5,
                      remote_url=redis.url, remote_serde="naive")
    llm = hold(bf16_llm(model, yaml, {"hma_stats_file": str(stats), "hma_store_answers": True}))
    yield llm, stats
    shutdown(llm)


def test_model_output_depends_on_distant_context(reference):
    """Otherwise an exactness test could not fail: the first word changes the output."""
    a, b = reference[LONG_PROMPT], reference[VARIANT]
    i = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert max(a.margins[i], b.margins[i]) >= BF16_TIE_TOL  # decisively, not by rounding


def test_hit_from_cpu_tier_loads_kv_and_state_and_is_exact(cpu_engine, reference):
    llm, stats = cpu_engine
    [cold] = generate(llm, LONG_PROMPT)
    assert cold.cached == 0 and same_logprobs(reference[LONG_PROMPT], cold), diff(reference[LONG_PROMPT], cold)
    llm.reset_prefix_cache()
    [hit] = generate(llm, LONG_PROMPT)
    assert hit.cached == 5888
    assert same_logprobs(reference[LONG_PROMPT, HIT], hit), diff(reference[LONG_PROMPT, HIT], hit)
    s = read_stats(stats)
    assert s["loads_ok"] == 1 and s["loaded_tokens"] == 5888
    assert s["loads_async"] == 1 and not s.get("loads_sync")  # never the held, same-step path
    assert s["loaded_bytes_full_attention"] == 23 * FULL_PAGE
    assert s["loaded_bytes_recurrent_state"] == STATE_BYTES  # one state per GDN layer
    assert s["stored_bytes_recurrent_state"] == 3 * STATE_BYTES  # states at 2048, 4096, 5888


def test_prompt_sharing_part_of_a_stored_one_backs_off_to_a_stored_state(cpu_engine, reference):
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    before = read_stats(stats)["loaded_tokens"]
    [toks] = generate(llm, PREFIX_PROMPT)
    # full chunks are stored through 2816, but the last state before the divergence is at 2048
    assert toks.cached == 2048 and recomputed_same(reference[PREFIX_PROMPT], toks)
    assert read_stats(stats)["loaded_tokens"] - before == 2048


def test_local_hit_covering_part_of_external_hit_is_exact(cpu_engine, reference):
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    generate(llm, SHORT_PREFIX)  # vLLM now holds the KV and a state of part of LONG_PROMPT locally
    before = read_stats(stats)
    [toks] = generate(llm, LONG_PROMPT)
    after = read_stats(stats)
    assert toks.cached == 5888
    assert same_logprobs(reference[LONG_PROMPT, HIT], toks), diff(reference[LONG_PROMPT, HIT], toks)
    loaded = after["loaded_tokens"] - before["loaded_tokens"]
    assert 0 < loaded < 5888 and loaded % CHUNK == 0  # the local part (vLLM's state at 4096) not loaded
    assert after["loaded_bytes_recurrent_state"] - before["loaded_bytes_recurrent_state"] == STATE_BYTES


def test_batch_of_prompts_sharing_prefixes_is_exact(cpu_engine, reference):
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    prompts = [LONG_PROMPT, PREFIX_PROMPT, OTHER_PROMPT, LONG_PROMPT]
    before = read_stats(stats)["loaded_tokens"]
    outs = generate(llm, prompts)
    assert all(recomputed_same(reference[p], o) for p, o in zip(prompts, outs)), \
        [diff(reference[p], o) for p, o in zip(prompts, outs)]
    assert outs[0].cached == 5888 and read_stats(stats)["loaded_tokens"] - before >= 5888


def answered_on(reference) -> Gen:
    """What the reference (no connector) generated after turn 1's answer, running on."""
    ref = reference[TURN1, CONTINUED]
    return Gen(ref.tokens[ANSWER1:], 0, ref.margins[ANSWER1:], ref.logprobs[ANSWER1:])


def turn2_prompts(tokenizer, answer: Gen) -> dict:
    """Turn 2's prompts by the hit each must get: turn 1's prompt and whole answer (1205: every
    token turn 1 computed, and vLLM computes the answer's last token as turn 1 would have); the
    same with a new message after it (1205); and one that leaves turn 1's answer 11 tokens
    before its end (1024: the prompt's state, computed by its prefill)."""
    prompt, more = tokenizer.encode(TURN1), tokenizer.encode(" And then?")[1:]
    assert len(prompt) == 1106
    return {"answered on": (prompt + answer.tokens, 1205), "new message": (prompt + answer.tokens + more, 1205),
            "diverged": (prompt + answer.tokens[:-11] + more, 1024)}


def test_next_turn_hits_the_turn_end_with_its_recurrent_states(cpu_engine, reference):
    """Turn 2 hits every token turn 1 computed: the full-attention KV up to 1205 and every GDN
    layer's state after 1205 tokens, which vLLM kept in the Mamba block at 1204 // 256 when turn
    1 finished.

    Exact where exactness is defined in bf16: a turn 2 of turn 1's prompt and answer computes
    the answer's last token on the restored state and KV, as vLLM would have had it answered on,
    so its output is bit-identical to the reference answering on (``same_logprobs``). With a new
    message after the answer it is not, with or without a connector: vLLM's prefill of several
    tokens on a state its decode steps made sums in another order than decoding them, and that
    moves bf16 logits past any tie gate (docs/design.md, turn ends); its hit and loads are
    checked. A turn 2 that diverges 11 tokens before the turn end hits the prompt's state at
    1024, made by its prefill: bit-identical to a cold run (a ``cache_salt``: keys nothing was
    stored under), as vLLM's own prefix cache is."""
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    before = settled_stats(stats)
    [answer] = generate(llm, TURN1, max_tokens=ANSWER1)
    turn_end_stored(stats, before, "turn 1's turn end")  # before the reset below
    assert answer.cached == 0 and answer.tokens == reference[TURN1, CONTINUED].tokens[:ANSWER1]
    for case, (turn2, hit) in turn2_prompts(llm.get_tokenizer(), answer).items():
        expected = answered_on(reference) if case == "answered on" else None  # "new message": none
        if case == "diverged":
            llm.reset_prefix_cache()
            [expected] = generate(llm, {"prompt_token_ids": turn2, "cache_salt": "cold"})
            assert expected.cached == 0
        llm.reset_prefix_cache()
        before = read_stats(stats)
        [toks] = generate(llm, {"prompt_token_ids": turn2})
        after = read_stats(stats)
        assert toks.cached == hit and after["loaded_tokens"] - before.get("loaded_tokens", 0) == hit, case
        assert after["loaded_bytes_recurrent_state"] - before.get("loaded_bytes_recurrent_state", 0) == STATE_BYTES
        if expected is not None:
            assert same_logprobs(expected, toks), (case, diff(expected, toks))


# -- Redis: two engines sharing one ---------------------------------------------------------

def test_two_engines_share_states_through_redis(cpu_engine, reference, model, redis, tmp_path):
    """A (the CPU-tier engine, writing through to Redis) stores, B (another engine, alive at the
    same time, on Redis alone) hits; then the other way round (VARIANT: new to both); then B
    serves the next turn of a conversation A had, from A's turn end."""
    a, stats_a = cpu_engine
    a.reset_prefix_cache()
    generate(a, LONG_PROMPT)  # stored by A's first test already (a CPU-tier hit now), unless this runs alone
    stats_b = tmp_path / "b.json"
    b = bf16_llm(model, write_redis_yaml(tmp_path / "redis.yaml", redis.url),
                 {"hma_stats_file": str(stats_b), "hma_store_answers": True},
                 keep_held=True, disable_log_stats=False)  # A stays up; B with vLLM's stats
    try:
        before = cached_by_source(b)
        [toks] = generate(b, LONG_PROMPT)
        assert toks.cached == 5888 and same_logprobs(reference[LONG_PROMPT, HIT], toks)
        # vLLM's prompt_tokens_cached_by_source: KV another instance computed, from Redis, is "p2p"
        assert source_delta(before, cached_by_source(b)) == {"p2p": 5888}
        s = read_stats(stats_b)
        assert s["loaded_tokens_redis"] == 5888 and s["loaded_bytes_recurrent_state"] == STATE_BYTES
        [toks] = generate(b, VARIANT)
        assert toks.cached == 0 and same_logprobs(reference[VARIANT], toks)
        a.reset_prefix_cache()
        before = read_stats(stats_a)
        [toks] = generate(a, VARIANT)
        assert toks.cached == 5888 and same_logprobs(reference[VARIANT, HIT], toks)
        after = read_stats(stats_a)
        assert after["loads_ok"] - before.get("loads_ok", 0) == 1
        assert after["loaded_tokens_redis"] - before.get("loaded_tokens_redis", 0) == 5888  # from B, via Redis
        # a conversation's next turn at the other instance: B hits A's turn end and its states,
        # and answers on exactly as the reference does (test_next_turn_hits_the_turn_end_...)
        a.reset_prefix_cache()
        [answer] = generate(a, TURN1, max_tokens=ANSWER1)
        settled_stats(stats_a)  # its turn end goes with A's next step (stored already if A's first test ran)
        turn2, hit = turn2_prompts(a.get_tokenizer(), answer)["answered on"]
        b.reset_prefix_cache()
        before = read_stats(stats_b)
        [toks] = generate(b, {"prompt_token_ids": turn2})
        after = read_stats(stats_b)
        assert toks.cached == hit and after["loaded_tokens_redis"] - before["loaded_tokens_redis"] == hit
        ref = answered_on(reference)
        assert same_logprobs(ref, toks), diff(ref, toks)
    finally:
        shutdown(b)


# -- negative control and an injected load failure; the writer of the disk tier --------------

KINDS = ("recurrent_state", "full_attention")


@pytest.fixture(scope="module")
def writer(model, reference, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("writer")
    disk = d / "disk"
    tiers = dict(chunk_size=CHUNK, local_disk=f"file://{disk}/", max_local_disk_size=1)
    stats = d / "stats.json"
    llm = hold(bf16_llm(model, write_yaml(d / "cpu_disk.yaml", local_cpu=True, max_local_cpu_size=0.5, **tiers),
                        {"hma_test_fail_loads": 1, "hma_test_corrupt_loads": ",".join(KINDS),
                         "hma_stats_file": str(stats), "hma_store_answers": True}))
    # the corrupted-loads engine on the CPU tier (which serves its hits) and the disk tier; the
    # fresh reader's YAML: the disk tier alone
    w = Writer(llm, stats=stats, disk=disk,
               yaml=write_yaml(d / "disk.yaml", local_cpu=False, max_local_cpu_size=0.2, **tiers))
    yield w
    w.close()


def test_corrupted_state_or_kv_changes_tokens(writer, reference):
    """The checks above can fail: noise in the loaded state alone changes the tokens (and so
    does noise in the full-attention KV alone); a failed load is recomputed exactly."""
    assert writer.alive, "the writer was closed before the corrupted loads were tried"
    llm, stats = writer.llm, writer.stats
    generate(llm, LONG_PROMPT)
    llm.reset_prefix_cache()
    [toks] = generate(llm, LONG_PROMPT)  # the load fails after the hit was promised
    assert recomputed_same(reference[LONG_PROMPT], toks) and read_stats(stats)["loads_failed"] == 1
    for kind in KINDS:
        llm.reset_prefix_cache()
        [toks] = generate(llm, LONG_PROMPT)
        assert toks.cached == 5888 and not recomputed_same(reference[LONG_PROMPT], toks), kind
        print(f"corrupted {kind}: {diff(reference[LONG_PROMPT], toks)}")
    llm.reset_prefix_cache()  # the stored objects were never damaged: exact again
    [toks] = generate(llm, LONG_PROMPT)
    assert toks.cached == 5888 and same_logprobs(reference[LONG_PROMPT, HIT], toks)


# -- disk tier, read by a fresh engine; a damaged state object ------------------------------

def state_files(disk: Path) -> list[Path]:
    return sorted(p for p in disk.iterdir() if ".state@" in p.name)


@pytest.fixture(scope="module")
def stored(writer):
    """LONG_PROMPT on the writer's disk tier, the writer shut down (``Writer.flushed``)."""
    return writer.flushed(LONG_PROMPT)


def test_disk_tier_read_by_fresh_engine_and_damaged_state_is_recomputed(model, reference, stored, tmp_path):
    disk, yaml = stored.disk, stored.yaml
    kinds = Counter(name.split("@")[0].rsplit(".", 1)[1] for name in os.listdir(disk))
    # full chunks, 3 boundary states, and the turn ends of the writer's requests (each with its states)
    assert kinds["full"] == 23 and kinds["turn"] >= 1 and kinds["state"] == 3 + kinds["turn"]
    assert set(kinds) == {"full", "state", "turn", "turnmark"}
    stats = tmp_path / "stats.json"
    reader = bf16_llm(model, yaml, {"hma_stats_file": str(stats)})  # new EngineCore and worker
    try:
        [toks] = generate(reader, LONG_PROMPT)
        assert toks.cached == 5888 and same_logprobs(reference[LONG_PROMPT, HIT], toks)
        reader.reset_prefix_cache()
        [toks] = generate(reader, PREFIX_PROMPT)  # back off to the state at 2048, from disk
        assert toks.cached == 2048 and recomputed_same(reference[PREFIX_PROMPT], toks)
        assert read_stats(stats)["loads_ok"] == 2
        for path in state_files(disk):  # flip bytes in the middle of every stored state
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)
            path.write_bytes(bytes(raw))
        reader.reset_prefix_cache()
        [toks] = generate(reader, LONG_PROMPT)  # the promised load fails its check: recomputed
        s = read_stats(stats)
        assert recomputed_same(reference[LONG_PROMPT], toks), diff(reference[LONG_PROMPT], toks)
        assert s["loads_failed"] == 1 and s["integrity_failures"] >= 1
        reader.reset_prefix_cache()
        [toks] = generate(reader, LONG_PROMPT)  # the recompute stored the state again
        assert toks.cached == 5888 and same_logprobs(reference[LONG_PROMPT, HIT], toks)
        assert read_stats(stats)["loads_ok"] == 3
    finally:
        shutdown(reader)


# -- the reproduction on the gated-delta-net model -------------------------------------------

def test_repro_on_the_qwen3next_shape(capfd, monkeypatch):
    """``lmcache-hma repro --preset tiny-qwen3next``: vLLM's cache evicted, the connector serves
    the last state stored before token 5888 (first_prompt's steps end every 2048 tokens)."""
    from lmcache_hma.tools.repro import DEFAULT_CONFIG, KV_CACHE_BYTES, run_repro

    counting_repro_starts(monkeypatch)

    result = run_repro(None, DEFAULT_CONFIG, KV_CACHE_BYTES["tiny-qwen3next"], "tiny-qwen3next")
    last = result["rows"][-1]
    assert last["hit"] == last["loaded"] == 4096 and result["evicted"] and result["identical"]
    assert "recurrent_state=407040" in capfd.readouterr().err
