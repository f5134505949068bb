"""bench_capacity's traces and offline models (``benchmarks/_capacity_traces.py``,
``benchmarks/_capacity_oracle.py``): deterministic, shaped as described, and an oracle that is
prefix-closed, stays within its budget and serves what a hand count says. No engine."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _capacity_oracle import (ALIGN, Realized, Sizes, admit, gemma_layout, ideal_paths,  # noqa: E402
                              Tokens, oracle)
from _capacity_traces import agent_trace, chat_trace, rag_trace, stand_in_answers, traces  # noqa: E402


def realize(trace, chunk=256):
    prompts, answers = trace.realize(stand_in_answers(trace))
    return Realized(prompts, answers, chunk)


# --------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------


def test_traces_are_deterministic_and_seeded():
    a, b = traces(quick=True), traces(quick=True)
    assert [t.requests for t in a] == [t.requests for t in b]
    assert rag_trace(20, seed=1).requests != rag_trace(20, seed=9).requests
    t = chat_trace(4, turns=2)
    assert t.realize(stand_in_answers(t)) == t.realize(stand_in_answers(t))


def test_rag_shape():
    t = rag_trace(200)
    assert len(t.requests) == 200
    system = t.requests[0].tokens[:512]
    docs = Counter()
    for r in t.requests:
        assert r.parent is None and r.answer == 16
        assert r.tokens[:512] == system
        assert 512 + 1536 + 30 <= len(r.tokens) <= 512 + 1536 + 50
        docs[r.tokens[512:2048]] += 1
        assert r.group == f"doc{int(r.group[3:])}"
    assert len(docs) <= 12
    by_group = Counter(r.group for r in t.requests)
    assert by_group.most_common(1)[0][0] == "doc0"  # Zipf: the first document is the most popular
    assert by_group["doc0"] > 3 * by_group.get("doc11", 0)
    questions = [r.tokens[2048:] for r in t.requests]
    assert len(set(questions)) == len(questions)  # a question of its own


def test_chat_shape_turns_extend_and_interleave():
    t = chat_trace(10, turns=4)
    assert len(t.requests) == 40
    turns = Counter(r.group for r in t.requests)
    assert set(turns.values()) == {4}
    prompts, answers = t.realize(stand_in_answers(t))
    system = prompts[0][:512]
    interleaved = 0
    for i, r in enumerate(t.requests):
        assert prompts[i][:512] == system
        if r.parent is None:
            assert len(r.tokens) - 512 >= 64
        else:
            assert t.requests[r.parent].group == r.group and r.parent < i
            p = r.parent
            assert prompts[i] == prompts[p] + answers[p] + list(r.tokens)  # previous prompt + answer + message
            assert 64 <= len(r.tokens) <= 192 and 48 <= t.requests[p].answer <= 96
            interleaved += r.parent != i - 1
    assert interleaved > 10  # turns of other conversations come between a turn and the next


def test_agent_shape_branches_on_one_prefix_some_extended():
    t = agent_trace(40)
    prompts, answers = t.realize(stand_in_answers(t))
    prefix = prompts[0][:2048]
    roots = [r for r in t.requests if r.parent is None]
    ext = [r for r in t.requests if r.parent is not None]
    assert len(roots) == 40 and 5 <= len(ext) <= 40
    for i, r in enumerate(t.requests):
        assert prompts[i][:2048] == prefix
        if r.parent is not None:
            assert r.parent < i and t.requests[r.parent].group.split(".")[0] == r.group.split(".")[0]
            assert prompts[i][:len(prompts[r.parent])] == prompts[r.parent]
        assert int(r.group.split(".")[1]) <= 3
    assert any(int(r.group.split(".")[1]) >= 2 for r in ext)  # some extended again


# --------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------


def test_object_sizes_of_the_gemma_shape():
    s = Sizes(gemma_layout())
    full, tail = s.payload("F", 0), s.payload("T", 8)
    assert full == 256 * 512  # one full layer, 512 B/token (K and V, 64 x float32)
    assert tail == 10 * full  # five sliding layers x 512 tokens
    assert s.payload("T", 1) == 5 * 256 * 512  # a window longer than the prefix: all of it
    assert s.payload("U", 2103) == (1 + 25) * 65536  # the partial chunk's block + 5 layers x 5 blocks
    assert s.tier("F", 0) % ALIGN == 0 and s.tier("F", 0) > full
    assert s.all_layers_per_token() == 6 * 512
    assert Sizes(s.layout, footprint=lambda n: 2 * n).tier("F", 0) == 2 * (full + 128)  # a Redis's, measured
    assert {full + 128, tail + 128, s.payload("U", 2103) + 128} <= s.object_bytes(4096)


def test_interval_admission_stores_more_tails_than_branch_on_rag():
    real, s = realize(rag_trace(40)), Sizes(gemma_layout())
    today, new = admit(real, s, "interval"), admit(real, s, "branch")
    assert today.stored_payload["T"] > 2.5 * new.stored_payload["T"]
    assert today.stored_payload["U"] > new.stored_payload["U"]  # turn ends sampled
    assert today.stored_payload["F"] == new.stored_payload["F"]
    ideal, _ = ideal_paths(real)
    assert today.hit_tokens == sum(ideal)  # unbounded, tails everywhere: every repeat hits
    assert sum(ideal) - 2 * 512 <= new.hit_tokens < today.hit_tokens  # a cold branch costs a request


# --------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------


def _tiny():
    """Chunks of 4 tokens; every object takes one 4 KiB allocation."""
    return Sizes(gemma_layout(sliding_layers=1, full_layers=1, window=4, block_size=2, chunk=4))


def test_oracle_on_a_hand_made_trace():
    A = list(range(100, 108))  # 8 tokens: two chunks
    ans0 = [1, 2]
    prompts = [A, A + [7, 8, 9], A + ans0 + [5, 6], A]
    answers = [ans0, [3], [4], [4]]
    real, s = Realized(prompts, answers, 4), _tiny()
    assert all(s.tier(k, at) == ALIGN for k, at in (("F", 0), ("T", 2), ("U", 9)))
    # r0 computes A + ans0[0] (9 tokens): chunks 0, 1, tails at 4 and 8, a turn end at 9.
    # r1 hits the tail at 8; r2 the turn end at 9 (its prompt extends r0's); r3 (A again) the tail at 4.
    ideal, _ = ideal_paths(real)
    assert ideal == [0, 8, 9, 4]
    assert oracle(real, s, None).hits == [0, 8, 9, 4]
    # The turn end at 9 reads the window from token 6: it is stored on_tail ("V"), the tail at 8
    # holding the tokens before 8, and a hit through it reads both.
    assert s.payload("V", 9) < s.payload("U", 9) and ideal_paths(real, s.layout)[1][2][-2:] == [
        Tokens(A + ans0, 4).tail(2), Tokens(A + ans0, 4).turn(9, on_tail=True)]
    # Three objects: after r0 the two chunks and the tail at 8 (the tail at 4 is used last, the turn
    # end, a leaf over that tail, next-to-last); after r1 the tail at 4 comes back (r1 computes it)
    # and goes again; r2 finds no turn end and hits the tail at 8; r2 computes the tail at 4 for r3.
    three = oracle(real, s, 3 * ALIGN)
    assert three.hits == [0, 8, 8, 4]
    assert three.hit_tokens == 20 and three.evictions == 4
    # Four: the turn end stays for r2.
    assert oracle(real, s, 4 * ALIGN).hits == [0, 8, 9, 4]
    # What no later request reads is never stored: r1's, r2's and r3's turn ends, r2's third chunk.
    assert oracle(real, s, None).stored_objects == 5


@pytest.mark.parametrize("make", [lambda: rag_trace(40), lambda: chat_trace(8, turns=3), lambda: agent_trace(16)])
def test_oracle_is_prefix_closed_within_budget_and_at_most_ideal(make):
    trace = make()
    real, s = realize(trace), Sizes(gemma_layout())
    work = admit(real, s, "interval").payload_bytes
    ideal, _ = ideal_paths(real)
    assert oracle(real, s, None).hits == ideal
    for frac in (0.05, 0.2):
        budget = int(frac * work)
        seen = []

        def check(i, held, parent):
            assert sum(held.values()) <= budget
            assert all(parent[k] is None or parent[k] in held for k in held)  # prefix-closed
            seen.append(i)

        out = oracle(real, s, budget, on_step=check)
        assert seen == list(range(len(real)))
        assert all(h <= best for h, best in zip(out.hits, ideal))
        assert out.peak_bytes > budget or out.evictions == 0
    small, large = oracle(real, s, int(0.05 * work)), oracle(real, s, int(0.2 * work))
    assert small.hit_tokens <= large.hit_tokens <= sum(ideal)


@pytest.mark.parametrize("make", [lambda: rag_trace(40), lambda: chat_trace(8, turns=3)])
def test_the_value_tier_keeps_its_budget_and_its_prefixes_and_serves_at_most_the_oracle(make):
    """``ValueTier`` (the connector's value policy at a budget, ``sim_capacity.py``): never over
    its budget, never a held object whose parent is not held (checked after every request), at
    most what the oracle serves at the same budget, and as much as unbounded admission when it
    is big enough never to evict."""
    from _capacity_oracle import ValueTier, check_prefix_closed

    real, s = realize(make()), Sizes(gemma_layout())
    work = admit(real, s, "interval").payload_bytes
    for frac in (0.05, 0.2):
        tier = ValueTier(s, int(frac * work))
        read = tier.read

        def checked(path):  # each request's hit: then what the previous one stored is in place
            assert tier.total <= tier.budget and tier.total == sum(tier.held.values())
            assert check_prefix_closed(tier.held, {k: tier.lineage.get(k).parent for k in tier.held})
            read(path)

        tier.read = checked
        out = admit(real, s, "branch", tier=tier)
        assert out.evictions > 0 and out.hit_tokens <= oracle(real, s, tier.budget).hit_tokens
    big = admit(real, s, "branch", tier=ValueTier(s, 10 * work))
    assert big.evictions == 0 and big.hits == admit(real, s, "branch").hits


@pytest.mark.parametrize("make", [lambda: rag_trace(40), lambda: chat_trace(6, turns=3), lambda: agent_trace(16)],
                         ids=["rag", "chat", "agent"])
def test_no_exact_format_stores_less_than_the_format_floor(make):
    """``format_floor``: each token's KV once where a hit needs it, at most what the oracle's
    admission stores in the connector's objects (windows stored whole per boundary)."""
    from _capacity_oracle import format_floor

    real = realize(make())
    sizes = Sizes(gemma_layout())
    floor = format_floor(real, sizes)
    stored = oracle(real, sizes, None).payload_bytes / (real.distinct_tokens() * sizes.all_layers_per_token())
    assert 0 < floor <= stored
