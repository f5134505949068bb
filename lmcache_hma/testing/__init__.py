"""Tooling for tests, benchmarks and the reproduction: tiny models built locally.

``tiny_model`` (hybrid text models), ``tiny_vlm`` (a Gemma-3 vision-language model and
its torchvision shim in ``_vlm_shim``), ``tiny_qwen35`` (Qwen3.5 as shipped: a vision tower in
front of gated-delta-net and full-attention layers; it needs the same shim) and ``tiny_lora``
(random LoRA adapters). Never imported by the connector.
"""
