"""Speculative decoding with the connector: which methods it serves, and what a draft model's KV
adds to the chunk keys. Read once, in the connector's constructor (both roles), from
``vllm_config.speculative_config``; a method it cannot serve exactly stops the engine there with
one message naming the method and the reason.

What a hit means per method (vLLM 0.32 source lines in brackets):

* **n-gram**: proposals come from the request's own token ids; no state exists beside the
  target's KV. Served as it is.
* **EAGLE, EAGLE3**: the draft model has attention layers of its own. They are built from the
  same ``VllmConfig`` and registered in the same forward context as the target's (an EAGLE Llama
  layer is named ``layers.{number of target layers + i}``: ``llama_eagle.py``/``llama_eagle3.py``
  ``start_layer_id``), so the runner gives them KV cache specs like any attention layer and they
  sit in the KV cache groups the connector is built with, usually in the target's full-attention
  group (the CPU runner logs "EAGLE drafter KV cache initialized": ``cpu_model_runner.py`` ~107).
  The connector stores and loads them with the target's layers. vLLM finishes the connector's
  step only after the drafter ran (``gpu_model_runner.py`` ~4176-4179 and ~4505-4509), so a stored
  chunk holds the draft KV of all its positions.
  That KV is not a function of the chunk's tokens alone: the drafter computes position ``p`` from
  the target's hidden state at ``p`` and token ``p + 1``, and at the end of a prefill step it reads
  the next prompt token(s) (``VllmConfig.num_prefill_lookahead_tokens``, ``config/vllm.py`` ~644:
  1 for EAGLE; vLLM's own prefix cache drops the last block of a hit for this reason,
  ``v1/core/kv_cache_coordinator.py`` ~135-150). So the ``lookahead`` tokens after a chunk go into
  its key (``keys.ChunkHasher``): a hit at ``h`` is served only to a prompt whose tokens from ``h``
  on are those the stored draft KV was computed with. A chunk whose lookahead is not prompt text
  (the prompt's last tokens) is stored once the answer's first tokens are accepted, with answers
  (``hma_store_answers``); an answer's chunks and turn end alike (``scheduler.request_keys``). The draft's weights go into the namespace: two
  deployments with the same target and different drafts never share draft KV.
* **MTP** and every other method: refused, see ``_REFUSED``.
* **Any method on a recurrent-state (gated delta net) model**: refused, see ``_RECURRENT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lmcache_hma.core.identity import model_identity

SERVED = ("ngram", "eagle", "eagle3")  # each run end to end with the connector (tests/)
DRAFT_KV = ("eagle", "eagle3")  # of those, the methods whose draft model keeps KV

_RECURRENT = (
    "vLLM 0.32's CPU build fails at the first step for every speculative method on a "
    "recurrent-state model (speculative_config set on a hybrid model makes the Mamba 'align' "
    "pre-copy use precopy_mamba_align_fused_kernel, a Triton kernel: v1/worker/gpu_model_runner.py "
    "~1027 _get_mamba_bufs, v1/worker/mamba_utils.py ~1226 run_fused_precopy), so how vLLM moves "
    "states through its speculative state blocks (MambaSpec.num_speculative_blocks) was never "
    "verified with the connector's stored states"
)
_REFUSED = {
    "mtp": "the MTP heads of the families this connector serves (Qwen3.5, Qwen3-Next) sit on "
           "recurrent-state models, where vLLM's CPU build runs no speculative method; other MTP "
           "models were never run with the connector (an MTP layer reuses the target's decoder "
           "layer and vLLM finds its KV group by position only, v1/core/kv_cache_utils.py "
           "_annotate_eagle_groups; multi-module MTP reads num_speculative_tokens tokens ahead)",
}
_UNVERIFIED = "it was never run with this connector (it serves " + ", ".join(SERVED) + ")"


class UnsupportedSpeculation(ValueError):
    """The speculative method cannot be served exactly by this connector."""


@dataclass(frozen=True)
class SpeculationPlan:
    method: Optional[str] = None  # None: no speculative decoding
    lookahead: int = 0  # tokens after a chunk that go into its key
    identity: dict = field(default_factory=dict)  # added to the namespace's identity


def speculation_plan(vllm_config) -> SpeculationPlan:
    """What the connector does for ``vllm_config``'s speculative method, or
    ``UnsupportedSpeculation`` naming the method and why it is refused."""
    spec = vllm_config.speculative_config
    if spec is None:
        return SpeculationPlan()
    method = spec.method
    # the draft's model type names what vLLM made of the method given, e.g. 'mtp' (qwen3_5_mtp)
    draft_type = (getattr(getattr(spec.draft_model_config, "hf_config", None), "model_type", None)
                  if spec.uses_draft_kv_cache() else None)
    name = f"{method!r}" + (f" ({draft_type})" if draft_type and draft_type != method else "")
    if vllm_config.model_config.is_hybrid:
        raise UnsupportedSpeculation(_refusal(name, "on a recurrent-state model", _RECURRENT,
                                              "serve this model without --speculative-config"))
    if method not in SERVED:
        raise UnsupportedSpeculation(_refusal(name, "", _REFUSED.get(method, _UNVERIFIED)))
    if method not in DRAFT_KV:
        return SpeculationPlan(method)
    lookahead = int(vllm_config.num_prefill_lookahead_tokens)
    if lookahead < 1:  # vLLM 0.32 gives EAGLE 1; anything else was not read here
        raise UnsupportedSpeculation(_refusal(name, "", f"vLLM reports a prefill lookahead of "
                                                        f"{lookahead}, expected at least 1"))
    draft = spec.draft_model_config
    identity = {"speculative": {
        "method": method, "lookahead": lookahead, "draft_model": draft.model,
        "draft": model_identity(draft, vllm_config.cache_config),
    }}
    return SpeculationPlan(method, lookahead, identity)


def _refusal(name: str, where: str, why: str,
             advice: str = "serve it without --speculative-config or with another method") -> str:
    where = f" {where}" if where else ""
    return (f"LMCacheHMAConnector does not serve speculative decoding with method {name}{where}: "
            f"{why}; {advice}")
