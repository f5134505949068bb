"""The ``lmcache-hma`` command line (lmcache_hma/tools/cli.py) and what ``repro`` checks before
vLLM starts (lmcache_hma/tools/repro.py).

In-process through ``cli.main([...])`` (the console script once, as a subprocess). No test here
starts vLLM: ``repro``'s engine is replaced by a stub that fails the test if it is reached where
the command must stop first, and that records what it was given where it must not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_hma.tools import check, cli, repro
from tests.redis_server import CONFIGS, free_port

COMMAND_NAMES = ["check", "repro", "build-model", "serve", "help"]


def commands_section(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("commands:") + 1
    end = lines.index("", start)
    return lines[start:end]


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"]])
def test_help_lists_each_command_on_one_line(argv, capsys):
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    listed = commands_section(out)
    assert [ln.split()[0] for ln in listed] == COMMAND_NAMES  # one line each, in order
    assert all(len(ln.split(None, 1)) == 2 for ln in listed)  # each with what it does
    assert "LMCACHE_HMA_HOME" in out and "LMCACHE_CONFIG_FILE" in out


def test_help_shows_every_option_of_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "lmcache-hma COMMAND --help" in out
    for name in ("check", "repro", "build-model"):
        parser = cli.COMMANDS[name][2]()
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        assert options
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(f"lmcache-hma {name} ")]
        for option in options:
            assert option in line, (name, option)
    assert any(ln.strip() == "lmcache-hma serve MODEL [vllm serve options]" for ln in out.splitlines())


def test_no_command_is_usage_on_stderr(capsys):
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "commands:" in err


@pytest.mark.parametrize("argv, hint", [(["bogus"], "commands: check, repro"),
                                        (["chek", "--config", "x"], "did you mean 'check'"),
                                        (["help", "bogus"], "commands:")])
def test_an_unknown_command_is_one_line_and_status_2(argv, hint, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.strip().splitlines()
    assert repr(argv[-1] if argv[0] == "help" else argv[0]) in line and hint in line


def test_each_command_help_names_its_options_and_lmcache_hma_home(capsys):
    assert cli.main(["help", "repro"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lmcache-hma repro") and "--kv-cache-bytes" in out
    assert "LMCACHE_HMA_HOME" in out and "~/.cache/lmcache_hma/models" in out
    assert cli.main(["build-model", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lmcache-hma build-model") and "LMCACHE_HMA_HOME" in out and "--preset" in out
    assert cli.main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lmcache-hma check") and "--extra-config" in out and "LMCACHE_CONFIG_FILE" in out


def test_a_usage_error_of_a_command_is_status_2(capsys):
    assert cli.main(["check", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert cli.main(["build-model", "--preset", "bogus"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown preset 'bogus'" in line and "tiny-qwen3next" in line


def test_console_script_help():
    script = Path(sys.executable).with_name("lmcache-hma")
    if not script.exists():
        script = Path(shutil.which("lmcache-hma") or script)
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [ln.split()[0] for ln in commands_section(done.stdout)] == COMMAND_NAMES


# -- repro: everything is checked before vLLM starts ----------------------------------------
@pytest.fixture
def engine(monkeypatch):
    """``repro.run_repro`` replaced: ``engine.calls`` records what it was given (model, config,
    KV cache bytes); ``engine.forbid()`` makes reaching it fail the test."""

    class Engine:
        calls: list = []
        forbidden = False

        def forbid(self):
            self.forbidden = True

    stub = Engine()

    def run_repro(model, config, kv_cache_bytes, preset=None):
        assert not stub.forbidden, "vLLM would have started"
        stub.calls.append((model, config, kv_cache_bytes, preset))
        return {"identical": True, "evicted": True}

    def no_llm(*args, **kwargs):
        raise AssertionError("vLLM must not start in these tests")

    monkeypatch.setattr(repro, "run_repro", run_repro)
    monkeypatch.setattr(repro, "_llm", no_llm)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)  # repro sets it; restored after
    return stub


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("lmcache-hma repro: ")
    return line


def test_repro_unknown_preset_names_the_valid_ones(engine, capsys):
    from lmcache_hma.testing.tiny_model import PRESETS

    engine.forbid()
    assert cli.main(["repro", "--preset", "bogus"]) == 2
    line = one_error_line(capsys)
    assert "unknown preset 'bogus'" in line and all(name in line for name in PRESETS)
    assert cli.main(["repro", "--preset", "tiny-gemma3", "--model", "/x"]) == 2
    assert "give one" in one_error_line(capsys)


def test_repro_checks_the_config_before_vllm_starts(engine, tmp_path, capsys):
    engine.forbid()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 1, "chunk_sise": 1}))
    assert cli.main(["repro", "--config", str(bad)]) == 2
    line = one_error_line(capsys)
    assert "chunk_sise" in line and str(bad) in line
    assert cli.main(["repro", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_repro_with_an_unreachable_redis_says_so_before_vllm_starts(engine, redis_yaml, capsys):
    engine.forbid()
    port = free_port()  # nothing listens there
    config = redis_yaml(f"redis://127.0.0.1:{port}", extra_config={"hma_remote_timeout_s": 0.5})
    assert cli.main(["repro", "--config", str(config)]) == 1
    line = one_error_line(capsys)
    assert f"Redis at 127.0.0.1:{port} is unreachable" in line and "start it" in line
    assert "--config configs/cpu.yaml" in line or "cpu.yaml" in line


def test_repro_sizes_vllms_kv_cache_for_a_model_directory(engine, capsys):
    from lmcache_hma.testing.tiny_model import build_tiny_model

    model = build_tiny_model("tiny-gemma3")
    assert cli.main(["repro", "--model", str(model)]) == 0
    ((given_model, _, kv_bytes, _),) = engine.calls
    assert given_model == str(model)
    # the tiny Gemma-3's first_prompt is 30006 tokens; the size the README's repro uses is 24 MiB
    assert kv_bytes == repro.DEFAULT_KV_CACHE_BYTES
    out = capsys.readouterr().out
    assert "vLLM's KV cache for" in out and "first_prompt is 30006 tokens" in out and "--kv-cache-bytes" in out
    engine.calls.clear()
    assert cli.main(["repro", "--model", str(model), "--kv-cache-bytes", "12345678"]) == 0
    assert engine.calls[0][2] == 12345678
    engine.calls.clear()
    assert cli.main(["repro", "--preset", "tiny-qwen3next"]) == 0  # a tested preset keeps its size
    assert engine.calls[0][0] is None and engine.calls[0][2] == 40 * 2**20


def test_repro_sizing_of_a_gated_delta_net_model(tmp_path):
    """The estimate for tiny-qwen3next's shape lands near the 40 MiB its reproduction is run
    with (160 blocks of 256 tokens): room for one first_prompt and max_model_len, not two."""
    from lmcache_hma.testing.tiny_model import PRESETS

    spec = PRESETS["tiny-qwen3next"]
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "num_hidden_layers": spec.num_layers, "layer_types": list(spec.layer_types),
        "hidden_size": spec.hidden_size, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "torch_dtype": "bfloat16", "max_position_embeddings": 40960}))
    nbytes, room = repro.kv_cache_bytes_for(check.read_model(str(tmp_path)), repro.TINY_FIRST_PROMPT_TOKENS)
    assert repro.MAX_MODEL_LEN < room < 2 * repro.TINY_FIRST_PROMPT_TOKENS
    assert 40 * 2**20 <= nbytes <= 48 * 2**20


def test_repro_model_it_cannot_size_says_what_to_pass(engine, tmp_path, capsys):
    engine.forbid()
    assert cli.main(["repro", "--model", str(tmp_path)]) == 2  # no config.json there
    line = one_error_line(capsys)
    assert "no config.json" in line and "--kv-cache-bytes" in line
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 128,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    assert cli.main(["repro", "--model", str(short)]) == 2
    assert "max_position_embeddings 4096" in one_error_line(capsys)
