"""Conversations keep every turn end while the tier has room (scheduler.admission, store.value_policy).

Three conversations on one shared 700-token system prompt, batched (they start together: none
of their turn ends can be read before the others' turns finished, so admission's turn-end probe
must not judge them unread yet; their turn ends share the marker after the system prompt, rewritten
by each in one write batch), vLLM's prefix cache emptied before each turn: each next turn hits
every token the turn before computed, and its answer equals the reference's continuation
(tiny-gemma3, float32, chunk 256; each next turn's prompt is the previous prompt and its answer).

Then an edit, each turn on a fresh instance through one Redis: a conversation's second turn ends in
the chunk its first turn ended in (one marker lists both), and the user rewrites the second
turn's message: the new prompt is the first turn's prompt and answer, then a new message; it hits
the first turn's turn end, every token that turn computed (the second turn's instance read the
marker at its lookup, so its rewrite lists the first turn end too: core.turn_ends).
"""

from __future__ import annotations

import random

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import Gen, Reference, generate, hold, make_llm, read_stats, same_greedy, settled_stats, shutdown
from tests.engines import turn_end_stored, write_yaml
from tests.redis_server import write_redis_yaml

VOCAB, ANSWER, TURNS = 790, 24, 3
_rng = random.Random(58)
SYSTEM = [_rng.randrange(10, VOCAB) for _ in range(700)]
PROMPTS = [SYSTEM + [_rng.randrange(10, VOCAB) for _ in range(n)] for n in (33, 39, 25)]
BATCH = Reference("tiny-gemma3", [{"prompt_token_ids": p} for p in PROMPTS], max_tokens=TURNS * ANSWER)
# the edit: turn 1 ends in chunk 2 (700 + 24 tokens), turn 2 too (a 16-token message, 16 tokens)
CHAT = [_rng.randrange(10, VOCAB) for _ in range(700)]
MESSAGE, EDITED = ([_rng.randrange(10, VOCAB) for _ in range(16)] for _ in range(2))
FIRST = Reference("tiny-gemma3", {"prompt_token_ids": CHAT}, max_tokens=ANSWER)


@pytest.fixture(scope="module")
def reference():
    FIRST.get()
    return BATCH.get()


@pytest.fixture(scope="module")
def engine(reference, tmp_path_factory):
    d = tmp_path_factory.mktemp("turns")
    yaml = write_yaml(d / "cpu.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=1.0)
    stats = d / "stats.json"
    llm = hold(make_llm(build_tiny_model("tiny-gemma3"), yaml, {"hma_stats_file": str(stats)}))
    yield llm, stats
    shutdown(llm)


def test_conversations_started_together_on_a_shared_system_prompt_hit_every_turn_end(engine, reference):
    llm, stats = engine
    prompts = [list(p) for p in PROMPTS]
    before = read_stats(stats)
    for turn in range(TURNS):
        if turn:  # the turn ends go with the engine's next step: stored before the reset drops them
            turn_end_stored(stats, before)
            before = settled_stats(stats)
        llm.reset_prefix_cache()
        outs = generate(llm, [{"prompt_token_ids": p} for p in prompts], max_tokens=ANSWER)
        part = slice(turn * ANSWER, (turn + 1) * ANSWER)
        for i, (ref, out) in enumerate(zip(reference, outs)):
            assert same_greedy(Gen(ref.tokens[part], 0, ref.margins[part]), out), f"turn {turn + 1}, conversation {i}"
            if turn:
                assert out.cached == len(prompts[i]) - 1, f"turn {turn + 1}, conversation {i}: " \
                                                          f"{out.cached} of {len(prompts[i]) - 1} computed before"
        if any(out.tokens != ref.tokens[part] for ref, out in zip(reference, outs)):
            break  # parted from the reference at a near tie: the next prompts are not its
        for p, out in zip(prompts, outs):
            p += out.tokens


def test_an_edited_message_hits_the_turn_end_the_conversation_went_on_from(reference, module_redis, tmp_path):
    model = build_tiny_model("tiny-gemma3")

    def fresh_turn(prompt, n, name):
        yaml = write_redis_yaml(tmp_path / f"{name}.yaml", module_redis.url)
        llm = make_llm(model, yaml, {"hma_stats_file": str(tmp_path / f"{name}.json")})  # (the held one stops)
        try:
            [out] = generate(llm, {"prompt_token_ids": prompt}, max_tokens=n)
        finally:
            shutdown(llm)  # its writer has put the turn end into Redis by then
        return out

    first = fresh_turn(CHAT, ANSWER, "turn1")
    assert same_greedy(FIRST.get(), first)
    went_on = CHAT + first.tokens
    second = fresh_turn(went_on + MESSAGE, 16, "turn2")
    assert second.cached == len(went_on) - 1
    assert len(went_on + MESSAGE) + 15 < 3 * 256, "turn 2 must end in the chunk turn 1 ended in"
    edit = {"prompt_token_ids": went_on + EDITED}
    expected = Reference("tiny-gemma3", edit, max_tokens=16).get()  # an engine without the connector
    out = fresh_turn(edit["prompt_token_ids"], 16, "edit")
    assert out.cached == len(went_on) - 1, f"the edit hit {out.cached} of the {len(went_on) - 1} turn 1 computed"
    assert same_greedy(expected, out)
