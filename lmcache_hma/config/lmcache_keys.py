"""Every key of LMCache's YAML, and what lmcache_hma does with it: honoured, refused or ignored.

lmcache_hma opens LMCache's ``StorageManager`` (its CPU, disk and remote tiers and its
allocator) and nothing else of LMCache: not its cache engine, its vLLM connector, its lookup
client, its controller, its internal API server. So most of LMCache's 119 keys (names and
their aliases, ``lmcache_schema.config_keys()``) mean nothing here, and a few that would be
read by LMCache would make a backend the adapter has no tier for. Each key is one of:

* ``HONOURED``: read, with the meaning given (``settings`` checks its value strictly);
* ``REFUSED``: a setting lmcache_hma does not honour and whose value would change what the
  user gets. Set to LMCache's default, or off (``false``, ``null``, an empty list), it passes
  with one warning line; any other value stops the engine with one line naming the key and
  what to use instead;
* ``IGNORED``: harmless here (a side service lmcache_hma does not start, a tuning knob of
  code it does not run): one warning line naming it.

Only HONOURED keys reach LMCache's config (``settings._lmcache_config``): the others cannot
change anything, whatever LMCache would do with them. The table is checked against LMCache's
own list (``tests/test_config_keys.py``) and rendered into docs/configuration.md
(``python -m lmcache_hma.config.lmcache_keys --write``).
"""

from __future__ import annotations

import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from lmcache_hma.config.adapter_keys import ADAPTER_KEYS, ADAPTER_LIMITS
from lmcache_hma.config.errors import ConfigError
from lmcache_hma.config.lmcache_schema import config_definitions

HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"


@dataclass(frozen=True)
class Key:
    verdict: str
    text: str  # HONOURED: its meaning here; REFUSED: what to use instead; IGNORED: why it does nothing


def _h(text: str) -> Key:
    return Key(HONOURED, text)


def _r(text: str) -> Key:
    return Key(REFUSED, text)


def _i(text: str) -> Key:
    return Key(IGNORED, text)


_DECODE = ("whether what a request decodes is stored is extra_config.hma_store_answers (unset: stored, "
           "except on gated-delta-net models)")
_UNFULL = ("a request's last partial chunk (its turn end) is stored with its answer: set "
           "extra_config.hma_store_answers")
_BLEND = "CacheBlend (enable_blending) is not supported"
_TIERS = ("every object goes to every configured tier and reads try them in order (CPU, disk, Redis); "
          "choose the tiers with local_cpu, local_disk and remote_url")
_P2P = "peer-to-peer KV sharing is not supported: share KV through a Redis remote_url"
_CONTROLLER = ("LMCache's controller is not supported (lmcache_hma starts no LMCache worker); for KV "
               "cache events use vLLM's --kv-events-config")
_PD = ("LMCache's PD backend (KV sent from instance to instance) is not used: for disaggregated prefill set "
       "vLLM's kv_role (kv_producer, kv_consumer) and share a tier (remote_url)")
_NIXL = "NIXL transfer and storage are not supported"
_GDS = "GPU Direct Storage is not supported: use local_disk"
_MARU = "the Maru CXL memory tier is not supported"
_PLUGINS = "LMCache's runtime plugins are not started by lmcache_hma"
_STORAGE_PLUGINS = "storage plugins are not supported: the tiers are local_cpu, local_disk and a Redis remote_url"
_REMOTE_CONFIG = "LMCache's remote configuration service is not consulted: lmcache_hma reads this file only"
_HIDDEN = "hidden-state caching (vLLM-Omni) is not supported"
_API = ("LMCache's internal API server is not started by lmcache_hma (its metrics are in vLLM's "
        "/metrics: docs/metrics.md)")
_MP = "LMCache's multiprocess server (for SGLang) is not used by lmcache_hma"
_LAZY = "LMCache 0.5.6 allocates max_local_cpu_size in full anyway (its lazy allocator is disabled)"
_STATS = "chunk statistics are kept by LMCache's cache engine, which lmcache_hma does not start"
_PIN = "LMCache's pin monitor is not started: lmcache_hma pins no memory object"

# Every key of LMCache 0.5.6's YAML (names, then aliases): tests/test_config_keys.py checks
# that this is exactly lmcache_schema.config_keys().
LMCACHE_KEYS: dict[str, Key] = {
    # the tiers and the objects: what lmcache_hma is made of
    "chunk_size": _h("tokens per chunk (one stored object per chunk and kind); a positive integer up to "
                     "65536, a multiple of every KV cache group's block size (checked when the engine starts; "
                     "one that is not a multiple of 16, vLLM's default block size, is warned about at load)"),
    "local_cpu": _h("true: CPU memory is a tier (objects are kept there); false: only a staging buffer "
                    "(then local_disk or remote_url must be set)"),
    "max_local_cpu_size": _h("GB of CPU memory, > 0: the tier, or with local_cpu false the staging buffer "
                             "every object passes through; up to half of it holds hits between lookup and load"),
    "local_cpu_use_hugepages": _h("true: LMCache's allocator backs that CPU memory with huge pages"),
    "local_disk": _h("the disk tier's directory: file:///path/ or /path/, ${VAR} and ~ expanded, one "
                     "directory (no comma list); a relative path is resolved against the working directory, "
                     "with a warning; created with mode 0700, refused when another user owns it or every user "
                     "can write it"),
    "max_local_disk_size": _h("GB of the disk tier; > 0 when local_disk is set"),
    "remote_url": _h("the Redis tier: redis://, rediss://, unix:// or redis-cluster://, with credentials "
                     "and ${VAR} placeholders (docs/redis.md); host and port are checked at start"),
    "remote_serde": _h("naive (LMCache's default), the only serde accepted (with a remote tier or without): "
                       "objects are stored byte-exact and checked on load"),
    "pre_caching_hash_algorithm": _h("builtin (LMCache's default), sha256_cbor or sha256: chunk keys are "
                                     "SHA-256 over canonical CBOR either way (never Python's hash)"),
    "cache_policy": _h("with extra_config.hma_eviction: lru, the eviction order of the CPU and disk tiers: LRU "
                       "(LMCache's default), LFU, FIFO or MRU; under hma_eviction: value (the default) the value "
                       "policy replaces it: LRU is warned about, any other policy refused"),
    "numa_mode": _h("null (LMCache's default), auto or manual (with extra_config.gpu_to_numa_mapping): "
                    "LMCache's allocator binds the CPU memory to the GPU's NUMA node"),
    "extra_config": _h("lmcache_hma's hma_* keys (table below); any other key is handed to LMCache as is, "
                       "except enable_nixl_storage and audit_backend_enabled (refused) and LMCache's "
                       "top-level keys (they belong at the top of the YAML)"),
    # read by LMCache for a feature lmcache_hma does not offer, or said another way here
    "save_decode_cache": _r(_DECODE),
    "save_unfull_chunk": _r(_UNFULL),
    "use_layerwise": _r("layer-by-layer transfer is not supported: each chunk is loaded and stored for "
                        "all layers at once"),
    "enable_async_loading": _r("lmcache_hma always loads hits asynchronously (its own loads), so this "
                               "setting of LMCache's loader does not apply"),
    "lookup_timeout_ms": _r("use extra_config.hma_lookup_timeout_s (seconds; 5 by default)"),
    "blocking_timeout_secs": _r("use extra_config.hma_remote_timeout_s (the deadline of each Redis call)"),
    "external_lookup_client": _r("lmcache_hma answers lookups itself (extra_config.hma_lookup_timeout_s "
                                 "bounds the wait)"),
    "min_retrieve_tokens": _r("every hit is loaded; a minimum hit length is not supported"),
    "hit_miss_ratio": _r("LMCache's hit-limiting lookup client is not supported"),
    "priority_limit": _r("storing by request priority is not supported; a request can ask not to be "
                         "stored with lmcache.skip_save in its kv_transfer_params"),
    "retrieve_locations": _r(_TIERS),
    "store_location": _r(_TIERS),
    "local_disk_path_sharding": _r("lmcache_hma takes one local_disk directory, so there is nothing to "
                                   "shard (by_gpu, LMCache's default and only strategy, is accepted)"),
    "enable_kv_events": _r("use vLLM's --kv-events-config: lmcache_hma announces its tiers' events there"),
    "enable_blending": _r(_BLEND),
    "blend_recompute_ratios": _r(_BLEND),
    "blend_thresholds": _r(_BLEND),
    "blend_check_layers": _r(_BLEND),
    "blend_min_tokens": _r(_BLEND),
    "blend_special_str": _r(_BLEND),
    "enable_p2p": _r(_P2P),
    "p2p_host": _r(_P2P),
    "p2p_init_ports": _r(_P2P),
    "p2p_lookup_ports": _r(_P2P),
    "transfer_channel": _r(_P2P),
    "enable_controller": _r(_CONTROLLER),
    "controller_pull_url": _r(_CONTROLLER),
    "controller_reply_url": _r(_CONTROLLER),
    "lmcache_worker_ports": _r(_CONTROLLER),
    "lmcache_worker_ids": _r(_CONTROLLER),
    "lmcache_worker_heartbeat_delay_time": _r(_CONTROLLER),
    "lmcache_worker_heartbeat_time": _r(_CONTROLLER),
    "enable_pd": _r(_PD),
    "pd_role": _r(_PD),
    "pd_buffer_size": _r(_PD),
    "pd_buffer_device": _r(_PD),
    "pd_peer_host": _r(_PD),
    "pd_peer_init_port": _r(_PD),
    "pd_peer_alloc_port": _r(_PD),
    "pd_peer_query_port": _r(_PD),
    "pd_proxy_host": _r(_PD),
    "pd_proxy_port": _r(_PD),
    "pd_allocation_timeout_sec": _r(_PD),
    "pd_shutdown_timeout_sec": _r(_PD),
    "pd_condition_poll_interval_sec": _r(_PD),
    "pd_max_prefill_len": _r(_PD),
    "pd_backend_mode": _r(_PD),
    "pd_skip_proxy_notification": _r(_PD),
    "pd_bidirectional": _r(_PD),
    "nixl_backends": _r(_NIXL),
    "nixl_buffer_size": _r(_NIXL),
    "nixl_buffer_device": _r(_NIXL),
    "gds_path": _r(_GDS),
    "gds_path_sharding": _r(_GDS),
    "gds_buffer_size": _r(_GDS),
    "use_gds": _r(_GDS),
    "gds_backend": _r(_GDS),
    "maru_path": _r(_MARU),
    "maru_pool_size": _r(_MARU),
    "runtime_plugin_locations": _r(_PLUGINS),
    "storage_plugins": _r(_STORAGE_PLUGINS),
    "remote_storage_plugins": _r("use remote_url (Redis)"),
    "remote_config_url": _r(_REMOTE_CONFIG),
    "app_id": _r(_REMOTE_CONFIG),
    "enable_hidden_state_cache": _r(_HIDDEN),
    "max_hidden_state_cpu_size": _r(_HIDDEN),
    "hidden_state_layers": _r(_HIDDEN),
    "hidden_states_retrieve_mode": _r(_HIDDEN),
    # harmless: one warning line each
    "reserve_local_cpu_size": _i("LMCache 0.5.6 applies it only to MLA models with "
                                 "extra_config.save_only_first_rank; the CPU memory is max_local_cpu_size"),
    "lmcache_instance_id": _i("it only names an LMCache engine to its controller, which is not used"),
    "py_enable_gc": _i("read by LMCache's cache engine, which lmcache_hma does not start"),
    "use_gpu_connector_v3": _i("lmcache_hma copies KV with its own code, not LMCache's GPU connectors"),
    "lookup_server_worker_ids": _i("lookups are answered by lmcache_hma's first worker"),
    "enable_scheduler_bypass_lookup": _i("the scheduler asks lmcache_hma's first worker"),
    "audit_actual_remote_url": _i("LMCache's audit connector is not used (remote_url is Redis)"),
    "mp_host": _i(_MP),
    "mp_port": _i(_MP),
    "internal_api_server_enabled": _i(_API),
    "internal_api_server_host": _i(_API),
    "internal_api_server_port_start": _i(_API),
    "internal_api_server_include_index_list": _i(_API),
    "internal_api_server_socket_path_prefix": _i(_API),
    "script_allowed_imports": _i(_API),
    "run_script_api_enabled": _i(_API),
    "enable_lazy_memory_allocator": _i(_LAZY),
    "lazy_memory_initial_ratio": _i(_LAZY),
    "lazy_memory_expand_trigger_ratio": _i(_LAZY),
    "lazy_memory_step_ratio": _i(_LAZY),
    "lazy_memory_safe_size": _i(_LAZY),
    "enable_chunk_statistics": _i(_STATS),
    "chunk_statistics_auto_start_statistics": _i(_STATS),
    "chunk_statistics_auto_exit_timeout_hours": _i(_STATS),
    "chunk_statistics_auto_exit_target_unique_chunks": _i(_STATS),
    "chunk_statistics_strategy": _i(_STATS),
    "pin_timeout_sec": _i(_PIN),
    "pin_check_interval_sec": _i(_PIN),
    # LMCache's aliases (old names): as the key they stand for
    "enable_xpyd": _r("alias of enable_pd: " + _PD),
    "nixl_peer_host": _r("alias of pd_peer_host: " + _PD),
    "nixl_peer_init_port": _r("alias of pd_peer_init_port: " + _PD),
    "nixl_peer_alloc_port": _r("alias of pd_peer_alloc_port: " + _PD),
    "nixl_proxy_host": _r("alias of pd_proxy_host: " + _PD),
    "nixl_proxy_port": _r("alias of pd_proxy_port: " + _PD),
    "nixl_role": _r("alias of pd_role: " + _PD),
    "controller_url": _r("alias of controller_pull_url: " + _CONTROLLER),
    "lmcache_worker_port": _r("alias of lmcache_worker_ports: " + _CONTROLLER),
    "plugin_locations": _r("alias of runtime_plugin_locations: " + _PLUGINS),
    "external_backends": _r("alias of storage_plugins: " + _STORAGE_PLUGINS),
}

HONOURED_KEYS = frozenset(k for k, v in LMCACHE_KEYS.items() if v.verdict == HONOURED)

# extra_config keys LMCache reads that would give it a backend lmcache_hma has no tier for
EXTRA_CONFIG_REFUSED = {
    "enable_nixl_storage": _NIXL,
    "audit_backend_enabled": "LMCache's audit backend is not supported (it wraps the tiers lmcache_hma reads directly)",
}
# LMCache's top-level names that are also extra_config keys of its own (not misplaced there)
EXTRA_CONFIG_SHARED_NAMES = frozenset({"audit_actual_remote_url"})


def definition(key: str) -> tuple[Any, Any]:
    """LMCache's (type, default) of ``key`` (an alias: of the key it stands for)."""
    defs, aliases = config_definitions()
    return defs[key] if key in defs else defs[aliases[key]]


def check_keys(raw: dict, src: Callable[[str], str]) -> list[str]:
    """Check the type of every LMCache key in ``raw`` (``src(key)``: where its value came from) and
    apply its verdict: raise ``ConfigError`` for a REFUSED key set to something that is not
    LMCache's default or off, and for a HONOURED key that may not be null set to null; return the
    warning lines (one per REFUSED key left at its default or off, one per IGNORED key). Unknown
    keys are the caller's (``settings``)."""
    warnings = []
    for key, value in raw.items():
        rule = LMCACHE_KEYS.get(key)
        if rule is None:
            continue
        where = src(key)
        typ, default = definition(key)
        if value is None:
            if rule.verdict == HONOURED and typing.get_origin(typ) is not typing.Union:
                raise ConfigError(f"{where}: {key} is null (an empty '{key}:' line?): give it a value, or remove "
                                  f"the line for LMCache's default ({shown(default)})")
            if rule.verdict == HONOURED:
                continue  # unset
        problem = type_problem(typ, value) if value is not None else None  # null: off
        if problem:
            raise ConfigError(f"{where}: {key} must be {problem}, got {shown(value)}")
        if rule.verdict == REFUSED:
            if not _off(value, default):
                raise ConfigError(f"{where}: {key}: {shown(value)} is not supported by lmcache_hma: {rule.text}; "
                                  f"remove it")
            warnings.append(f"{where}: {key} ({shown(value)}, LMCache's default or off) is not read by "
                            f"lmcache_hma: {rule.text}; remove it")
        elif rule.verdict == IGNORED:
            warnings.append(f"{where}: {key} has no effect with lmcache_hma: {rule.text}; remove it")
    return warnings


def shown(value: Any) -> str:
    """A YAML value as the YAML file has it (true, not True), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _off(value: Any, default: Any) -> bool:
    """Whether a REFUSED key's value leaves its feature off: LMCache's default, false, an empty list."""
    if value is None or value is False or value == []:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def type_problem(typ: Any, value: Any) -> Optional[str]:
    """What ``value`` should be for LMCache's ``typ`` (None: it is one). Strict: a boolean is a
    YAML true/false, never "yes", "on" or 1 (LMCache reads every other value as false)."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is typing.Union:  # Optional[X]
        if value is None:
            return None
        typ = next(a for a in args if a is not type(None))
    origin = typing.get_origin(typ) or typ
    if origin is bool:
        return None if isinstance(value, bool) else "true or false (a YAML boolean, unquoted)"
    if origin is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if origin is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        return None if ok else "a number"
    if origin is str:
        return None if isinstance(value, str) else "a string (quote it)"
    if origin is list:  # LMCache also takes one value or a comma list for these
        ok = isinstance(value, (list, str, int, float)) and not isinstance(value, bool)
        return None if ok else "a list"
    if origin is dict:
        return None if isinstance(value, dict) else "a mapping of keys to values"
    return None


# -- docs/configuration.md ----------------------------------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
_MARKS = {
    "lmcache": ("<!-- generated: LMCACHE_KEYS (python -m lmcache_hma.config.lmcache_keys --write) -->",
                "<!-- end of LMCACHE_KEYS -->"),
    "adapter": ("<!-- generated: ADAPTER_KEYS (python -m lmcache_hma.config.lmcache_keys --write) -->",
                "<!-- end of ADAPTER_KEYS -->"),
}


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def lmcache_table() -> str:
    """The Markdown table of ``LMCACHE_KEYS`` (honoured first, then refused, then ignored)."""
    rows = ["| LMCache key | verdict | LMCache's default | meaning in lmcache_hma / what to use instead |",
            "| --- | --- | --- | --- |"]
    order = {HONOURED: 0, REFUSED: 1, IGNORED: 2}
    for key, rule in sorted(LMCACHE_KEYS.items(), key=lambda kv: (order[kv[1].verdict], kv[0])):
        default = definition(key)[1]
        text = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        rows.append(f"| `{key}` | {rule.verdict} | `{_cell(text)}` | {_cell(rule.text)} |")
    return "\n".join(rows)


def adapter_table() -> str:
    """The Markdown table of ``adapter_keys.ADAPTER_KEYS``."""
    rows = ["| adapter key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (typ, default, meaning) in ADAPTER_KEYS.items():
        text = "unset" if default is None or default == "" else str(default).lower() if isinstance(default, bool) \
            else default
        limit = ADAPTER_LIMITS.get(key)
        kind = {bool: "true/false", int: "integer", float: "number", str: "string"}[typ]
        if limit:
            kind += f" {limit[1]} {limit[0]}"
        rows.append(f"| `{key}` | {kind} | `{_cell(text)}` | {_cell(meaning)} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` (docs/configuration.md) with both generated tables replaced by the current ones."""
    for name, table in (("lmcache", lmcache_table()), ("adapter", adapter_table())):
        start, end = _MARKS[name]
        head, found, rest = text.partition(start)
        _, found_end, tail = rest.partition(end)
        if not (found and found_end):
            raise ValueError(f"{DOC}: the markers {start!r} and {end!r} are missing")
        text = f"{head}{start}\n{table}\n{end}{tail}"
    return text


if __name__ == "__main__":  # python -m lmcache_hma.config.lmcache_keys [--write]
    current = DOC.read_text()
    if "--write" in sys.argv[1:]:
        DOC.write_text(render(current))
    else:
        print(lmcache_table(), "\n\n", adapter_table(), sep="")
