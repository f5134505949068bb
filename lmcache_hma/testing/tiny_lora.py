"""Tiny random PEFT LoRA adapters for a tiny test model, written by hand (no PEFT, no hub).

The connector's chunk keys must tell apart KV computed with different LoRA adapters
(and without one): the same prompt gives different KV under each. Testing that needs
adapters vLLM (CPU build) will load, whose effect on the output is large enough that
serving one adapter's KV to another changes the greedy tokens. This module writes
such an adapter for a model built by :func:`lmcache_hma.testing.tiny_model.build_tiny_model`:

* ``adapter_config.json``: ``peft_type: LORA``, rank ``r``, ``lora_alpha``, the
  attention projections q/k/v/o_proj as ``target_modules``, the base model's path;
* ``adapter_model.safetensors``: ``base_model.model.model.layers.{i}.self_attn.
  {q,k,v,o}_proj.lora_{A,B}.weight`` for every layer, shapes from the base model's
  ``config.json`` (A: ``r x in``, B: ``out x r``), both random and nonzero (std
  ``STD``, bf16; PEFT's own init zeroes B, which would change nothing).

The files are a deterministic function of ``(base_model_dir, seed, rank)``: the same
arguments give byte-identical files, another seed another adapter.

Usage::

    python -m lmcache_hma.testing.tiny_lora BASE_MODEL_DIR OUT_DIR [--seed N] [--rank R]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STD = 0.3
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each attention projection of the base model."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }


def build_lora_adapter(base_model_dir, out_dir, *, seed: int, rank: int = 8) -> Path:
    """Write a random LoRA adapter for the model in ``base_model_dir`` into ``out_dir``.

    Returns ``out_dir``. Existing adapter files there are overwritten.
    """
    import torch
    from safetensors.torch import save_file

    if rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    base = Path(base_model_dir)
    config = json.loads((base / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal wrapper's language model
    shapes = projection_shapes(config)

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for name, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                w = torch.randn(shape, generator=gen, dtype=torch.float32) * STD
                tensors[f"{prefix}.{name}.weight"] = w.to(torch.bfloat16).contiguous()

    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,  # scaling alpha / r = 1
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random LoRA adapter.")
    parser.add_argument("base_model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    print(build_lora_adapter(args.base_model_dir, args.out_dir, seed=args.seed, rank=args.rank))


if __name__ == "__main__":
    main()
