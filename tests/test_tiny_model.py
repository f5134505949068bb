"""Tests for the tiny hybrid-attention model builder (no vLLM engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_hma.testing import distant_context as dc
from lmcache_hma.testing import tiny_model as tm
from lmcache_hma.testing import model_cache
from lmcache_hma.testing import tiny_tokenizer as tt

S, F = tm.S, tm.F
HELLO = "Hello, how are you?"
STORY = "Tell me a very long story"
LONG = HELLO * 5000 + "Hello, my name is"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A private LMCACHE_HMA_HOME, so tests never touch the user's cache."""
    path = tmp_path_factory.mktemp("lmcache_hma_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_HMA_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(home) -> Path:
    return tm.build_tiny_model(tm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def fresh_tokenizer():
    """Built in memory, without a model."""
    return tt.build_tokenizer()


def n_tokens(tok, text: str) -> int:
    return len(tok(text).input_ids)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def test_short_prompts_split_like_gpt(tokenizer):
    ids = tokenizer(HELLO, add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in ids] == ["Hello", ",", " how", " are", " you", "?"]
    assert len(tokenizer(STORY, add_special_tokens=False).input_ids) == 6


def test_bos_is_prepended(tokenizer):
    ids = tokenizer(HELLO).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 7
    assert n_tokens(tokenizer, HELLO * 1000 + STORY) == 6007


def test_long_prompt_and_one_digit_prefixes(tokenizer):
    base = tokenizer(LONG).input_ids
    assert base[0] == tokenizer.bos_token_id
    assert len(base) == 1 + 30000 + 5
    for digit in "12":
        ids = tokenizer(digit + LONG).input_ids
        assert len(ids) == len(base) + 1
        assert tokenizer.decode([ids[1]]) == digit
        assert ids[2:] == base[1:]


def test_any_text_encodes_and_ascii_round_trips(tokenizer):
    ascii_text = "The {quick} brown fox #42 jumps\n\tover `the` lazy dog!? ~_~"
    ids = tokenizer(ascii_text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == ascii_text
    other = "naïve café, 日本語, emoji 🙂"
    assert tokenizer.decode(tokenizer(other).input_ids, skip_special_tokens=True) == other


def test_special_tokens_and_vocab_size(model_dir, tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert 256 < len(tokenizer) <= 2048
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id


def test_eos_and_pad_embeddings_are_zero(model_dir, tokenizer):
    import torch
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    (emb,) = [w for name, w in weights.items() if name.endswith("embed_tokens.weight")]
    assert emb.shape[0] == len(tokenizer)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        assert not emb[token_id].any()
    assert emb[tokenizer.bos_token_id].any()


# --------------------------------------------------------------------------
# Build: cache, atomicity, determinism
# --------------------------------------------------------------------------


def test_model_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LMCACHE_HMA_HOME", str(tmp_path))
    assert model_cache.model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("LMCACHE_HMA_HOME")
    assert model_cache.model_cache_dir() == Path.home() / ".cache" / "lmcache_hma" / "models"


def test_build_layout_and_cache(home, model_dir, monkeypatch):
    spec = tm.PRESETS[tm.DEFAULT_MODEL]
    assert model_dir == home / "models" / f"{spec.name}-{spec.digest()}"
    assert (model_dir / model_cache.MARKER_FILE).read_text().strip() == spec.digest()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs

    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(tm, "_write_model", no_rebuild)
    assert tm.build_tiny_model(tm.DEFAULT_MODEL) == model_dir
    assert tm.build_tiny_model(spec) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_digest_depends_on_spec_and_builder_version(monkeypatch):
    import dataclasses

    spec = tm.PRESETS[tm.DEFAULT_MODEL]
    assert spec.digest() == tm.PRESETS[tm.DEFAULT_MODEL].digest()
    assert dataclasses.replace(spec, seed=1).digest() != spec.digest()
    old = spec.digest()
    monkeypatch.setattr(tm, "BUILDER_VERSION", tm.BUILDER_VERSION + "-next")
    assert spec.digest() != old


def test_crashed_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(spec, out: Path):
        (out / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(tm, "_write_model", crash)
    out = tmp_path / "model"
    with pytest.raises(RuntimeError, match="simulated crash"):
        tm.build_tiny_model(tm.DEFAULT_MODEL, out)
    assert list(tmp_path.iterdir()) == []


def test_out_dir_with_other_files_is_not_replaced(tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        tm.build_tiny_model(tm.DEFAULT_MODEL, out, force=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


def test_build_is_deterministic_and_force_rebuilds(model_dir, tmp_path):
    a = tm.build_tiny_model(tm.DEFAULT_MODEL, tmp_path / "a")
    assert a == tmp_path / "a"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (model_dir / name).read_bytes(), name

    marker = a / model_cache.MARKER_FILE
    inode = marker.stat().st_ino
    tm.build_tiny_model(tm.DEFAULT_MODEL, a, force=True)
    assert marker.stat().st_ino != inode
    assert (a / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_cli_prints_directory(home, model_dir, capsys):
    tm.main(["--preset", tm.DEFAULT_MODEL])
    assert capsys.readouterr().out.strip() == str(model_dir)


def test_build_in_another_process_is_identical(model_dir, tmp_path):
    """The BPE training and weight init do not depend on the process (hash seed)."""
    out = tmp_path / "other"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "lmcache_hma.testing.tiny_model", "--out", str(out)]
    repo = Path(tm.__file__).resolve().parents[2]
    res = subprocess.run(
        cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert res.stdout.strip().splitlines()[-1] == str(out)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def test_output_depends_on_distant_context(model_dir):
    assert dc.output_depends_on_distant_context(model_dir)
    effect = dc.distant_context_effect(model_dir)
    assert effect.greedy_token_changed  # not merely a logit change
    assert effect.relative_logit_change > dc.MATERIAL_LOGIT_CHANGE


EXPECTED = {
    "tiny-gemma3": ("gemma3", (S, S, F, S, S, F), 128),
    "tiny-gemma3-2g": ("gemma3", (S, F, S, F), 512),
    "tiny-gemma3-5to1": ("gemma3", (S, S, S, S, S, F) * 2, 1024),
    "tiny-gptoss-like": ("gemma3", (S, F, S, F), 128),
    "tiny-gemma2": ("gemma2", (S, F, S, F), 128),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_configs(name, fresh_tokenizer):
    arch, layer_types, window = EXPECTED[name]
    spec = tm.PRESETS[name]
    assert (spec.name, spec.arch) == (name, arch)
    assert (spec.layer_types, spec.sliding_window) == (layer_types, window)
    config = tm.make_config(spec, fresh_tokenizer)
    assert list(config.layer_types) == list(layer_types)
    assert config.num_hidden_layers == len(layer_types)
    assert config.sliding_window == window
    assert config.architectures == [tm._ARCHES[arch][1]]


def test_default_model_config_on_disk(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == [S, S, F, S, S, F]
    assert config["sliding_window"] == 128
    assert config["dtype"] == "bfloat16"
    assert tm.DEFAULT_MODEL == "tiny-gemma3"
