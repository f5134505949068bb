"""The local tiers of ``lmcache-hma check``, and every tier of a configuration in turn.

Contract: ``check_cpu`` weighs ``max_local_cpu_size`` against this machine's (or its cgroup's)
memory (LMCache 0.5.6 allocates it in full, in every vLLM worker); ``check_disk`` prepares the
disk tier's directory as the worker does (``prepare_disk_dir``), writes and removes a probe file,
and leaves behind only what was there before; ``tier_checks`` gives the lines of every tier an
``HMAConfig`` names (the remote one through ``redis_probe.check_remote``) and the remote result.
Each verdict is a ``check_lines.Line``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from lmcache_hma.tools.check_lines import FAIL, OK, WARN, Line, size_text
from lmcache_hma.tools.redis_probe import RemoteResult, check_remote


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
    have = f"{where} has {size_text(total)}" + (f", {size_text(avail)} available" if avail is not None else "")
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
                  f"{size_text(size)}, {size_text(usage.free)} free on its file system")
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


# -- every tier ----------------------------------------------------------------------------------
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

