"""Tiny speculative-decoding models for offline tests: EAGLE and EAGLE3 drafts, the sliding-window
target EAGLE3 needs, and the tiny Qwen3.5 with an MTP head. Seeded random weights, built locally
and cached like ``tiny_model``'s (``build_into``).

* ``build_tiny_eagle(target)``: an EAGLE-1 draft (``EagleLlamaForCausalLM``, one Llama layer) for a
  target of ``tiny_model``'s: its ``fc`` passes the target's hidden state through (plus a little
  of the next token's embedding) and its layer adds a little, so with the target's LM head (vLLM
  shares it, as the embedding) it mostly proposes the token the target just predicted; a
  target that repeats a token gets proposals accepted.
* ``build_tiny_llama_swa()``: a ``LlamaForCausalLM`` whose ``layer_types`` alternate sliding
  (window 128) and full attention, which vLLM's Llama honours: a sliding-window hybrid whose
  vLLM model supports EAGLE3 (Gemma-2/3's do not: vLLM raises "Model does not support EAGLE3
  interface"). ``tiny_model``'s tokenizer, attention and output logits sharpened as there.
* ``build_tiny_eagle3(target)``: an EAGLE3 draft (``LlamaForCausalLMEagle3``) reading the hidden
  states after the target's layers 2, 4 and 6 (the last); like the EAGLE draft it passes the last
  one through, with the target's final norm and LM head as its own, so it mostly proposes the
  token the target just predicted.
* ``build_tiny_qwen35_mtp()``: ``tiny_qwen35``'s model plus one MTP layer (``mtp.*`` tensors,
  ``mtp_num_hidden_layers: 1``; the layer copies the last full-attention layer's weights).

Usage::

    python -m lmcache_hma.testing.tiny_drafts [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from lmcache_hma.testing import model_cache
from lmcache_hma.testing import tiny_model as tm
from lmcache_hma.testing import tiny_tokenizer as tt

BUILDER_VERSION = "4"
SEED = 0
EAGLE_FC_EMBED_STD = 0.02  # the next token's share in the EAGLE draft's input
EAGLE3_FC_AUX_STD = 0.001  # the EAGLE3 draft's share of the target's earlier hidden states
# The Llama target's last hidden state (before its norm) has an RMS of about 0.1: the EAGLE3 draft
# scales it up so that its own layer's output (about 0.07) stays a small change.
EAGLE3_PASS_GAIN = 20.0
EAGLE_LAYER_STD = 0.02  # the draft layer's weights: small beside the passed-through hidden state
LLAMA_SWA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=64, sliding_window=128, max_position_embeddings=40960,
                 layer_types=[tm.S, tm.F] * 3, initializer_range=0.02)
EAGLE3_AUX_LAYERS = [2, 4, 6]  # hidden states after these layers; 6: the last


def _digest(*parts) -> str:
    payload = json.dumps([BUILDER_VERSION, SEED, *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _target_digest(target: Path) -> str:
    marker = Path(target) / model_cache.MARKER_FILE
    return marker.read_text().strip() if marker.is_file() else str(target)


def _save(out: Path, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _random(generator, std: float, *shape):
    import torch

    return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)


def _draft_config(target: dict, arch: str, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id")
    return dict({k: target[k] for k in keys}, architectures=[arch], model_type="llama",
                num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                tie_word_embeddings=False, torch_dtype="bfloat16", **extra)


def _llama_layer(generator, prefix: str, h: int, inter: int, heads: int, kv: int, hd: int,
                 qkv_in: int) -> dict:
    import torch

    r = lambda *shape: _random(generator, EAGLE_LAYER_STD, *shape)  # noqa: E731
    return {f"{prefix}self_attn.q_proj.weight": r(heads * hd, qkv_in),
            f"{prefix}self_attn.k_proj.weight": r(kv * hd, qkv_in),
            f"{prefix}self_attn.v_proj.weight": r(kv * hd, qkv_in),
            f"{prefix}self_attn.o_proj.weight": r(h, heads * hd),
            f"{prefix}mlp.gate_proj.weight": r(inter, h), f"{prefix}mlp.up_proj.weight": r(inter, h),
            f"{prefix}mlp.down_proj.weight": r(h, inter),
            f"{prefix}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}


def build_tiny_eagle(target: Path, out_dir: Path | None = None, *, force: bool = False) -> Path:
    """An EAGLE-1 draft for ``target`` (a directory holding a ``tiny_model`` build)."""
    target = Path(target)
    digest = _digest("eagle", _target_digest(target), EAGLE_FC_EMBED_STD, EAGLE_LAYER_STD)
    final = Path(out_dir) if out_dir else model_cache.model_cache_dir() / f"eagle-{target.name}-{digest}"

    def write(out: Path) -> None:
        import torch

        t = json.loads((target / "config.json").read_text())
        h = t["hidden_size"]
        g = torch.Generator().manual_seed(SEED)
        fc = torch.cat([_random(g, EAGLE_FC_EMBED_STD, h, h), torch.eye(h, dtype=torch.bfloat16)], 1)
        tensors = {"fc.weight": fc, **_llama_layer(
            g, "layers.0.", h, t["intermediate_size"], t["num_attention_heads"],
            t["num_key_value_heads"], t["head_dim"], h)}
        _save(out, _draft_config(t, "EagleLlamaForCausalLM"), tensors)

    return model_cache.build_into(final, digest, write, force=force)


def build_tiny_llama_swa(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """The sliding-window Llama target (EAGLE3-capable in vLLM)."""
    digest = _digest("llama-swa", LLAMA_SWA, tm.BUILDER_VERSION, tm.ATTENTION_LOGIT_STD,
                     tm.OUTPUT_LOGIT_STD)
    final = Path(out_dir) if out_dir else model_cache.model_cache_dir() / f"tiny-llama-swa-{digest}"

    def write(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = tt.build_tokenizer()
        cfg = dict(LLAMA_SWA)
        layer_types, window = cfg.pop("layer_types"), cfg.pop("sliding_window")
        config = LlamaConfig(**cfg, vocab_size=len(tokenizer), num_hidden_layers=len(layer_types),
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
                             architectures=["LlamaForCausalLM"], dtype="bfloat16")
        config.layer_types, config.sliding_window = list(layer_types), window  # read by vLLM's Llama
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).eval()
        init, hidden, hd = cfg["initializer_range"], cfg["hidden_size"], cfg["head_dim"]
        with torch.no_grad():  # sharpened as tiny_model's (see _sharpen_attention, _sharpen_output)
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(tm.ATTENTION_LOGIT_STD / (init**2 * hidden * hd**0.5))
            model.model.norm.weight.fill_(tm.OUTPUT_LOGIT_STD / (init * hidden**0.5))
            for token in (tt.PAD_TOKEN, tt.EOS_TOKEN, tt.UNK_TOKEN):  # never greedy
                model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(token)].zero_()
                model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)].zero_()
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            setattr(model.generation_config, name, getattr(tokenizer, name))
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return model_cache.build_into(final, digest, write, force=force)


def build_tiny_eagle3(target: Path, out_dir: Path | None = None, *, force: bool = False) -> Path:
    """An EAGLE3 draft for ``target`` (``build_tiny_llama_swa``'s), full vocabulary."""
    target = Path(target)
    digest = _digest("eagle3", _target_digest(target), EAGLE3_AUX_LAYERS, EAGLE3_FC_AUX_STD,
                     EAGLE3_PASS_GAIN, EAGLE_LAYER_STD)
    final = Path(out_dir) if out_dir else model_cache.model_cache_dir() / f"eagle3-{target.name}-{digest}"

    def write(out: Path) -> None:
        import torch
        from safetensors.torch import load_file

        t = json.loads((target / "config.json").read_text())
        h = t["hidden_size"]
        own = load_file(str(target / "model.safetensors"))
        g = torch.Generator().manual_seed(SEED)
        ones = lambda: torch.ones(h, dtype=torch.bfloat16)  # noqa: E731
        fc = torch.cat([_random(g, EAGLE3_FC_AUX_STD, h, 2 * h),
                        EAGLE3_PASS_GAIN * torch.eye(h, dtype=torch.bfloat16)], 1)
        tensors = {"fc.weight": fc, "norm.weight": own["model.norm.weight"].clone(),
                   "lm_head.weight": own["lm_head.weight"].clone(),
                   "midlayer.input_layernorm.weight": ones(), "midlayer.hidden_norm.weight": ones(),
                   **_llama_layer(g, "midlayer.", h, t["intermediate_size"], t["num_attention_heads"],
                                  t["num_key_value_heads"], t["head_dim"], 2 * h)}
        _save(out, _draft_config(t, "LlamaForCausalLMEagle3", draft_vocab_size=t["vocab_size"],
                                 eagle_aux_hidden_state_layer_ids=EAGLE3_AUX_LAYERS), tensors)

    return model_cache.build_into(final, digest, write, force=force)


def build_tiny_qwen35_mtp(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """``tiny_qwen35``'s model with one MTP layer (the processor and tokenizer as there)."""
    from lmcache_hma.testing.tiny_qwen35 import build_tiny_qwen35

    base = build_tiny_qwen35()
    digest = _digest("qwen35-mtp", _target_digest(base))
    final = Path(out_dir) if out_dir else model_cache.model_cache_dir() / f"tiny-qwen35-mtp-{digest}"

    def write(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        for f in base.iterdir():
            if f.is_file() and f.name not in (model_cache.MARKER_FILE, "config.json", "model.safetensors"):
                shutil.copy(f, out / f.name)
        config = json.loads((base / "config.json").read_text())
        config["text_config"]["mtp_num_hidden_layers"] = 1
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = load_file(str(base / "model.safetensors"))
        text = config["text_config"]
        last_full = max(i for i, kind in enumerate(text["layer_types"]) if kind == tm.F)
        src = f"model.language_model.layers.{last_full}."
        tensors.update({"mtp.layers.0." + k[len(src):]: v.clone() for k, v in tensors.items()
                        if k.startswith(src)})
        h = text["hidden_size"]
        g = torch.Generator().manual_seed(SEED)
        tensors["mtp.fc.weight"] = _random(g, text["initializer_range"], h, 2 * h)
        for norm in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
            tensors[f"mtp.{norm}.weight"] = tensors["model.language_model.norm.weight"].clone()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    return model_cache.build_into(final, digest, write, force=force)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny speculative-decoding models.")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    gemma = tm.build_tiny_model("tiny-gemma3")
    llama = build_tiny_llama_swa(force=args.force)
    for path in (build_tiny_eagle(gemma, force=args.force), llama,
                 build_tiny_eagle3(llama, force=args.force), build_tiny_qwen35_mtp(force=args.force)):
        print(path)


if __name__ == "__main__":
    main()
