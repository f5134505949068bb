"""The central test: with the connector, greedy tokens equal a run with no connector.

Real vLLM engine (CPU build), real LMCache tiers, the built-in tiny hybrid models.
Every check empties vLLM's own prefix cache (``reset_prefix_cache``) before the
run that must hit, and asserts the hit really came from the connector.

Engines: the references (no connector, ``tests.engines.Reference``: one engine for the whole
session's tiny-gemma3 references, another for the 2-group model's); the CPU tier; the
corrupted-loads engine, which also writes the disk tier that two fresh engines then read (one
with the same weights, one with other weights behind the same path); the tier too small; the
2-group model's connector engine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from lmcache_hma.core.turn_ends import MARK_BYTES
from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.waiting import wait_for
from tests.engines import (MAX_TOKENS, TIE_TOL, LONG_PROMPT, Gen, Reference, Writer, cached_by_source, diff, generate, hold, make_llm, read_stats,
                           same_greedy, settled_stats, shutdown, source_delta, write_yaml)

CHUNK = 256
SHARED_PREFIX = "Hello, how are you?" * 500  # 3000 tokens + BOS shared with LONG_PROMPT
PREFIX_PROMPT = SHARED_PREFIX + "Once upon a time there was a king"
SHORT_PREFIX = "Hello, how are you?" * 200  # a local prefix-cache hit of part of LONG_PROMPT
OTHER_PROMPT = "Tell me a very long story" * 1000  # no prefix shared with the others
VARIANT = "Tell" + LONG_PROMPT[5:]  # LONG_PROMPT with another first word
TURN1 = "Once upon a time there was a king who ruled a small country. " * 27  # 595 tokens, a prefix of no other
ANSWER1, TURN2_TOKENS = 450, 10  # turn 1's answer, then what turn 2 generates
PAGE = 128 * 2 * 64 * 4  # one 128-token block of one layer: K and V of 1 head of 64, float32


def boundary(num_tokens: int) -> int:
    """The longest chunk boundary a prompt of ``num_tokens`` can hit."""
    return (num_tokens - 1) // CHUNK * CHUNK


# -- the 3-group model (window 128 < chunk) ----------------------------------------

@pytest.fixture(scope="module")
def model3():
    return build_tiny_model("tiny-gemma3")


# Tokens of every prompt used below from an engine with no connector, cold, one at a time as
# the checks run them (the session's one tiny-gemma3 reference engine computes them).
REFERENCES3 = {p: Reference("tiny-gemma3", p) for p in (LONG_PROMPT, PREFIX_PROMPT, OTHER_PROMPT, VARIANT)}
# Turn 1 and turn 2 of a conversation in one: the greedy continuation of TURN1 past its answer is
# what turn 2 (TURN1 + the answer) generates (the session's reference engine computes it).
CONVERSATION = Reference("tiny-gemma3", TURN1, max_tokens=ANSWER1 + TURN2_TOKENS)
LONG_CONVERSATION = Reference("tiny-gemma3", LONG_PROMPT, max_tokens=MAX_TOKENS + TURN2_TOKENS)  # the same, for LONG_PROMPT


@pytest.fixture(scope="module")
def reference3():
    return {**{p: ref.get() for p, ref in REFERENCES3.items()}, TURN1: CONVERSATION.get(),
            "long conversation": LONG_CONVERSATION.get()}


@pytest.fixture(scope="module")
def cpu_engine(model3, reference3, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("cpu")
    yaml = write_yaml(d / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)
    stats = d / "stats.json"
    llm = hold(make_llm(model3, yaml, {"hma_stats_file": str(stats)}))  # until another engine starts
    yield llm, stats
    shutdown(llm)


def test_model_output_depends_on_distant_context(reference3):
    """Otherwise an exactness test could not fail: the first word changes the output."""
    a, b = reference3[LONG_PROMPT], reference3[VARIANT]
    i = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert max(a.margins[i], b.margins[i]) >= TIE_TOL  # decisively, not by rounding


def test_hit_from_cpu_tier_is_exact(cpu_engine, reference3):
    llm, stats = cpu_engine
    [cold] = generate(llm, LONG_PROMPT)
    assert cold.cached == 0 and same_greedy(reference3[LONG_PROMPT], cold)
    llm.reset_prefix_cache()
    [hit] = generate(llm, LONG_PROMPT)
    assert hit.cached == boundary(6007) == 5888
    assert same_greedy(reference3[LONG_PROMPT], hit)
    s = read_stats(stats)
    assert s["loads_ok"] == 1 and s["loaded_tokens"] == 5888
    assert s["loads_sync"] == 1  # held at lookup, loaded in the step that computes the request
    # full-attention KV of 23 chunks + one window of sliding KV, not all layers
    layers_full, layers_sliding = 2, 4
    assert s["loaded_bytes_full_attention"] == 5888 // 128 * layers_full * PAGE
    assert s["loaded_bytes_sliding_window"] == 1 * layers_sliding * PAGE


def test_a_request_that_asks_not_to_be_stored_is_not_stored_and_still_hits(cpu_engine, reference3):
    """LMCache's request config ``lmcache.skip_save`` (in ``kv_transfer_params``): nothing of
    that request is stored; it still loads what is stored; the next request without it stores."""
    llm, _ = cpu_engine
    prompt, skip = "Please" + LONG_PROMPT[5:], {"lmcache.skip_save": True}
    llm.reset_prefix_cache()
    [first] = generate(llm, prompt, kv_transfer_params=skip)
    llm.reset_prefix_cache()
    [again] = generate(llm, prompt)  # nothing to hit: the first one stored nothing
    assert first.cached == again.cached == 0 and first.tokens == again.tokens
    llm.reset_prefix_cache()
    [hit] = generate(llm, prompt, kv_transfer_params=skip)  # what the second one stored
    assert hit.cached == 5888 and same_greedy(again, hit)


def test_prompt_sharing_only_a_prefix_is_exact(cpu_engine, reference3):
    llm, _ = cpu_engine
    llm.reset_prefix_cache()
    [toks] = generate(llm, PREFIX_PROMPT)
    assert toks.cached == 3001 // CHUNK * CHUNK  # the chunks it shares with LONG_PROMPT
    assert same_greedy(reference3[PREFIX_PROMPT], toks)


def test_local_hit_covering_part_of_external_hit_is_exact(cpu_engine, reference3):
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    generate(llm, SHORT_PREFIX)  # vLLM now holds ~1200 tokens of LONG_PROMPT locally
    before = read_stats(stats)
    [toks] = generate(llm, LONG_PROMPT)
    after = read_stats(stats)
    assert toks.cached == 5888 and same_greedy(reference3[LONG_PROMPT], toks)
    loaded = after["loaded_tokens"] - before["loaded_tokens"]
    assert 0 < loaded < 5888 and (5888 - loaded) % 128 == 0  # the local part was not loaded
    assert (5888 - loaded) % CHUNK != 0  # a local hit that is not chunk-aligned


def test_batch_of_prompts_sharing_prefixes_is_exact(cpu_engine, reference3):
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    prompts = [LONG_PROMPT, PREFIX_PROMPT, OTHER_PROMPT, LONG_PROMPT]
    before = read_stats(stats)["loaded_tokens"]
    outs = generate(llm, prompts)
    assert all(same_greedy(reference3[p], o) for p, o in zip(prompts, outs))
    # vLLM's own cache was emptied, so each of LONG_PROMPT's 5,888 hit tokens was loaded by the
    # connector, for it or for a batch-mate whose blocks it then shares in vLLM, except the one
    # block PREFIX_PROMPT computes past its 2,816-token hit (it shares 23 blocks, 2,944 tokens,
    # with LONG_PROMPT) when the scheduler allocates it first (LONG_PROMPT's lookup can ask vLLM to
    # come back a step later, as in one CI run: a turn end it could hit still on its way): LONG_PROMPT then finds those
    # 2,944 tokens in vLLM's cache and loads only the rest.
    loaded = read_stats(stats)["loaded_tokens"] - before
    assert outs[0].cached == 5888 and loaded >= 5888 - 128, loaded
    assert outs[1].cached == 2816 and outs[3].cached == 5888  # from the connector or the batch-mates' blocks


@pytest.fixture(scope="module")
def turn1(cpu_engine, reference3):
    """Turn 1 of a conversation on the CPU tier: (its prompt's token ids, its answer). Its turn
    end (1044: 20 tokens into chunk 4) follows the tail the answer stored at 1024 (tiny-gemma3's
    tail interval is one chunk), so it is stored on that tail (``ObjectRef.on_tail``): the
    blocks of its own chunk, every layer, far less than a whole window of every sliding layer."""
    llm, stats = cpu_engine
    llm.reset_prefix_cache()
    before = settled_stats(stats)  # what earlier tests' requests stored is counted: the delta is turn 1's
    [answer] = generate(llm, TURN1, max_tokens=ANSWER1)
    assert answer.cached == 0 and answer.tokens == reference3[TURN1].tokens[:ANSWER1]  # cold: the reference's split
    prompt = llm.get_tokenizer().encode(TURN1)  # with BOS, as vLLM tokenized it
    assert len(prompt) == 595
    grew = lambda key: read_stats(stats).get(key, 0) - before.get(key, 0)  # noqa: E731
    wait_for(lambda: grew("stored_bytes_turn_end") > MARK_BYTES, what="turn 1's turn end")
    # chunks 0-3 (a prefix of no other): 1024 tokens of the two full-attention layers
    per_layer_token = grew("stored_bytes_full_attention") // (1024 * 2)
    # vLLM's blocks here are 128 tokens: on the tail, block 8 (1024-1151) of all 6 layers; the whole
    # window would be blocks 7-8 of the 4 sliding layers and block 8 of the 2 full ones (10 blocks)
    on_tail = 6 * 128 * per_layer_token
    wait_for(lambda: grew("stored_bytes_turn_end") == on_tail + MARK_BYTES,
             what=f"turn 1's turn end on its tail ({on_tail} bytes and its marker)")
    return prompt, answer


def test_next_turn_hits_the_previous_answer_and_turn_end_exactly(cpu_engine, reference3, turn1):
    """A conversation: turn 2's prompt is turn 1's prompt and answer. The answer's chunks were
    stored while turn 1 decoded (``hma_store_answers``), and its last partial chunk when it
    finished (the turn end: every token whose KV turn 1 computed), so turn 2 hits all of it."""
    llm, stats = cpu_engine
    ref = reference3[TURN1]
    turn1_prompt, answer = turn1
    prompt = turn1_prompt + answer.tokens
    llm.reset_prefix_cache()  # vLLM's own cache only: the answer can only come from the connector
    before = read_stats(stats).get("loaded_tokens", 0)
    [turn2] = generate(llm, {"prompt_token_ids": prompt}, max_tokens=TURN2_TOKENS)
    # turn 1 computed the KV of all its tokens but the last answer token: 1044, past the last
    # chunk boundary (1024) and past turn 1's prompt's whole chunks (512)
    assert 595 // CHUNK * CHUNK == 512 < boundary(len(prompt)) == 1024 < turn2.cached == len(prompt) - 1 == 1044
    assert read_stats(stats)["loaded_tokens"] - before == 1044
    continuation = Gen(ref.tokens[ANSWER1:], 0, ref.margins[ANSWER1:])
    assert same_greedy(continuation, turn2), diff(continuation, turn2)


def test_a_next_turn_that_diverges_before_the_turn_end_hits_the_chunk_boundary(cpu_engine, turn1):
    """Turn 2 keeps turn 1's prompt and answer up to 10 tokens before its turn end, then says
    something else: the turn end (a key over all of turn 1's partial chunk) cannot hit; the
    chunk boundary before it does. Tokens equal the same engine's cold run (a ``cache_salt``
    gives it keys nothing was stored under)."""
    llm, stats = cpu_engine
    turn1_prompt, answer = turn1
    prompt = turn1_prompt + answer.tokens[:-11] + llm.get_tokenizer().encode(" and then the queen spoke.")[1:]
    llm.reset_prefix_cache()
    [cold] = generate(llm, {"prompt_token_ids": prompt, "cache_salt": "cold"}, max_tokens=TURN2_TOKENS)
    assert cold.cached == 0
    llm.reset_prefix_cache()
    before = read_stats(stats).get("loaded_tokens", 0)
    [turn2] = generate(llm, {"prompt_token_ids": prompt}, max_tokens=TURN2_TOKENS)
    assert turn2.cached == 1024 and read_stats(stats)["loaded_tokens"] - before == 1024
    assert same_greedy(cold, turn2), diff(cold, turn2)


# -- negative control and injected load failures; the writer of the disk tier ---------

KINDS = ("all", "full_attention", "sliding_window")


@pytest.fixture(scope="module")
def model_copy(model3, tmp_path_factory):
    """A copy of the model: test_disk_tier_alone_read_by_fresh_engine replaces its weights."""
    return Path(shutil.copytree(model3, tmp_path_factory.mktemp("copy") / "model"))


@pytest.fixture(scope="module")
def writer(model_copy, reference3, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("writer")
    disk = d / "disk"
    tiers = dict(chunk_size=CHUNK, local_disk=f"file://{disk}/", max_local_disk_size=1)
    yaml = write_yaml(d / "cpu_disk.yaml", local_cpu=True, max_local_cpu_size=0.5, **tiers)
    stats = d / "stats.json"
    llm = hold(make_llm(model_copy, yaml, {"hma_test_fail_loads": 1, "hma_test_corrupt_loads": ",".join(KINDS),
                                           "hma_test_fail_sync_loads": 1, "hma_stats_file": str(stats)}))
    # the corrupted-loads engine on the CPU tier (which serves its hits) and the disk tier; the
    # fresh reader's YAML: the disk tier alone
    w = Writer(llm, stats=stats, disk=disk,
               yaml=write_yaml(d / "disk.yaml", local_cpu=False, max_local_cpu_size=0.2, **tiers))
    yield w
    w.close()


def test_corrupted_loads_change_tokens(writer, reference3):
    """The exactness checks above can fail: corrupting loaded KV changes the tokens.

    Each group kind on its own, so a broken tail path (or full-attention path) cannot
    hide behind the other.
    """
    assert writer.alive, "the writer was closed before the corrupted loads were tried"
    llm, stats, kinds = writer.llm, writer.stats, KINDS
    generate(llm, LONG_PROMPT)
    # 1) a load that fails after the hit was promised: vLLM recomputes, tokens exact
    llm.reset_prefix_cache()
    [toks] = generate(llm, LONG_PROMPT)
    assert same_greedy(reference3[LONG_PROMPT], toks)
    assert read_stats(stats)["loads_failed"] == 1
    # 2) loads that "succeed" with corrupted bytes: tokens differ (the first of these
    # synchronous loads fails once and is tried again, in the same step)
    for kind in kinds:
        llm.reset_prefix_cache()
        [toks] = generate(llm, LONG_PROMPT)
        assert toks.cached == 5888 and not same_greedy(reference3[LONG_PROMPT], toks), kind
        print(f"corrupted {kind}: {diff(reference3[LONG_PROMPT], toks)}")
    # 3) and the stored objects were never damaged: the next hit is exact again
    llm.reset_prefix_cache()
    [toks] = generate(llm, LONG_PROMPT)
    assert toks.cached == 5888 and same_greedy(reference3[LONG_PROMPT], toks)
    s = read_stats(stats)
    assert s["sync_load_retries"] == 1 and "sync_loads_failed" not in s


# -- disk tier, read by a fresh engine process --------------------------------------

@pytest.fixture(scope="module")
def stored(writer):
    """LONG_PROMPT on the writer's disk tier, the writer shut down (``Writer.flushed``)."""
    return writer.flushed(LONG_PROMPT)


def test_disk_tier_alone_read_by_fresh_engine(model_copy, reference3, stored, tmp_path):
    """A fresh engine reads the disk tier; one whose weights were replaced behind the same path does not."""
    model, disk, yaml = model_copy, stored.disk, stored.yaml
    files = os.listdir(disk)
    chunks = [f for f in files if ".full@" in f or ".tail@" in f]
    assert len(chunks) == 2 * 23  # full + tail object per chunk: LONG_PROMPT's, nothing else
    # and the requests' turn ends (each answer its own, a corrupted load's too) with their one marker
    assert {f.split("@")[0].rsplit(".", 1)[1] for f in files if f not in chunks} == {"turn", "turnmark"}
    assert os.stat(disk).st_mode & 0o777 == 0o700  # created private
    stats = tmp_path / "stats.json"
    # new EngineCore and worker processes; with vLLM's stats, for its hits by source
    reader = make_llm(model, yaml, {"hma_stats_file": str(stats)}, disable_log_stats=False)
    try:
        before = cached_by_source(reader)
        [toks] = generate(reader, LONG_PROMPT)
        assert toks.cached == 5888 and same_greedy(reference3[LONG_PROMPT], toks)
        s = read_stats(stats)  # read and held at lookup, loaded in the step that computes the rest
        assert s["loads_sync"] == 1 and s["loaded_tokens_disk"] == 5888
        # vLLM's prompt_tokens_cached_by_source: the whole hit under "disk", none unattributed
        assert source_delta(before, cached_by_source(reader)) == {"disk": 5888}
        # the next turn (LONG_PROMPT and its answer) hits its turn end on disk: every token computed
        reader.reset_prefix_cache()
        prompt = reader.get_tokenizer().encode(LONG_PROMPT) + reference3[LONG_PROMPT].tokens
        [turn2] = generate(reader, {"prompt_token_ids": prompt}, max_tokens=TURN2_TOKENS)
        assert turn2.cached == len(prompt) - 1 == 6016 and read_stats(stats)["loaded_tokens_disk"] == 5888 + 6016
        ref = reference3["long conversation"]
        continuation = Gen(ref.tokens[MAX_TOKENS:], 0, ref.margins[MAX_TOKENS:])
        assert same_greedy(continuation, turn2), diff(continuation, turn2)
    finally:
        shutdown(reader)
    replace_weights(model)  # same path, same shapes, other weights
    stats = tmp_path / "stats-other.json"
    other = make_llm(model, yaml, {"hma_stats_file": str(stats)})
    try:
        [toks] = generate(other, LONG_PROMPT)
        assert toks.cached == 0 and read_stats(stats).get("loads_ok", 0) == 0  # the old KV is not theirs
        assert toks.tokens != reference3[LONG_PROMPT].tokens  # the weights did change the output
    finally:
        shutdown(other)
    # the old files left alone beside the new ones
    assert len([f for f in os.listdir(disk) if ".full@" in f or ".tail@" in f]) == 4 * 23
    assert set(files) <= set(os.listdir(disk))


def replace_weights(model: Path) -> None:
    """Overwrite the model's weights with others of the same shapes and dtype (a new fine-tune)."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    weights = load_file(path)
    g = torch.Generator().manual_seed(1234)
    weights = {k: (v.float() + torch.randn(v.shape, generator=g) * v.float().std().clamp(min=1e-3)).to(v.dtype)
               for k, v in weights.items()}
    save_file(weights, path, metadata={"format": "pt"})


# -- a CPU tier too small for everything; sparse sliding checkpoints ----------------

def test_small_tier_evicts_and_backs_off_exactly(model3, reference3, tmp_path):
    """Eviction and back-off, with vLLM's asynchronous scheduling on.

    One prompt stores 23 full objects (256 KiB each in float32) + 7 tails (every
    1024 tokens and the prompt's last chunk): ~7.6 MB. The tier holds ~12 MB: the
    second prompt evicts most of the first. A 5888-token hit (~6 MB) is more than
    the worker may hold (half the tier): it loads asynchronously.
    """
    yaml = write_yaml(tmp_path / "small.yaml", chunk_size=CHUNK, local_cpu=True,
                      max_local_cpu_size=0.012, extra_config={"hma_checkpoint_interval": 1024})
    llm = make_llm(model3, yaml, async_scheduling=True)
    try:
        generate(llm, [OTHER_PROMPT])
        generate(llm, [LONG_PROMPT])
        llm.reset_prefix_cache()
        # shares 11 chunks with LONG_PROMPT, but the nearest stored tail is at 2048
        [toks] = generate(llm, PREFIX_PROMPT)
        assert toks.cached == 2048 and same_greedy(reference3[PREFIX_PROMPT], toks)
        llm.reset_prefix_cache()
        [toks] = generate(llm, LONG_PROMPT)  # the last-chunk tail was stored
        assert toks.cached == 5888 and same_greedy(reference3[LONG_PROMPT], toks)
        llm.reset_prefix_cache()
        [toks] = generate(llm, OTHER_PROMPT)  # its first chunks were evicted
        assert toks.cached < boundary(6001) and same_greedy(reference3[OTHER_PROMPT], toks)
    finally:
        shutdown(llm)


# -- the 2-group model (window 512 > chunk) -----------------------------------------

REFERENCES2 = {p: Reference("tiny-gemma3-2g", p) for p in (LONG_PROMPT, PREFIX_PROMPT)}


def test_two_groups_window_larger_than_chunk(tmp_path):
    model = build_tiny_model("tiny-gemma3-2g")
    expected, expected_prefix = REFERENCES2[LONG_PROMPT].get(), REFERENCES2[PREFIX_PROMPT].get()
    yaml = write_yaml(tmp_path / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)
    stats = tmp_path / "stats.json"
    llm = make_llm(model, yaml, {"hma_stats_file": str(stats)})
    try:
        generate(llm, LONG_PROMPT)
        llm.reset_prefix_cache()
        [toks] = generate(llm, LONG_PROMPT)
        assert toks.cached == 5888 and same_greedy(expected, toks)
        # window 512: the tail at 5888 covers tokens 5377..5887 -> blocks 42..45 (4 blocks)
        assert read_stats(stats)["loaded_bytes_sliding_window"] == 4 * 2 * PAGE
        llm.reset_prefix_cache()
        [toks] = generate(llm, PREFIX_PROMPT)
        # shares 11 chunks (2816 tokens); tails are stored every 512 tokens (the default
        # interval for a 512-token window) and at each prompt's last chunk: back off to 2560
        assert toks.cached == 2560 and same_greedy(expected_prefix, toks)
    finally:
        shutdown(llm)
