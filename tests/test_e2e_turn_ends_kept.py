"""Conversations keep every turn end while the tier has room (scheduler.admission, store.value_policy).

Three conversations on one shared 700-token system prompt, batched (they start together: none
of their turn ends can be read before the others' turns finished, so admission's turn-end probe
must not judge them unread yet; their turn ends share the marker after the system prompt, rewritten
by each in one write batch), vLLM's prefix cache emptied before each turn: each next turn hits
every token the turn before computed, and its answer equals the reference's continuation
(tiny-gemma3, float32, chunk 256; each next turn's prompt is the previous prompt and its answer).
"""

from __future__ import annotations

import random

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import Gen, Reference, generate, hold, make_llm, read_stats, same_greedy, settled_stats, shutdown
from tests.engines import turn_end_stored, write_yaml

VOCAB, ANSWER, TURNS = 790, 24, 3
_rng = random.Random(58)
SYSTEM = [_rng.randrange(10, VOCAB) for _ in range(700)]
PROMPTS = [SYSTEM + [_rng.randrange(10, VOCAB) for _ in range(n)] for n in (33, 39, 25)]
BATCH = Reference("tiny-gemma3", [{"prompt_token_ids": p} for p in PROMPTS], max_tokens=TURNS * ANSWER)


@pytest.fixture(scope="module")
def reference():
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
