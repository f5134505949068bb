"""Speculative decoding at the connector's start (``config/speculative.py``) and the draft-KV
lookahead in chunk keys. Real ``VllmConfig``s built by vLLM's ``EngineArgs`` (no engine start),
the connector's real constructor, the scheduler half with a real lookup server.

The refusals are checked at this level: vLLM's CPU build cannot run the refused methods on these
models (MTP and n-gram on Qwen3.5 stop at the first step with "'function' object is not
subscriptable" from a Triton kernel, see ``_RECURRENT``), so an engine start would show vLLM's
failure or the connector's message only in a child process's log.
"""

from __future__ import annotations

import shutil

import pytest

from lmcache_hma.config.speculative import SpeculationPlan, UnsupportedSpeculation, speculation_plan
from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.testing.tiny_drafts import build_tiny_eagle, build_tiny_qwen35_mtp
from lmcache_hma.testing.tiny_model import build_tiny_model
from lmcache_hma.testing.tiny_vlm import shim_everywhere
from tests.fakes import layout
from tests.test_scheduler import CHUNK, TOKENS, Engine, check_saves, request, saved


def vllm_config(model, spec=None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="LMCacheHMAConnector", kv_connector_module_path="lmcache_hma",
                                kv_role="kv_both")
    return EngineArgs(model=str(model), speculative_config=spec, max_model_len=4096, enforce_eager=True,
                      kv_transfer_config=transfer).create_engine_config()


@pytest.fixture(scope="module")
def gemma():
    return build_tiny_model("tiny-gemma3")


@pytest.fixture(scope="module")
def qwen35_mtp():
    """The model, with the torchvision shim here and in every child process (vLLM's qwen3_5
    imports transformers' torchvision-based image processor, also in the subprocess that
    inspects the architecture while the config is built)."""
    with shim_everywhere():
        yield build_tiny_qwen35_mtp()


def refusal(config) -> str:
    """The connector's constructor on ``config``: the message it stops the engine with."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_hma.connector import LMCacheHMAConnector

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedSpeculation) as info:
            LMCacheHMAConnector(config, role, kv_cache_config=None)  # before the layout is read
    return str(info.value)


def test_mtp_is_refused_at_start_naming_the_method_and_the_reason(qwen35_mtp):
    message = refusal(vllm_config(qwen35_mtp, {"method": "qwen3_5_mtp", "num_speculative_tokens": 1}))
    assert "method 'mtp' (qwen3_5_mtp) on a recurrent-state model" in message
    assert "precopy_mamba_align_fused_kernel" in message and "never verified" in message


def test_every_method_is_refused_on_a_recurrent_state_model(qwen35_mtp):
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert "method 'ngram' on a recurrent-state model" in refusal(vllm_config(qwen35_mtp, ngram))


def test_methods_never_run_with_the_connector_are_refused(gemma):
    spec = {"method": "draft_model", "model": str(gemma), "num_speculative_tokens": 2}
    assert "method 'draft_model' (gemma3_text): it was never run with this connector" in \
        refusal(vllm_config(gemma, spec))


def test_served_methods(gemma, tmp_path):
    assert speculation_plan(vllm_config(gemma)) == SpeculationPlan()
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert speculation_plan(vllm_config(gemma, ngram)) == SpeculationPlan("ngram")  # no draft KV
    draft = build_tiny_eagle(gemma)
    plan = speculation_plan(vllm_config(gemma, {"method": "eagle", "model": str(draft),
                                                "num_speculative_tokens": 2}))
    assert plan.method == "eagle" and plan.lookahead == 1
    named = plan.identity["speculative"]
    assert named["draft_model"] == str(draft) and named["draft"]["files"]
    assert "0x" not in repr(named)  # the same in every process (vLLM's override is a function)
    # another draft (one weight differs) is another namespace: draft KV is never shared
    other = tmp_path / "other-draft"
    shutil.copytree(draft, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(other / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"] * 2
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    other_plan = speculation_plan(vllm_config(gemma, {"method": "eagle", "model": str(other),
                                                      "num_speculative_tokens": 2}))
    assert other_plan.identity["speculative"]["draft"]["files"] != named["draft"]["files"]


def test_chunk_keys_cover_the_lookahead_tokens():
    import torch

    from lmcache_hma.core.keys import Namespace

    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="t",
                   world_size=1, rank=0)
    hasher = ChunkHasher(ns)
    c = ns.layout.chunk_size
    a = list(range(3 * c))
    b = a[:2 * c] + [999] + a[2 * c + 1:]  # differs at token 2C: the first token after chunk 1
    assert hasher.chunk_hashes(a, 2) == hasher.chunk_hashes(b, 2)  # no lookahead: as before
    with_a, with_b = hasher.chunk_hashes(a, 2, lookahead=1), hasher.chunk_hashes(b, 2, lookahead=1)
    assert with_a[0] == with_b[0] and with_a[1] != with_b[1]
    assert with_a[0] != hasher.chunk_hashes(a, 1)[0]  # lookahead keys never meet plain keys
    with pytest.raises(ValueError, match="need"):
        hasher.chunk_hashes(a[:2 * c], 2, lookahead=1)  # the token after chunk 1 is missing


def test_with_a_lookahead_a_chunk_is_stored_only_when_the_prompt_holds_the_token_after_it(tmp_path):
    e = Engine(tmp_path)
    try:
        e.sched.lookahead = 1  # as the connector builds it for EAGLE
        req = request("r", TOKENS[:3 * CHUNK])  # fills 3 chunks: chunk 2 has no token after it
        e.admit(req)
        metas = e.prefill(req)
        for meta in metas:
            check_saves(e, meta)
        stored = [name for meta in metas for name in saved(meta, "r")]
        assert stored and all(name[1:] in ("0", "1") for name in stored), stored
        expected = ChunkHasher(e.ns).chunk_hashes(TOKENS[:3 * CHUNK], 2, lookahead=1)
        assert e.sched.requests["r"].hashes == expected
        # the same prompt again hits both chunks; one ending at chunk 1's boundary does not
        # (its token after chunk 1 is not the stored one's)
        again = request("again", TOKENS[:3 * CHUNK])
        assert e.admit(again)[0] == 2 * CHUNK
        cut = request("cut", TOKENS[:2 * CHUNK] + [7] + TOKENS[2 * CHUNK + 1:3 * CHUNK])
        assert e.admit(cut)[0] == CHUNK
    finally:
        e.close()


def test_an_engine_with_the_connector_and_mtp_stops_at_start_with_the_message(qwen35_mtp, tmp_path, capfd,
                                                                             monkeypatch):
    """The real start: the worker builds its connector before loading the model and stops there
    (vLLM reports "Engine core initialization failed"; the reason is in its processes' log)."""
    from tests.engines import make_llm, write_yaml

    yaml = write_yaml(tmp_path / "cpu.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.2)
    with pytest.raises(RuntimeError, match="initialization failed"):
        make_llm(qwen35_mtp, yaml, dtype="bfloat16", kv_cache_memory_bytes=2**28,
                 limit_mm_per_prompt={"image": 0, "video": 0},
                 speculative_config={"method": "qwen3_5_mtp", "num_speculative_tokens": 1})
    out, err = capfd.readouterr()
    assert "UnsupportedSpeculation: LMCacheHMAConnector does not serve speculative decoding with " \
           "method 'mtp' (qwen3_5_mtp) on a recurrent-state model" in out + err
