"""Real vLLM engines (CPU build) for end-to-end tests, with or without the connector.

An engine start costs 20-35 s here: test modules share them with module-scoped
fixtures. Both sides of every comparison run with the same thread settings
(``VLLM_CPU_NUM_OF_RESERVED_CPU``), see NOTES.md.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Optional

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

LONG_PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"  # 6007 tokens
MAX_TOKENS = 10


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, top_p=0.95, max_tokens=max_tokens)


def make_llm(model_dir, lmcache_yaml: Optional[Path] = None, extra: Optional[dict] = None,
             max_num_batched_tokens: int = 2048, **kwargs):
    """An ``LLM`` with the hybrid manager on; with the connector when a YAML is given."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if lmcache_yaml is not None:
        transfer = KVTransferConfig(
            kv_connector="LMCacheHMAConnector",
            kv_connector_module_path="lmcache_hma",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache_config_file": str(lmcache_yaml), **(extra or {})},
        )
    return LLM(
        model=str(model_dir), dtype="bfloat16", max_model_len=kwargs.pop("max_model_len", 8192),
        enforce_eager=True, disable_hybrid_kv_cache_manager=False,
        max_num_batched_tokens=max_num_batched_tokens, kv_transfer_config=transfer, seed=0,
        **kwargs,
    )


def shutdown(llm) -> None:
    """Stop an engine's processes now (the connector closes its store)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def generate(llm, prompts, max_tokens: int = MAX_TOKENS):
    """[(token ids, num_cached_tokens)] for greedy generation of each prompt."""
    outs = llm.generate(prompts if isinstance(prompts, list) else [prompts], greedy(max_tokens),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


def write_yaml(path: Path, **keys) -> Path:
    """An LMCache YAML with ``keys`` (nested dicts allowed)."""
    import yaml

    path.write_text(yaml.safe_dump(keys))
    return path


def read_stats(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}
