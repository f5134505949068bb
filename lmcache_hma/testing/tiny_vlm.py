"""A tiny, randomly initialised Gemma-3 vision-language model for offline tests.

Chunk keys must tell apart two prompts with the same text but different images (the
image's tokens are placeholders: equal ids, different KV). Testing that needs a
multimodal hybrid model that vLLM (CPU build) loads offline; this module builds one
with seeded random weights, like ``tiny_model.py`` does for text models:

* ``Gemma3ForConditionalGeneration``: a SigLIP vision tower (64x64 images, 8x8 patches,
  2 layers, hidden 64) pooled to 16 tokens per image, and the text model of
  ``tiny_model`` (6 layers alternating sliding-window 128 / full attention: vLLM makes
  2 KV cache groups).
* ``Gemma3Processor`` with the PIL image processor, and ``tiny_model``'s BPE tokenizer
  plus Gemma-3's image tokens and the newline tokens vLLM's Gemma-3 code looks up.

The output depends on the image: transformers initialises the image projection to zero
(every image would look alike to the text model); here it is random, scaled so image
embeddings are about as large as the text model's residual stream.

Two workarounds: vLLM wants the vision tower's weights under
``vision_tower.vision_model.`` (real checkpoints' names), so the saved keys are renamed;
and vLLM imports transformers' torchvision-based Gemma-3 image processor, so processes
loading the model need the ``sitecustomize`` in :func:`vlm_pythonpath` on ``PYTHONPATH``
(and :func:`install_shim` in the current process).

Usage::

    python -m lmcache_hma.testing.tiny_vlm [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
from pathlib import Path

from lmcache_hma.testing import tiny_model as tm
from lmcache_hma.testing import model_cache
from lmcache_hma.testing import tiny_tokenizer as tt

BUILDER_VERSION = "1"
"""Bump whenever the builder's output changes, so cached models are rebuilt."""

TEXT_SPEC = tm.TinyModelSpec("tiny-gemma3-vlm", "gemma3", (tm.S, tm.F) * 3, sliding_window=128)
IMAGE_SIZE, PATCH_SIZE = 64, 8
MM_TOKENS_PER_IMAGE = 16  # a square the 8x8 patch grid pools to (kernel 2)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
IMAGE_EMBED_STD = 1.0  # std of a projected image token; see _make_model
SEED = 0

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]  # whole tokens, as in Gemma-3's vocab

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}" + BOI + "{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def digest() -> str:
    payload = json.dumps({"text": TEXT_SPEC.digest(), "vision": VISION, "mm": MM_TOKENS_PER_IMAGE,
                          "img_std": IMAGE_EMBED_STD, "seed": SEED, "builder": BUILDER_VERSION},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_vlm_dir() -> Path:
    return model_cache.model_cache_dir() / f"{TEXT_SPEC.name}-{digest()}"


def build_tiny_vlm(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Build the model (unless a complete build is there) and return its directory."""
    final = Path(out_dir) if out_dir is not None else default_vlm_dir()
    return model_cache.build_into(final, digest(), _write_model, force=force)


def vlm_pythonpath() -> str:
    """The directory holding the torchvision shim's ``sitecustomize.py``: put it on
    ``PYTHONPATH`` before starting vLLM, whose child processes then get the shim."""
    return str(Path(__file__).parent / "_vlm_shim")


def install_shim() -> None:
    """Install the same shim in this process (vLLM processes prompts' images here)."""
    from lmcache_hma.testing._vlm_shim import sitecustomize

    sitecustomize.install()


def shim_env() -> dict[str, str]:
    """Install the shim here and return the environment (``PYTHONPATH`` with the shim first)
    that gives it to every child process too: vLLM's engine and workers, and the subprocess
    in which vLLM inspects a model's architecture (``python -m
    vllm.model_executor.models.registry``; its answer is cached under ``VLLM_CACHE_ROOT``, so
    a warm cache hides a child without the shim)."""
    install_shim()
    return {"PYTHONPATH": os.pathsep.join(filter(None, [vlm_pythonpath(), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def shim_everywhere():
    """``shim_env`` applied to ``os.environ`` while the block runs (a module fixture's model)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ.update(shim_env())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """``tiny_model``'s tokenizer plus Gemma-3's image tokens and whole newline tokens."""
    from transformers import PreTrainedTokenizerFast

    backend = tt.build_tokenizer().backend_tokenizer
    backend.add_tokens(NEWLINES)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=tt.BOS_TOKEN, eos_token=tt.EOS_TOKEN,
        pad_token=tt.PAD_TOKEN, unk_token=tt.UNK_TOKEN, model_max_length=10**9,
        clean_up_tokenization_spaces=False,
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN},
    )


def _make_model(tokenizer):  # -> transformers.Gemma3ForConditionalGeneration
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = tm.make_config(TEXT_SPEC, tokenizer)
    text.architectures = None
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=text, vision_config=SiglipVisionConfig(**VISION),
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE, boi_token_index=ids(BOI),
        eoi_token_index=ids(EOI), image_token_index=ids(IMAGE_TOKEN),
        initializer_range=TEXT_SPEC.initializer_range, tie_word_embeddings=True,
        architectures=["Gemma3ForConditionalGeneration"], dtype=TEXT_SPEC.dtype,
    )
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        lm = model.model.language_model
        emb = lm.embed_tokens.weight
        for token in (tt.PAD_TOKEN, tt.EOS_TOKEN, tt.UNK_TOKEN, BOI, EOI, IMAGE_TOKEN):
            emb[ids(token)].zero_()  # never greedy (see tiny_model)
        # Projection inputs are RMS-normalised (std ~1): std/sqrt(in) per weight.
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0.0, IMAGE_EMBED_STD / proj.shape[0] ** 0.5)
        logit_std = TEXT_SPEC.initializer_range * TEXT_SPEC.hidden_size**0.5
        lm.norm.weight.fill_(tm.OUTPUT_LOGIT_STD / logit_std - 1.0)  # as tiny_model
    return model.to(getattr(torch, TEXT_SPEC.dtype))


def _write_model(out: Path) -> None:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tokenizer()
    model = _make_model(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    model.save_pretrained(out, safe_serialization=True)
    _rename_vision_keys(out)
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                     do_pan_and_scan=False)
    Gemma3Processor(images, tokenizer, chat_template=CHAT_TEMPLATE,
                    image_seq_length=MM_TOKENS_PER_IMAGE).save_pretrained(out)


def _rename_vision_keys(out: Path) -> None:
    """``vision_tower.X`` -> ``vision_tower.vision_model.X`` (vLLM's names)."""
    from safetensors.torch import load_file, save_file

    old, new = "vision_tower.", "vision_tower.vision_model."
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {(new + k[len(old):] if k.startswith(old) and not k.startswith(new) else k): v
                   for k, v in tensors.items()}
        assert renamed.keys() != tensors.keys(), "no vision tower keys to rename"
        save_file(renamed, path, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Gemma-3 VLM for tests.")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    print(build_tiny_vlm(args.out, force=args.force))


if __name__ == "__main__":
    main()
