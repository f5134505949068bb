"""``remote_url``: which Redis, its credentials, its timeouts and its turn ends' TTL, checked at start.

``remote_url`` (Redis): ``redis://[[user]:password@]host:port[/db]`` (also
``rediss://``, ``unix://``), or a Redis Cluster: ``redis-cluster://[[user]:password@]h1:p1,h2:p2``
(seed nodes; the client discovers the rest). Any part may hold ``${ENV_VAR}`` placeholders,
expanded at load time (LMCache has no such facility for redis:// URLs), e.g.
``redis://:${REDIS_PASSWORD}@10.0.0.5:6379``; a variable's value in the user or password
part is used verbatim (no percent-encoding needed), while a user or password written in the URL
percent-encodes ``@``, ``#``, ``/`` and ``?`` (``%40`` ...): unescaped they are refused, as they
would end the credentials early (``_check_escaped``). Credentials never reach
LMCache's config (which LMCache logs): they are taken out of the URL here and
handed to the store (``remote_auth``), which gives them to the Redis client.
The URL also gets ``socket_timeout``/``socket_connect_timeout`` (from
``hma_remote_timeout_s``) unless it sets them, so a dead or hung Redis costs
a bounded time per call (a cluster URL takes no options: ``remote_timeout_s``
hands the timeout to the store; ``turn_end_ttl_s`` hands it ``hma_redis_turn_end_ttl_s``). Nothing else is accepted: the store reads and
writes its remote tier through ``store.redis`` only, so LMCache's other remote
backends (``resp://``, ``lm://``, ``valkey://``, ...) are refused at start rather
than failing at the first read; ``redis-sentinel://`` too (see ``_SENTINEL_BROKEN``). A URL
redis-py would fail on at its first call is refused at start as well: no host, a port that is
not a number in 1..65535, a database that is not a number, a ``unix://`` URL without a path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from lmcache_hma.config.errors import ConfigError

DEFAULT_TIMEOUT_S = 2.0  # hma_remote_timeout_s
DEFAULT_TURN_END_TTL_S = 1800.0  # hma_redis_turn_end_ttl_s
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # LMCache's RedisConnector (redis-py URLs)
CLUSTER_SCHEME = "redis-cluster://"  # LMCache's RedisClusterConnector (seed host:port list)
# What the store's remote tier serves (store.redis): nothing else.
REMOTE_SCHEMES = (*REDIS_SCHEMES, CLUSTER_SCHEME)
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
_TURN_END_TTL_ATTR = "_lmcache_hma_redis_turn_end_ttl_s"


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
    return getattr(lmcache_config, _TIMEOUT_ATTR, DEFAULT_TIMEOUT_S)


def turn_end_ttl_s(lmcache_config) -> float:
    """``hma_redis_turn_end_ttl_s`` of the config ``load_config`` made (the default otherwise)."""
    return getattr(lmcache_config, _TURN_END_TTL_ATTR, DEFAULT_TURN_END_TTL_S)


def attach_remote_settings(lmcache_config, auth: Optional[RemoteAuth], timeout_s: float,
                           turn_end_ttl: float = DEFAULT_TURN_END_TTL_S) -> None:
    """Keep the credentials, the timeout and the turn ends' TTL with LMCache's config (out of what
    it logs), where the Redis tier is built from (``store.redis.redis_tiers_for``)."""
    setattr(lmcache_config, _AUTH_ATTR, auth)
    setattr(lmcache_config, _TIMEOUT_ATTR, timeout_s)
    attach_turn_end_ttl(lmcache_config, turn_end_ttl)


def attach_turn_end_ttl(lmcache_config, seconds: float) -> None:
    """Keep ``hma_redis_turn_end_ttl_s`` with LMCache's config (``attach_remote_settings``)."""
    setattr(lmcache_config, _TURN_END_TTL_ATTR, float(seconds))


def uses_hash_tags(lmcache_config) -> bool:
    """Whether object keys carry a Redis Cluster hash tag (only with a ``redis-cluster://`` tier)."""
    return (getattr(lmcache_config, "remote_url", None) or "").startswith(CLUSTER_SCHEME)


def check_remote_url(value: str, path: Optional[str]) -> None:
    """Refuse a ``remote_url`` whose scheme no tier serves."""
    url = str(value) if has_scheme(str(value)) else expand_env(str(value), path)
    if url.startswith(_SENTINEL_SCHEME):
        raise ConfigError(f"{path}: remote_url {redact_url(str(value))!r}: {_SENTINEL_BROKEN}")
    if not url.startswith(REMOTE_SCHEMES):
        scheme = url.split("://", 1)[0] + "://" if has_scheme(url) else "(none)"
        raise ConfigError(f"{path}: remote_url {redact_url(str(value))!r} must start with one "
                          f"of {', '.join(REMOTE_SCHEMES)}: its scheme {scheme} is not served "
                          f"(lmcache_hma reads and writes the remote tier through Redis only)")


def has_scheme(url: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url) is not None


def expand_env(text: str, path: Optional[str], key: str = "remote_url") -> str:
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


def redact_url(url: str) -> str:
    """``url`` with any password (userinfo or query) replaced by ``***`` (for messages)."""
    if "://" not in url:
        return url
    url = _SECRET_PARAMS.sub(r"\1***", url)
    scheme, userinfo, rest = _split_netloc(url)
    if not userinfo:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{user}{':***' if colon else ''}@{rest}"


def prepare_remote_url(raw: dict, path: Optional[str], timeout_s: float) -> tuple[dict, Optional[RemoteAuth]]:
    """Expand ``${ENV}`` in ``remote_url``; for Redis, take the credentials out and add timeouts."""
    value = raw.get("remote_url")
    if value is None:
        return raw, None
    url = str(value)
    if not has_scheme(url):  # e.g. remote_url: ${REDIS_URL}
        url = expand_env(url, path)
    scheme, userinfo, rest = _split_netloc(url)
    if url.startswith(CLUSTER_SCHEME) and re.search(r"@[^@,]*:\d+,", userinfo):
        raise ConfigError(f"{path}: remote_url {redact_url(url)!r} gives credentials per seed node; give them once, "
                          f"before the first host (every node of a cluster has the same credentials)")
    _check_escaped(url, path)
    # Credentials are expanded after splitting, so their values are used verbatim.
    user, colon, password = userinfo.partition(":")
    user = expand_env(unquote(user), path) if userinfo else ""
    password = expand_env(unquote(password), path) if colon else ""
    rest = expand_env(rest, path)
    if url.startswith(CLUSTER_SCHEME):
        return _prepare_cluster_url(raw, path, url, userinfo, user, password, rest)
    if "@" in re.split(r"[/?#]", rest, maxsplit=1)[0]:
        raise ConfigError(f"{path}: remote_url {redact_url(url)!r}: its host part holds '@' (a ${{VAR}} "
                          f"there that expands to credentials?); give credentials once, before the host")
    base, _, fragment = rest.partition("#")
    base, _, query_text = base.partition("?")
    _check_address(scheme, base, redact_url(url), path)
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    # redis-py also reads credentials from the query (?password=...): take them out the same way.
    q_user, q_password = query.pop("username", None), query.pop("password", None)
    if (q_user or q_password) and userinfo:
        raise ConfigError(f"{path}: remote_url {redact_url(url)!r} gives credentials twice "
                          f"(before the host and in the query); keep one")
    if q_user or q_password:
        user, password = q_user or "", q_password or ""  # ${VAR} already expanded in `rest`
    for name in ("socket_timeout", "socket_connect_timeout"):
        query.setdefault(name, f"{timeout_s:g}")
    clean = f"{scheme}{base}?{urlencode(query)}" + (f"#{fragment}" if fragment else "")
    auth = RemoteAuth(user or None, password) if (user or password) else None
    return {**raw, "remote_url": clean}, auth


_ESCAPES = {"@": "%40", "#": "%23", "/": "%2F", "?": "%3F"}


def _check_escaped(url: str, path: Optional[str]) -> None:
    """Refuse credentials holding an unescaped ``@``, ``#``, ``/`` or ``?`` (a URL's user and
    password must percent-encode them): ``redis://:p@ss#word@host:6399`` would be read as the host
    ``ss`` with the rest a fragment, and ``redis://:p@ss@host`` is read differently by different
    URL parsers. ``url`` is as written, before ``${VAR}`` expansion (a variable's value is used
    as it is)."""
    scheme, text = url.split("://", 1)
    ats = []  # the '@' that are not inside a query value (?password=p@ss is one)
    for i, ch in enumerate(text):
        if ch == "@":
            head = text[:i]
            if "?" in head and "=" in re.split(r"[?&]", head)[-1]:
                continue
            ats.append(i)
    if not ats:
        return
    end = min([i for i in (text.find(c) for c in "/?#") if i >= 0], default=len(text))
    if len(ats) == 1 and end > ats[0]:
        return
    chars = [c for c in _ESCAPES if c in text[:ats[-1]]]
    shown = f"{scheme}://***@{text[ats[-1] + 1:]}"
    raise ConfigError(f"{path}: remote_url {shown!r}: its user or password holds {' and '.join(map(repr, chars))} "
                      f"unescaped, which a URL reads as the end of the credentials; percent-encode "
                      f"{'it' if len(chars) == 1 else 'them'} as {' and '.join(_ESCAPES[c] for c in chars)} "
                      f"(e.g. p{_ESCAPES[chars[0]]}ss), or give the password as ${{VAR}} (a variable's value is used "
                      f"as it is)")


def _check_address(scheme: str, base: str, shown: str, path: Optional[str]) -> None:
    """Refuse a redis://, rediss:// or unix:// URL whose host, port, database or socket path
    redis-py would fail on at the first call (``base``: the URL after its credentials, up to
    its query)."""
    if scheme == "unix://":
        if not base.split("?")[0].strip("/"):
            raise ConfigError(f"{path}: remote_url {shown!r} names no socket path; expected "
                              f"unix:///path/to/redis.sock")
        return
    usage = f"expected {scheme}[[user]:password@]host:port[/db]"
    hostport, slash, db = base.partition("/")
    if not hostport:
        raise ConfigError(f"{path}: remote_url {shown!r} names no host; {usage}")
    try:
        parts = urlsplit("//" + hostport)
        host = parts.hostname
    except ValueError:  # e.g. a broken [IPv6] address
        parts, host = None, None
    try:
        port = parts.port if parts is not None else None
    except ValueError:  # not a number in 0..65535
        port = -1
    if not host or port == -1 or port == 0:
        text = hostport.rpartition(":")[2] if ":" in hostport else hostport
        what = f"port {text!r} is not a number in 1..65535" if host else f"{hostport!r} is not host:port"
        raise ConfigError(f"{path}: remote_url {shown!r}: {what}; {usage}")
    if slash and db and not db.isdigit():
        raise ConfigError(f"{path}: remote_url {shown!r}: database {db!r} is not a number; {usage}")


def _prepare_cluster_url(raw: dict, path: Optional[str], url: str, userinfo: str, user: str,
                         password: str, rest: str) -> tuple[dict, Optional[RemoteAuth]]:
    """``redis-cluster://[[user]:password@]h1:p1,h2:p2[?username=..&password=..]``, checked.

    LMCache gets ``redis-cluster://h1:p1,h2:p2`` alone: its adapter splits the URL on
    commas and its ``RedisClusterConnector`` drops anything else (no database, no query
    options); credentials go to the store as for redis://, and so does the timeout
    (``remote_timeout_s``).
    """
    shown = redact_url(url)
    usage = "expected redis-cluster://[[user]:password@]host1:port1,host2:port2,..."
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
