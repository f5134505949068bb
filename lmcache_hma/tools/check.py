"""``lmcache-hma check``: is this configuration ready to serve? One line per check.

Reads the LMCache YAML as the connector will (``load_config``, with ``--extra-config`` as
vLLM's ``kv_connector_extra_config``), then reaches each tier it names:

* CPU: ``max_local_cpu_size`` against this machine's memory (LMCache 0.5.6 allocates it in full,
  in every vLLM worker);
* disk: the directory prepared as the worker prepares it (``prepare_disk_dir``: created with mode
  0700, refused when others can write it), a probe file written and removed, its mode and the
  free space;
* Redis / Redis Cluster: PING through the connector's own Redis code (``store.redis``: the same
  client, handshake and deadline, ``hma_remote_timeout_s``), the credentials, and ``maxmemory`` /
  ``maxmemory-policy`` read back (``CONFIG GET``; ``INFO memory`` when CONFIG is disabled).

With ``--model`` (a model directory, or a Hugging Face id whose config.json is already in the
local Hugging Face cache: nothing is downloaded, no weights are read) it also estimates what one
stored token costs for that model, by layer kind, against an all-layers connector, and how many
tokens each tier holds.

Each line is ``OK``, ``WARN`` or ``FAIL`` with the reason and, when something is wrong, the
fix. The exit status is 1 when any line is ``FAIL``, 2 for a usage error, else 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

OK, WARN, FAIL = "OK", "WARN", "FAIL"
CONFIG_ENV = "LMCACHE_CONFIG_FILE"
TRAILER_BYTES = 128  # every stored object's trailer (core/objects.py)
DOCS_EVICTION = "docs/redis.md#eviction-policy"


@dataclass
class Line:
    """One check's verdict: ``what`` was checked, ``reason``, and ``fix`` when it is not OK."""

    verdict: str
    what: str
    reason: str
    fix: str = ""
    details: list = field(default_factory=list)  # indented lines printed under it

    @property
    def message(self) -> str:
        return f"{self.reason}: {self.fix}" if self.fix else self.reason

    def __str__(self) -> str:
        head = f"{self.verdict:<4} {self.what}: {self.message}"
        return "\n".join([head, *(f"     {d}" for d in self.details)])


class UsageError(Exception):
    """A bad command line (exit status 2)."""


# -- sizes -------------------------------------------------------------------------------------
def _size(n: float) -> str:
    """``n`` bytes for people: 512 B, 1.5 KiB, 2 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B" if n == int(n) else f"{n:.1f} B"


def _tokens(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    """Bytes with thousands separators (per-token figures)."""
    return f"{n:,.0f} B"


# -- the configuration -------------------------------------------------------------------------
@contextmanager
def _captured_warnings(into: list):
    """The ``lmcache_hma`` logger's warnings go into ``into`` (as text) instead of stderr, and
    nothing logs at INFO or below meanwhile (this command's output is its lines)."""
    root = logging.getLogger("lmcache_hma")
    from lmcache_hma.log import get_logger

    get_logger()  # its handler exists (so that restoring it below restores it)

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                text = record.getMessage()
                into.append(text[len("LMCacheHMA: "):] if text.startswith("LMCacheHMA: ") else text)

    saved, disabled = root.handlers[:], logging.root.manager.disable
    root.handlers = [_Keep()]
    logging.disable(max(disabled, logging.INFO))  # LMCache's info lines at import (its device, ...)
    try:
        yield into
    finally:
        logging.disable(disabled)
        root.handlers = saved


def load(config: Optional[str], extra: Optional[dict] = None):
    """``(HMAConfig or None, [Line])``: the configuration read as the connector reads it."""
    from lmcache_hma.config.errors import ConfigError
    from lmcache_hma.config.settings import load_config

    given = dict(extra or {})
    if config:
        given.setdefault("lmcache_config_file", str(config))
    source = given.get("lmcache_config_file") or os.environ.get(CONFIG_ENV)
    warnings: list = []
    try:
        with _captured_warnings(warnings):
            cfg = load_config(given)
    except ConfigError as exc:
        return None, [Line(FAIL, "config", str(exc))]
    except Exception as exc:  # LMCache's own parser, an unreadable file, ...
        return None, [Line(FAIL, "config", f"{source or 'LMCache defaults'}: {type(exc).__name__}: {exc}",
                           "fix the YAML")]
    lines = []
    if source is None:
        lines.append(Line(WARN, "config", "no YAML given (--config, or the environment variable "
                                          f"{CONFIG_ENV}): the connector would run on LMCache's defaults "
                                          "(a 5 GB CPU tier)", f"pass --config PATH or set {CONFIG_ENV}"))
    lm = cfg.lmcache
    lines.append(Line(OK, "config", f"{source or 'LMCache defaults'} is valid (chunk_size {lm.chunk_size}; "
                                    f"tiers: {', '.join(_tier_names(lm)) or 'none'})"))
    lines += [Line(WARN, "config", w) for w in warnings if not w.startswith("no LMCache config file")]
    return cfg, lines


def _tier_names(lm) -> list:
    names = ["cpu"] if lm.local_cpu else []
    if lm.local_disk:
        names.append("disk")
    if lm.remote_url:
        names.append("redis-cluster" if lm.remote_url.startswith("redis-cluster://") else "redis")
    return names


# -- CPU -----------------------------------------------------------------------------------------
def memory_info() -> tuple[Optional[int], Optional[int], str]:
    """(total bytes, available bytes, where the limit comes from) of this machine or its cgroup."""
    total = avail = None
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for row in f:
                key, _, rest = row.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        total, avail = fields.get("MemTotal"), fields.get("MemAvailable")
    except (OSError, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    where = "this machine"
    limit, used = _cgroup_memory()
    if limit is not None and (total is None or limit < total):
        total, where = limit, "this container (cgroup limit)"
        if used is not None:
            avail = max(0, limit - used) if avail is None else min(avail, max(0, limit - used))
    return total, avail, where


def _cgroup_memory() -> tuple[Optional[int], Optional[int]]:
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if not text.isdigit() or int(text) >= 2**60:  # "max", or v1's "unlimited"
            return None, None
        try:
            used = int(Path(used_file).read_text().strip())
        except (OSError, ValueError):
            used = None
        return int(text), used
    return None, None


def check_cpu(lm) -> Line:
    gib = float(lm.max_local_cpu_size)
    nbytes = int(gib * 2**30)
    role = "the CPU tier" if lm.local_cpu else "a staging buffer (local_cpu: false: not a tier)"
    total, avail, where = memory_info()
    reason = (f"max_local_cpu_size {gib:.10g} GiB is {role}, allocated in full by each vLLM worker "
              f"(each tensor-parallel rank)")
    if total is None:
        return Line(WARN, "cpu", f"{reason}; this machine's memory could not be read", "")
    have = f"{where} has {_size(total)}" + (f", {_size(avail)} available" if avail is not None else "")
    if nbytes > total:
        return Line(FAIL, "cpu", f"{reason}: more than {have}", "lower max_local_cpu_size")
    if avail is not None and nbytes > avail:
        return Line(WARN, "cpu", f"{reason}: more than is available now ({have})",
                    "lower max_local_cpu_size or free memory: the worker may fail to allocate it or "
                    "push other processes out")
    return Line(OK, "cpu", f"{reason}; {have}")


# -- disk ----------------------------------------------------------------------------------------
def check_disk(lm) -> Optional[Line]:
    """The disk tier's directory, prepared as the worker prepares it, and a probe file."""
    url = lm.local_disk
    if not url:
        return None
    from lmcache_hma.config.errors import ConfigError
    from lmcache_hma.store.local_tiers import prepare_disk_dir

    path = url[len("file://"):] if url.startswith("file://") else url
    path = path.rstrip("/") or "/"
    created = _missing_parents(path)
    try:
        prepare_disk_dir(url)
    except ConfigError as exc:
        return Line(FAIL, "disk", str(exc))
    try:
        st = os.stat(path)
        probe = os.path.join(path, f".lmcache_hma_check.{os.getpid()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return Line(FAIL, "disk", f"local_disk {path!r}: cannot write a file there ({exc.strerror or exc})",
                        "make it writable by this user, or use another directory")
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        size = int(float(lm.max_local_disk_size) * 2**30)
        usage = shutil.disk_usage(path)
        held = _files_bytes(path)
        mode = f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid} (this user)"
        state = ("not there yet: created with mode 0700 for the probe and removed again (the connector "
                 "creates it at start)" if created else mode)
        reason = (f"local_disk {path}/ {state}; a probe file was written and removed; tier "
                  f"{_size(size)}, {_size(usage.free)} free on its file system")
        if usage.free + held < size:
            return Line(WARN, "disk", f"{reason}: the tier can fill the file system",
                        "lower max_local_disk_size or free space (a full file system fails the tier's writes)")
        return Line(OK, "disk", reason)
    finally:
        for d in created:  # only what this check created, deepest first
            try:
                os.rmdir(d)
            except OSError:
                break


def _missing_parents(path: str) -> list:
    """The directories of ``path`` that are not there yet, deepest first."""
    out, p = [], os.path.abspath(path)
    while p and not os.path.lexists(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out


def _files_bytes(path: str) -> int:
    total = 0
    try:
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


# -- Redis ---------------------------------------------------------------------------------------
def _probe_tier(url: str, auth, timeout_s: float):
    """The connector's Redis tier class (``RedisTier`` or ``RedisClusterTier``) with its clients,
    handshake and deadline, but without LMCache's connector and the health thread: its
    ``_probe`` is the health check the worker runs at start and every second."""
    from lmcache_hma.config.remote_url import CLUSTER_SCHEME
    from lmcache_hma.store.redis.cluster_tier import RedisClusterTier
    from lmcache_hma.store.redis.node_tier import RedisTier

    base = RedisClusterTier if url.startswith(CLUSTER_SCHEME) else RedisTier

    class Probe(base):
        def __init__(self) -> None:  # RedisTier.__init__ less LMCache's connector and the thread
            self._manager = None
            self.url = url.split("?", 1)[0]
            self._creds = {}
            if auth is not None:
                self._creds["password"] = auth.password
                if auth.username:
                    self._creds["username"] = auth.username
            self._timeout_s = timeout_s
            self._connector = None
            self.up = True
            self.not_written = self.protocol_errors = self.health_errors = 0
            self._counts_lock = threading.Lock()
            self._write_trouble = False
            self._stop = threading.Event()
            self._setup(url)

    return Probe()


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
    shown = ", ".join(_size(m) if m else "0 (no limit)" for m in sorted(limits))
    text = f"maxmemory {shown}, maxmemory-policy {', '.join(sorted(policies))}{each}"
    if any(s.get("from") for s in settings):
        text += " (read from INFO memory)"
    fix = []
    if 0 in limits:
        fix.append("set maxmemory (e.g. CONFIG SET maxmemory 8gb): without it Redis grows until the machine "
                   "runs out of memory")
    if any(not p.startswith("allkeys-") for p in policies):
        fix.append("set maxmemory-policy allkeys-lru (or allkeys-lfu): with noeviction or a volatile-* policy "
                   "(the connector's keys carry no TTL) every write fails once Redis is full, and objects "
                   "stop being shared")
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
    with _captured_warnings(warnings):
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


def tier_checks(cfg) -> tuple[list, Optional[RemoteResult]]:
    """The lines of every tier of ``cfg`` (an ``HMAConfig``), and the remote tier's result."""
    lm = cfg.lmcache
    lines = [check_cpu(lm)]
    disk = check_disk(lm)
    if disk is not None:
        lines.append(disk)
    remote = check_remote(lm)
    if remote is not None:
        lines += remote.lines
    return lines, remote


# -- the model -----------------------------------------------------------------------------------
class ModelError(Exception):
    """The model's config.json cannot be found or read (one line, with what to do)."""


DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
FULL, SLIDING, GDN = "full attention", "sliding window", "gated delta net"
_KINDS = {"full_attention": FULL, "sliding_attention": SLIDING}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read now, not at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def find_model_file(model: str, filename: str = "config.json") -> Path:
    """``filename`` of ``model``: a directory, or a Hugging Face id already in the local cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        found = path / filename
        if not found.is_file():
            raise ModelError(f"{model}: the directory has no {filename}")
        return found
    if path.is_file() and filename == "config.json" and path.suffix == ".json":
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelError(f"{model}: not a model directory")
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    try:
        found = try_to_load_from_cache(model, filename, cache_dir=str(cache))
    except Exception as exc:  # e.g. an id that is not one
        raise ModelError(f"{model}: not a model directory, nor a Hugging Face id ({exc})") from None
    if not isinstance(found, str):
        raise ModelError(f"{model}: not a model directory, and its {filename} is not in the Hugging Face cache "
                         f"({cache}); nothing is downloaded here: pass the model's directory, or fetch the file "
                         f"first (huggingface-cli download {model} {filename})")
    return Path(found)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model's config.json (its text model's)."""

    name: str
    architecture: str
    model_type: str
    layers: tuple  # per layer: FULL, SLIDING, GDN or the config's own name of an unknown kind
    sliding_window: int
    kv_heads: int
    head_dim: int
    dtype: str
    gdn_state_bytes: int = 0  # per gated-delta-net layer: conv state + recurrent state
    max_position_embeddings: Optional[int] = None
    notes: tuple = ()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layers if k == kind)

    @property
    def unknown(self) -> dict:
        out: dict = {}
        for k in self.layers:
            if k not in (FULL, SLIDING, GDN):
                out[k] = out.get(k, 0) + 1
        return out


def _config_dicts(config_path: Path) -> tuple[dict, dict, str]:
    """(the text model's settings, the whole config.json, how they were read): through
    transformers' config class when it knows the model (it fills in the defaults a config.json
    leaves out, e.g. Gemma-3's head_dim and layer pattern), else the file's own keys."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{config_path}: not a JSON object")
    try:
        from transformers import AutoConfig  # a local directory: nothing is downloaded

        conf = AutoConfig.from_pretrained(str(config_path.parent), local_files_only=True)
        text = conf.get_text_config().to_dict()
        return text, raw, "transformers"
    except Exception:
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        return text, raw, "config.json"


def _layer_kinds(text: dict, model_type: str) -> tuple[tuple, list]:
    """(the kind of each layer, notes on what was assumed)."""
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise ModelError("config.json gives no num_hidden_layers")
    notes: list = []
    types = text.get("layer_types")
    gdn = model_type in GDN_MODEL_TYPES
    if isinstance(types, list) and types:
        if len(types) != n:
            notes.append(f"layer_types names {len(types)} layers, num_hidden_layers {n}: the first {n} counted")
        kinds = []
        for t in types[:n]:
            if t == "linear_attention" and gdn:
                kinds.append(GDN)
            else:
                kinds.append(_KINDS.get(t, str(t)))
        return tuple(kinds), notes
    if model_type.startswith("gemma3"):
        pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6
        notes.append(f"no layer_types: every {pattern}th layer full attention (sliding_window_pattern)")
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)), notes
    if model_type in ("gemma2", "gpt_oss"):
        notes.append("no layer_types: sliding and full attention alternate")
        return tuple(FULL if (i + 1) % 2 == 0 else SLIDING for i in range(n)), notes
    if gdn:
        interval = text.get("full_attention_interval") or 4
        notes.append(f"no layer_types: every {interval}th layer full attention (full_attention_interval)")
        return tuple(FULL if (i + 1) % interval == 0 else GDN for i in range(n)), notes
    if text.get("sliding_window") and text.get("use_sliding_window", True) is not False:
        notes.append("no layer_types: every layer assumed a sliding-window layer (sliding_window is set)")
        return (SLIDING,) * n, notes
    return (FULL,) * n, notes


def read_model(model: str, kv_dtype: Optional[str] = None) -> ModelShape:
    """The shape of ``model`` (a directory or a cached Hugging Face id) from its config.json."""
    config_path = find_model_file(model)
    text, raw, how = _config_dicts(config_path)
    model_type = str(text.get("model_type") or raw.get("model_type") or "")
    kinds, notes = _layer_kinds(text, model_type)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") // heads if heads and text.get("hidden_size") else None)
    if not kv_heads or not head_dim:
        raise ModelError(f"{config_path}: no num_key_value_heads / head_dim (nor hidden_size and "
                         f"num_attention_heads) to size the KV cache from")
    given = kv_dtype or str(raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype")
                            or text.get("dtype") or "").replace("torch.", "")
    if kv_dtype:
        if kv_dtype not in DTYPE_BYTES:
            raise ModelError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        dtype = kv_dtype
    elif given in ("bfloat16", "float16"):
        dtype = given
    else:
        dtype = "bfloat16"
        notes.append(f"KV in bfloat16 (the model's dtype is {given or 'not given'}; vLLM serves float32 "
                     f"weights in 16 bits by default; --kv-dtype to change)")
    window = int(text.get("sliding_window") or 0) if SLIDING in kinds else 0
    state = 0
    if GDN in kinds:
        kernel = text.get("linear_conv_kernel_dim") or 4
        kd, vd = text.get("linear_key_head_dim") or 128, text.get("linear_value_head_dim") or 128
        nk, nv = text.get("linear_num_key_heads") or 16, text.get("linear_num_value_heads") or 32
        conv = (kernel - 1) * (kd * nk * 2 + vd * nv) * DTYPE_BYTES[dtype]
        state = conv + nv * kd * vd * 4
        notes.append("recurrent states counted in float32 (vLLM's CPU build keeps them so; a GPU engine keeps "
                     "them in the model's dtype unless --mamba-ssm-cache-dtype float32: about half)")
    if how == "config.json":
        notes.append("read from config.json alone (transformers does not know this model): keys it leaves out "
                     "were not filled in")
    arch = (raw.get("architectures") or [model_type or "?"])[0]
    name = Path(model).name if Path(model).expanduser().is_dir() else model
    return ModelShape(name=name, architecture=str(arch), model_type=model_type, layers=kinds,
                      sliding_window=window, kv_heads=int(kv_heads), head_dim=int(head_dim), dtype=dtype,
                      gdn_state_bytes=state, max_position_embeddings=text.get("max_position_embeddings"),
                      notes=tuple(notes))


def default_interval(shape: ModelShape, chunk: int) -> int:
    """``hma_checkpoint_interval``'s default (``core.layout.checkpoint_interval``): the largest
    window rounded up to whole chunks; one chunk without windows."""
    return max(chunk, -(-shape.sliding_window // chunk) * chunk)


PREFILL_STEP = 2048  # --max-num-batched-tokens assumed for where vLLM hands recurrent states over


@dataclass(frozen=True)
class Costs:
    """Estimated bytes stored per prompt token of long prompts, by what they are, and what each
    prompt adds at its end."""

    full: float
    tails: float
    states: float
    trailers: float
    all_layers: float
    interval: int  # tokens between stored tails
    state_every: int  # tokens between stored states
    tail_bytes: int  # one tail object
    state_bytes: int  # one state object

    @property
    def total(self) -> float:
        return self.full + self.tails + self.states + self.trailers


def costs(shape: ModelShape, chunk: int = 256, interval: int = 0, prefill_step: int = PREFILL_STEP) -> Costs:
    """Per stored token: the full-attention KV of every chunk; a tail (a window of every sliding
    layer's KV) every ``interval`` tokens; a state (every gated-delta-net layer's) where vLLM
    hands one over on a multiple of the interval, which it does only where a prefill step of
    ``prefill_step`` tokens ends; a 128-byte trailer per object. An all-layers connector stores
    every layer's blocks: a sliding layer's as a full one's, and a gated-delta-net layer's state
    page per block, which vLLM sizes to an attention layer's page (about one attention layer's
    KV per token)."""
    interval = interval or default_interval(shape, chunk)
    kv = shape.kv_bytes_per_token_layer
    tail = shape.count(SLIDING) * kv * shape.sliding_window
    state = shape.count(GDN) * shape.gdn_state_bytes
    state_every = math.lcm(interval, max(1, prefill_step)) if state else interval
    full = shape.count(FULL) * kv
    objects = (1 if full else 0) / chunk + (1 if tail else 0) / interval + (1 if state else 0) / state_every
    all_layers = (shape.count(FULL) + shape.count(SLIDING) + shape.count(GDN)) * kv
    return Costs(full, tail / interval, state / state_every, objects * TRAILER_BYTES, all_layers, interval,
                 state_every, tail, state)


def model_lines(shape: ModelShape, cfg, remote: Optional[RemoteResult], prefill_step: int = PREFILL_STEP) -> list:
    lm = cfg.lmcache if cfg is not None else None
    chunk = lm.chunk_size if lm is not None else 256
    c = costs(shape, chunk, cfg.checkpoint_interval if cfg is not None else 0, prefill_step)
    kinds = [f"{shape.count(FULL)} full attention"]
    if shape.count(SLIDING):
        kinds.append(f"{shape.count(SLIDING)} sliding window {shape.sliding_window}")
    if shape.count(GDN):
        kinds.append(f"{shape.count(GDN)} gated delta net ({_size(shape.gdn_state_bytes)} of state each)")
    kinds += [f"{n} {k}" for k, n in shape.unknown.items()]
    kv = shape.kv_bytes_per_token_layer
    head = (f"{shape.name} ({shape.architecture}): {len(shape.layers)} layers: {', '.join(kinds)}; KV "
            f"{_bytes(kv)} per token per layer ({shape.kv_heads} KV head{'s' if shape.kv_heads != 1 else ''} x "
            f"{shape.head_dim} x {shape.dtype})")
    parts = [f"full attention {_bytes(c.full)}"]
    if c.tails:
        parts.append(f"sliding tails {_bytes(c.tails)} ({shape.count(SLIDING)} layers' {shape.sliding_window}-token "
                     f"window every {c.interval} tokens)")
    if c.states:
        parts.append(f"recurrent states {_bytes(c.states)} ({shape.count(GDN)} layers' states every "
                     f"{c.state_every} tokens: where {prefill_step}-token prefill steps end, on the "
                     f"{c.interval}-token interval)")
    parts.append(f"object trailers {_bytes(c.trailers)}")
    ratio = f" ({c.total / c.all_layers:.2f}x)" if c.all_layers else ""
    details = [f"per stored token (an estimate; chunk_size {chunk}): " + " + ".join(parts)
               + f" = {_bytes(c.total)}; an all-layers connector: {_bytes(c.all_layers)}{ratio}"]
    ends = []
    if c.tail_bytes:
        ends.append(f"up to 2 more tails ({_size(c.tail_bytes)} each) at its last chunk boundaries")
    if c.state_bytes:
        ends.append(f"a state ({_size(c.state_bytes)}) at its last block boundary")
    if ends:
        details.append("each prompt adds " + " and ".join(ends) + "; short prompts cost more per token")
    if lm is not None:
        tiers = []
        if lm.local_cpu:
            size = float(lm.max_local_cpu_size) * 2**30
            tiers.append(f"cpu {_size(size)}: ~{_tokens(size / c.total)} tokens")
        if lm.local_disk:
            size = float(lm.max_local_disk_size) * 2**30
            tiers.append(f"disk {_size(size)}: ~{_tokens(size / c.total)} tokens")
        if lm.remote_url:
            if remote is not None and remote.maxmemory:
                tiers.append(f"redis (maxmemory {_size(remote.maxmemory)}): ~{_tokens(remote.maxmemory / c.total)} "
                             f"tokens")
            else:
                tiers.append("redis: maxmemory unknown or unlimited")
        if tiers:
            details.append("capacity (an estimate for long prompts of this model; every object goes to every "
                           "tier): " + "; ".join(tiers))
    details += [f"note: {n}" for n in shape.notes]
    lines = [Line(OK, "model", head, details=details)]
    if shape.unknown:
        lines.append(Line(WARN, "model", f"layer kinds {', '.join(shape.unknown)} are not counted: the connector "
                                         f"serves full-attention, sliding-window and gated-delta-net layers "
                                         f"(Qwen3-Next, Qwen3.5) only and refuses others at start "
                                         f"(docs/models.md)"))
    if not shape.count(SLIDING) and not shape.count(GDN) and not shape.unknown:
        lines.append(Line(WARN, "model", "not a hybrid model: every layer is full attention, so the connector "
                                         "stores what an all-layers connector stores"))
    return lines


# -- the command ---------------------------------------------------------------------------------
def run(config: Optional[str], extra: Optional[dict] = None, model: Optional[str] = None,
        kv_dtype: Optional[str] = None, out: Callable[[str], None] = print,
        prefill_step: int = PREFILL_STEP) -> int:
    """Every check, each line printed by ``out`` as it is found; 1 when any FAIL, else 0."""
    lines: list = []

    def say(new: list) -> None:
        for line in new:
            lines.append(line)
            out(str(line))

    cfg, found = load(config, extra)
    say(found)
    remote = None
    if cfg is not None:
        tiers, remote = tier_checks(cfg)
        say(tiers)
    if model:
        try:
            shape = read_model(model, kv_dtype)
        except ModelError as exc:
            say([Line(FAIL, "model", str(exc))])
        else:
            say(model_lines(shape, cfg, remote, prefill_step))
    fails = sum(1 for line in lines if line.verdict == FAIL)
    warns = sum(1 for line in lines if line.verdict == WARN)
    out(f"{fails} FAIL, {warns} WARN")
    return 1 if fails else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-hma check",
        description="Check a configuration before serving: the YAML as the connector reads it, each tier it "
                    "names (CPU memory, the disk directory, Redis or Redis Cluster), and with --model an "
                    "estimate of the bytes one stored token costs. One line per check: OK, WARN or FAIL with "
                    "the reason and the fix.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when no check FAILs, 1 when one does, 2 for a usage error.\n"
               f"environment: {CONFIG_ENV}: the YAML when --config is not given (as the connector reads it);\n"
               "  HF_HUB_CACHE / HF_HOME: where --model looks up a Hugging Face id's config.json.")
    parser.add_argument("--config", metavar="YAML", default=None,
                        help=f"the LMCache YAML (default: ${CONFIG_ENV})")
    parser.add_argument("--extra-config", metavar="JSON", default=None,
                        help="vLLM's kv_connector_extra_config as JSON, e.g. '{\"hma_remote_timeout_s\": 1.0}'")
    parser.add_argument("--model", metavar="DIR_OR_HF_ID", default=None,
                        help="estimate bytes per stored token and tokens per tier for this model: a model "
                             "directory, or a Hugging Face id whose config.json is in the local cache "
                             "(nothing is downloaded, no weights are read)")
    parser.add_argument("--kv-dtype", metavar="DTYPE", default=None, choices=sorted(DTYPE_BYTES),
                        help="the KV cache's dtype for the estimate (vLLM's --kv-cache-dtype; default: the "
                             "model's, float32 counted as bfloat16)")
    parser.add_argument("--max-num-batched-tokens", metavar="N", type=int, default=PREFILL_STEP,
                        help="vLLM's --max-num-batched-tokens, for the estimate of a gated-delta-net model: vLLM "
                             f"hands recurrent states over only where a prefill step ends (default {PREFILL_STEP})")
    return parser


def parse_extra(text: Optional[str]) -> dict:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-config is not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise UsageError(f"--extra-config must be a JSON object (kv_connector_extra_config), got {text!r}")
    return extra


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = parse_extra(args.extra_config)
    except UsageError as exc:
        print(f"lmcache-hma check: {exc}", file=sys.stderr)
        return 2
    if args.max_num_batched_tokens <= 0:
        print("lmcache-hma check: --max-num-batched-tokens must be > 0", file=sys.stderr)
        return 2
    return run(args.config, extra, args.model, args.kv_dtype, out=lambda s: print(s, flush=True),
               prefill_step=args.max_num_batched_tokens)


if __name__ == "__main__":
    sys.exit(main())
