"""bench_fleet_route's traces (``benchmarks/_fleet_traces.py``): a conversation's next prompt
carries the model's answers, as a chat client sends them back, so its previous turn end (answer
included) is a prefix of it."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from benchmarks._fleet_traces import conversation_deps, make_trace, prompts


def fake_tokenize(text: str, special: bool) -> list[int]:
    return ([1] if special else []) + [hash(w) % 1000 + 2 for w in text.split()]


def fake_answer(tokens: list[int]) -> list[int]:
    return [len(tokens) % 97 + 2000, 2001]


def test_a_next_turn_is_its_history_and_answers_then_the_new_text():
    trace = make_trace("chat", random.Random(7), quick=True)
    got, answers = prompts(trace, fake_tokenize, fake_answer)
    last: dict = {}
    for (conv, piece), tokens, answer in zip(trace, got, answers):
        assert answer == fake_answer(tokens)
        if conv is None:  # a one-off prompt of its own
            assert tokens == fake_tokenize(piece, True)
            continue
        if conv in last:
            before = last[conv]
            assert tokens[:len(before)] == before and tokens[len(before):] == fake_tokenize(piece, False)
        else:
            assert tokens[0] == 1  # a first turn: special tokens once, at its start
        last[conv] = tokens + answer
    assert len(last) == 5 and sum(c is None for c, _ in trace) > 0


def test_a_turn_waits_for_its_conversations_previous_turn_only():
    """With clients at once, a turn is sent after the answer to its conversation's previous one."""
    trace = make_trace("chat", random.Random(7), quick=True)
    deps = conversation_deps(trace)
    for n, ((conv, _), dep) in enumerate(zip(trace, deps)):
        earlier = [k for k in range(n) if trace[k][0] == conv and conv is not None]
        assert dep == (earlier[-1] if earlier else None)
    assert sum(d is not None for d in deps) == 5 * 4  # five conversations of five turns
    rag = make_trace("rag", random.Random(7), quick=True)
    assert conversation_deps(rag) == [None] * len(rag)


def test_rag_prompts_stand_alone_and_agents_share_one_system_prompt():
    rag = make_trace("rag", random.Random(7), quick=True)
    assert all(conv is None for conv, _ in rag)
    agents = make_trace("agents", random.Random(7), quick=True)
    got, _ = prompts(agents, fake_tokenize, fake_answer)
    firsts = [t for (conv, _), t in zip(agents, got)][:3]
    common = min(len(t) for t in firsts)
    assert len({tuple(t[:200]) for t in firsts}) == 1 and common > 200


def test_importing_the_traces_leaves_the_environment_alone():
    """This module is imported into pytest workers that start engines: importing
    ``benchmarks._common`` there (which sets vLLM's CPU KV cache space) gave every later engine of
    the worker a 1 GiB cache, and tests that need vLLM to evict or preempt failed."""
    code = ("import os, sys; before = dict(os.environ); import benchmarks._fleet_traces; "
            "sys.exit(dict(os.environ) != before or 'benchmarks._common' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0
