"""Seeded request traces for ``bench_capacity.py`` (and its oracle): RAG, chat and agent shapes.

A trace is a list of ``Request``: token ids of its own (``tokens``), appended to what an earlier
request computed (``parent``: its prompt and its answer) or standing alone, and the number of
tokens it generates (``answer``; greedy, ``min_tokens`` = ``max_tokens``). The answers are the
model's, so a prompt that extends an earlier request is known only once that request ran:
``realize`` builds the prompts from the answers (the benchmark takes them from the first server
that runs the trace; the tests and the oracle's unit tests from a seeded stand-in).

Shapes (``rag``, ``chat``, ``agent``; sizes of the full run, ``quick`` ones smaller):

* **rag**: one shared system prompt of 512 tokens, then one of 12 documents of 1536 tokens picked
  by Zipf popularity (exponent 1.0, document 0 the most popular), then a question of 30-50
  tokens of its own, and a 16-token answer. No request extends another.
* **chat**: conversations on one shared 512-token system prompt, 4 turns each; a turn's prompt is
  the previous turn's prompt, its answer (48-96 tokens) and a new user message (64-192 tokens).
  Six conversations (of 20) are open at a time and take turns in a seeded random order (a new one opens
  when one ends): the turns of different conversations interleave.
* **agent**: a shared tool prefix of 2048 tokens, then a task of 64-256 tokens of its own (a
  branch; 56 of them), a 32-64-token answer; 40% of the branches are extended (the step's prompt, its answer
  and a tool result of 64-192 tokens) 2-10 requests later, and an extension again with the same
  chance, up to 3 extensions.

Token ids are drawn uniformly from ``[10, vocab)``: independent draws never share a 256-token
chunk, so the only shared prefixes are the ones the shape describes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

VOCAB = 790  # lmcache_hma.testing.tiny_tokenizer's size, rounded down (ids below 10 are special)
LOW = 10


@dataclass(frozen=True)
class Request:
    """One request of a trace: its prompt is ``parent``'s prompt and answer (when ``parent`` is
    not None) followed by ``tokens``; it generates ``answer`` tokens. ``group``: what it is
    about (a document, a conversation, a branch), for reading the results."""

    index: int
    parent: Optional[int]
    tokens: tuple[int, ...]
    answer: int
    group: str


@dataclass
class Trace:
    name: str
    seed: int
    requests: list[Request]
    params: dict = field(default_factory=dict)

    def prompt(self, i: int, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> list[int]:
        """Request ``i``'s prompt, given the prompts and answers of the requests before it."""
        r = self.requests[i]
        if r.parent is None:
            return list(r.tokens)
        return list(prompts[r.parent]) + list(answers[r.parent]) + list(r.tokens)

    def realize(self, answer_of: Callable[[int, list[int]], Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """``(prompts, answers)`` of every request, in order; ``answer_of(i, prompt)`` gives
        request ``i``'s answer (``requests[i].answer`` token ids)."""
        prompts: list[list[int]] = []
        answers: list[list[int]] = []
        for i, r in enumerate(self.requests):
            p = self.prompt(i, prompts, answers)
            a = list(answer_of(i, p))
            if len(a) != r.answer:
                raise ValueError(f"request {i}: answer of {len(a)} tokens, the trace says {r.answer}")
            prompts.append(p)
            answers.append(a)
        return prompts, answers


def stand_in_answers(trace: Trace, seed: int = 12345, vocab: int = VOCAB) -> Callable[[int, list[int]], list[int]]:
    """A deterministic stand-in for the model's answers to ``trace`` (tests, sizing the tiers
    before a run): each request's answer seeded by its index and prompt length."""
    def answer_of(i: int, prompt: list[int]) -> list[int]:
        rng = random.Random(f"{seed}/{trace.name}/{i}/{len(prompt)}")
        return [rng.randrange(LOW, vocab) for _ in range(trace.requests[i].answer)]
    return answer_of


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(LOW, vocab) for _ in range(n))


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def rag_trace(requests: int = 96, *, seed: int = 1, vocab: int = VOCAB, system: int = 512, documents: int = 12,
              document_tokens: int = 1536, question: tuple[int, int] = (30, 50), answer: int = 16,
              zipf: float = 1.0) -> Trace:
    rng = random.Random(f"rag/{seed}")
    sys_ids = _ids(rng, system, vocab)
    docs = [_ids(rng, document_tokens, vocab) for _ in range(documents)]
    weights = zipf_weights(documents, zipf)
    out = []
    for i in range(requests):
        d = rng.choices(range(documents), weights)[0]
        q = _ids(rng, rng.randint(*question), vocab)
        out.append(Request(i, None, sys_ids + docs[d] + q, answer, f"doc{d}"))
    return Trace("rag", seed, out, {"requests": requests, "system": system, "documents": documents,
                                     "document_tokens": document_tokens, "question": list(question),
                                     "answer": answer, "zipf": zipf})


def chat_trace(conversations: int = 20, *, seed: int = 2, vocab: int = VOCAB, turns: int = 4, system: int = 512,
               user: tuple[int, int] = (64, 192), answer: tuple[int, int] = (48, 96), open_at_once: int = 6) -> Trace:
    rng = random.Random(f"chat/{seed}")
    sys_ids = _ids(rng, system, vocab)
    out: list[Request] = []
    last: dict[int, int] = {}  # conversation -> index of its last request
    done: dict[int, int] = {}  # conversation -> turns taken
    waiting = list(range(conversations))
    open_: list[int] = []
    while waiting or open_:
        while waiting and len(open_) < open_at_once:
            open_.append(waiting.pop(0))
        c = rng.choice(open_)
        i = len(out)
        new = _ids(rng, rng.randint(*user), vocab)
        parent = last.get(c)
        out.append(Request(i, parent, (sys_ids + new) if parent is None else new, rng.randint(*answer), f"conv{c}"))
        last[c] = i
        done[c] = done.get(c, 0) + 1
        if done[c] == turns:
            open_.remove(c)
    return Trace("chat", seed, out, {"conversations": conversations, "turns": turns, "system": system,
                                      "user": list(user), "answer": list(answer), "open_at_once": open_at_once})


def agent_trace(branches: int = 56, *, seed: int = 3, vocab: int = VOCAB, prefix: int = 2048,
                task: tuple[int, int] = (64, 256), answer: tuple[int, int] = (32, 64),
                tool: tuple[int, int] = (64, 192), extend: float = 0.4, max_extensions: int = 3,
                gap: tuple[int, int] = (2, 10)) -> Trace:
    rng = random.Random(f"agent/{seed}")
    tools = _ids(rng, prefix, vocab)
    # (position, order, branch, depth, parent slot): extensions are placed ``gap`` requests after
    # their parent; a list of slots sorted by position gives the order
    slots: list[dict] = []
    for b in range(branches):
        slots.append({"pos": float(b), "branch": b, "depth": 0, "parent": None})
    # decide extensions branch by branch, in position order
    k = 0
    while k < len(slots):
        s = slots[k]
        if s["depth"] < max_extensions and rng.random() < extend:
            slots.append({"pos": s["pos"] + rng.randint(*gap) + 0.5 * rng.random(), "branch": s["branch"],
                          "depth": s["depth"] + 1, "parent": k})
        k += 1
    order = sorted(range(len(slots)), key=lambda j: (slots[j]["pos"], j))
    index_of = {j: i for i, j in enumerate(order)}
    out = []
    for i, j in enumerate(order):
        s = slots[j]
        if s["parent"] is None:
            toks = tools + _ids(rng, rng.randint(*task), vocab)
            parent = None
        else:
            toks = _ids(rng, rng.randint(*tool), vocab)
            parent = index_of[s["parent"]]
            assert parent < i
        out.append(Request(i, parent, toks, rng.randint(*answer), f"branch{s['branch']}.{s['depth']}"))
    return Trace("agent", seed, out, {"branches": branches, "prefix": prefix, "task": list(task),
                                       "answer": list(answer), "tool": list(tool), "extend": extend,
                                       "max_extensions": max_extensions, "gap": list(gap)})


def traces(quick: bool = False, vocab: int = VOCAB) -> list[Trace]:
    """The benchmark's three traces (``quick``: shorter ones)."""
    if quick:
        return [rag_trace(40, vocab=vocab), chat_trace(10, vocab=vocab, turns=3),
                agent_trace(20, vocab=vocab)]
    return [rag_trace(vocab=vocab), chat_trace(vocab=vocab), agent_trace(vocab=vocab)]
