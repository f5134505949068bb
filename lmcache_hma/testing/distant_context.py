"""A probe: does a tiny model's output depend on distant context?

Exactness tests ("a prefix restored from LMCache gives the same output as a recomputed
one") are only meaningful if a wrong or missing KV block changes the output, so the tiny
models are built to depend on distant context (``tiny_model``). This checks that they do,
with ``transformers`` on CPU: the last position's logits of a long prompt against those of
a variant whose first token after BOS was replaced. Kept apart from the builder: it loads a
built model rather than making one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DISTANT_PROMPT = "Hello, how are you?"
DISTANT_REPLACEMENT = "Tell"


MATERIAL_LOGIT_CHANGE = 0.05


@dataclass(frozen=True)
class DistantContextEffect:
    """What replacing the first token after BOS did to the last position's logits."""

    greedy_token_changed: bool
    relative_logit_change: float  # ||l_a - l_b|| / ||l_a||


def distant_context_effect(model_dir: Path | str, prompt_len: int = 2000) -> DistantContextEffect:
    """Compare the last-position logits of a long prompt and of a one-token variant.

    Runs ``transformers`` on CPU (float32; about a second for 2000 tokens). The
    prompt is BOS + ``DISTANT_PROMPT`` repeated, cut to ``prompt_len`` tokens;
    the variant replaces its first token ("Hello") by ``DISTANT_REPLACEMENT``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if prompt_len < 3:
        raise ValueError("prompt_len must be at least 3")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    per_copy = len(tokenizer(DISTANT_PROMPT, add_special_tokens=False).input_ids)
    ids = tokenizer(DISTANT_PROMPT * (prompt_len // per_copy + 1)).input_ids[:prompt_len]
    variant = list(ids)
    (variant[1],) = tokenizer(DISTANT_REPLACEMENT, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids, variant])).logits[:, -1].float()
    change = (logits[0] - logits[1]).norm() / logits[0].norm()
    return DistantContextEffect(
        greedy_token_changed=bool(logits[0].argmax() != logits[1].argmax()),
        relative_logit_change=float(change),
    )


def output_depends_on_distant_context(model_dir: Path | str, prompt_len: int = 2000) -> bool:
    """Whether changing the first token after BOS changes the last position's output.

    True when the greedy next token differs or, failing that, when the
    last-position logits change materially (relative L2 change above
    ``MATERIAL_LOGIT_CHANGE``). See :func:`distant_context_effect`. With the
    default 2000 tokens the greedy token changes for tiny-gemma3,
    tiny-gemma3-2g and tiny-gptoss-like; for tiny-gemma3-5to1 and tiny-gemma2
    only the logits do (by about 70% and 13%).
    """
    effect = distant_context_effect(model_dir, prompt_len)
    return effect.greedy_token_changed or effect.relative_logit_change > MATERIAL_LOGIT_CHANGE
