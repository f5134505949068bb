"""The vLLM release gate and the runner facts the connector relies on (``vllm_compat``)."""

from types import SimpleNamespace

import pytest

from lmcache_hma import vllm_compat


def test_other_vllm_releases_are_refused_with_one_message():
    vllm_compat.check_version()  # the installed one
    for other in ("0.35.0", "0.31.2", "1.0.0"):
        with pytest.raises(ImportError, match=f"needs vLLM 0.32.x, 0.33.x, 0.34.x .* found {other}"):
            vllm_compat.check_version(other)


def test_releases_0_32_to_0_34_are_accepted():
    for found in ("0.32.0", "0.32.1", "0.33.0", "0.34.0", "0.34.2rc1"):
        vllm_compat.check_version(found)


def test_release_predicates():
    assert vllm_compat.release("0.34.0") == (0, 34)
    assert not vllm_compat.hears_sleep("0.32.0") and vllm_compat.hears_sleep("0.33.0")
    assert vllm_compat.hears_sleep("0.34.1")
    assert not vllm_compat.only_v2_runner("0.33.0") and vllm_compat.only_v2_runner("0.34.0")
    assert vllm_compat.prefill_checkpoint_blocks(SimpleNamespace()) == 0  # 0.32 GDN: no field read
    assert vllm_compat.prefill_checkpoint_blocks(SimpleNamespace(num_prefill_checkpoint_blocks=1)) == 1


def test_gathers_never_defer_on_0_34_nor_under_sleep_mode_on_0_32(monkeypatch):
    plain = SimpleNamespace(needs_kv_cache_zeroing=False)
    v1 = SimpleNamespace(use_v2_model_runner=False, model_config=SimpleNamespace(enable_sleep_mode=False))
    sleepy = SimpleNamespace(use_v2_model_runner=False, model_config=SimpleNamespace(enable_sleep_mode=True))
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.34.0")
    defer, why = vllm_compat.gathers_may_defer(SimpleNamespace(), plain)  # no use_v2_model_runner in 0.34
    assert not defer and "V2" in why
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.32.0")
    assert vllm_compat.gathers_may_defer(v1, plain)[0]
    defer, why = vllm_compat.gathers_may_defer(sleepy, plain)
    assert not defer and "sleep mode" in why
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.33.0")
    assert vllm_compat.gathers_may_defer(sleepy, plain)[0]  # 0.33 drains them (unregister_kv_caches)


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


def test_a_finished_requests_blocks_are_read_first_in_the_next_step_on_the_v1_runner_whatever_it_zeroes():
    """Turn ends (``scheduler.turn_ends``): vLLM's V1 runner zeroes new blocks and copies
    recurrent states after ``handle_preemptions``, so there a finished request's blocks can be
    read in the next step's first call although vLLM freed them; elsewhere vLLM must keep them."""
    v1, v2 = SimpleNamespace(use_v2_model_runner=False), SimpleNamespace(use_v2_model_runner=True)
    assert vllm_compat.first_call_before_kv_writes(v1)[0]
    assert not vllm_compat.gathers_may_defer(v1, SimpleNamespace(needs_kv_cache_zeroing=True))[0]
    assert not vllm_compat.first_call_before_kv_writes(v2)[0]


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_the_event_hash_converter_is_vllms_conversion(as_int, monkeypatch):
    """``event_block_hash_converter`` (the flag read once) gives what ``maybe_convert_block_hash``
    gives, with block hashes as ints (vLLM's default) and as bytes."""
    import hashlib

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from lmcache_hma.vllm_compat import event_block_hash_converter

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    convert = event_block_hash_converter()
    for i in range(64):
        h = hashlib.sha256(bytes([i])).digest()
        assert convert(h) == maybe_convert_block_hash(h)
