"""A sweep of configurations a newcomer plausibly writes (issue 61, items 3 and 5; issue 58,
item 8): each is refused with one line naming the key and the fix, or accepted with one warning
that says what it does, or accepted silently, and silently only when it is fully valid.

Each case is the YAML text as written (``{tmp}``: the test's directory); the connector's own
loader (``load_config``) reads it as an engine would.
"""

from __future__ import annotations

import logging
import os

import pytest

from lmcache_hma.config.settings import ConfigError, load_config
from tests.test_config_keys import logged  # noqa: F401 (the lmcache_hma logger's records: a fixture)

CPU = "local_cpu: true\nmax_local_cpu_size: 1\n"  # a tier named, so no line about LMCache's defaults
REDIS = "remote_url: redis://127.0.0.1:6379\n"

# (id, YAML text, "refused" / "warned" / "ok", the key the line names, a part of the line)
SWEEP = [
    # what LMCache's defaults give
    ("empty file", "", "warned", "tier", "names no tier: a 5 GiB CPU tier per vLLM worker"),
    ("comments only", "# LMCache config\n", "warned", "tier", "names no tier: a 5 GiB CPU tier per vLLM worker"),
    ("chunk_size only", "chunk_size: 256\n", "warned", "max_local_cpu_size", "5 GiB CPU tier per vLLM worker"),
    # chunk_size
    ("chunk_size 200", "chunk_size: 200\n" + CPU, "warned", "chunk_size",
     "not a multiple of 16, vLLM's default block size"),
    ("chunk_size 1e9", "chunk_size: 1000000000\n" + CPU, "refused", "chunk_size", "more than 65536 tokens"),
    ("chunk_size quoted", "chunk_size: \"256\"\n" + CPU, "refused", "chunk_size", "positive integer"),
    ("chunk_size negative", "chunk_size: -256\n" + CPU, "refused", "chunk_size", "positive integer"),
    ("chunk_size empty", "chunk_size:\n" + CPU, "refused", "chunk_size", "remove the line for LMCache's default"),
    ("chunk_size 256k", "chunk_size: 256k\n" + CPU, "refused", "chunk_size", "positive integer"),
    # sizes
    ("cpu size 5GB", "local_cpu: true\nmax_local_cpu_size: 5GB\n", "refused", "max_local_cpu_size", "number of GB"),
    ("cpu size '5 GB'", "local_cpu: true\nmax_local_cpu_size: 5 GB\n", "refused", "max_local_cpu_size",
     "number of GB"),
    ("cpu size negative", "local_cpu: true\nmax_local_cpu_size: -1\n", "refused", "max_local_cpu_size", "> 0"),
    ("cpu size 0", "local_cpu: true\nmax_local_cpu_size: 0\n", "refused", "max_local_cpu_size", "> 0"),
    ("disk size 10G", CPU + "local_disk: {tmp}/d/\nmax_local_disk_size: 10G\n", "refused", "max_local_disk_size",
     "number of GB"),
    ("disk size negative", CPU + "local_disk: {tmp}/d/\nmax_local_disk_size: -5\n", "refused",
     "max_local_disk_size", ">= 0"),
    ("disk without size", CPU + "local_disk: {tmp}/d/\n", "refused", "max_local_disk_size", "is 0"),
    ("disk size without disk", CPU + "max_local_disk_size: 5\n", "refused", "max_local_disk_size",
     "local_disk is not"),
    # booleans
    ("local_cpu 'True' quoted", "local_cpu: \"True\"\nmax_local_cpu_size: 1\n", "refused", "local_cpu",
     "true or false"),
    ("local_cpu 1", "local_cpu: 1\nmax_local_cpu_size: 1\n", "refused", "local_cpu", "true or false"),
    ("local_cpu yes (YAML boolean)", "local_cpu: yes\nmax_local_cpu_size: 1\n", "ok", "", ""),
    # tiers
    ("both tiers off", "local_cpu: false\nmax_local_cpu_size: 1\n", "refused", "local_cpu", "no tier to store into"),
    ("cpu off, remote null", "local_cpu: false\nremote_url: null\n", "refused", "local_cpu", "no tier"),
    ("unknown tier local_ssd", CPU + "local_ssd: /mnt/ssd\n", "refused", "local_ssd", "unknown LMCache config key"),
    ("unknown tier redis_url", CPU + "redis_url: redis://127.0.0.1:6379\n", "refused", "redis_url",
     "did you mean 'remote_url'"),
    ("typo max_local_cpu_sise", "max_local_cpu_sise: 2\n", "refused", "max_local_cpu_sise",
     "did you mean 'max_local_cpu_size'"),
    ("typo chunksize", "chunksize: 256\n" + CPU, "refused", "chunksize", "did you mean 'chunk_size'"),
    ("capitalised key", "Chunk_Size: 256\n" + CPU, "refused", "Chunk_Size", "did you mean 'chunk_size'"),
    # the disk tier's directory
    ("relative local_disk", CPU + "local_disk: lmcache_disk/\nmax_local_disk_size: 1\n", "warned", "local_disk",
     "is a relative path: resolved against this process's working directory to {tmp}/lmcache_disk/"),
    ("relative file:// local_disk", CPU + "local_disk: file://./cache\nmax_local_disk_size: 1\n", "warned",
     "local_disk", "to {tmp}/cache/"),
    ("absolute local_disk", CPU + "local_disk: file://{tmp}/disk/\nmax_local_disk_size: 1\n", "ok", "", ""),
    # Redis
    ("password with @", CPU + "remote_url: \"redis://:p@ss@127.0.0.1:6379\"\n", "refused", "remote_url",
     "'@' unescaped, which a URL reads as the end of the credentials; percent-encode it as %40"),
    ("password with @ and #", CPU + "remote_url: \"redis://:p@ss#word@127.0.0.1:6399\"\n", "refused",
     "remote_url", "percent-encode them as %40 and %23"),
    ("password with #", CPU + "remote_url: \"redis://:pass#word@127.0.0.1:6399\"\n", "refused", "remote_url",
     "'#' unescaped"),
    ("password escaped", CPU + "remote_url: \"redis://:p%40ss%23word@127.0.0.1:6399\"\n", "ok", "", ""),
    ("url without scheme", CPU + "remote_url: 127.0.0.1:6379\n", "refused", "remote_url", "must start with"),
    ("lm:// url", CPU + "remote_url: lm://127.0.0.1:65432\n", "refused", "remote_url", "Redis only"),
    ("serde cachegen, no remote", CPU + "remote_serde: cachegen\n", "refused", "remote_serde",
     "without remote_url it has nothing to do"),
    ("serde cachegen with remote", CPU + REDIS + "remote_serde: cachegen\n", "refused", "remote_serde", "use naive"),
    ("redis tier", "local_cpu: false\nmax_local_cpu_size: 0.5\n" + REDIS + "remote_serde: naive\n", "ok", "", ""),
    # other honoured keys
    ("hash null", CPU + "pre_caching_hash_algorithm: null\n", "refused", "pre_caching_hash_algorithm",
     "remove the line for LMCache's default ('builtin')"),
    ("hash xxhash", CPU + "pre_caching_hash_algorithm: xxhash\n", "refused", "pre_caching_hash_algorithm",
     "sha256_cbor"),
    ("cache_policy LFU", CPU + "cache_policy: LFU\n", "refused", "cache_policy",
     "does nothing under hma_eviction: value (the default"),
    ("cache_policy LRU", CPU + "cache_policy: LRU\n", "warned", "cache_policy",
     "is not read under hma_eviction: value"),
    ("cache_policy LFU with lru eviction", CPU + "cache_policy: LFU\nextra_config:\n  hma_eviction: lru\n", "ok",
     "", ""),
    ("cache_policy null", CPU + "cache_policy: null\n", "refused", "cache_policy", "give it a value"),
    # LMCache's keys lmcache_hma does not read
    ("save_unfull_chunk", CPU + "save_unfull_chunk: true\n", "refused", "save_unfull_chunk", "hma_store_answers"),
    ("use_layerwise off", CPU + "use_layerwise: false\n", "warned", "use_layerwise", "is not read by lmcache_hma"),
    ("enable_p2p null", CPU + "enable_p2p: null\n", "warned", "enable_p2p", "is not read by lmcache_hma"),
    ("py_enable_gc", CPU + "py_enable_gc: false\n", "warned", "py_enable_gc", "has no effect"),
    # lmcache_hma's keys
    ("hma key at the top", CPU + "hma_eviction: lru\n", "refused", "hma_eviction", "put it under extra_config"),
    ("hma_eviction LRU", CPU + "extra_config:\n  hma_eviction: LRU\n", "refused", "hma_eviction",
     "must be one of value, lru"),
    ("timeout '5s'", CPU + "extra_config:\n  hma_lookup_timeout_s: 5s\n", "refused", "hma_lookup_timeout_s",
     "must be float"),
    ("interval 300", CPU + "extra_config:\n  hma_checkpoint_interval: 300\n", "refused", "hma_checkpoint_interval",
     "multiple of chunk_size 256"),
    ("typo hma_store_answer", CPU + "extra_config:\n  hma_store_answer: true\n", "refused", "hma_store_answer",
     "did you mean 'hma_store_answers'"),
    # the shipped shape, fully valid
    ("cpu tier", "chunk_size: 256\n" + CPU, "ok", "", ""),
]


def test_the_sweep_covers_what_the_issue_lists():
    assert len(SWEEP) >= 45 and len({s[0] for s in SWEEP}) == len(SWEEP)


@pytest.mark.parametrize("text, verdict, key, part", [s[1:] for s in SWEEP], ids=[s[0] for s in SWEEP])
def test_each_config_is_refused_warned_about_or_fully_valid(tmp_path, monkeypatch, logged, text, verdict, key, part):
    for name in [n for n in os.environ if n.startswith("LMCACHE_") and not n.startswith("LMCACHE_HMA_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("{tmp}", str(tmp_path)))
    part = part.replace("{tmp}", str(tmp_path))
    if verdict == "refused":
        with pytest.raises(ConfigError) as err:
            load_config({"lmcache_config_file": str(path)})
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{path}: "), message
        assert key in message and part in message, message
        return
    load_config({"lmcache_config_file": str(path)})
    lines = [r.getMessage() for r in logged.records if r.levelno >= logging.WARNING]
    if verdict == "ok":
        assert lines == [], lines
        return
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert str(path) in lines[0] and key in lines[0] and part in lines[0], lines[0]
