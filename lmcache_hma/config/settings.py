"""Configuration: the LMCache YAML plus this adapter's keys, validated at start.

Read once, in each process, into ``HMAConfig`` (frozen); nothing deeper reads
dicts. Where the file comes from, in order:

1. ``kv_connector_extra_config["lmcache_config_file"]``;
2. the environment variable ``LMCACHE_CONFIG_FILE``;
3. neither: LMCache's defaults (CPU tier of 5 GB), with a warning.

The YAML holds LMCache's own keys (``chunk_size``, ``local_cpu``,
``max_local_cpu_size``, ``local_disk``, ``max_local_disk_size``, ``remote_url``,
...). This adapter's keys live under ``extra_config`` in the YAML or directly in
``kv_connector_extra_config`` (which wins); see ``ADAPTER_KEYS``. ``remote_url`` is
checked and prepared by ``remote_url``.

LMCache itself only warns about unknown keys and turns unparsable values into
None; here both are errors that name the key and the file.

"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from lmcache_hma.config.errors import ConfigError
from lmcache_hma.config.remote_url import (DEFAULT_TIMEOUT_S, attach_remote_settings, check_remote_url, expand_env,
                                          prepare_remote_url)
from lmcache_hma.log import get_logger
from lmcache_hma.worker.faults import CORRUPT_KINDS, FaultPlan

logger = get_logger(__name__)

CONFIG_ENV = "LMCACHE_CONFIG_FILE"
FILE_KEY = "lmcache_config_file"

# adapter key -> (type, default, meaning)
ADAPTER_KEYS: dict[str, tuple[type, Any, str]] = {
    "hma_checkpoint_interval": (
        int, 0,
        "tokens between stored sliding-window tails; a multiple of chunk_size (0: the "
        "largest sliding window rounded up to chunk_size). The last full chunk of each "
        "prompt always gets one.",
    ),
    "hma_store_answers": (
        bool, None,
        "store the KV a request computes while decoding (its answer) as well as its prompt's, so a "
        "conversation's next turn hits the answer too; false: prompt chunks only (e.g. for "
        "sampling-heavy traffic whose answers are never sent back). Unset: true, but false for "
        "models with recurrent-state (gated delta net) layers, whose states computed while decoding "
        "are not bit-equal to a prefill's (a later turn can then differ from recomputing, as with "
        "vLLM's own prefix cache); true turns it on for them too",
    ),
    "hma_share_parallel_shapes": (
        bool, False,
        "store KV and recurrent states in a format with no tensor-parallel size, rank or block size in "
        "it (one object per KV head, per state shard), so instances of different TP sizes and block "
        "sizes share one store; KV computed at another TP size may differ in its last bits "
        "(docs/tp_sharing.md); not with pipeline parallelism",
    ),
    "hma_consumer_stores_answers": (
        bool, False,
        "disaggregated prefill: a kv_consumer (decode instance) stores the KV of its answers (the "
        "chunks past the prompt and the turn end) for a conversation's next turn, whichever instance "
        "prefills it; off, a kv_consumer writes nothing (its prompts' KV came from the producer)",
    ),
    "hma_verify_checksums": (bool, True, "check each loaded object's CRC32"),
    "hma_lookup_timeout_s": (float, 5.0, "scheduler waits this long for a lookup answer, then treats it as a miss"),
    "hma_stats_file": (str, "", "worker writes its byte counters here as JSON (for tests and benchmarks)"),
    "hma_remote_timeout_s": (
        float, DEFAULT_TIMEOUT_S,
        "Redis remote tier: deadline of each whole call (connect, handshake, every send and "
        "receive; reads and writes get their bytes' time at 64 MiB/s on top), and of the health "
        "check that bypasses an unreachable Redis until it answers again",
    ),
    "hma_shared_secret": (
        str, "",
        "a secret shared by every deployment trusted to write the shared tiers (at least 16 "
        "characters; ${ENV_VAR} is expanded): keys and object trailers are HMACs under it, so "
        "objects written without it are never loaded and keys reveal nothing about prompts",
    ),
    "hma_store_queue_objects": (
        int, 256,
        "stores are sealed and put on a background thread; at most this many wait, past it a "
        "store is dropped (a future miss, counted) instead of blocking the engine",
    ),
    "hma_test_corrupt_loads": (
        str, "",
        "TEST ONLY: overwrite loaded KV with noise after the checks, to prove tests can fail: a "
        "comma list applied to successive loads, each 'all', 'full_attention', 'sliding_window' or "
        "'recurrent_state'",
    ),
    "hma_test_fail_loads": (int, 0, "TEST ONLY: fail this many asynchronous loads after the hit was promised"),
    "hma_test_fail_sync_loads": (
        int, 0, "TEST ONLY: fail this many attempts of synchronous loads (each load retries once)",
    ),
    "hma_test_lookup_delay_s": (float, 0.0, "TEST ONLY: send every lookup answer this many seconds after it was found"),
}

_SIZE_KEYS = ("max_local_cpu_size", "max_local_disk_size", "reserve_local_cpu_size")
_HASHES = {"builtin": "sha256_cbor", "sha256_cbor": "sha256_cbor", "sha256": "sha256"}


@dataclass(frozen=True)
class HMAConfig:
    lmcache: Any  # LMCacheEngineConfig
    source: str  # file path, or "defaults"
    checkpoint_interval: int  # tokens, a multiple of chunk_size; 0: auto (see layout)
    verify_checksums: bool
    lookup_timeout_s: float
    stats_file: str
    faults: Optional[FaultPlan]  # TEST ONLY (hma_test_* keys): faults injected by the worker
    store_queue_objects: int = 256
    shared_secret: Optional[bytes] = field(default=None, repr=False)
    # hma_store_answers: chunks of the output get keys and are stored; None: unset (``answers_for``)
    store_answers: Optional[bool] = None
    share_parallel_shapes: bool = False  # hma_share_parallel_shapes: the parallelism-free object format
    consumer_stores_answers: bool = False  # hma_consumer_stores_answers (config.transfer_role)

    def answers_for(self, has_state: bool) -> bool:
        """Whether answers are stored for a model (``has_state``: with recurrent-state layers)."""
        return self.store_answers if self.store_answers is not None else not has_state

    @property
    def chunk_size(self) -> int:
        return self.lmcache.chunk_size


def load_config(extra_config: Optional[dict] = None) -> HMAConfig:
    """Read and validate the configuration for one engine."""
    extra = dict(extra_config or {})
    path = extra.pop(FILE_KEY, None) or os.environ.get(CONFIG_ENV)
    raw = _read_yaml(path) if path else {}
    _check_lmcache_keys(raw, path)
    yaml_extra = raw.get("extra_config") or {}
    if not isinstance(yaml_extra, dict):
        raise ConfigError(f"{path}: extra_config must be a mapping")
    adapter = {k: v for k, v in yaml_extra.items() if k.startswith("hma_")}
    lm_extra = {k: v for k, v in yaml_extra.items() if not k.startswith("hma_")}
    for k, v in extra.items():
        if not k.startswith("hma_"):
            raise ConfigError(
                f"kv_connector_extra_config: unknown key {k!r}; expected {FILE_KEY!r} or "
                f"one of {sorted(ADAPTER_KEYS)}"
            )
        adapter[k] = v
    values = _adapter_values(adapter, path or "kv_connector_extra_config")
    if values["hma_remote_timeout_s"] <= 0:
        raise ConfigError(f"{path}: hma_remote_timeout_s must be > 0 seconds, got {values['hma_remote_timeout_s']}")
    raw, auth = prepare_remote_url(raw, path, values["hma_remote_timeout_s"])

    lm = _lmcache_config({**raw, "extra_config": lm_extra or None}, path)
    attach_remote_settings(lm, auth, values["hma_remote_timeout_s"])
    interval = values["hma_checkpoint_interval"]
    if interval % lm.chunk_size:
        raise ConfigError(
            f"hma_checkpoint_interval {interval} must be a positive multiple of "
            f"chunk_size {lm.chunk_size}"
        )
    return HMAConfig(
        lmcache=lm,
        source=path or "defaults",
        checkpoint_interval=interval,
        verify_checksums=values["hma_verify_checksums"],
        lookup_timeout_s=values["hma_lookup_timeout_s"],
        stats_file=values["hma_stats_file"],
        faults=_fault_plan(values, path),
        store_queue_objects=max(1, values["hma_store_queue_objects"]),
        shared_secret=_shared_secret(values["hma_shared_secret"], path),
        store_answers=values["hma_store_answers"],
        share_parallel_shapes=values["hma_share_parallel_shapes"],
        consumer_stores_answers=values["hma_consumer_stores_answers"],
    )


_MIN_SECRET_CHARS = 16


def _fault_plan(values: dict, path: Optional[str]) -> Optional[FaultPlan]:
    """The TEST ONLY ``hma_test_*`` keys as a ``FaultPlan`` (None when none is set)."""
    kinds = tuple(k.strip() for k in values["hma_test_corrupt_loads"].split(",") if k.strip())
    bad = [k for k in kinds if k not in CORRUPT_KINDS]
    if bad:
        raise ConfigError(f"{path}: hma_test_corrupt_loads {bad[0]!r} must be one of {', '.join(CORRUPT_KINDS)}")
    plan = FaultPlan(fail_loads=values["hma_test_fail_loads"], fail_sync_loads=values["hma_test_fail_sync_loads"],
                     corrupt_loads=kinds, lookup_delay_s=values["hma_test_lookup_delay_s"])
    if not plan:
        return None
    logger.warning("LMCacheHMA: TEST ONLY fault injection: %s", plan)
    return plan


def _shared_secret(value: str, path: Optional[str]) -> Optional[bytes]:
    """``hma_shared_secret`` with ``${ENV}`` expanded; None when unset."""
    if not value:
        return None
    secret = expand_env(value, path, "hma_shared_secret")
    if len(secret) < _MIN_SECRET_CHARS:
        raise ConfigError(f"{path}: hma_shared_secret must be at least {_MIN_SECRET_CHARS} characters "
                          f"(got {len(secret)}); e.g. `openssl rand -hex 32`")
    return secret.encode()


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"LMCache config file {path!r} does not exist (set {CONFIG_ENV} or {FILE_KEY})")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read LMCache config file {path!r}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"LMCache config file {path!r} is not valid YAML: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"LMCache config file {path!r} must be a mapping of keys to values")
    return raw


def _check_lmcache_keys(raw: dict, path: Optional[str]) -> None:
    from lmcache_hma.store.lmcache_compat import config_keys

    known = config_keys()
    for key, value in raw.items():
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{path}: unknown LMCache config key {key!r}{hint}")
        if key == "chunk_size" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{path}: chunk_size must be a positive integer, got {value!r}")
        if key in _SIZE_KEYS and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ConfigError(f"{path}: {key} must be a number of GB >= 0, got {value!r}")
        if key == "remote_url" and value is not None:
            check_remote_url(str(value), path)
        if key == "remote_serde" and value is not None and value != "naive" and raw.get("remote_url"):
            raise ConfigError(
                f"{path}: remote_serde {value!r} is not supported; use naive (objects are stored "
                f"byte-exact and checked on load; a lossy serde would fail every check)"
            )
        if key == "pre_caching_hash_algorithm" and value not in _HASHES:
            raise ConfigError(
                f"{path}: pre_caching_hash_algorithm {value!r} is not supported; use sha256_cbor "
                f"(default) or sha256: keys must not depend on PYTHONHASHSEED or collide"
            )


def _lmcache_config(raw: dict, path: Optional[str]):
    from lmcache.v1.config import LMCacheEngineConfig

    raw = {k: v for k, v in raw.items() if v is not None or k == "extra_config"}
    raw["pre_caching_hash_algorithm"] = _HASHES[raw.get("pre_caching_hash_algorithm", "builtin")]
    if path is None:
        logger.warning("LMCacheHMA: no LMCache config file (%s unset); using LMCache defaults", CONFIG_ENV)
    cfg = LMCacheEngineConfig.from_dict(raw)
    for key, value in raw.items():
        if value is not None and getattr(cfg, key, None) is None and key != "extra_config":
            raise ConfigError(f"{path}: invalid value {value!r} for {key}")
    if cfg.local_disk and not cfg.max_local_disk_size:
        raise ConfigError(f"{path}: local_disk is set but max_local_disk_size is 0; give the disk tier a size in GB")
    return cfg


def _adapter_values(adapter: dict, where: str) -> dict:
    values = {k: default for k, (_, default, _) in ADAPTER_KEYS.items()}
    for key, value in adapter.items():
        if key not in ADAPTER_KEYS:
            near = difflib.get_close_matches(key, sorted(ADAPTER_KEYS), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}: unknown LMCacheHMA key {key!r}{hint}")
        typ = ADAPTER_KEYS[key][0]
        ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{where}: {key} must be {typ.__name__}, got {value!r}")
        if typ in (int, float) and value < 0:
            raise ConfigError(f"{where}: {key} must be >= 0, got {value!r}")
        values[key] = value
    return values


