"""The README stays true: short, its shell blocks parse, and every file, command, key and link it
names exists. (Its commands are not run here: they serve a model on a GPU or build the venv.)"""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 200


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def test_the_readme_is_short():
    assert len(README.splitlines()) <= MAX_LINES


@pytest.mark.parametrize("n", range(len(blocks("bash"))))
def test_every_shell_block_parses(n):
    block = blocks("bash")[n]
    done = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
    assert done.returncode == 0, f"block {n}: {done.stderr}\n{block}"


def _words() -> list[str]:
    """The words of every shell block, as the shell splits them (continuations joined)."""
    words = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words += shlex.split(line, comments=True)
            except ValueError:
                words += line.split()
    return words


def test_every_repository_file_the_commands_name_exists():
    named = {w.split("=", 1)[-1] for w in _words()
             if re.match(r"^(\w+=)?(configs|examples|benchmarks|docs|tests)/\S+\.\w+$", w)}
    named |= set(re.findall(r"`((?:configs|examples|benchmarks|docs|tests)/[\w./-]+\.\w+)`", README))
    assert named, "the README names no repository file?"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_every_link_points_at_a_file_of_the_repository():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []


def test_every_kv_transfer_config_names_the_connector_and_a_vllm_role():
    configs = [json.loads(words[i + 1]) for words in [_words()] for i, w in enumerate(words)
               if w == "--kv-transfer-config"]
    assert configs
    for c in configs:
        assert c["kv_connector"] == "LMCacheHMAConnector" and c["kv_connector_module_path"] == "lmcache_hma"
        assert c["kv_role"] in ("kv_both", "kv_producer", "kv_consumer")
        assert set(c) <= {"kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config"}


def test_every_lmcache_hma_subcommand_exists():
    from lmcache_hma.tools.cli import COMMANDS

    words = _words()
    used = {words[i + 1] for i, w in enumerate(words) if w.endswith("lmcache-hma") and i + 1 < len(words)}
    used |= set(re.findall(r"`lmcache-hma ([\w-]+)", README))
    assert used and used <= set(COMMANDS), used - set(COMMANDS)


def test_every_adapter_key_it_names_exists():
    from lmcache_hma.config.settings import ADAPTER_KEYS

    named = set(re.findall(r"\bhma_[a-z_]+", README))
    assert named and named <= set(ADAPTER_KEYS), named - set(ADAPTER_KEYS)


def test_its_yaml_example_loads_as_the_connector_reads_it(tmp_path, monkeypatch):
    from lmcache_hma.config.settings import load_config

    monkeypatch.setenv("REDIS_PASSWORD", "pw")
    monkeypatch.setenv("LMCACHE_HMA_SECRET", "0123456789abcdef0123")
    [example] = blocks("yaml")
    path = tmp_path / "readme.yaml"
    path.write_text(example)
    assert isinstance(yaml.safe_load(example), dict)
    config = load_config({"lmcache_config_file": str(path)})
    assert config.chunk_size == 256 and config.shared_secret


def test_the_shipped_configs_it_names_load():
    from lmcache_hma.config.settings import load_config

    for name in re.findall(r"configs/(\w+)\.yaml", README):
        load_config({"lmcache_config_file": str(ROOT / "configs" / f"{name}.yaml")})
