"""Tooling for tests, benchmarks and the reproduction: tiny models built locally.

``tiny_model`` (hybrid text models), ``tiny_vlm`` (a Gemma-3 vision-language model and
its torchvision shim in ``_vlm_shim``) and ``tiny_lora`` (random LoRA adapters). Never
imported by the connector at serving time.
"""
