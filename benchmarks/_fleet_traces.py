"""The traces of ``bench_fleet_route.py``: RAG, chat and agents, as text, and the token prompts a
running instance makes of them (a conversation's next prompt carries the model's answers).

No side effect on import (``benchmarks._common`` sets vLLM's environment when imported): the tests
import this module into processes that start engines of their own."""

from __future__ import annotations

import random

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega river stone cloud field light shadow music paper").split()


def text(rng: random.Random, n_words: int, tag: str) -> str:
    return tag + " " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def make_trace(kind: str, rng: random.Random, quick: bool) -> list[tuple]:
    """Requests (text) in arrival order, each ``(conversation, text)``: ``conversation`` None, a
    prompt of its own; otherwise the text is appended to that conversation's history, which then
    takes the model's answer too, as a chat client sends back what the model said (``prompts``).
    A word is about 3.5 tokens; every prompt fits the 2,048-token context whole. Sized so that
    what a trace reuses is more than one instance keeps (vLLM's 8,192 device tokens, its 20 MB
    CPU tier: about 16k tokens of chunks and tails) and less than the fleet does: the regime a
    KV-aware router is for (where one instance holds all of it, every policy hits alike; where
    the fleet cannot, none does)."""
    out: list[tuple] = []
    if kind == "rag":  # 20 documents of ~1,500 tokens (30k), Zipf-like popularity
        n_docs = 10 if quick else 20
        docs = [text(rng, 420, f"Document {d}:") for d in range(n_docs)]
        weights = [1 / (d + 1) ** 0.8 for d in range(n_docs)]
        for q in range(30 if quick else 60):
            if q % 4 == 3:
                out.append((None, text(rng, 420, f"One-off {q}:")))
            d = rng.choices(range(n_docs), weights)[0]
            out.append((None, docs[d] + text(rng, 25, f" Question {q}:")))
    elif kind == "chat":  # 10 conversations of 5 turns (~1,800 tokens at the end), in any order
        n_convs = 5 if quick else 10
        system = text(rng, 110, "System:")
        turns = [0] * n_convs
        pending = [c for c in range(n_convs) for _ in range(5)]
        rng.shuffle(pending)
        for n, c in enumerate(pending):
            turns[c] += 1
            out.append((f"chat {c}", (system if turns[c] == 1 else "") + text(rng, 80, f" Turn {turns[c]} of {c}:")))
            if n % 4 == 3:
                out.append((None, text(rng, 420, f"One-off {n}:")))
    elif kind == "agents":  # agents on one shared system prompt, each history growing
        system = text(rng, 250, "Tools and rules:")
        n_agents = 3 if quick else 6
        tasks = [system + text(rng, 40, f" Task {a}:") for a in range(n_agents)]
        for step in range(6):
            for a in range(n_agents):
                out.append((f"agent {a}", (tasks[a] if step == 0 else "") + text(rng, 40, f" Step {step} observation {a}:")))
    else:
        raise ValueError(kind)
    return out


def prompts(trace: list[tuple], tokenize, answer) -> tuple[list[list[int]], list[list[int]]]:
    """The token prompts of ``trace`` and the answer to each (greedy: the same on every
    instance, as the connector's hits change no token): a conversation's next prompt is its
    history (prompts and answers) and the new text, tokenized without special tokens, so its
    previous turn's KV, answer included, is a prefix of it. ``tokenize(text, special)``,
    ``answer(tokens)``: from a running instance."""
    history: dict[str, list[int]] = {}
    out, answers = [], []
    for conv, piece in trace:
        before = history.get(conv, []) if conv is not None else []
        tokens = before + tokenize(piece, not before)
        assert len(tokens) <= 2040, f"a prompt of {len(tokens)} tokens does not fit the context"
        got = answer(tokens)
        out.append(tokens)
        answers.append(got)
        if conv is not None:
            history[conv] = tokens + got
    return out, answers


def conversation_deps(trace: list[tuple]) -> list[int | None]:
    """Per request of ``trace``, the index of its conversation's previous turn (None: the first or
    a prompt of its own): a client sends a turn once it has the answer to the one before."""
    last: dict[str, int] = {}
    out: list[int | None] = []
    for n, (conv, _) in enumerate(trace):
        out.append(last.get(conv) if conv is not None else None)
        if conv is not None:
            last[conv] = n
    return out
