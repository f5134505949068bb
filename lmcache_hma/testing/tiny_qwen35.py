"""A tiny, randomly initialised Qwen3.5 (as shipped: vision tower included) for offline tests.

The Qwen3.5 checkpoints people deploy are ``Qwen3_5ForConditionalGeneration``: a vision tower in
front of a text model mixing gated-delta-net (``linear_attention``) and full-attention layers.
This module builds one with seeded random weights, like ``tiny_model`` and ``tiny_vlm`` do:

* Text model: 8 layers, ``[linear x3, full] x2``, hidden 256, 4 query / 2 KV heads of 128
  (a 256-token attention page holds a GDN state, as in ``tiny-qwen3next``), dense MLPs, untied
  LM head, bf16, M-RoPE as in the real config. The GDN layers get ``tiny_model``'s long memory
  (``A_log``, ``dt_bias``) and the attention and output logits its sharpening, so a wrong state
  or KV changes the output.
* Vision tower: depth 1, hidden 32, 16x16 patches merged 2x2; the processor resizes every
  image to 128x128 pixels' worth (its minimum and maximum), so a square image is 128x128:
  16 image tokens. Its output projection is scaled so that image tokens are about
  as large as text embeddings (random init leaves them far smaller: every image would look
  alike to the text model).
* ``Qwen3VLProcessor`` with the PIL Qwen2-VL image processor, a Qwen3-VL video processor and
  ``tiny_model``'s BPE tokenizer plus the Qwen vision tokens.

Processes loading the model need the torchvision shim of ``tiny_vlm`` (``vlm_pythonpath``,
``install_shim``): vLLM's ``qwen3_5`` imports transformers' torchvision-based image processor.

Usage::

    python -m lmcache_hma.testing.tiny_qwen35 [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from lmcache_hma.testing import tiny_model as tm
from lmcache_hma.testing import model_cache
from lmcache_hma.testing import tiny_tokenizer as tt

BUILDER_VERSION = "1"
"""Bump whenever the builder's output changes, so cached models are rebuilt."""

NAME = "tiny-qwen35"
LAYER_TYPES = (tm.L, tm.L, tm.L, tm.F) * 2
TEXT = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, max_position_embeddings=40960, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
            linear_num_value_heads=2)
# As the real checkpoints: a quarter of each head rotates, interleaved M-RoPE (t, h, w sections
# of the 16 rotary frequency pairs).
ROPE = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
            mrope_section=[6, 5, 5], mrope_interleaved=True)
IMAGE_SIZE, PATCH_SIZE, MERGE = 128, 16, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE // MERGE) ** 2  # 16 per square image
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH_SIZE,
              spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=64,
              out_hidden_size=TEXT["hidden_size"])
IMAGE_EMBED_STD = 0.05  # std of an image token as the text model sees it; see _make_model
INITIALIZER_RANGE = 0.02
SEED = 0

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END  # one image in a text prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def digest() -> str:
    payload = json.dumps({"layers": LAYER_TYPES, "text": TEXT, "rope": ROPE, "vision": VISION,
                          "image": IMAGE_SIZE, "img_std": IMAGE_EMBED_STD,
                          "init": INITIALIZER_RANGE, "seed": SEED, "builder": BUILDER_VERSION,
                          "tokenizer": tm.BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_dir() -> Path:
    return model_cache.model_cache_dir() / f"{NAME}-{digest()}"


def build_tiny_qwen35(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Build the model (unless a complete build is there) and return its directory."""
    final = Path(out_dir) if out_dir is not None else default_dir()
    return model_cache.build_into(final, digest(), _write_model, force=force)


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """``tiny_model``'s tokenizer plus Qwen's vision tokens (special: never split)."""
    from transformers import PreTrainedTokenizerFast

    backend = tt.build_tokenizer().backend_tokenizer
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=tt.BOS_TOKEN, eos_token=tt.EOS_TOKEN,
        pad_token=tt.PAD_TOKEN, unk_token=tt.UNK_TOKEN, model_max_length=10**9,
        clean_up_tokenization_spaces=False,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_start_token": VISION_START, "vision_end_token": VISION_END},
    )


def _make_model(tokenizer):  # -> transformers.Qwen3_5ForConditionalGeneration
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    text = dict(TEXT, vocab_size=len(tokenizer), num_hidden_layers=len(LAYER_TYPES),
                layer_types=list(LAYER_TYPES), rope_parameters=dict(ROPE),
                initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id, dtype="bfloat16")
    config = Qwen3_5Config(
        text_config=text, vision_config=dict(VISION, initializer_range=INITIALIZER_RANGE),
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=False, architectures=["Qwen3_5ForConditionalGeneration"],
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        lm = model.model.language_model
        emb, head = lm.embed_tokens.weight, model.lm_head.weight
        for token in (tt.PAD_TOKEN, tt.EOS_TOKEN, tt.UNK_TOKEN, IMAGE_PAD, VIDEO_PAD,
                      VISION_START, VISION_END):
            emb[ids(token)].zero_()
            head[ids(token)].zero_()  # never greedy (see tiny_model)
        for layer in lm.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(tm._GDN_A_LOG)
                layer.linear_attn.dt_bias.fill_(tm._GDN_DT_BIAS)
            else:  # QK-norm with a (1 + weight) scale, as tiny_model's Qwen3-Next
                layer.self_attn.q_norm.weight.fill_(tm.ATTENTION_LOGIT_STD - 1.0)
        logit_std = INITIALIZER_RANGE * TEXT["hidden_size"] ** 0.5
        lm.norm.weight.fill_(tm.OUTPUT_LOGIT_STD / logit_std - 1.0)  # as tiny_model
        # fc2's inputs are GELU outputs of std ~1: std/sqrt(in) per weight gives outputs of std.
        fc2 = model.model.visual.merger.linear_fc2
        fc2.weight.normal_(0.0, IMAGE_EMBED_STD / fc2.weight.shape[1] ** 0.5)
        fc2.bias.zero_()
    return model.to(torch.bfloat16)


def _write_model(out: Path) -> None:
    from lmcache_hma.testing.tiny_vlm import install_shim

    install_shim()  # the processor's video processor needs it without torchvision
    import transformers.models.auto.video_processing_auto  # noqa: F401  (the shim registers)
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = build_tokenizer()
    model = _make_model(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    model.save_pretrained(out, safe_serialization=True)
    pixels = IMAGE_SIZE * IMAGE_SIZE  # a square image becomes IMAGE_SIZE x IMAGE_SIZE
    common = dict(patch_size=PATCH_SIZE, merge_size=MERGE, temporal_patch_size=2,
                  size={"shortest_edge": pixels, "longest_edge": pixels},
                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Qwen3VLProcessor(Qwen2VLImageProcessorPil(**common), tokenizer, Qwen3VLVideoProcessor(**common),
                     chat_template=CHAT_TEMPLATE).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Qwen3.5 (with vision) for tests.")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    print(build_tiny_qwen35(args.out, force=args.force))


if __name__ == "__main__":
    main()
