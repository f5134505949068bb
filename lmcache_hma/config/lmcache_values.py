"""The values of LMCache's HONOURED keys, checked strictly, and what a configuration leaves to
LMCache's defaults.

Contract: ``check_values(raw, src)`` raises ``ConfigError`` (one line: where the value came from,
the key, what is wrong, the fix) or returns the warning lines of values that are accepted but do
something a reader may not expect; ``src(key)`` is where a key's value came from (the YAML's
path, or an ``LMCACHE_*`` environment variable). ``prepare_local_disk`` makes ``local_disk`` one
absolute directory. ``tier_defaults`` says what a configuration that names no tier gets;
``check_cache_policy`` refuses a ``cache_policy`` that ``hma_eviction`` replaces. The types of
the keys that are not honoured are ``lmcache_keys.check_keys``'s.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

from lmcache_hma.config.errors import ConfigError
from lmcache_hma.config.lmcache_keys import shown
from lmcache_hma.config.private_dir import WORLD_WRITABLE, dir_problem
from lmcache_hma.config.remote_url import check_remote_url, expand_env, has_scheme

Source = Callable[[str], str]  # key -> where its value came from

HASHES = {"builtin": "sha256_cbor", "sha256_cbor": "sha256_cbor", "sha256": "sha256"}
CACHE_POLICIES = ("LRU", "LFU", "FIFO", "MRU")  # LMCache 0.5.6's cache_policy.POLICY_MAPPING
_NUMA_MODES = ("auto", "manual")
# vLLM's block size unless --block-size or the model's layers set another (every KV cache group's
# block size must divide chunk_size: core.layout refuses the engine otherwise)
VLLM_BLOCK_SIZE = 16
# A chunk is stored and looked up whole (a request's last partial chunk only as its turn end): past
# this, no prompt of a real context length would fill one, and one object would be gigabytes.
MAX_CHUNK_SIZE = 65536
# the keys that name a tier: a configuration with none of them gets LMCache's default CPU tier
TIER_KEYS = ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url")
DEFAULT_CPU_GB = 5.0  # LMCache 0.5.6's max_local_cpu_size


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_values(raw: dict, src: Source) -> list[str]:
    """Check the HONOURED keys of ``raw`` (null values are unset); return the warning lines."""
    warnings = []
    v = {k: val for k, val in raw.items() if val is not None}
    for key in ("local_disk", "remote_url", "remote_serde", "pre_caching_hash_algorithm", "cache_policy",
                "numa_mode"):
        if key in v and not isinstance(v[key], str):
            raise ConfigError(f"{src(key)}: {key} must be a string (quote it), got {v[key]!r}")
    for key in ("local_cpu", "local_cpu_use_hugepages"):
        if key in v and not isinstance(v[key], bool):
            raise ConfigError(f"{src(key)}: {key} must be true or false (a YAML boolean, unquoted), "
                              f"got {shown(v[key])}")
    chunk = v.get("chunk_size")
    if chunk is not None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ConfigError(f"{src('chunk_size')}: chunk_size must be a positive integer (tokens), got {chunk!r}; "
                              f"e.g. 256 (LMCache's default)")
        if chunk > MAX_CHUNK_SIZE:
            raise ConfigError(f"{src('chunk_size')}: chunk_size {chunk} is more than {MAX_CHUNK_SIZE} tokens: KV is "
                              f"stored and looked up in whole chunks, so no prompt shorter than that would hit; "
                              f"use 256 (LMCache's default) to 4096")
        if chunk % VLLM_BLOCK_SIZE:
            fit = -(-chunk // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
            warnings.append(f"{src('chunk_size')}: chunk_size {chunk} is not a multiple of {VLLM_BLOCK_SIZE}, vLLM's "
                            f"default block size: an engine whose KV cache block size does not divide it refuses "
                            f"to start; use a multiple of {VLLM_BLOCK_SIZE} (e.g. {fit} or 256)")
    cpu = v.get("max_local_cpu_size", DEFAULT_CPU_GB)
    if not _number(cpu) or cpu <= 0:
        raise ConfigError(
            f"{src('max_local_cpu_size')}: max_local_cpu_size must be a number of GB > 0, got {cpu!r}: LMCache "
            f"allocates every object in this CPU memory (with local_cpu: false it is the staging buffer); e.g. 0.5"
        )
    disk_size = v.get("max_local_disk_size", 0.0)
    if not _number(disk_size) or disk_size < 0:
        raise ConfigError(f"{src('max_local_disk_size')}: max_local_disk_size must be a number of GB >= 0, got "
                          f"{disk_size!r}; e.g. 50")
    disk = v.get("local_disk")
    if disk and not disk_size:
        raise ConfigError(f"{src('local_disk')}: local_disk is set but max_local_disk_size is 0; give the disk "
                          f"tier a size in GB (max_local_disk_size)")
    if v.get("local_cpu", True) is False and not disk and not v.get("remote_url"):
        raise ConfigError(f"{src('local_cpu')}: local_cpu is false and neither local_disk nor remote_url is set: "
                          f"there is no tier to store into; set local_cpu: true or configure a tier")
    if "remote_url" in v:
        check_remote_url(v["remote_url"], src("remote_url"))
    serde = v.get("remote_serde")
    if serde is not None and serde != "naive":
        without = "" if v.get("remote_url") else " (and without remote_url it has nothing to do)"
        raise ConfigError(
            f"{src('remote_serde')}: remote_serde {serde!r} is not supported{without}; use naive or remove "
            f"it (objects are stored byte-exact and checked on load; a lossy serde would fail every check)"
        )
    algo = v.get("pre_caching_hash_algorithm", "builtin")
    if algo not in HASHES:
        raise ConfigError(
            f"{src('pre_caching_hash_algorithm')}: pre_caching_hash_algorithm {algo!r} is not supported; use "
            f"sha256_cbor (default) or sha256: keys must not depend on PYTHONHASHSEED or collide"
        )
    policy = v.get("cache_policy", "LRU")
    if policy.upper() not in CACHE_POLICIES:
        raise ConfigError(f"{src('cache_policy')}: cache_policy {policy!r} is not one of "
                          f"{', '.join(CACHE_POLICIES)}")
    numa = v.get("numa_mode")
    if numa is not None and numa not in _NUMA_MODES:
        raise ConfigError(f"{src('numa_mode')}: numa_mode {numa!r} must be auto or manual (or unset)")
    mapping = (raw.get("extra_config") or {}).get("gpu_to_numa_mapping")  # a mapping: checked first
    if numa == "manual" and not isinstance(mapping, dict):
        raise ConfigError(f"{src('numa_mode')}: numa_mode manual needs extra_config.gpu_to_numa_mapping "
                          f"(GPU index: NUMA node, e.g. {{0: 0, 1: 1}}); or use numa_mode: auto")
    return warnings


def check_cache_policy(raw: dict, src: Source, eviction: str, eviction_from: str) -> list[str]:
    """``cache_policy`` is what the CPU and disk tiers drop only under ``hma_eviction: lru``; under
    ``value`` (the default) the value policy replaces it: LRU (LMCache's default) is one warning,
    any other policy is refused."""
    policy = raw.get("cache_policy")
    if policy is None or eviction != "value":
        return []
    by = "the default" if eviction_from == "defaults" else f"from {eviction_from}"
    if policy.upper() == "LRU":
        return [f"{src('cache_policy')}: cache_policy {policy!r} is not read under hma_eviction: value ({by}: the "
                f"tiers drop the least value per byte); remove it, or set extra_config.hma_eviction: lru"]
    raise ConfigError(f"{src('cache_policy')}: cache_policy {policy!r} does nothing under hma_eviction: value ({by}: "
                      f"the tiers drop the least value per byte); set extra_config.hma_eviction: lru to evict "
                      f"by cache_policy, or remove cache_policy")


def prepare_local_disk(raw: dict, src: Source) -> tuple[dict, list[str]]:
    """(``raw`` with ``local_disk`` as one absolute directory, the warning lines).

    ``${VAR}`` and ``~`` are expanded (LMCache expands neither: ``file://${HOME}/x`` would be a
    directory named ``${HOME}`` in the working directory) and the directory is checked as the
    worker will create it (``private_dir``). A relative path is resolved against this process's
    working directory, with a warning saying so (each process that reads the file resolves it
    against its own)."""
    value = raw.get("local_disk")
    where = src("local_disk")
    if not value:
        if _number(raw.get("max_local_disk_size")) and raw["max_local_disk_size"] > 0:
            raise ConfigError(f"{src('max_local_disk_size')}: max_local_disk_size is set but local_disk is not; "
                              f"name the disk tier's directory (local_disk: file:///path/) or remove "
                              f"max_local_disk_size")
        return raw, []
    text = value.strip()
    if "," in text:
        raise ConfigError(f"{where}: local_disk {value!r} names several directories; lmcache_hma takes one "
                          f"(file:///path/)")
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif has_scheme(text):
        raise ConfigError(f"{where}: local_disk {value!r} must be a directory (file:///path/ or /path/), "
                          f"not a {text.split('://')[0]}:// URL")
    text = os.path.expanduser(expand_env(text, where, "local_disk"))
    if text.startswith("~"):
        raise ConfigError(f"{where}: local_disk {value!r}: {text.split('/')[0]!r} is not a user's home "
                          f"directory here")
    if not text:
        raise ConfigError(f"{where}: local_disk {value!r} names no directory; e.g. file:///var/cache/lmcache/")
    disk = os.path.abspath(text).rstrip("/") + "/"
    warnings = []
    if not os.path.isabs(text):
        warnings.append(f"{where}: local_disk {value!r} is a relative path: resolved against this process's working "
                        f"directory to {disk} (a process started elsewhere resolves it elsewhere); give the "
                        f"absolute path")
    problem = dir_problem(disk.rstrip("/") or "/", WORLD_WRITABLE)
    if problem:
        raise ConfigError(f"{where}: local_disk {disk!r} is {problem}; use a directory only this user can "
                          f"write (or a new path: the connector creates it with mode 0700)")
    return {**raw, "local_disk": disk}, warnings


def tier_defaults(raw: dict) -> Optional[str]:
    """What a configuration that names no tier (none of ``TIER_KEYS``) gets; None when it names one."""
    if any(raw.get(k) is not None for k in TIER_KEYS):
        return None
    return (f"a {DEFAULT_CPU_GB:g} GiB CPU tier per vLLM worker (LMCache's defaults: local_cpu: true, "
            f"max_local_cpu_size: {DEFAULT_CPU_GB:g}), allocated in full by each tensor-parallel rank")
