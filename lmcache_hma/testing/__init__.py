"""Tooling for tests, benchmarks and the reproduction: tiny models built locally.

``tiny_model`` (hybrid text models), ``tiny_vlm`` (a Gemma-3 vision-language model and
its torchvision shim in ``_vlm_shim``), ``tiny_qwen35`` (Qwen3.5 as shipped: a vision tower in
front of gated-delta-net and full-attention layers; it needs the same shim), ``tiny_lora``
(random LoRA adapters) and ``tiny_drafts`` (EAGLE and EAGLE3 drafts, a sliding-window Llama
target, the tiny Qwen3.5 with an MTP layer). Never imported by the connector.
"""
