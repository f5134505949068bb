"""The vLLM release gate and the runner facts the connector relies on (``vllm_compat``)."""

from types import SimpleNamespace

import pytest

from lmcache_hma import vllm_compat


def test_other_vllm_releases_are_refused_with_one_message():
    vllm_compat.check_version()  # the installed one
    for other in ("0.33.0", "0.31.2", "1.0.0"):
        with pytest.raises(ImportError, match=f"needs vLLM 0.32.x .* found {other}"):
            vllm_compat.check_version(other)


def test_gathers_defer_only_where_the_barrier_precedes_every_kv_write():
    v1, v2 = SimpleNamespace(use_v2_model_runner=False), SimpleNamespace(use_v2_model_runner=True)
    plain, zeroing = SimpleNamespace(needs_kv_cache_zeroing=False), SimpleNamespace(needs_kv_cache_zeroing=True)
    assert vllm_compat.gathers_may_defer(v1, plain)[0]
    assert not vllm_compat.gathers_may_defer(v2, plain)[0]
    assert not vllm_compat.gathers_may_defer(v1, zeroing)[0]
    assert not vllm_compat.gathers_may_defer(v1, SimpleNamespace())[0]  # not known: never defer

    class Unknown:
        @property
        def use_v2_model_runner(self):
            raise ValueError("Model Runner V2 requires Triton")

    defer, why = vllm_compat.gathers_may_defer(Unknown(), plain)
    assert not defer and "Triton" in why


def test_failed_blocks_are_recomputed_only_for_one_kv_cache_group():
    assert vllm_compat.recomputes_failed_blocks(1)
    assert not vllm_compat.recomputes_failed_blocks(3)
