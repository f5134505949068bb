"""What an instance does with the store, from vLLM's ``kv_role`` (disaggregated prefill).

* ``kv_both`` (the default): looks up and loads hits, stores what it computes.
* ``kv_producer`` (a prefill instance): stores, never loads (it sends no lookups). Beside its
  prompt's chunks it stores a turn end at ``L - 1`` of each prompt of ``L`` tokens (the
  full-attention KV of its last partial chunk and the sliding tail there), so that a decode
  instance sent the same prompt, which may load at most ``L - 1`` tokens (vLLM computes one),
  loads all of them. Models with recurrent-state layers get none: vLLM keeps a running request's
  state after its last computed token only (``L``), not at ``L - 1``; their decode instance loads
  up to the last boundary where vLLM handed a state over.
* ``kv_consumer`` (a decode instance): loads, never stores what it prefilled (the producer did).
  With ``hma_consumer_stores_answers`` it stores the KV of its answers (the chunks past the
  prompt and the turn end) for a conversation's next turn, whichever instance prefills it.

What a producer tells a decode instance it stored (``kv_transfer_params``) and how long the
decode instance waits for it: ``scheduler.promises``.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class TransferRole:
    name: str  # vLLM's kv_role
    loads: bool  # looks up and loads hits
    stores_prompts: bool  # stores the chunks (tails, states) of what it prefills
    stores_answers: bool  # may store answer chunks and turn ends (hma_store_answers still decides)
    prompt_turn_ends: bool  # stores a turn end at each prompt's L - 1 (a producer's)

    @classmethod
    def of(cls, kv_role: str, consumer_stores_answers: bool = False) -> "TransferRole":
        """The role of vLLM's ``kv_role`` (None: ``kv_both``)."""
        kv_role = kv_role or "kv_both"
        if kv_role == "kv_producer":
            return cls(kv_role, loads=False, stores_prompts=True, stores_answers=False, prompt_turn_ends=True)
        if kv_role == "kv_consumer":
            return cls(kv_role, loads=True, stores_prompts=False, stores_answers=consumer_stores_answers,
                       prompt_turn_ends=False)
        if kv_role == "kv_both":
            return cls(kv_role, loads=True, stores_prompts=True, stores_answers=True, prompt_turn_ends=False)
        raise ValueError(f"kv_role {kv_role!r} is not one of {', '.join(ROLES)}")

    @property
    def stores(self) -> bool:
        return self.stores_prompts or self.stores_answers


BOTH = TransferRole.of("kv_both")
