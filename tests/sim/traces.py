"""Trace families: where the next request's prompt and answer come from, drawn from the seed.

* ``rag``: a system prompt, one of a few shared documents, a question.
* ``chat``: a conversation's next turn (the previous prompt, its whole answer, a new message);
  a regenerate (the same prompt again) or an edit (the last message changed).
* ``agent``: a chat whose turns append long tool outputs.
* ``long``: a one-off long prompt nothing shares.

Answers are 1-40 tokens, so turns end on chunk boundaries and inside chunks. A request's
``answer`` is what vLLM samples for it (a pure function of the seed, not of the KV: the oracle
checks the KV itself).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Conversation:
    family: str
    prompt: list[int] = field(default_factory=list)  # the last turn's prompt
    answer: list[int] = field(default_factory=list)  # its whole answer (set when it finished)
    turns: int = 0
    open: bool = False  # a turn is running


@dataclass
class Draw:
    family: str
    prompt: list[int]
    answer: list[int]
    conversation: Conversation | None = None
    kind: str = "new"  # new | next | regenerate | edit | doc


class Traces:
    def __init__(self, rng: random.Random, vocab: int = 30000, max_len: int = 400):
        self.rng = rng
        self.max_len = max_len  # prompt and answer
        max_prompt = min(200, max_len - 40)
        self.vocab = vocab
        self.max_prompt = max_prompt
        self.system = self.tokens(rng.randint(4, 20))
        self.docs = [self.tokens(rng.randint(10, 60)) for _ in range(rng.randint(2, 5))]
        self.conversations: list[Conversation] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def answer(self) -> list[int]:
        return self.tokens(self.rng.choice([1, 2, 3, 7, 8, 9, 12, 16, 17, 23, 31, 40]))

    def draw(self) -> Draw:
        r = self.rng
        family = r.choices(["rag", "chat", "agent", "long"], weights=[3, 5, 2, 1])[0]
        if family == "rag":
            doc = r.choice(self.docs)
            return Draw("rag", self.system + doc + self.tokens(r.randint(1, 12)), self.answer(), kind="doc")
        if family == "long":
            return Draw("long", self.tokens(r.randint(60, self.max_prompt)), self.answer())
        idle = [c for c in self.conversations if c.family == family and not c.open and c.turns]
        if idle and r.random() < 0.75:
            c = r.choice(idle)
            how = r.choices(["next", "regenerate", "edit"], weights=[6, 1, 1])[0]
            if how == "next":
                extra = self.tokens(r.randint(20, 60) if family == "agent" else r.randint(1, 12))
                answer = list(c.answer)
                if answer and r.random() < 0.3:  # a chat template ends the turn its own way (not the EOS sampled)
                    answer[-1] = self.tokens(1)[0]
                prompt = c.prompt + answer + extra
            elif how == "regenerate":
                prompt = list(c.prompt)
            else:
                cut = r.randint(max(1, len(c.prompt) - 10), len(c.prompt))
                prompt = c.prompt[:cut] + self.tokens(r.randint(1, 8))
            if len(prompt) + 40 > self.max_len:
                c.turns = 0  # the conversation is too long: it ends
                return self.draw()
            c.open, c.prompt = True, prompt
            return Draw(family, prompt, self.answer(), c, how)
        c = Conversation(family, self.system + self.tokens(r.randint(1, 16)), [], 0, True)
        self.conversations.append(c)
        if len(self.conversations) > 8:
            self.conversations = [x for x in self.conversations if x.open or x is c] + \
                [x for x in self.conversations if not x.open and x is not c][-6:]
        return Draw(family, list(c.prompt), self.answer(), c, "new")

    def finished(self, draw: Draw, output: list[int]) -> None:
        c = draw.conversation
        if c is None:
            return
        c.open = False
        c.answer = list(output)
        c.turns += 1
