"""Configuration: the LMCache YAML plus this adapter's keys, validated at start.

Read once, in each process, into ``HMAConfig`` (frozen); nothing deeper reads
dicts. Where the file comes from, in order:

1. ``kv_connector_extra_config["lmcache_config_file"]``;
2. the environment variable ``LMCACHE_CONFIG_FILE``;
3. neither: LMCache's defaults (CPU tier of 5 GB), with a warning.

The YAML holds LMCache's own keys (``chunk_size``, ``local_cpu``,
``max_local_cpu_size``, ``local_disk``, ``max_local_disk_size``, ``remote_url``,
...). This adapter's keys live under ``extra_config`` in the YAML or directly in
``kv_connector_extra_config`` (which wins); see ``ADAPTER_KEYS``.

LMCache itself only warns about unknown keys and turns unparsable values into
None; here both are errors that name the key and the file.

``remote_url`` (Redis): ``redis://[[user]:password@]host:port[/db]`` (also
``rediss://``, ``unix://``), or a Redis Cluster: ``redis-cluster://[[user]:password@]h1:p1,h2:p2``
(seed nodes; the client discovers the rest). Any part may hold ``${ENV_VAR}`` placeholders,
expanded at load time (LMCache has no such facility for redis:// URLs), e.g.
``redis://:${REDIS_PASSWORD}@10.0.0.5:6379``; a value in the user or password
part is used verbatim (no percent-encoding needed). Credentials never reach
LMCache's config (which LMCache logs): they are taken out of the URL here and
handed to the store (``remote_auth``), which gives them to the Redis client.
The URL also gets ``socket_timeout``/``socket_connect_timeout`` (from
``hma_remote_timeout_s``) unless it sets them, so a dead or hung Redis costs
a bounded time per call (a cluster URL takes no options: ``remote_timeout_s``
hands the timeout to the store). Nothing else is accepted: the store reads and
writes its remote tier through ``redis_tier`` only, so LMCache's other remote
backends (``resp://``, ``lm://``, ``valkey://``, ...) are refused at start rather
than failing at the first read; ``redis-sentinel://`` too (see ``_SENTINEL_BROKEN``).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import yaml
from lmcache_hma.log import get_logger
from lmcache_hma.testing.faults import CORRUPT_KINDS, FaultPlan

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
    "hma_verify_checksums": (bool, True, "check each loaded object's CRC32"),
    "hma_lookup_timeout_s": (float, 5.0, "scheduler waits this long for a lookup answer, then treats it as a miss"),
    "hma_stats_file": (str, "", "worker writes its byte counters here as JSON (for tests and benchmarks)"),
    "hma_remote_timeout_s": (
        float, 2.0,
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
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # LMCache's RedisConnector (redis-py URLs)
CLUSTER_SCHEME = "redis-cluster://"  # LMCache's RedisClusterConnector (seed host:port list)
# What the store's remote tier serves (redis_tier.RedisTier, RedisClusterTier): nothing else.
_REMOTE_SCHEMES = (*REDIS_SCHEMES, CLUSTER_SCHEME)
_SENTINEL_SCHEME = "redis-sentinel://"
# Seen with LMCache 0.5.6 and a real master + replica + sentinel on loopback: its
# RedisSentinelConnector calls redis.asyncio's Sentinel clients without awaiting them, so
# every lookup is a hit (bool of a coroutine), no write reaches Redis and every read fails
# (AssertionError). Refused at start rather than promising hits that always fail.
_SENTINEL_BROKEN = (
    "redis-sentinel:// is not supported: LMCache 0.5.6's RedisSentinelConnector never awaits its "
    "redis.asyncio calls (every lookup reports a hit, writes never reach Redis, every read fails). "
    "Point remote_url at the current master (redis://host:port) or use a Redis Cluster "
    "(redis-cluster://host1:port1,host2:port2,...), which fails over to replicas"
)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_AUTH_ATTR = "_lmcache_hma_remote_auth"
_TIMEOUT_ATTR = "_lmcache_hma_remote_timeout_s"


class ConfigError(ValueError):
    """A configuration problem, with what to change."""


@dataclass(frozen=True)
class RemoteAuth:
    """Redis credentials taken out of ``remote_url`` (never logged)."""

    username: Optional[str]
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"RemoteAuth(username={self.username!r}, password=***)"


def remote_auth(lmcache_config) -> Optional[RemoteAuth]:
    """The credentials ``load_config`` took out of ``remote_url``, if any."""
    return getattr(lmcache_config, _AUTH_ATTR, None)


def remote_timeout_s(lmcache_config) -> float:
    """``hma_remote_timeout_s`` of the config ``load_config`` made (the default otherwise)."""
    return getattr(lmcache_config, _TIMEOUT_ATTR, ADAPTER_KEYS["hma_remote_timeout_s"][1])


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
    raw, auth = _prepare_remote_url(raw, path, values["hma_remote_timeout_s"])

    lm = _lmcache_config({**raw, "extra_config": lm_extra or None}, path)
    setattr(lm, _AUTH_ATTR, auth)
    setattr(lm, _TIMEOUT_ATTR, values["hma_remote_timeout_s"])
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
    secret = _expand_env(value, path, "hma_shared_secret")
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
            url = str(value) if _has_scheme(str(value)) else _expand_env(str(value), path)
            if url.startswith(_SENTINEL_SCHEME):
                raise ConfigError(f"{path}: remote_url {_redact_url(str(value))!r}: {_SENTINEL_BROKEN}")
            if not url.startswith(_REMOTE_SCHEMES):
                scheme = url.split("://", 1)[0] + "://" if _has_scheme(url) else "(none)"
                raise ConfigError(f"{path}: remote_url {_redact_url(str(value))!r} must start with one "
                                  f"of {', '.join(_REMOTE_SCHEMES)}: its scheme {scheme} is not served "
                                  f"(lmcache_hma reads and writes the remote tier through Redis only)")
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


# -- remote_url: ${ENV} placeholders, credentials, timeouts ---------------------------

def _has_scheme(url: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url) is not None


def _expand_env(text: str, path: Optional[str], key: str = "remote_url") -> str:
    """``text`` with each ``${NAME}`` replaced by the environment variable's value."""
    def value(m: "re.Match[str]") -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(f"{path}: {key} names the environment variable {name}, which is not set")
        return os.environ[name]
    return _ENV_REF.sub(value, text)


def _split_netloc(url: str) -> tuple[str, str, str]:
    """(scheme://, userinfo or "", the rest) of a URL, without parsing the userinfo."""
    scheme, rest = url.split("://", 1)
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hostport = netloc.rpartition("@")
    return scheme + "://", userinfo if at else "", hostport + tail


_SECRET_PARAMS = re.compile(r"([?&](?:password|username)=)[^&#]*", re.IGNORECASE)


def _redact_url(url: str) -> str:
    """``url`` with any password (userinfo or query) replaced by ``***`` (for messages)."""
    if "://" not in url:
        return url
    url = _SECRET_PARAMS.sub(r"\1***", url)
    scheme, userinfo, rest = _split_netloc(url)
    if not userinfo:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{user}{':***' if colon else ''}@{rest}"


def _prepare_remote_url(raw: dict, path: Optional[str], timeout_s: float) -> tuple[dict, Optional[RemoteAuth]]:
    """Expand ``${ENV}`` in ``remote_url``; for Redis, take the credentials out and add timeouts."""
    value = raw.get("remote_url")
    if value is None:
        return raw, None
    url = str(value)
    if not _has_scheme(url):  # e.g. remote_url: ${REDIS_URL}
        url = _expand_env(url, path)
    scheme, userinfo, rest = _split_netloc(url)
    # Credentials are expanded after splitting, so their values are used verbatim.
    user, colon, password = userinfo.partition(":")
    user = _expand_env(unquote(user), path) if userinfo else ""
    password = _expand_env(unquote(password), path) if colon else ""
    rest = _expand_env(rest, path)
    if url.startswith(CLUSTER_SCHEME):
        return _prepare_cluster_url(raw, path, url, userinfo, user, password, rest)
    if "@" in rest.split("/", 1)[0]:
        raise ConfigError(f"{path}: remote_url {_redact_url(url)!r}: put credentials before the host "
                          f"only once (percent-encode '@' in a literal password, or use ${{ENV_VAR}})")
    base, _, fragment = rest.partition("#")
    base, _, query_text = base.partition("?")
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    # redis-py also reads credentials from the query (?password=...): take them out the same way.
    q_user, q_password = query.pop("username", None), query.pop("password", None)
    if (q_user or q_password) and userinfo:
        raise ConfigError(f"{path}: remote_url {_redact_url(url)!r} gives credentials twice "
                          f"(before the host and in the query); keep one")
    if q_user or q_password:
        user, password = q_user or "", q_password or ""  # ${VAR} already expanded in `rest`
    for name in ("socket_timeout", "socket_connect_timeout"):
        query.setdefault(name, f"{timeout_s:g}")
    clean = f"{scheme}{base}?{urlencode(query)}" + (f"#{fragment}" if fragment else "")
    auth = RemoteAuth(user or None, password) if (user or password) else None
    return {**raw, "remote_url": clean}, auth


def _prepare_cluster_url(raw: dict, path: Optional[str], url: str, userinfo: str, user: str,
                         password: str, rest: str) -> tuple[dict, Optional[RemoteAuth]]:
    """``redis-cluster://[[user]:password@]h1:p1,h2:p2[?username=..&password=..]``, checked.

    LMCache gets ``redis-cluster://h1:p1,h2:p2`` alone: its adapter splits the URL on
    commas and its ``RedisClusterConnector`` drops anything else (no database, no query
    options); credentials go to the store as for redis://, and so does the timeout
    (``remote_timeout_s``).
    """
    shown = _redact_url(url)
    usage = "expected redis-cluster://[[user]:password@]host1:port1,host2:port2,..."
    if re.search(r"@[^@,]*:\d+,", userinfo):
        raise ConfigError(f"{path}: remote_url {shown!r} gives credentials per seed node; give them once, "
                          f"before the first host (every node of a cluster has the same credentials)")
    base, _, fragment = rest.partition("#")
    base, _, query_text = base.partition("?")
    seeds_text, slash, db = base.partition("/")
    if slash:
        raise ConfigError(f"{path}: remote_url {shown!r}: a Redis Cluster has no databases; remove "
                          f"'/{db}' ({usage})")
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    q_user, q_password = query.pop("username", None), query.pop("password", None)
    if query or fragment:
        raise ConfigError(f"{path}: remote_url {shown!r}: redis-cluster:// takes no options besides "
                          f"username= and password= (got {sorted(query) or '#' + fragment}); the call "
                          f"timeout is hma_remote_timeout_s")
    if (q_user or q_password) and userinfo:
        raise ConfigError(f"{path}: remote_url {shown!r} gives credentials twice "
                          f"(before the host and in the query); keep one")
    if q_user or q_password:
        user, password = q_user or "", q_password or ""
    if not seeds_text.strip():
        raise ConfigError(f"{path}: remote_url {shown!r} names no cluster node; {usage}")
    seeds = []
    for seed in seeds_text.split(","):
        try:
            parts = urlsplit("//" + seed.strip())
            host, port = parts.hostname, parts.port
        except ValueError as exc:  # a port that is not a number in 0..65535
            raise ConfigError(f"{path}: remote_url {shown!r}: seed {seed.strip()!r} is not host:port "
                              f"({exc}); {usage}") from exc
        if not seed.strip() or not host or not port or parts.username is not None or parts.path:
            what = "an empty seed (a stray comma?)" if not seed.strip() else f"seed {seed.strip()!r}"
            raise ConfigError(f"{path}: remote_url {shown!r}: {what} is not host:port; {usage}")
        seeds.append(seed.strip())
    auth = RemoteAuth(user or None, password) if (user or password) else None
    return {**raw, "remote_url": CLUSTER_SCHEME + ",".join(seeds)}, auth
