"""Configuration: the LMCache YAML plus this adapter's keys, validated at start.

Read once, in each process, into ``HMAConfig`` (frozen); nothing deeper reads
dicts. Where the file comes from, in order:

1. ``kv_connector_extra_config["lmcache_config_file"]``;
2. the environment variable ``LMCACHE_CONFIG_FILE``;
3. neither: LMCache's defaults.

Over the file's values (or LMCache's defaults), LMCache's ``LMCACHE_<KEY>`` environment variables,
as LMCache's own loader reads them (``environment``). A configuration that names no tier gets
LMCache's default CPU tier (5 GiB per worker), said in one warning line (``lmcache_values``).

The YAML holds LMCache's own keys. Each of them (all 119) is honoured, refused or warned
about by name: ``lmcache_keys.LMCACHE_KEYS`` says which and why (docs/configuration.md), and
only the honoured ones reach LMCache's config. This adapter's keys live under
``extra_config`` in the YAML or directly in ``kv_connector_extra_config`` (which wins); see
``adapter_keys``. ``remote_url`` is checked and prepared by ``remote_url``.

LMCache itself only warns about unknown keys and reads a value it cannot parse as None (and
any boolean but ``true`` as false); here every value is checked strictly: a boolean is a
YAML ``true``/``false``, a number is in its range, a URL names a host and port, a path has
its ``${VAR}`` and ``~`` expanded. Every problem is a ``ConfigError`` of one line naming the
key, where its value came from (the YAML file, an ``LMCACHE_*`` variable, or
``kv_connector_extra_config``) and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from lmcache_hma.config.adapter_keys import ADAPTER_CHOICES, ADAPTER_KEYS, ADAPTER_LIMITS  # noqa: F401
from lmcache_hma.config.environment import lmcache_variables
from lmcache_hma.config.environment import source as env_source
from lmcache_hma.config.errors import ConfigError
from lmcache_hma.config.faults import CORRUPT_KINDS, FaultPlan
from lmcache_hma.config.lmcache_keys import (EXTRA_CONFIG_REFUSED, EXTRA_CONFIG_SHARED_NAMES, HONOURED_KEYS, check_keys,
                                            shown)
from lmcache_hma.config.lmcache_schema import config_keys
from lmcache_hma.config.lmcache_values import (HASHES, check_cache_policy, check_values, prepare_local_disk,
                                              tier_defaults)
from lmcache_hma.config.remote_url import attach_remote_settings, expand_env, prepare_remote_url
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

CONFIG_ENV = "LMCACHE_CONFIG_FILE"
FILE_KEY = "lmcache_config_file"
ENV_SOURCE_PREFIX = "the environment variable "  # how ``environment.source`` names a variable
_SECRET_HOLDERS = ("remote_url", "extra_config")  # values that may hold a password or hma_shared_secret

EXTRA_SOURCE = "kv_connector_extra_config"  # where values given there are said to come from


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
    tail_admission: str = "branch"  # hma_tail_admission (scheduler.admission)
    spare_tail_fill: float = 0.5  # hma_spare_tail_fill (scheduler.admission, worker.gathers)
    eviction: str = "value"  # hma_eviction (store.value_policy)
    redis_turn_end_ttl_s: float = 1800.0  # hma_redis_turn_end_ttl_s
    # LMCache key -> where its value came from (the file's path, "the environment variable LMCACHE_X")
    sources: dict = field(default_factory=dict, repr=False)
    environment: tuple = ()  # the LMCACHE_<KEY> variables read
    tier_defaults: str = ""  # what LMCache's defaults give when no tier is named ("": one is)

    def answers_for(self, has_state: bool) -> bool:
        """Whether answers are stored for a model (``has_state``: with recurrent-state layers)."""
        return self.store_answers if self.store_answers is not None else not has_state

    @property
    def spares_tails(self) -> bool:
        """Whether tails are stored on speculation (``hma_spare_tail_fill``): under ``branch``
        admission and ``value`` eviction only (LMCache's LRU would not drop them first), and not
        in the parallelism-free format (its parts carry no line for the policy to rank them by)."""
        return (self.spare_tail_fill > 0 and self.tail_admission == "branch" and self.eviction == "value"
                and not self.share_parallel_shapes)

    @property
    def chunk_size(self) -> int:
        return self.lmcache.chunk_size

    def source_of(self, key: str) -> str:
        """Where an LMCache key's value came from: the file, an environment variable, or LMCache's defaults."""
        return self.sources.get(key, self.source if self.source != "defaults" else "LMCache defaults")


def load_config(extra_config: Optional[dict] = None) -> HMAConfig:
    """Read and validate the configuration for one engine.

    Every problem is a ``ConfigError`` of one line naming the key, where its value came from
    (the YAML file's path, an ``LMCACHE_*`` environment variable, or ``kv_connector_extra_config``)
    and what to do.
    """
    extra = dict(extra_config or {})
    path, origin = _config_path(extra.pop(FILE_KEY, None))
    raw = _read_yaml(path, origin) if path else {}
    where = path or "LMCache defaults"
    _check_top_level(raw, where)
    warnings: list = []
    sources = {k: where for k in raw}
    for key, value in lmcache_variables().items():  # as LMCache: the environment wins over the file
        if raw.get(key) is not None and raw[key] != value:
            was = "" if key in _SECRET_HOLDERS else f": {shown(raw[key])}"  # no password in a log line
            warnings.append(f"{env_source(key)} overrides {key}{was} of {where} (as LMCache's own loader does)")
        raw[key], sources[key] = value, env_source(key)

    def src(key: str) -> str:
        return sources.get(key, where)

    yaml_extra = raw.get("extra_config") or {}
    if not isinstance(yaml_extra, dict):
        raise ConfigError(f"{src('extra_config')}: extra_config must be a mapping of keys to values, got "
                          f"{yaml_extra!r}")
    warnings += check_values(raw, src)
    warnings += check_keys(raw, src)
    adapter = {k: (v, src("extra_config")) for k, v in yaml_extra.items() if str(k).startswith("hma_")}
    lm_extra = {k: v for k, v in yaml_extra.items() if not str(k).startswith("hma_")}
    _check_lmcache_extra(lm_extra, src("extra_config"))
    for k, v in extra.items():
        if not str(k).startswith("hma_"):
            if k in _lmcache_key_names():
                raise ConfigError(f"{EXTRA_SOURCE}: {k!r} is an LMCache key: put it in the LMCache YAML "
                                  f"({FILE_KEY}), not in {EXTRA_SOURCE}")
            raise ConfigError(f"{EXTRA_SOURCE}: unknown key {k!r}; expected {FILE_KEY!r} or one of "
                              f"{sorted(ADAPTER_KEYS)}")
        adapter[k] = (v, EXTRA_SOURCE)
    values, adapter_sources = _adapter_values(adapter)
    warnings += check_cache_policy(raw, src, values["hma_eviction"], adapter_sources["hma_eviction"])
    raw, disk_warnings = prepare_local_disk(raw, src)
    warnings += disk_warnings
    timeout = values["hma_remote_timeout_s"]
    raw, auth = prepare_remote_url(raw, src("remote_url"), timeout)

    lm = _lmcache_config({k: v for k, v in raw.items() if k in HONOURED_KEYS} | {"extra_config": lm_extra or None},
                         src)
    attach_remote_settings(lm, auth, timeout, values["hma_redis_turn_end_ttl_s"])
    interval = values["hma_checkpoint_interval"]
    if interval % lm.chunk_size:
        interval_from = adapter_sources["hma_checkpoint_interval"]
        chunk_from = "" if interval_from == src("chunk_size") else f" (from {src('chunk_size')})"
        raise ConfigError(
            f"{interval_from}: hma_checkpoint_interval {interval} must be a multiple of chunk_size "
            f"{lm.chunk_size}{chunk_from}; e.g. {(interval // lm.chunk_size + 1) * lm.chunk_size}, "
            f"or 0 for the default"
        )
    if values["hma_spare_tail_fill"] > 1:
        raise ConfigError(f"{adapter_sources['hma_spare_tail_fill']}: hma_spare_tail_fill "
                          f"{values['hma_spare_tail_fill']} is a fraction of a tier's size: between 0 (off) and 1")
    env_vars = tuple(sorted({v for v in sources.values() if v.startswith(ENV_SOURCE_PREFIX)}))
    defaults = tier_defaults(raw)
    if defaults:  # said once, first
        warnings.insert(0, _defaults_line(path, env_vars, defaults))
    for line in warnings:
        logger.warning("LMCacheHMA: %s", line)
    if env_vars:
        logger.info("LMCacheHMA: LMCache's environment variables read: %s",
                    ", ".join(v[len(ENV_SOURCE_PREFIX):] for v in env_vars))
    return HMAConfig(
        lmcache=lm,
        source=path or "defaults",
        sources={k: v for k, v in sources.items() if k in HONOURED_KEYS},
        environment=tuple(v[len(ENV_SOURCE_PREFIX):] for v in env_vars),
        tier_defaults=defaults or "",
        checkpoint_interval=interval,
        verify_checksums=values["hma_verify_checksums"],
        lookup_timeout_s=values["hma_lookup_timeout_s"],
        stats_file=values["hma_stats_file"],
        faults=_fault_plan(values, adapter_sources),
        store_queue_objects=values["hma_store_queue_objects"],
        shared_secret=_shared_secret(values["hma_shared_secret"], adapter_sources["hma_shared_secret"]),
        store_answers=values["hma_store_answers"],
        share_parallel_shapes=values["hma_share_parallel_shapes"],
        consumer_stores_answers=values["hma_consumer_stores_answers"],
        tail_admission=values["hma_tail_admission"],
        spare_tail_fill=values["hma_spare_tail_fill"],
        eviction=values["hma_eviction"],
        redis_turn_end_ttl_s=values["hma_redis_turn_end_ttl_s"],
    )


def _defaults_line(path: Optional[str], env_vars: tuple, defaults: str) -> str:
    """The warning for a configuration that names no tier: what LMCache's defaults give."""
    names = ", ".join(v[len(ENV_SOURCE_PREFIX):] for v in env_vars)
    if path:
        return (f"{path}{f' (with {names})' if names else ''} names no tier: {defaults}; name the tier "
                f"(e.g. max_local_cpu_size) to choose its size")
    if names:
        return (f"the environment variables {names} name no tier (no LMCache config file): {defaults}; set "
                f"LMCACHE_MAX_LOCAL_CPU_SIZE to choose its size")
    return (f"no LMCache config file ({CONFIG_ENV} unset, no {FILE_KEY} in {EXTRA_SOURCE}) and no LMCACHE_<KEY> "
            f"variable: LMCache's defaults give {defaults}; name a YAML with the tiers to choose them")


_MIN_SECRET_CHARS = 16


def _fault_plan(values: dict, sources: dict) -> Optional[FaultPlan]:
    """The TEST ONLY ``hma_test_*`` keys as a ``FaultPlan`` (None when none is set)."""
    kinds = tuple(k.strip() for k in values["hma_test_corrupt_loads"].split(",") if k.strip())
    bad = [k for k in kinds if k not in CORRUPT_KINDS]
    if bad:
        raise ConfigError(f"{sources['hma_test_corrupt_loads']}: hma_test_corrupt_loads {bad[0]!r} must be one "
                          f"of {', '.join(CORRUPT_KINDS)}")
    plan = FaultPlan(fail_loads=values["hma_test_fail_loads"], fail_sync_loads=values["hma_test_fail_sync_loads"],
                     corrupt_loads=kinds, lookup_delay_s=values["hma_test_lookup_delay_s"])
    if not plan:
        return None
    logger.warning("LMCacheHMA: TEST ONLY fault injection: %s", plan)
    return plan


def _shared_secret(value: str, where: str) -> Optional[bytes]:
    """``hma_shared_secret`` with ``${ENV}`` expanded; None when unset."""
    if not value:
        return None
    secret = expand_env(value, where, "hma_shared_secret")
    if len(secret) < _MIN_SECRET_CHARS:
        raise ConfigError(f"{where}: hma_shared_secret must be at least {_MIN_SECRET_CHARS} characters "
                          f"(got {len(secret)}); e.g. `openssl rand -hex 32`")
    return secret.encode()


# -- the file ---------------------------------------------------------------------------
def _config_path(given: Any) -> tuple[Optional[str], str]:
    """(the YAML's path or None, where the path came from)."""
    if given is not None and given != "":
        if not isinstance(given, (str, os.PathLike)):
            raise ConfigError(f"{EXTRA_SOURCE}: {FILE_KEY} must be a path (a string), got {given!r}")
        return os.fspath(given), f"{EXTRA_SOURCE}[{FILE_KEY!r}]"
    env = os.environ.get(CONFIG_ENV)
    return (env, f"the environment variable {CONFIG_ENV}") if env else (None, "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last would win silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            continue  # yaml's own constructor reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and "
                            f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str, origin: str) -> dict:
    if os.path.isdir(path):
        raise ConfigError(f"LMCache config file {path!r} is a directory (named by {origin}); name the YAML "
                          f"file in it")
    if not os.path.exists(path):
        raise ConfigError(f"LMCache config file {path!r} does not exist (named by {origin}); fix the path")
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except OSError as exc:
        raise ConfigError(f"cannot read LMCache config file {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"LMCache config file {path!r} is not text (UTF-8): {exc.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"LMCache config file {path!r} is not valid YAML: {_yaml_problem(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"LMCache config file {path!r} must be a mapping of keys to values, "
                          f"got a {type(raw).__name__}")
    return raw


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{at}{problem}".split())


# -- LMCache's keys ---------------------------------------------------------------------
def _lmcache_key_names() -> set:
    return config_keys()


def _check_top_level(raw: dict, where: str) -> None:
    """Refuse a key LMCache does not have; an adapter key here belongs under ``extra_config``."""
    known = _lmcache_key_names()
    for key in raw:
        if key in known:
            continue
        name = str(key)
        if name.startswith("hma_"):
            if name in ADAPTER_KEYS:
                raise ConfigError(f"{where}: {name!r} is an lmcache_hma key: put it under extra_config, "
                                  f"not at the top level")
            near = difflib.get_close_matches(name, sorted(ADAPTER_KEYS), n=1)
            under = f"; did you mean {near[0]!r} (under extra_config)?" if near else ""
            raise ConfigError(f"{where}: unknown key {name!r} (neither LMCache's nor lmcache_hma's){under}")
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{where}: unknown LMCache config key {key!r}{hint}")


def _check_lmcache_extra(lm_extra: dict, where: str) -> None:
    """``extra_config`` keys that are not the adapter's go to LMCache: refuse those that would
    give it a backend without a tier here, and LMCache keys misplaced under extra_config."""
    known = _lmcache_key_names()
    for key, value in lm_extra.items():
        if key in EXTRA_CONFIG_REFUSED and value not in (None, False):
            raise ConfigError(f"{where}: extra_config.{key}: {shown(value)} is not supported by lmcache_hma: "
                              f"{EXTRA_CONFIG_REFUSED[key]}; remove it")
        if key in known and key not in EXTRA_CONFIG_SHARED_NAMES:
            raise ConfigError(f"{where}: extra_config.{key} is an LMCache key, not read under extra_config: "
                              f"move it to the top level of the YAML")


def _lmcache_config(raw: dict, src):
    """LMCache's config from the HONOURED keys only (nothing else can change what LMCache does)."""
    from lmcache.v1.config import LMCacheEngineConfig

    raw = {k: v for k, v in raw.items() if v is not None or k == "extra_config"}
    raw["pre_caching_hash_algorithm"] = HASHES[raw.get("pre_caching_hash_algorithm", "builtin")]
    cfg = LMCacheEngineConfig.from_dict(raw)
    for key, value in raw.items():
        if value is not None and getattr(cfg, key, None) is None and key != "extra_config":
            raise ConfigError(f"{src(key)}: invalid value {value!r} for {key}")
    return cfg


# -- the adapter's keys -------------------------------------------------------------------
def _adapter_values(adapter: dict) -> tuple[dict, dict]:
    """(``{key: value}`` of every adapter key, ``{key: where its value came from}``);
    ``adapter``: ``{key: (value, where)}``."""
    values = {k: default for k, (_, default, _) in ADAPTER_KEYS.items()}
    sources = {k: "defaults" for k in ADAPTER_KEYS}
    for key, (value, where) in adapter.items():
        if key not in ADAPTER_KEYS:
            near = difflib.get_close_matches(key, sorted(ADAPTER_KEYS), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}: unknown LMCacheHMA key {key!r}{hint}")
        typ, given = ADAPTER_KEYS[key][0], value
        ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            kind = "true or false (a YAML boolean, unquoted)" if typ is bool else typ.__name__
            raise ConfigError(f"{where}: {key} must be {kind}, got {shown(given)}")
        if key in ADAPTER_CHOICES and value not in ADAPTER_CHOICES[key]:
            raise ConfigError(f"{where}: {key} must be one of {', '.join(ADAPTER_CHOICES[key])}, got {shown(given)}")
        if typ in (int, float):
            bound, op = ADAPTER_LIMITS.get(key, (0, ">="))
            if not math.isfinite(value) or (value <= bound if op == ">" else value < bound):
                raise ConfigError(f"{where}: {key} must be {op} {bound}, got {shown(given)}")
        values[key] = value
        sources[key] = where
    return values, sources
