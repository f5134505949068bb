"""LMCache's ``LMCACHE_<KEY>`` environment variables configure the connector as they configure
LMCache 0.5.6 (issue 61, item 4): without a file they are the configuration (over LMCache's
defaults), with one they override its values; the same allow-list (a variable per key and
alias), the same parsing (compared with LMCache's own ``from_env`` / ``update_config_from_env``),
and every check a YAML value gets, each problem one line naming the variable.
"""

from __future__ import annotations


import pytest

from lmcache_hma.config.settings import EXTRA_SOURCE, ConfigError, load_config
from tests.engines import write_yaml
from tests.test_config_keys import logged, warnings_of  # noqa: F401 (the lmcache_hma logger's records: a fixture)

QUICK_START = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "5"}


@pytest.fixture
def env(monkeypatch):
    """Set LMCACHE_* variables for one test (none is set outside it)."""
    import os

    for name in [n for n in os.environ if n.startswith("LMCACHE_") and not n.startswith("LMCACHE_HMA_")]:
        monkeypatch.delenv(name)

    def set_(**names):
        for name, value in names.items():
            monkeypatch.setenv(name, value)
    return set_


def refused(extra=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(extra or {})
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_lmcaches_quick_start_variables_configure_the_connector_without_a_file(env, logged):
    env(**QUICK_START)
    c = load_config({})
    assert (c.chunk_size, c.lmcache.local_cpu, c.lmcache.max_local_cpu_size) == (256, True, 5.0)
    assert c.environment == ("LMCACHE_CHUNK_SIZE", "LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE")
    assert c.source_of("chunk_size") == "the environment variable LMCACHE_CHUNK_SIZE"
    assert c.tier_defaults == "" and warnings_of(logged) == []  # a tier is named: nothing to warn about

    env(LMCACHE_CHUNK_SIZE="512", LMCACHE_MAX_LOCAL_CPU_SIZE="0.5", LMCACHE_LOCAL_CPU="false",
        LMCACHE_LOCAL_DISK="file:///tmp/lmcache_hma_env_disk/", LMCACHE_MAX_LOCAL_DISK_SIZE="1")
    c = load_config({})
    assert (c.chunk_size, c.lmcache.local_cpu, c.lmcache.max_local_cpu_size) == (512, False, 0.5)
    assert (c.lmcache.local_disk, c.lmcache.max_local_disk_size) == ("/tmp/lmcache_hma_env_disk/", 1.0)


def test_variables_override_the_files_values_as_lmcache_does(env, logged, tmp_path, monkeypatch):
    path = write_yaml(tmp_path / "c.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=2)
    env(LMCACHE_CHUNK_SIZE="512")
    for given in ({"lmcache_config_file": str(path)}, {}):  # named by vLLM's extra config, or as LMCache names it
        if not given:
            monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
        c = load_config(given)
        assert (c.chunk_size, c.lmcache.max_local_cpu_size) == (512, 2.0)  # the file's other values stand
        assert c.source_of("chunk_size") == "the environment variable LMCACHE_CHUNK_SIZE"
        assert c.source_of("max_local_cpu_size") == str(path)
    (line,) = set(warnings_of(logged))
    assert line == (f"LMCacheHMA: the environment variable LMCACHE_CHUNK_SIZE overrides chunk_size: 256 of "
                    f"{path} (as LMCache's own loader does)")


def test_values_are_parsed_as_lmcache_parses_them(env, tmp_path):
    """The honoured keys' values equal those of LMCache's own loader, from the environment alone
    (``from_env``) and over a file (``from_file`` + ``update_config_from_env``)."""
    from lmcache.v1.config import LMCacheEngineConfig

    names = {"LMCACHE_CHUNK_SIZE": "'512'", "LMCACHE_LOCAL_CPU": " TRUE ", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
             "LMCACHE_LOCAL_DISK": f"file://{tmp_path}/disk/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "3",
             "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_CACHE_POLICY": "LRU",
             "LMCACHE_LOCAL_CPU_USE_HUGEPAGES": "0", "LMCACHE_EXTRA_CONFIG": '{"hma_eviction": "lru"}'}
    keys = ("chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_serde",
            "cache_policy", "local_cpu_use_hugepages")
    env(**names)
    ours = load_config({}).lmcache
    theirs = LMCacheEngineConfig.from_env()
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(theirs, k) for k in keys}
    assert ours.chunk_size == 512 and ours.local_cpu is True and ours.local_cpu_use_hugepages is False

    path = write_yaml(tmp_path / "c.yaml", chunk_size=128, max_local_cpu_size=1, remote_url="redis://h:1",
                      extra_config={"hma_eviction": "lru"})
    ours = load_config({"lmcache_config_file": str(path)}).lmcache
    theirs = LMCacheEngineConfig.from_file(str(path)).update_config_from_env()
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(theirs, k) for k in keys}
    assert ours.remote_url.startswith("redis://h:1")  # the file's, not named in the environment


@pytest.mark.parametrize("names, message", [
    ({"LMCACHE_CHUNK_SIZE": "abc"}, "the environment variable LMCACHE_CHUNK_SIZE='abc': chunk_size must be an integer"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "5GB"},
     "the environment variable LMCACHE_MAX_LOCAL_CPU_SIZE='5GB': max_local_cpu_size must be a number of GB, e.g. 5"),
    ({"LMCACHE_LOCAL_CPU": "yes"}, "the environment variable LMCACHE_LOCAL_CPU='yes': local_cpu must be true or "
                                   "false (or 1 or 0); LMCache would read it as false"),
    ({"LMCACHE_CHUNK_SIZE": "-5"}, "the environment variable LMCACHE_CHUNK_SIZE: chunk_size must be a positive "
                                   "integer (tokens), got -5"),
    ({"LMCACHE_LOCAL_CPU": "false"}, "the environment variable LMCACHE_LOCAL_CPU: local_cpu is false and neither "
                                     "local_disk nor remote_url is set"),
    ({"LMCACHE_SAVE_UNFULL_CHUNK": "True"}, "the environment variable LMCACHE_SAVE_UNFULL_CHUNK: save_unfull_chunk: "
                                            "true is not supported by lmcache_hma"),
    ({"LMCACHE_ENABLE_XPYD": "1"}, "the environment variable LMCACHE_ENABLE_XPYD: enable_xpyd: true is not "
                                   "supported by lmcache_hma: alias of enable_pd"),
    ({"LMCACHE_REMOTE_URL": "redis://:p@ss@127.0.0.1:6379"}, "the environment variable LMCACHE_REMOTE_URL: "
                                                               "remote_url 'redis://***@127.0.0.1:6379'"),
    ({"LMCACHE_REMOTE_SERDE": "cachegen"}, "the environment variable LMCACHE_REMOTE_SERDE: remote_serde 'cachegen' "
                                           "is not supported"),
    ({"LMCACHE_EXTRA_CONFIG": "{not json"}, "the environment variable LMCACHE_EXTRA_CONFIG: extra_config must be "
                                            "a JSON object"),
    ({"LMCACHE_EXTRA_CONFIG": '{"hma_lookup_timeout_s": 0}'}, "the environment variable LMCACHE_EXTRA_CONFIG: "
                                                               "hma_lookup_timeout_s must be > 0, got 0"),
    ({"LMCACHE_CACHE_POLICY": "LFU"}, "the environment variable LMCACHE_CACHE_POLICY: cache_policy 'LFU' does "
                                      "nothing under hma_eviction: value"),
])
def test_a_bad_variable_is_one_line_naming_it(env, names, message):
    env(**names)
    assert refused().startswith(message)


def test_no_secret_of_a_variable_is_printed(env):
    env(LMCACHE_EXTRA_CONFIG='{"hma_shared_secret": "hunter2hunter2', LMCACHE_REMOTE_URL="redis://:hunter2@h:x")
    message = refused()
    assert "LMCACHE_EXTRA_CONFIG" in message and "hunter2" not in message


def test_harmless_variables_warn_by_name_and_an_empty_one_is_unset(env, logged):
    env(LMCACHE_ENABLE_P2P="false", LMCACHE_PY_ENABLE_GC="true", LMCACHE_REMOTE_URL="", **QUICK_START)
    c = load_config({})
    lines = warnings_of(logged)
    assert any(line.startswith("LMCacheHMA: the environment variable LMCACHE_ENABLE_P2P: enable_p2p (false") and
               "is not read by lmcache_hma" in line for line in lines), lines
    assert any(line.startswith("LMCacheHMA: the environment variable LMCACHE_PY_ENABLE_GC: py_enable_gc has no "
                               "effect") for line in lines), lines
    assert c.lmcache.remote_url is None


def test_adapter_keys_from_the_variable_and_kv_connector_extra_config_wins(env):
    env(LMCACHE_EXTRA_CONFIG='{"hma_lookup_timeout_s": 2.5, "hma_store_queue_objects": 9}', **QUICK_START)
    c = load_config({"hma_store_queue_objects": 3})
    assert c.lookup_timeout_s == 2.5 and c.store_queue_objects == 3
    with pytest.raises(ConfigError, match=f"^{EXTRA_SOURCE}: hma_lookup_timeout_s must be > 0"):
        load_config({"hma_lookup_timeout_s": 0})


def test_other_lmcache_variables_are_not_config_keys(env, logged):
    """LMCACHE_CONFIG_FILE, LMCache's own flags: not keys, read by nobody here (as in LMCache's loader)."""
    env(LMCACHE_USE_EXPERIMENTAL="True", LMCACHE_LOG_LEVEL="DEBUG", **QUICK_START)
    c = load_config({})
    assert c.environment == ("LMCACHE_CHUNK_SIZE", "LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE")
    assert warnings_of(logged) == []


def test_an_engine_refuses_a_chunk_size_from_the_environment_naming_the_variable(env, tmp_path, capfd):
    """The block-size check at engine start names where chunk_size came from (here the variable)."""
    from lmcache_hma.testing.tiny_model import build_tiny_model
    from tests.engines import make_llm

    path = write_yaml(tmp_path / "c.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.5)
    env(LMCACHE_CHUNK_SIZE="200")
    with pytest.raises(Exception):
        make_llm(build_tiny_model("tiny-gemma3"), path)
    err = capfd.readouterr().err
    assert ("the environment variable LMCACHE_CHUNK_SIZE: chunk_size 200 is not a multiple of the block size"
            in err), err[-3000:]
    assert "set chunk_size to a multiple of" in err


def test_an_override_of_a_value_that_may_hold_a_secret_does_not_print_it(env, logged, tmp_path):
    path = write_yaml(tmp_path / "c.yaml", local_cpu=True, max_local_cpu_size=1,
                      remote_url="redis://:hunter2hunter2@127.0.0.1:6379",
                      extra_config={"hma_shared_secret": "s3cret-s3cret-s3cret"})
    env(LMCACHE_REMOTE_URL="redis://127.0.0.1:6380", LMCACHE_EXTRA_CONFIG='{"hma_lookup_timeout_s": 2}')
    c = load_config({"lmcache_config_file": str(path)})
    assert c.lmcache.remote_url.startswith("redis://127.0.0.1:6380") and c.shared_secret is None
    lines = warnings_of(logged)
    assert any("LMCACHE_REMOTE_URL overrides remote_url of" in line for line in lines), lines
    assert any("LMCACHE_EXTRA_CONFIG overrides extra_config of" in line for line in lines), lines
    assert not any("hunter2" in line or "s3cret" in line for line in lines), lines
