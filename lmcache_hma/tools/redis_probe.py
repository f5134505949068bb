"""The remote tier of ``lmcache-hma check``: Redis or Redis Cluster, reached as the worker reaches it.

Contract: ``check_remote`` PINGs through the connector's own Redis code (``store.redis``: the
same client, handshake and deadline, ``hma_remote_timeout_s``; the health check the worker runs),
says whether the credentials were taken, and reads ``maxmemory`` / ``maxmemory-policy`` back
(``CONFIG GET``; ``INFO memory`` when CONFIG is disabled) on the server or on each cluster
master: a WARN with the fix for no limit or another policy than ``RECOMMENDED_POLICY``. It returns
a ``RemoteResult``: the ``check_lines.Line`` verdicts, the bytes the tier may hold when every
server has a limit, and whether it answered; None when no ``remote_url`` is set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from lmcache_hma.tools.check_lines import FAIL, OK, WARN, Line, captured_warnings, size_text

DOCS_EVICTION = "docs/redis.md#eviction-policy"
RECOMMENDED_POLICY = "allkeys-lfu"  # measured in docs/redis.md#eviction-policy


def _probe_tier(url: str, auth, timeout_s: float):
    """The connector's Redis tier class (``RedisTier`` or ``RedisClusterTier``) with its clients,
    handshake and deadline, but without LMCache's connector and the health thread: its
    ``_probe`` is the health check the worker runs at start and every second."""
    from lmcache_hma.config.remote_url import CLUSTER_SCHEME
    from lmcache_hma.store.redis.cluster_tier import RedisClusterTier
    from lmcache_hma.store.redis.node_tier import RedisTier

    base = RedisClusterTier if url.startswith(CLUSTER_SCHEME) else RedisTier

    return base(None, None, url, auth, timeout_s, watch=False)  # the tier without LMCache's connector


_AUTH_MARKS = ("AuthenticationError", "NOAUTH", "WRONGPASS", "invalid password", "invalid username-password")


def _classify(why: str) -> str:
    if any(m in why for m in _AUTH_MARKS):
        return "auth"
    if "called without any password configured" in why or "without any password" in why:
        return "no-password"
    if "Timeout" in why or "no complete answer" in why or "timed out" in why:
        return "timeout"
    return "unreachable"


def _where(url: str) -> str:
    for scheme in ("redis://", "redis-cluster://"):
        if url.startswith(scheme):
            return url[len(scheme):]
    if url.startswith("rediss://"):
        return url[len("rediss://"):] + " (TLS)"
    return url


def _down_line(where: str, why: str, timeout_s: float, cluster: bool) -> Line:
    what = "Redis Cluster" if cluster else "Redis"
    kind = _classify(why)
    if kind == "auth":
        url = "redis-cluster://[user]:PASSWORD@host1:port1,..." if cluster else "redis://[user]:PASSWORD@host:port"
        return Line(FAIL, "redis", f"authentication failed at {what} {where} ({why})",
                    f"give the server's password in remote_url ({url}, or ${{VAR}}); with ACLs the user too")
    if kind == "no-password":
        return Line(FAIL, "redis", f"authentication failed at {what} {where}: the server has no password "
                                   f"but remote_url gives one ({why})",
                    "remove the credentials from remote_url, or set the server's requirepass")
    if kind == "timeout":
        return Line(FAIL, "redis", f"{what} at {where} did not answer within {timeout_s:g} s "
                                   f"(hma_remote_timeout_s) ({why})",
                    "is it hung, overloaded or behind a firewall that drops packets? The connector "
                    "would bypass it (misses) until it answers")
    return Line(FAIL, "redis", f"{what} at {where} is unreachable ({why})",
                "start it, or fix remote_url in the YAML")


_REPLY_BYTES, _REPLY_ITEMS = 64 << 10, 64


def _memory_settings(probe, client) -> tuple[Optional[dict], str]:
    """({"maxmemory": int, "maxmemory-policy": str}, "") read back with CONFIG GET, or, when
    CONFIG is refused, from INFO memory with why CONFIG failed; (None, why) when neither works."""
    from lmcache_hma.store.redis import resp
    from lmcache_hma.store.redis.wire import command

    def read(reader):
        out = []
        for _ in range(2):
            try:
                out.append(reader.reply(_REPLY_BYTES, _REPLY_ITEMS))
            except resp.ReplyError as exc:
                out.append(exc)
        return out

    why = ""
    try:
        replies = probe._call(client, [command(b"CONFIG", b"GET", b"maxmemory"),
                                       command(b"CONFIG", b"GET", b"maxmemory-policy")], read)
        values = {}
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            if isinstance(reply, list) and len(reply) == 2:
                values[reply[0].decode()] = reply[1].decode()
        if {"maxmemory", "maxmemory-policy"} <= set(values):
            return {"maxmemory": int(values["maxmemory"]), "maxmemory-policy": values["maxmemory-policy"]}, ""
        why = f"CONFIG GET answered {replies!r:.80}"
    except resp.ReplyError as exc:
        why = f"CONFIG GET refused: {exc}"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        info = probe._call(client, [command(b"INFO", b"memory")], lambda r: r.bulk(_REPLY_BYTES))
        fields = dict(row.split(":", 1) for row in (info or b"").decode(errors="replace").splitlines() if ":" in row)
        return {"maxmemory": int(fields["maxmemory"]), "maxmemory-policy": fields["maxmemory_policy"].strip(),
                "from": "INFO memory"}, why
    except Exception as exc:
        return None, f"{why}; INFO memory: {type(exc).__name__}: {exc}"


def _server_version(probe, client) -> str:
    from lmcache_hma.store.redis.wire import command

    try:
        info = probe._call(client, [command(b"INFO", b"server")], lambda r: r.bulk(_REPLY_BYTES))
    except Exception:
        return ""
    for row in (info or b"").decode(errors="replace").splitlines():
        if row.startswith(("redis_version:", "valkey_version:")):
            name, _, version = row.partition(":")
            return f"{'Valkey' if name.startswith('valkey') else 'Redis'} {version.strip()}"
    return ""


def _memory_line(settings: list) -> Line:
    """One verdict on the maxmemory settings of one Redis or of each cluster master."""
    limits = {s["maxmemory"] for s in settings}
    policies = {s["maxmemory-policy"] for s in settings}
    each = " on each master" if len(settings) > 1 else ""
    shown = ", ".join(size_text(m) if m else "0 (no limit)" for m in sorted(limits))
    text = f"maxmemory {shown}, maxmemory-policy {', '.join(sorted(policies))}{each}"
    if any(s.get("from") for s in settings):
        text += " (read from INFO memory)"
    fix = []
    if 0 in limits:
        fix.append("set maxmemory (e.g. CONFIG SET maxmemory 8gb): without it Redis grows until the machine "
                   "runs out of memory")
    policy_fix = f"CONFIG SET maxmemory-policy {RECOMMENDED_POLICY} (and in redis.conf{each})"
    if any(not p.startswith("allkeys-") for p in policies):
        fix.append(f"{policy_fix}: with noeviction or a volatile-* policy (only turn ends carry a TTL) writes "
                   f"fail once Redis is full and objects stop being shared; allkeys-lru keeps fewer whole prefixes")
    elif policies != {RECOMMENDED_POLICY}:
        others = "/".join(sorted(policies - {RECOMMENDED_POLICY}))
        fix.append(f"{policy_fix}: hits use a prefix's chunks at least as often as what follows them, so it "
                   f"evicts leaves first; {others} evicts chunks in the middle of prefixes many requests read")
    if fix:
        return Line(WARN, "redis", text, "; ".join(fix) + f" ({DOCS_EVICTION})")
    return Line(OK, "redis", text)


@dataclass
class RemoteResult:
    lines: list
    maxmemory: Optional[int] = None  # bytes the remote tier may hold (all masters), None: unknown or no limit
    reachable: bool = False


def check_remote(lm) -> Optional[RemoteResult]:
    """PING (the connector's health check), then the maxmemory settings."""
    url = lm.remote_url
    if not url:
        return None
    from lmcache_hma.config.remote_url import CLUSTER_SCHEME, remote_auth, remote_timeout_s

    cluster = url.startswith(CLUSTER_SCHEME)
    auth, timeout_s = remote_auth(lm), remote_timeout_s(lm)
    where = _where(url.split("?", 1)[0])
    warnings: list = []
    with captured_warnings(warnings):
        try:
            probe = _probe_tier(url, auth, timeout_s)
        except Exception as exc:
            return RemoteResult([Line(FAIL, "redis", f"cannot build a client for {where}: {type(exc).__name__}: {exc}",
                                      "fix remote_url")])
        try:
            return _check_reachable(probe, cluster, where, timeout_s, auth)
        finally:
            probe._close_clients()


def _check_reachable(probe, cluster: bool, where: str, timeout_s: float, auth) -> RemoteResult:
    t0 = time.monotonic()
    ok, why = probe._probe()
    elapsed = time.monotonic() - t0
    if not ok:
        return RemoteResult([_down_line(where, why, timeout_s, cluster)])
    user = f" as user {auth.username!r}" if auth is not None and auth.username else ""
    authed = f", authenticated{user}" if auth is not None else ""
    if cluster:
        ranges = probe._slot_map[1]
        masters = sorted({m for _, _, m in ranges})
        silent = [m for m in masters if m in probe._down]
        others = sorted(set(probe._down) - set(masters))
        clients = [(m, probe._node(m)) for m in masters if m not in probe._down]
        version = _server_version(probe, clients[0][1]) if clients else ""
        answered = (f"{len(masters)} masters" if not silent else f"{len(clients)} of {len(masters)} masters")
        lines = [Line(OK, "redis", f"Redis Cluster via {where}: cluster_state ok, {answered} answered PING "
                                   f"({', '.join(m for m, _ in clients)}; checked in {elapsed * 1000:.0f} ms, each "
                                   f"call's deadline {timeout_s:g} s, hma_remote_timeout_s){authed}"
                                   f"{f'; {version}' if version else ''}")]
        if silent:
            lines.append(Line(WARN, "redis", f"Redis Cluster masters not answering within {timeout_s:g} s: "
                                             f"{', '.join(silent)}",
                              "their slots' objects are misses and writes to them are skipped until they "
                              "answer or a replica takes over; look at those servers"))
        if others:
            lines.append(Line(WARN, "redis", f"Redis Cluster replicas not answering: {', '.join(others)}",
                              "a failover of their masters has no replica to take over"))
    else:
        clients = [(where, probe._client)]
        version = _server_version(probe, probe._client)
        lines = [Line(OK, "redis", f"Redis at {where} answered PING in {elapsed * 1000:.1f} ms (deadline "
                                   f"{timeout_s:g} s, hma_remote_timeout_s){authed}"
                                   f"{f'; {version}' if version else ''}")]
    settings, failures = [], []
    for name, client in clients:
        got, why = _memory_settings(probe, client)
        if got is None:
            failures.append(f"{name}: {why}")
            continue
        settings.append(got)
        if why:
            failures.append(f"{name}: {why}")
    if failures:
        fix = ("read from INFO memory instead" if settings else
               f"check maxmemory and maxmemory-policy on the server yourself ({DOCS_EVICTION})")
        lines.append(Line(WARN, "redis", "maxmemory / maxmemory-policy not read back with CONFIG GET ("
                                         + "; ".join(failures) + "): CONFIG is disabled or renamed, or this "
                                         "user may not run it", fix))
    if settings:
        lines.append(_memory_line(settings))
    limit = None
    if settings and len(settings) == len(clients) and all(s["maxmemory"] for s in settings):
        limit = sum(s["maxmemory"] for s in settings)
    return RemoteResult(lines, limit, True)
