"""Tiny, randomly initialised hybrid-attention causal LMs for offline tests.

The LMCache hybrid-memory-allocator (HMA) connector has to store and restore
the KV caches of models that mix sliding-window and full-attention layers,
which vLLM splits into several KV cache groups. Testing that connector needs
such a model, but no hub download is possible in tests. This module therefore
builds one locally: a few-layer Gemma-3 (or Gemma-2) text model with seeded
random weights, plus a small byte-level BPE tokenizer, saved with
``save_pretrained`` into a directory that ``transformers`` and vLLM (CPU build)
load offline.

Exactness tests ("a prefix restored from LMCache gives the same output as a
recomputed one") are only meaningful if a wrong or missing KV block changes the
output. A random model whose output ignores all but the last few tokens would
pass them vacuously, so the models are built to depend on distant context:

* Attention is sharp. Gemma-3 normalises queries and keys (QK-norm), so with
  the usual query scale ``head_dim**-0.5`` attention logits have a standard
  deviation of about 1 whatever the weights: near-uniform attention over
  thousands of tokens, in which any one token is drowned out (and lost in bf16
  rounding). ``query_pre_attn_scalar`` is therefore 1, giving logits of std
  ~``sqrt(head_dim)`` = 8. Gemma-2 has no QK-norm; its query projections are
  scaled after init to the same effect.
* The embeddings are small (``initializer_range`` 0.02). Gemma ties the LM head
  to the embeddings and normalises every sub-layer's output, so the weight
  scale mostly sets how much of the raw input embedding stays in the residual
  stream. Large embeddings (0.08 was tried) make the model repeat its last
  input token whatever came before; small ones let the attention outputs,
  hence the context, decide the next token.

With these, replacing only the first word of a 6000-token prompt changes the
10 greedy tokens vLLM generates, for every preset (checked with vLLM CPU).
``distant_context.output_depends_on_distant_context`` checks the same with
``transformers`` on a 2000-token prompt.

Special tokens other than BOS (pad, eos, unk) get all-zero embedding rows.
With the tied LM head their logit is exactly 0 while the largest of the other
logits is positive, so greedy decoding never emits them and a vLLM request for
``max_tokens=N`` gets N tokens, without ``ignore_eos``.

vLLM groups the KV caches of layers of one attention type into groups of equal
size (the smaller type's layer count), one group per slice, so the presets give
3 (tiny-gemma3: 4 sliding + 2 full layers), 2 (tiny-gemma3-2g,
tiny-gptoss-like, tiny-gemma2) and 6 (tiny-gemma3-5to1: 10 + 2) KV cache groups.

Gemma-2 note: ``Gemma2Config`` (transformers 5) accepts ``layer_types`` and
vLLM's ``gemma2`` model reads ``config.layer_types`` per layer, so the pattern
given here is honoured (both default to 1:1 alternation without it). Gemma-2
also soft-caps attention and final logits (50 and 30 by default), kept here.

Usage::

    python -m lmcache_hma.testing.tiny_model [--preset NAME] [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lmcache_hma.testing.model_cache import build_into, is_built, model_cache_dir
from lmcache_hma.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, build_tokenizer

BUILDER_VERSION = "3"
OUTPUT_LOGIT_STD = 4.0  # see _sharpen_output
"""Bump whenever the builder's output changes, so cached models are rebuilt."""


S = "sliding_attention"
F = "full_attention"
L = "linear_attention"  # gated delta net (Qwen3-Next): a recurrent state instead of KV


# Attention is made sharp (see module docstring). Gemma-3 normalises queries and
# keys, so a query scale of 1 (instead of head_dim**-0.5) gives attention
# logits of std ~sqrt(head_dim) = 8; for archs without QK-norm the query
# projection is scaled to the same effect.
QUERY_PRE_ATTN_SCALAR = 1
ATTENTION_LOGIT_STD = 8.0


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny model (and its cache key)."""

    name: str
    arch: str  # "gemma3", "gemma2" or "qwen3next"
    layer_types: tuple[str, ...]
    sliding_window: int
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.arch not in _ARCHES:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {sorted(_ARCHES)}")
        bad = set(self.layer_types) - ({F, L} if self.arch in _RECURRENT_ARCHES else {S, F})
        if bad or not self.layer_types:
            raise ValueError(f"invalid layer_types {self.layer_types!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def digest(self) -> str:
        """Short hash of the spec and the builder version."""
        payload = json.dumps(
            {"spec": dataclasses.asdict(self), "builder": BUILDER_VERSION}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# arch -> (transformers config class name, model class name)
_ARCHES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
_ARCHES_WITHOUT_QK_NORM = {"gemma2"}
_RECURRENT_ARCHES = {"qwen3next"}

PRESETS: dict[str, TinyModelSpec] = {
    spec.name: spec
    for spec in [
        # 3 KV cache groups in vLLM: two sliding groups, one full group.
        TinyModelSpec("tiny-gemma3", "gemma3", (S, S, F, S, S, F), sliding_window=128),
        # Window larger than LMCache's 256-token chunk; 2 groups.
        TinyModelSpec("tiny-gemma3-2g", "gemma3", (S, F, S, F), sliding_window=512),
        # The real Gemma-3 ratio, 5 sliding : 1 full.
        TinyModelSpec(
            "tiny-gemma3-5to1", "gemma3", ((S,) * 5 + (F,)) * 2, sliding_window=1024
        ),
        # gpt-oss shape: 1:1 alternation.
        TinyModelSpec("tiny-gptoss-like", "gemma3", (S, F, S, F), sliding_window=128),
        TinyModelSpec("tiny-gemma2", "gemma2", (S, F, S, F), sliding_window=128),
        # Qwen3-Next shape: 3 gated-delta-net layers + 1 full-attention layer, MoE in
        # layers 1 and 3 (see _qwen3next_config); vLLM makes one Mamba group per GDN layer.
        # 2 KV heads of 128: a 256-token attention block's page (256 KiB) holds a GDN state
        # (133 KiB), so vLLM keeps block size 256 (chunk 256 works).
        TinyModelSpec("tiny-qwen3next", "qwen3next", (L, L, L, F), sliding_window=0,
                      hidden_size=256, num_attention_heads=4, num_kv_heads=2, head_dim=128),
    ]
}

DEFAULT_MODEL = "tiny-gemma3"


# --------------------------------------------------------------------------
# Paths and caching
# --------------------------------------------------------------------------


def resolve_spec(spec_or_name: TinyModelSpec | str) -> TinyModelSpec:
    if isinstance(spec_or_name, TinyModelSpec):
        return spec_or_name
    try:
        return PRESETS[spec_or_name]
    except KeyError:
        raise KeyError(f"unknown preset {spec_or_name!r}; known: {sorted(PRESETS)}") from None


def default_model_dir(spec: TinyModelSpec) -> Path:
    return model_cache_dir() / f"{spec.name}-{spec.digest()}"


def is_complete(model_dir: Path, spec: TinyModelSpec) -> bool:
    return is_built(model_dir, spec.digest())


def build_tiny_model(
    spec_or_name: TinyModelSpec | str = DEFAULT_MODEL,
    out_dir: Path | None = None,
    *,
    force: bool = False,
) -> Path:
    """Build the model (unless a complete build is there) and return its directory."""
    spec = resolve_spec(spec_or_name)
    final = Path(out_dir) if out_dir is not None else default_model_dir(spec)
    return build_into(final, spec.digest(), lambda tmp: _write_model(spec, tmp), force=force)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def make_config(spec: TinyModelSpec, tokenizer):  # -> transformers.PretrainedConfig
    import transformers

    config_cls = getattr(transformers, _ARCHES[spec.arch][0])
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        layer_types=list(spec.layer_types),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        architectures=[_ARCHES[spec.arch][1]],
        dtype=spec.dtype,
    )
    if spec.arch == "qwen3next":
        return config_cls(**common, **_qwen3next_keys(spec))
    return config_cls(**common, sliding_window=spec.sliding_window,
                      query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR, tie_word_embeddings=True)


# Qwen3-Next: GDN state per layer = conv (3, 768) bf16 + recurrent (2, 128, 128) fp32.
_GDN_HEADS, _GDN_HEAD_DIM = 2, 128
# Long recurrent memory: decay exp(-exp(A_log) * softplus(a + dt_bias)) close to 1 per token,
# so a state restored wrongly (or not at all) still changes the output thousands of tokens on.
_GDN_A_LOG, _GDN_DT_BIAS = -4.0, -2.0


def _qwen3next_keys(spec: TinyModelSpec) -> dict:
    """Qwen3-Next: ``linear_attention`` (gated delta net) and ``full_attention`` layers, MoE
    in every other layer (vLLM's Qwen3-Next needs at least one), untied LM head (tied
    embeddings gave NaN logits in vLLM's CPU build)."""
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=_GDN_HEAD_DIM,
        linear_value_head_dim=_GDN_HEAD_DIM,
        linear_num_key_heads=_GDN_HEADS,
        linear_num_value_heads=_GDN_HEADS,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(spec.num_layers) if i % 2 == 0],  # MoE in odd layers
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=spec.intermediate_size // 2,
        shared_expert_intermediate_size=spec.intermediate_size // 2,
        tie_word_embeddings=False,
    )


def make_model(spec: TinyModelSpec, tokenizer):  # -> transformers.PreTrainedModel
    import torch
    import transformers

    config = make_config(spec, tokenizer)
    model_cls = getattr(transformers, _ARCHES[spec.arch][1])
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        if spec.arch in _ARCHES_WITHOUT_QK_NORM:
            _sharpen_attention(model, spec)
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight  # the same tensor when tied
        for token in (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN):  # never greedy; see module docstring
            emb[tokenizer.convert_tokens_to_ids(token)].zero_()
            head[tokenizer.convert_tokens_to_ids(token)].zero_()
        if spec.arch in _RECURRENT_ARCHES:
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log.fill_(_GDN_A_LOG)
                    layer.linear_attn.dt_bias.fill_(_GDN_DT_BIAS)
                else:  # QK-norm with a (1 + weight) scale: queries x ATTENTION_LOGIT_STD
                    layer.self_attn.q_norm.weight.fill_(ATTENTION_LOGIT_STD - 1.0)
        _sharpen_output(model, spec)
    return model.to(getattr(torch, spec.dtype))


def _sharpen_output(model, spec: TinyModelSpec) -> None:
    """Scale the final norm so output logits have std ~OUTPUT_LOGIT_STD.

    With small random weights the next-token distribution is nearly flat (top-2
    log-probabilities a few 1e-3 apart). Scaling the logits does not change any
    greedy token (argmax is scale-invariant) nor how often bf16 noise flips a
    near-tie; it puts the top-2 margins on the scale of real models (median about
    1 nat), so tests can name a near-tie with one fixed tolerance
    (``tests/engines.py: TIE_TOL``). Gemma's norms scale by ``1 + weight``; a
    logit's std is about ``initializer_range * sqrt(hidden)``.
    """
    logit_std = spec.initializer_range * spec.hidden_size**0.5
    model.model.norm.weight.fill_(OUTPUT_LOGIT_STD / logit_std - 1.0)


def _sharpen_attention(model, spec: TinyModelSpec) -> None:
    """Scale the query projections so attention logits have std ~ATTENTION_LOGIT_STD.

    Without QK-norm, a query/key element has std ``initializer_range *
    sqrt(hidden_size)`` (inputs are RMS-normalised) and, with a query scale of
    1, an attention logit has std ``(initializer_range**2 * hidden_size) *
    sqrt(head_dim)``: far below 1 for small weights, i.e. near-uniform attention.
    """
    logit_std = spec.initializer_range**2 * spec.hidden_size * spec.head_dim**0.5
    gain = ATTENTION_LOGIT_STD / logit_std
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.mul_(gain)


def _write_model(spec: TinyModelSpec, out: Path) -> None:
    tokenizer = build_tokenizer()
    model = make_model(spec, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "tiny_model_spec.json").write_text(
        json.dumps({**dataclasses.asdict(spec), "digest": spec.digest()}, indent=2) + "\n"
    )


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny hybrid-attention model for tests.")
    parser.add_argument("--preset", default=DEFAULT_MODEL, choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.preset, args.out, force=args.force))


if __name__ == "__main__":
    main()
