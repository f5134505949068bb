"""A weight update in place (the RL rollout loop: reset vLLM's caches with the connector's, load
new weights) on a real vLLM CPU engine with the CPU tier and a real Redis: nothing computed with
the old weights is served after it, from any tier, and the tokens are those of the new weights
without the connector. What the new weights compute is served as usual afterwards.

The new weights: tiny-gemma3's with every MLP weight scaled by 1.5 (saved in bf16 as the model's
own), loaded with vLLM's ``reload_weights`` through ``collective_rpc``. The unit-level
counterpart (the store's keys, a lone reset, a store overtaken by a reset) is
``test_weights_generation.py``."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import (LONG_PROMPT, Reference, generate, make_llm, read_stats, same_greedy, settled_stats,
                           shutdown, write_yaml)
from tests.redis_server import MISSING, redis_server, redis_server_binary  # noqa: F401 - the fixture

TOKENS = 16


@functools.lru_cache(maxsize=None)
def new_weights() -> Path:
    """A copy of tiny-gemma3 whose MLP weights are 1.5 times the model's (bf16, as stored)."""
    from safetensors.torch import load_file, save_file

    source = build_tiny_model("tiny-gemma3")
    target = Path(tempfile.mkdtemp(prefix="tiny-gemma3-new-weights-"))
    for path in Path(source).iterdir():
        if path.is_file():
            shutil.copy(path, target / path.name)
    tensors = load_file(str(target / "model.safetensors"))
    save_file({k: (v.float() * 1.5).to(v.dtype) if ".mlp." in k else v for k, v in tensors.items()},
              str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


OLD = Reference("tiny-gemma3", LONG_PROMPT, max_tokens=TOKENS)
NEW = Reference(new_weights, LONG_PROMPT, max_tokens=TOKENS)


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def test_after_a_weight_update_no_tier_serves_the_old_weights_kv(tmp_path, redis_server):
    old, new = OLD.get(), NEW.get()
    assert old.tokens != new.tokens  # the update changes the answer
    yaml = write_yaml(tmp_path / "cpu_redis.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.5,
                      remote_url=redis_server.plain_url, remote_serde="naive")
    stats = tmp_path / "stats.json"
    llm = make_llm(build_tiny_model("tiny-gemma3"), yaml, {"hma_stats_file": str(stats)})
    try:
        [cold] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
        stored = settled_stats(stats)
        assert stored.get("objects_stored", 0) > 0 and len(redis_server.client().keys("*")) > 0

        # the update: vLLM's caches and the connector's emptied, then the new weights loaded
        assert llm.reset_prefix_cache(reset_connector=True)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new_weights())})
        [after] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
        first = settled_stats(stats)

        llm.reset_prefix_cache()  # vLLM's own cache only: what the new weights computed is served
        [hit] = generate(llm, LONG_PROMPT, max_tokens=TOKENS)
        second = read_stats(stats)
    finally:
        shutdown(llm)
    assert cold.cached == 0 and same_greedy(old, cold)
    # zero objects from before the update served, from any tier (4d9fc3d: 5888 tokens from Redis)
    assert after.cached == 0, f"{after.cached} tokens of the old weights' KV were served"
    assert first.get("loaded_tokens", 0) == 0, first
    assert same_greedy(new, after)
    assert hit.cached == 5888 and second["loaded_tokens"] == 5888 and same_greedy(new, hit)
