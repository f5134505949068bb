"""Tests for the tiny Qwen3.5 builder and the torchvision shim it needs (no vLLM engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from lmcache_hma.testing import tiny_model as tm
from lmcache_hma.testing import tiny_qwen35 as q
from lmcache_hma.testing.tiny_vlm import install_shim, vlm_pythonpath


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Built in a private LMCACHE_HMA_HOME, so tests never touch the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_HMA_HOME", str(tmp_path_factory.mktemp("lmcache_hma_home")))
        yield q.build_tiny_qwen35()


def test_config_is_qwen35_as_shipped(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["tie_word_embeddings"] is False and config["dtype"] == "bfloat16"
    text, vision = config["text_config"], config["vision_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert vision["depth"] == 1 and vision["out_hidden_size"] == text["hidden_size"]
    assert q.build_tiny_qwen35() == model_dir  # cached: built once


def test_gdn_layers_have_long_memory(model_dir):
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    a_log = [v for k, v in weights.items() if k.endswith("linear_attn.A_log")]
    dt_bias = [v for k, v in weights.items() if k.endswith("linear_attn.dt_bias")]
    assert len(a_log) == len(dt_bias) == 6
    assert all((t.float() == tm._GDN_A_LOG).all() for t in a_log)
    assert all((t.float() == tm._GDN_DT_BIAS).all() for t in dt_bias)
    assert any(k.startswith("model.visual.blocks.0.") for k in weights)


def test_processor_expands_an_image_without_torchvision(model_dir):
    """What vLLM does with an image prompt: the saved processor (image and video processors,
    tokenizer) loads through the shim and puts IMAGE_TOKENS placeholders between the vision tokens."""
    install_shim()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image = Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8))  # a square: resized to IMAGE_SIZE
    ids = processor(text=["Hello" + q.IMAGE_PLACEHOLDER + " how"], images=[image])["input_ids"][0]
    tok = processor.tokenizer.convert_tokens_to_ids
    start = list(ids).index(tok(q.VISION_START))
    assert list(ids[start + 1:start + 1 + q.IMAGE_TOKENS]) == [tok(q.IMAGE_PAD)] * q.IMAGE_TOKENS
    assert ids[start + 1 + q.IMAGE_TOKENS] == tok(q.VISION_END)


def test_shim_reaches_child_processes():
    """vLLM's engine and worker processes get the shim from PYTHONPATH (``sitecustomize``)."""
    code = ("import transformers.models.qwen2_vl.image_processing_qwen2_vl as m, transformers; "
            "import transformers.models.auto.video_processing_auto; "
            "print(m.Qwen2VLImageProcessor.__name__, transformers.VideoProcessorMixin.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": vlm_pythonpath(), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["Qwen2VLImageProcessorPil", "VideoProcessorMixin"], out.stderr[-2000:]
