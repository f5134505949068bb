"""LMCache's local tiers (``LocalCPUBackend``, ``LocalDiskBackend``) as ``Tier``s.

The CPU tier is memory: objects read from the other tiers are kept there, and it
holds only objects sealed here or verified on their way in. The disk tier's index
is rebuilt from its directory at start (``reindex_disk``); its room is given back
whenever an object leaves it, and a write it does not make is counted
(``lmcache_compat.keep_disk_room``).
"""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

import torch

from lmcache_hma.core.kinds import TIERS
from lmcache_hma.log import get_logger
from lmcache_hma.store import lmcache_compat
from lmcache_hma.store.tier import Tier

logger = get_logger(__name__)

CPU_BACKEND, DISK_BACKEND = "LocalCPUBackend", "LocalDiskBackend"


class LocalTier(Tier):
    """One of LMCache's local backends, removing through its ``StorageManager``."""

    def __init__(self, manager, name: str, backend, label: str) -> None:
        self._manager, self.name, self.backend, self.label = manager, name, backend, label
        self.memory = self.trusted = name == CPU_BACKEND
        # the disk tier: its room given back on removals, its puts told taken or not written
        self._disk = lmcache_compat.keep_disk_room(backend) if name == DISK_BACKEND else None
        self.not_read_no_memory = 0  # objects held here but not read: no CPU memory to read them into

    def usable(self) -> bool:
        return self.name not in lmcache_compat.bypassed(self._manager)

    def fill(self) -> Optional[float]:
        """The CPU tier: its memory allocated (objects held, and those on their way in or out);
        the disk tier: its bytes on disk; each of its LMCache size."""
        return lmcache_compat.backend_fill(self.backend)

    def present_many(self, keys: Sequence) -> list[bool]:
        return [self.backend.contains(k) for k in keys]

    def fetch_many(self, keys, object_bytes, allocate, check=None, deadline=None) -> list:
        """The objects LMCache holds (its references, handed to the caller). A key the tier
        lists but cannot read (a deleted file) loses its entry: evicted from memory
        meanwhile is normal, a file gone is stale."""
        out: list = [None] * len(keys)
        for i, key in enumerate(keys):
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not self.backend.contains(key):
                continue
            try:
                obj = self.backend.get_blocking(key)
            except lmcache_compat.NoMemoryForRead:  # nothing evictable to read into now: a miss
                logger.info("LMCacheHMA: no CPU memory to read %d objects from %s into; they are misses "
                            "now", len(keys) - i, self.name)
                self.not_read_no_memory += len(keys) - i
                break
            except Exception as exc:  # a tier failing mid-read is a miss, not a crash
                logger.warning("LMCacheHMA: reading %s from %s failed: %s", key.to_string(), self.name, exc)
                obj = None
            if obj is None:
                if not self.memory:
                    self.remove(key)
                continue
            why = check(i, obj) if check is not None else None
            if why is not None:
                obj.ref_count_down()
            out[i] = obj if why is None else why
        return out

    def store_many(self, keys, objs, on_stored=None, expires=None) -> list[bool]:
        """The CPU tier takes every object; the disk tier may not write one (no room it can make,
        a failed write: counted as ``objects_not_on_disk``), nor does a bypassed tier."""
        if not self.usable():
            if self._disk is not None:
                for key in keys:
                    self._disk.not_stored(key, "the tier is bypassed")
            return [False] * len(keys)
        if self._disk is not None:
            return [self._disk.put(key, obj, on_stored) for key, obj in zip(keys, objs)]
        self.backend.batched_submit_put_task(list(keys), list(objs), on_complete_callback=on_stored)
        return [True] * len(keys)

    def wait_written(self, key, deadline: float) -> None:
        """The disk tier: a write of ``key`` still under way makes LMCache refuse another put of it
        ("already in progress": a rewritten marker lost, a later miss), so it is let land first."""
        while self._disk is not None and lmcache_compat.disk_writing(self.backend, key) \
                and time.monotonic() < deadline:
            time.sleep(0.002)

    def make_way(self, key) -> None:
        if self.holds(key):
            self.remove(key)

    def holds(self, key) -> bool:
        """Whether the tier's index has ``key`` (no lock: a racy answer only ranks an eviction)."""
        return key in lmcache_compat.backend_index(self.backend)

    def touch(self, keys: Sequence) -> None:
        """Tell the tier's cache policy that ``keys`` were read (a hit used them).

        Workaround: LMCache 0.5.6's ``LocalCPUBackend.get_blocking`` does not (only its own
        lookup path, ``contains(pin=True)`` then ``touch_cache``, does), so its LRU evicted in
        the order objects were stored, whatever was read since. Its disk tier's reads do."""
        with lmcache_compat.backend_lock(self.backend):
            index = lmcache_compat.backend_index(self.backend)
            for key in keys:
                if key in index:
                    self.backend.cache_policy.update_on_hit(key, index)

    def keep(self, key, obj, on_stored=None) -> None:
        """Keep a verified object read from another tier (takes its own reference)."""
        self.backend.submit_put_task(key, obj, on_complete_callback=on_stored)

    def observe_removals(self, removed) -> None:
        lmcache_compat.observe_removals(self.backend, removed)

    def counters(self) -> dict:
        not_written = self._disk.not_written if self._disk is not None else 0
        out = {"objects_not_on_disk": not_written} if not_written else {}
        if self.not_read_no_memory:
            out["objects_not_read_no_memory"] = self.not_read_no_memory
        return out

    def writes_pending(self) -> bool:
        return self.name == DISK_BACKEND and lmcache_compat.disk_writes_pending(self.backend)

    def close(self, timeout_s: float) -> None:
        """Let the disk tier's writes in flight land, for up to ``timeout_s``: each reads its
        object's bytes from LMCache's CPU memory, which ``StorageManager.close`` frees (see
        ``ChunkStore.close``)."""
        deadline = time.monotonic() + timeout_s
        while self.writes_pending() and time.monotonic() < deadline:
            time.sleep(0.005)

    def remove(self, key) -> None:
        try:
            self._manager.remove(key, locations=[self.name])
        except Exception as exc:
            logger.warning("LMCacheHMA: removing %s from %s failed: %s", key.to_string(), self.name, exc)

    def clear(self, ours) -> int:
        removed = 0
        for key in lmcache_compat.local_keys(self.backend):
            if ours(key):
                self.remove(key)
                removed += 1
        return removed


def for_backend(manager, name: str, backend) -> Optional[list]:
    """``[the tier]`` over one of LMCache's local backends, ``[]`` for a CPU backend that only
    stages (``local_cpu: false``), None for a backend that is not local."""
    if name == CPU_BACKEND:
        return [LocalTier(manager, name, backend, TIERS[0])] if lmcache_compat.is_cpu_tier(backend) else []
    if name == DISK_BACKEND:
        return [LocalTier(manager, name, backend, TIERS[1])]
    return None


def reindex_disk(tier: LocalTier, parse_name, dtype: torch.dtype, stale=None) -> tuple[int, int]:
    """Register this namespace's objects already on the disk tier, and remove its stale files.

    ``parse_name(file name)`` gives the key of a file of this namespace, else None;
    ``stale(file name)``: whether a file is this namespace's in an earlier format or under another
    weights generation (``ObjectKeys.stale_file``): no lookup asks for it again, so it is removed
    (its bytes would otherwise sit beside a full tier for good, never indexed nor counted).
    Returns (objects registered, files left alone). One INFO line says what was found, removed
    and left, in files and bytes.

    Workaround: LMCache 0.5.6's LocalDiskBackend keeps its index in memory only, so a
    restarted engine sees an empty disk tier although the files are there (``contains``
    is False for every key written by the previous process). The file names are
    ``key.to_string() + ".pt"`` and the bytes are the raw object, so the index is rebuilt
    from the directory; the trailer still checks every object on load. Anything else in
    the directory (another namespace's objects, stray files) is never read, indexed or
    removed: a directory may be shared by deployments.
    """
    from lmcache.v1.memory_management import MemoryFormat

    path = getattr(tier.backend, "path", None)
    if not path or not os.path.isdir(path):
        return 0, 0
    elem = dtype.itemsize
    entries, foreign, foreign_bytes, removed, removed_bytes = [], 0, 0, 0, 0
    for name in os.listdir(path):
        key = parse_name(name)
        full = os.path.join(path, name)
        if key is None or not os.path.isfile(full):
            size = _file_size(full)
            if key is None and stale is not None and stale(name) and os.path.isfile(full):
                try:
                    os.remove(full)
                    removed, removed_bytes = removed + 1, removed_bytes + size
                    continue
                except OSError as exc:
                    logger.warning("LMCacheHMA: removing the stale file %s failed: %s", full, exc)
            foreign, foreign_bytes = foreign + 1, foreign_bytes + size
            continue
        size = os.path.getsize(full)
        if size % elem:
            continue  # truncated mid-element: leave it, it can never verify
        entries.append((os.path.getmtime(full), name, key, size))
    count = 0
    for _, _, key, size in sorted(entries, key=lambda e: (e[0], e[1])):  # oldest first: LRU order
        if not lmcache_compat.disk_index_add(tier.backend, key, size, torch.Size([1, 1, size // elem]), dtype,
                                             MemoryFormat.KV_2LTD):
            break
        count += 1
    if count or foreign or removed:
        logger.info("LMCacheHMA: found %d stored objects on the disk tier (%s); removed %d stale files of "
                    "this model (an earlier format or weights generation: %d bytes); %d other files (other "
                    "namespaces or not ours: %d bytes, not counted against max_local_disk_size) left alone",
                    count, path, removed, removed_bytes, foreign, foreign_bytes)
    return count, foreign


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path) if os.path.isfile(path) else 0
    except OSError:
        return 0


def prepare_disk_dir(url) -> None:
    """Create the disk tier's directory private (0700); refuse one others can write.

    Another user who can write there could plant objects for us to load (the trailer
    would refuse them, but only a shared secret makes that airtight) or fill the tier;
    a predictable path under /tmp is exactly that risk.
    """
    if not url:
        return
    from lmcache_hma.config.private_dir import WORLD_WRITABLE, ensure_private_dir

    path = url[len("file://"):] if url.startswith("file://") else url
    ensure_private_dir(path, "local_disk directory", WORLD_WRITABLE,
                       "use a directory only this user can write (or a new path: the connector creates it "
                       "with mode 0700)")
