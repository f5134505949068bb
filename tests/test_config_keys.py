"""Every LMCache key is honoured, refused or warned about, by name (issue 48, item 1).

The table (``config.lmcache_keys.LMCACHE_KEYS``) against LMCache's own list and against
docs/configuration.md; strict values; and a sweep of wrong configurations, each of which must
stop ``load_config`` with one ``ConfigError`` line that names the key, where its value came
from (the YAML's path, or ``kv_connector_extra_config``) and the fix, never an
``AssertionError``, a ``KeyError`` or a ``NotADirectoryError`` from deeper down.
"""

from __future__ import annotations

import logging
import math
import os
import typing

import pytest
import yaml

from lmcache_hma.config import lmcache_keys
from lmcache_hma.config.lmcache_keys import HONOURED, IGNORED, LMCACHE_KEYS, REFUSED, definition
from lmcache_hma.config.settings import ADAPTER_KEYS, EXTRA_SOURCE, ConfigError, load_config
from lmcache_hma.config.lmcache_schema import config_keys
from tests.engines import write_yaml

CONFIGS = lmcache_keys.DOC.parents[1] / "configs"


@pytest.fixture
def logged(caplog):
    """The lmcache_hma logger's records (it does not propagate to the root logger caplog watches)."""
    logger = logging.getLogger("lmcache_hma")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def load(tmp_path, keys=None, extra=None, text=None):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    else:
        write_yaml(path, **(keys or {}))
    return load_config({"lmcache_config_file": str(path), **(extra or {})}), str(path)


def refused(tmp_path, keys=None, extra=None, text=None) -> tuple[str, str]:
    """(the one-line message of the ConfigError ``load`` raises, the YAML's path)."""
    path = tmp_path / "c.yaml"
    with pytest.raises(ConfigError) as err:
        load(tmp_path, keys, extra, text)
    message = str(err.value)
    assert "\n" not in message and message.strip() == message, message
    return message, str(path)


# -- the table ---------------------------------------------------------------------------

def test_the_table_has_exactly_lmcaches_keys():
    assert set(LMCACHE_KEYS) == config_keys() and len(LMCACHE_KEYS) == 119
    for key, rule in LMCACHE_KEYS.items():
        assert rule.verdict in (HONOURED, REFUSED, IGNORED) and rule.text and "\n" not in rule.text, key
    assert lmcache_keys.HONOURED_KEYS == {
        "chunk_size", "local_cpu", "max_local_cpu_size", "local_cpu_use_hugepages", "local_disk",
        "max_local_disk_size", "remote_url", "remote_serde", "pre_caching_hash_algorithm", "cache_policy",
        "numa_mode", "extra_config"}


def test_docs_list_every_key_of_both_tables_as_generated():
    doc = lmcache_keys.DOC.read_text()
    for key in [*LMCACHE_KEYS, *ADAPTER_KEYS]:
        assert f"| `{key}` |" in doc, f"docs/configuration.md does not list {key}"
    assert lmcache_keys.render(doc) == doc, (
        "docs/configuration.md's tables differ from LMCACHE_KEYS / ADAPTER_KEYS: run "
        "`.venv/bin/python -m lmcache_hma.config.lmcache_keys --write`")


def test_only_honoured_keys_reach_lmcache(tmp_path, logged):
    """An ignored or refused key left at its default is not handed to LMCache at all."""
    c, _ = load(tmp_path, dict(chunk_size=256, py_enable_gc=False, enable_pd=False, local_cpu_use_hugepages=False,
                               cache_policy="fifo", extra_config={"hma_eviction": "lru"}))
    assert c.lmcache.py_enable_gc is True  # LMCache's default: the YAML's value never reached it
    assert c.lmcache.cache_policy == "fifo" and "enable_pd" not in c.lmcache._user_set_keys
    assert {"chunk_size", "local_cpu_use_hugepages", "cache_policy"} <= c.lmcache._user_set_keys


def test_shipped_configs_load_without_a_warning(logged, monkeypatch):
    for name in ("cpu.yaml", "disk.yaml", "redis.yaml", "cpu_disk_redis.yaml"):
        load_config({"lmcache_config_file": str(CONFIGS / name)})
    assert warnings_of(logged) == []


# -- refused and ignored keys --------------------------------------------------------------

def other_value(key: str):
    """A value of LMCache's type for ``key`` that is neither its default nor off."""
    typ, default = definition(key)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if typing.get_origin(typ) is typing.Union:
        typ = args[0]
    origin = typing.get_origin(typ) or typ
    if origin is bool:
        return True  # (with a default of true, e.g. use_gds, no value turns a refused feature on)
    if origin is int:
        return (default or 0) + 1
    if origin is float:
        return 1.5 if default is None or math.isinf(default) else default + 1.5
    if origin is list:
        return ["x"] if typing.get_args(typ)[0] is str else [1]
    return "something-else"


@pytest.mark.parametrize("key", sorted(k for k, r in LMCACHE_KEYS.items() if r.verdict == REFUSED))
def test_a_refused_key_stops_the_engine_unless_left_at_its_default(tmp_path, logged, key):
    value, default = other_value(key), definition(key)[1]
    path = str(tmp_path / "c.yaml")
    if value is not default:
        message, path = refused(tmp_path, {key: value})
        assert message.startswith(f"{path}: {key}: ") and "is not supported by lmcache_hma" in message
        assert LMCACHE_KEYS[key].text in message
    if default is not None:  # LMCache's default (or off) passes, with one warning naming it
        load(tmp_path, {key: default})
        lines = [w for w in warnings_of(logged) if f": {key} (" in w]
        assert len(lines) == 1 and path in lines[0] and "is not read by lmcache_hma" in lines[0]


@pytest.mark.parametrize("key", sorted(k for k, r in LMCACHE_KEYS.items() if r.verdict == IGNORED))
def test_an_ignored_key_is_one_warning_naming_it(tmp_path, logged, key):
    typ, default = definition(key)
    load(tmp_path, {key: other_value(key)})
    lines = [w for w in warnings_of(logged) if f": {key} has no effect" in w]
    assert len(lines) == 1 and "\n" not in lines[0] and str(tmp_path / "c.yaml") in lines[0]
    assert LMCACHE_KEYS[key].text in lines[0]


# -- the sweep of wrong configurations ---------------------------------------------------

# (id, YAML keys ({tmp}: the test's directory), kv_connector_extra_config, the key the message must
#  name, where the value came from ("yaml" or "extra"), a part of the message)
SWEEP = [
    # keys LMCache has and lmcache_hma does not honour
    ("save_decode_cache", dict(save_decode_cache=True), None, "save_decode_cache", "yaml", "hma_store_answers"),
    ("save_unfull_chunk", dict(save_unfull_chunk=True), None, "save_unfull_chunk", "yaml", "hma_store_answers"),
    ("use_layerwise", dict(use_layerwise=True), None, "use_layerwise", "yaml", "all layers at once"),
    ("enable_blending", dict(enable_blending=True), None, "enable_blending", "yaml", "CacheBlend"),
    ("lookup_timeout_ms", dict(lookup_timeout_ms=100), None, "lookup_timeout_ms", "yaml", "hma_lookup_timeout_s"),
    ("enable_async_loading", dict(enable_async_loading=True), None, "enable_async_loading", "yaml", "asynchronously"),
    ("gds_path", dict(gds_path="/mnt/gds"), None, "gds_path", "yaml", "use local_disk"),
    ("enable_p2p", dict(enable_p2p=True), None, "enable_p2p", "yaml", "remote_url"),
    ("enable_pd", dict(enable_pd=True), None, "enable_pd", "yaml", "kv_role"),
    ("pd_role", dict(pd_role="sender"), None, "pd_role", "yaml", "kv_producer"),
    ("enable_xpyd alias", dict(enable_xpyd=True), None, "enable_xpyd", "yaml", "alias of enable_pd"),
    ("nixl_backends", dict(nixl_backends=["UCX"]), None, "nixl_backends", "yaml", "NIXL"),
    ("enable_controller", dict(enable_controller=True), None, "enable_controller", "yaml", "controller"),
    ("storage_plugins", dict(storage_plugins=["mine"]), None, "storage_plugins", "yaml", "storage plugins"),
    ("remote_storage_plugins", dict(remote_storage_plugins=["redis"]), None, "remote_storage_plugins", "yaml",
     "use remote_url"),
    ("maru_path", dict(maru_path="/dev/dax0.0"), None, "maru_path", "yaml", "Maru"),
    ("enable_kv_events", dict(enable_kv_events=True), None, "enable_kv_events", "yaml", "--kv-events-config"),
    ("blocking_timeout_secs", dict(blocking_timeout_secs=3), None, "blocking_timeout_secs", "yaml",
     "hma_remote_timeout_s"),
    ("retrieve_locations", dict(retrieve_locations=["LocalDiskBackend"]), None, "retrieve_locations", "yaml",
     "every configured tier"),
    ("local_disk_path_sharding", dict(local_disk_path_sharding="round_robin"), None, "local_disk_path_sharding",
     "yaml", "one local_disk directory"),
    ("priority_limit", dict(priority_limit=5), None, "priority_limit", "yaml", "lmcache.skip_save"),
    ("min_retrieve_tokens", dict(min_retrieve_tokens=64), None, "min_retrieve_tokens", "yaml", "every hit"),
    ("remote_config_url", dict(remote_config_url="http://cfg:8080"), None, "remote_config_url", "yaml",
     "reads this file only"),
    ("enable_hidden_state_cache", dict(enable_hidden_state_cache=True), None, "enable_hidden_state_cache", "yaml",
     "hidden-state"),
    ("a refused boolean as a string", dict(use_gds="yes"), None, "use_gds", "yaml", "must be true or false"),
    # booleans: YAML true/false only
    ("local_cpu yes", dict(local_cpu="yes"), None, "local_cpu", "yaml", "must be true or false"),
    ("local_cpu on", dict(local_cpu="on"), None, "local_cpu", "yaml", "got 'on'"),
    ("local_cpu ture", dict(local_cpu="ture"), None, "local_cpu", "yaml", "got 'ture'"),
    ("local_cpu 2", dict(local_cpu=2), None, "local_cpu", "yaml", "got 2"),
    ("hugepages 1", dict(local_cpu_use_hugepages=1), None, "local_cpu_use_hugepages", "yaml", "true or false"),
    ("hma bool as a string", dict(extra_config={"hma_verify_checksums": "false"}), None, "hma_verify_checksums",
     "yaml", "must be true or false"),
    ("hma bool from extra", None, {"hma_store_answers": "no"}, "hma_store_answers", "extra", "true or false"),
    # numbers in range
    ("max_local_cpu_size 0", dict(max_local_cpu_size=0), None, "max_local_cpu_size", "yaml", "> 0"),
    ("max_local_cpu_size 0, staging only", dict(max_local_cpu_size=0, local_cpu=False, remote_url="redis://h:1"),
     None, "max_local_cpu_size", "yaml", "staging buffer"),
    ("max_local_cpu_size text", dict(max_local_cpu_size="2GB"), None, "max_local_cpu_size", "yaml", "number of GB"),
    ("max_local_cpu_size inf", dict(max_local_cpu_size=float("inf")), None, "max_local_cpu_size", "yaml", "> 0"),
    ("chunk_size true", dict(chunk_size=True), None, "chunk_size", "yaml", "positive integer"),
    ("chunk_size float", dict(chunk_size=256.0), None, "chunk_size", "yaml", "positive integer"),
    ("lookup timeout 0", dict(extra_config={"hma_lookup_timeout_s": 0}), None, "hma_lookup_timeout_s", "yaml",
     "must be > 0"),
    ("lookup timeout inf", dict(extra_config={"hma_lookup_timeout_s": float("inf")}), None, "hma_lookup_timeout_s",
     "yaml", "must be > 0"),
    ("store queue 0", dict(extra_config={"hma_store_queue_objects": 0}), None, "hma_store_queue_objects", "yaml",
     "must be >= 1"),
    ("lookup timeout 0 from extra", dict(chunk_size=256), {"hma_lookup_timeout_s": 0}, "hma_lookup_timeout_s",
     "extra", "must be > 0"),
    ("remote timeout 0 from extra", dict(chunk_size=256), {"hma_remote_timeout_s": 0}, "hma_remote_timeout_s",
     "extra", "must be > 0"),
    ("fail loads -1", dict(extra_config={"hma_test_fail_loads": -1}), None, "hma_test_fail_loads", "yaml", ">= 0"),
    ("checkpoint interval", dict(chunk_size=256, extra_config={"hma_checkpoint_interval": 300}), None,
     "hma_checkpoint_interval", "yaml", "multiple of chunk_size 256; e.g. 512"),
    ("checkpoint interval from extra", dict(chunk_size=256), {"hma_checkpoint_interval": 300},
     "hma_checkpoint_interval", "extra", "multiple of chunk_size 256 (from "),
    # tiers
    ("no tier", dict(local_cpu=False), None, "local_cpu", "yaml", "no tier to store into"),
    ("disk size, no disk", dict(max_local_disk_size=5), None, "max_local_disk_size", "yaml", "local_disk is not"),
    ("disk, no size", dict(local_disk="file://{tmp}/d/"), None, "max_local_disk_size", "yaml", "is 0"),
    # URLs
    ("port not a number", dict(remote_url="redis://127.0.0.1:notaport"), None, "remote_url", "yaml",
     "port 'notaport' is not a number in 1..65535"),
    ("no host", dict(remote_url="redis://"), None, "remote_url", "yaml", "names no host"),
    ("port only", dict(remote_url="redis://:6379"), None, "remote_url", "yaml", "is not host:port"),
    ("port too big", dict(remote_url="rediss://h:70000"), None, "remote_url", "yaml", "port '70000'"),
    ("database not a number", dict(remote_url="redis://h:1/db1"), None, "remote_url", "yaml", "database 'db1'"),
    ("unix without a path", dict(remote_url="unix://"), None, "remote_url", "yaml", "names no socket path"),
    ("remote_url a number", dict(remote_url=6379), None, "remote_url", "yaml", "must be a string"),
    ("remote_serde", dict(remote_url="redis://h:1", remote_serde="cachegen"), None, "remote_serde", "yaml",
     "use naive"),
    # the disk tier's directory
    ("local_disk several", dict(local_disk="/a/,/b/", max_local_disk_size=1), None, "local_disk", "yaml",
     "names several directories"),
    ("local_disk s3", dict(local_disk="s3://bucket/x", max_local_disk_size=1), None, "local_disk", "yaml",
     "not a s3:// URL"),
    ("local_disk unset variable", dict(local_disk="file://${LMHMA_UNSET_DIR}/x/", max_local_disk_size=1), None,
     "local_disk", "yaml", "LMHMA_UNSET_DIR, which is not set"),
    ("local_disk a file", dict(local_disk="file://{tmp}/a-file", max_local_disk_size=1), None, "local_disk",
     "yaml", "is not a directory"),
    ("local_disk under a file", dict(local_disk="{tmp}/a-file/disk/", max_local_disk_size=1), None, "local_disk",
     "yaml", "is not creatable"),
    ("local_disk open to all", dict(local_disk="{tmp}/open/", max_local_disk_size=1), None, "local_disk", "yaml",
     "writable by every user"),
    # other honoured keys
    ("cache_policy", dict(cache_policy="random"), None, "cache_policy", "yaml", "LRU, LFU, FIFO, MRU"),
    ("numa_mode manual", dict(numa_mode="manual"), None, "numa_mode", "yaml", "gpu_to_numa_mapping"),
    ("numa_mode other", dict(numa_mode="sometimes"), None, "numa_mode", "yaml", "auto or manual"),
    ("hash", dict(pre_caching_hash_algorithm="xxhash"), None, "pre_caching_hash_algorithm", "yaml", "sha256_cbor"),
    # keys in the wrong place
    ("hma key at the top", dict(hma_lookup_timeout_s=1.0), None, "hma_lookup_timeout_s", "yaml",
     "put it under extra_config, not at the top level"),
    ("misspelt hma key at the top", dict(hma_chekpoint_interval=512), None, "hma_chekpoint_interval", "yaml",
     "did you mean 'hma_checkpoint_interval' (under extra_config)?"),
    ("misspelt LMCache key", dict(chunk_sise=256), None, "chunk_sise", "yaml", "did you mean 'chunk_size'"),
    ("LMCache key in extra_config", dict(extra_config={"chunk_size": 128}), None, "extra_config.chunk_size",
     "yaml", "move it to the top level"),
    ("extra_config a list", dict(extra_config=[1, 2]), None, "extra_config", "yaml", "must be a mapping"),
    ("nixl storage in extra_config", dict(extra_config={"enable_nixl_storage": True}), None,
     "extra_config.enable_nixl_storage", "yaml", "NIXL"),
    ("audit in extra_config", dict(extra_config={"audit_backend_enabled": True}), None,
     "extra_config.audit_backend_enabled", "yaml", "audit backend"),
    ("LMCache key in kv_connector_extra_config", dict(chunk_size=256), {"chunk_size": 128}, "chunk_size", "extra",
     "put it in the LMCache YAML"),
    ("unknown key in kv_connector_extra_config", dict(chunk_size=256), {"bogus": 1}, "bogus", "extra",
     "unknown key"),
    ("unknown hma key from extra", dict(chunk_size=256), {"hma_lookup_timeout": 1.0}, "hma_lookup_timeout", "extra",
     "did you mean 'hma_lookup_timeout_s'"),
]


@pytest.mark.parametrize("keys, extra, key, source, part", [s[1:] for s in SWEEP], ids=[s[0] for s in SWEEP])
def test_a_wrong_configuration_is_one_line_naming_key_source_and_fix(tmp_path, monkeypatch, keys, extra, key,
                                                                    source, part):
    monkeypatch.delenv("LMHMA_UNSET_DIR", raising=False)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    keys = yaml.safe_load(yaml.safe_dump(keys or {}).replace("{tmp}", str(tmp_path)))
    message, path = refused(tmp_path, keys, extra)
    assert key in message and part in message, message
    where = EXTRA_SOURCE if source == "extra" else path
    assert message.startswith(f"{where}: "), message
    if source == "extra":  # the value's source, not the YAML's
        assert not message.startswith(path)


def test_the_sweep_is_large_enough():
    assert len(SWEEP) >= 45


@pytest.mark.parametrize("key", sorted(LMCACHE_KEYS))
def test_no_value_of_any_key_escapes_as_another_exception(tmp_path, key):
    """Whatever a key is set to, ``load_config`` accepts it or raises ``ConfigError``: never an
    ``AssertionError``, ``KeyError``, ``TypeError`` ... from LMCache or from our own checks."""
    for value in ("yes", "ture", 2, -1, 0, 1.5, float("nan"), [], ["x"], {"a": 1}, "", "x://y", "${LMHMA_NOPE}"):
        try:
            load(tmp_path, {key: value})
        except ConfigError as exc:
            assert "\n" not in str(exc) and key in str(exc), (key, value, str(exc))


# -- files, YAML, paths ----------------------------------------------------------------------

def test_a_directory_as_the_config_file_is_said_to_be_one(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"is a directory \(named by kv_connector_extra_config"):
        load_config({"lmcache_config_file": str(tmp_path)})
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="does not exist \\(named by the environment variable LMCACHE_CONFIG_FILE"):
        load_config({})


@pytest.mark.parametrize("text, part", [
    ("chunk_size: 256\nlocal_cpu: true\nchunk_size: 512\n", "key 'chunk_size' is given twice (lines 1 and 3)"),
    ("chunk_size: [256\n", "line 2, column 1: expected ',' or ']'"),
    ("extra_config:\n  hma_lookup_timeout_s: 1\n\thma_stats_file: x\n", "is not valid YAML: line 3"),
])
def test_yaml_problems_are_one_line_with_the_line_number(tmp_path, text, part):
    message, path = refused(tmp_path, text=text)
    assert path in message and part in message, message


def test_local_disk_expands_variables_and_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LMHMA_DISK_ROOT", str(tmp_path / "root"))
    for given, expected in [("file://${HOME}/lmc/", tmp_path / "home" / "lmc"),
                            ("~/lmc", tmp_path / "home" / "lmc"),
                            ("${LMHMA_DISK_ROOT}/x", tmp_path / "root" / "x"),
                            ("file://rel/dir/", tmp_path / "rel" / "dir")]:
        c, _ = load(tmp_path, dict(local_disk=given, max_local_disk_size=0.1))
        assert c.lmcache.local_disk == f"{expected}/", given
    assert not any("$" in name or "~" in name for name in os.listdir(tmp_path))  # nothing made literally
    with pytest.raises(ConfigError, match="'~nosuchuser' is not a user's home directory"):
        load(tmp_path, dict(local_disk="~nosuchuser/x", max_local_disk_size=0.1))


def test_the_disk_directory_that_cannot_be_created_is_a_config_error(tmp_path):
    """At worker start (``ensure_private_dir``), not a raw ``NotADirectoryError``."""
    from lmcache_hma.config.private_dir import WORLD_WRITABLE, ensure_private_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"local_disk directory '.*/f/d' cannot be created: '.*/f' is not a "
                                          r"directory; fix it"):
        ensure_private_dir(str(tmp_path / "f" / "d"), "local_disk directory", WORLD_WRITABLE, "fix it")


# -- warnings ----------------------------------------------------------------------------------

def test_refused_keys_at_their_defaults_and_ignored_keys_warn_by_name(tmp_path, logged):
    c, path = load(tmp_path, dict(chunk_size=256, save_unfull_chunk=False, save_decode_cache=False,
                                  blocking_timeout_secs=10, use_gds=True, internal_api_server_enabled=True,
                                  py_enable_gc=True, reserve_local_cpu_size=2))
    lines = warnings_of(logged)
    assert all("\n" not in line and path in line for line in lines)
    for key in ("save_unfull_chunk", "save_decode_cache", "blocking_timeout_secs", "use_gds"):
        assert sum(f": {key} (" in line and "is not read by lmcache_hma" in line for line in lines) == 1, key
    for key in ("internal_api_server_enabled", "py_enable_gc", "reserve_local_cpu_size"):
        assert sum(f": {key} has no effect with lmcache_hma" in line for line in lines) == 1, key
    assert c.chunk_size == 256


def test_an_at_sign_in_a_query_password_is_a_password_not_a_second_host(tmp_path):
    """``?password=p@ss`` is credentials in the query (it was refused as a second '@' before the host)."""
    ok = write_yaml(tmp_path / "ok.yaml", chunk_size=256, local_cpu=False, max_local_cpu_size=0.1,
                    remote_url="redis://127.0.0.1:6379?password=p@ss", remote_serde="naive")
    load_config({"lmcache_config_file": str(ok)})
