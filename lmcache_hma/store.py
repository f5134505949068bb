"""The chunk store: LMCache's StorageManager with its CPU, disk and remote tiers.

Runs in the worker (rank 0 also answers the scheduler's lookups from it, on a
thread). Tiers are LMCache's own, searched in its order: LocalCPUBackend, then
LocalDiskBackend, then RemoteBackend (``remote_url``, e.g. ``redis://``).

Every object is sealed with an integrity trailer (``objects``) on put and
checked on get; an object that fails is removed from every tier and reported
as a miss, so it can neither reach the KV cache nor be served again.

The Redis tier gets extra care (``redis_tier.RedisTier``): credentials, a health
check that bypasses an unreachable Redis, removal of bad objects, and a close that
does not hang.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

import torch

from lmcache_hma.keys import DIGEST_BYTES, Namespace
from lmcache_hma.redis_tier import RedisTier, hash_tag_configs, uses_hash_tags
from lmcache_hma.objects import IntegrityError, ObjectKind, object_elems, payload_of, seal, verify
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_PROM_DIR = "PROMETHEUS_MULTIPROC_DIR"


class ChunkStore:
    """Objects by (kind, chunk hash) in LMCache's tiers."""

    def __init__(self, lmcache_config, namespace: Namespace, verify_checksums: bool = True):
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        self.namespace = namespace
        self.dtype = namespace.kv_dtype
        _prepare_disk_dir(lmcache_config.local_disk)
        self.verify_checksums = verify_checksums
        n_layers = len(namespace.layout.layer_names)
        metadata = LMCacheMetadata(
            model_name=namespace.model_field(ObjectKind.FULL),
            world_size=namespace.world_size,
            local_world_size=namespace.world_size,
            worker_id=namespace.rank,
            local_worker_id=namespace.rank,
            kv_dtype=namespace.kv_dtype,
            kv_shape=(n_layers, 2, lmcache_config.chunk_size, 1, 1),
            role="worker",
            chunk_size=lmcache_config.chunk_size,
        )
        # Redis Cluster: both keys of an object in one slot (redis_tier.hash_tag_configs)
        self._hash_tags = uses_hash_tags(lmcache_config)
        # Workaround: LMCache's PrometheusLogger sets PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus
        # in this process's environment when it is unset; every process started from here later
        # (a test's or a benchmark's vLLM server) then sums stale metric files of other
        # processes in that shared directory into its /metrics. Restore the environment.
        saved = os.environ.get(_PROM_DIR)
        try:
            self._manager = StorageManager(lmcache_config, metadata, EventManager())
        finally:
            if saved is None:
                os.environ.pop(_PROM_DIR, None)
        self.tiers = tuple(self._manager.storage_backends.keys())
        self._redis = RedisTier.attach(self._manager, lmcache_config)
        if self._redis is not None:  # nothing larger could be ours, nor fit half the buffer
            self._redis.bound_reads(max(self._max_object_bytes(),
                                        int(lmcache_config.max_local_cpu_size * 2**30 / 2)))
        cpu = self._manager.storage_backends.get("LocalCPUBackend")
        self._cpu_buffer = cpu if cpu is not None and not getattr(cpu, "use_hot", True) else None
        self.reindexed, self.foreign_files = self._reindex_disk()
        self.integrity_failures = 0

    def _reindex_disk(self) -> tuple[int, int]:
        """Register this namespace's objects already on the disk tier.

        Returns (objects registered, files of other namespaces left alone).

        Workaround: LMCache 0.5.6's LocalDiskBackend keeps its index in memory only,
        so a restarted engine sees an empty disk tier although the files are there
        (``contains`` is False for every key written by the previous process). The
        file names are ``key.to_string() + ".pt"`` and the bytes are the raw object,
        so the index is rebuilt from the directory; the trailer still checks every
        object on load. Anything else in the directory (another namespace's objects,
        stray files) is never read, indexed or removed.
        """
        from lmcache.v1.memory_management import MemoryFormat

        disk = self._manager.storage_backends.get("LocalDiskBackend")
        path = getattr(disk, "path", None)
        if disk is None or not path or not os.path.isdir(path):
            return 0, 0
        kinds = {self.namespace.model_field(k): k for k in ObjectKind}
        elem = torch.empty(0, dtype=self.dtype).element_size()
        entries, foreign = [], 0
        for name in os.listdir(path):
            entry = self._parse_disk_name(name, kinds)
            full = os.path.join(path, name)
            if entry is None or not os.path.isfile(full):
                foreign += 1
                continue
            size = os.path.getsize(full)
            if size % elem:
                continue  # truncated mid-element: leave it, it can never verify
            entries.append((os.path.getmtime(full), *entry, size))
        count = 0
        for _, kind, chunk_hash, size in sorted(entries):  # oldest first: LRU order
            if disk.current_cache_size + size > disk.max_cache_size:
                break
            disk.insert_key(self.key(kind, chunk_hash), size, torch.Size([1, 1, size // elem]),
                            self.dtype, MemoryFormat.KV_2LTD)
            disk.current_cache_size += size
            count += 1
        if count or foreign:
            logger.info("LMCacheHMA: found %d stored objects on the disk tier (%s); %d other files "
                        "(other namespaces or not ours) left alone", count, path, foreign)
        return count, foreign

    def _parse_disk_name(self, name: str, kinds: dict):
        """(kind, chunk hash) of a file of this namespace and rank, else None."""
        parts = name[:-3].split("@") if name.endswith(".pt") else []
        if len(parts) != (6 if self._hash_tags else 5) or parts[0] not in kinds:
            return None
        if parts[1:3] != [str(self.namespace.world_size), str(self.namespace.rank)]:
            return None
        try:
            chunk_hash = bytes.fromhex(parts[3])
        except ValueError:
            return None
        if len(chunk_hash) != DIGEST_BYTES or self.key(kinds[parts[0]], chunk_hash).to_string() + ".pt" != name:
            return None
        return kinds[parts[0]], chunk_hash

    # keys -----------------------------------------------------------------
    def key(self, kind: ObjectKind, chunk_hash: bytes):
        from lmcache.utils import CacheEngineKey

        ns = self.namespace
        tags = dict(request_configs=hash_tag_configs(chunk_hash)) if self._hash_tags else {}
        return CacheEngineKey(ns.model_field(kind), ns.world_size, ns.rank, chunk_hash, ns.kv_dtype, **tags)

    # lookups ----------------------------------------------------------------
    def count_full_prefix(self, chunk_hashes: Sequence[bytes]) -> int:
        """How many of ``chunk_hashes``, from the first, have a full object."""
        present = self.present(ObjectKind.FULL, chunk_hashes)
        return next((i for i, found in enumerate(present) if not found), len(present))

    def _max_object_bytes(self) -> int:
        """The largest object this namespace stores (a tail far from the start is the longest)."""
        lay = self.namespace.layout
        page = max((g.page_bytes for g in lay.paged_groups), default=0)
        payload = max(lay.payload_bytes(kind, 1 << 20, page) for kind in ObjectKind)
        return object_elems(payload, self.dtype) * torch.empty(0, dtype=self.dtype).element_size()

    def present(self, kind: ObjectKind, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``chunk_hashes`` have an object of ``kind`` in some tier.

        One pass over the tiers for all of them (a lookup's boundary probes): local
        tiers answer from memory, Redis in one pipelined round trip per shard.
        """
        keys = [self.key(kind, h) for h in chunk_hashes]
        found = [False] * len(keys)
        for name, backend in self._manager.storage_backends.items():
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            if name == RedisTier.NAME and self._redis is not None:
                flags = self._redis.exists_many([keys[i] for i in todo])
            elif name in self._manager._bypassed_backends:  # LMCache's own bypass set (a tier down)
                continue
            else:
                flags = [backend.contains(keys[i]) for i in todo]
            for i, flag in zip(todo, flags):
                found[i] = bool(flag)
        return found

    def has(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        return self._manager.contains(self.key(kind, chunk_hash)) is not None

    # put / get --------------------------------------------------------------
    def put(self, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int,
            fill: Callable[[torch.Tensor], None]) -> bool:
        """Allocate an object, let ``fill`` write its payload, seal and store it.

        Returns False (nothing stored) when the CPU tier has no room left.
        """
        obj = self.allocate(payload_bytes)
        if obj is None:
            logger.debug("no room to store %s chunk %s", kind.name, chunk_hash.hex()[:16])
            return False
        try:
            fill(payload_of(flat(obj)))
        except BaseException:
            release(obj)  # give it back, or a failing fill drains the allocator
            raise
        self.commit(kind, chunk_hash, obj)
        return True

    def allocate(self, payload_bytes: int):
        """A new object with room for ``payload_bytes`` (evicting if needed), or None.

        Hand it to ``commit`` or ``release`` it.
        """
        elems = object_elems(payload_bytes, self.dtype)
        # 3-D because LMCache's KV_2LTD bookkeeping (get_num_tokens) reads shape[2].
        return self._manager.allocate(torch.Size([1, 1, elems]), self.dtype, eviction=True, busy_loop=False)

    def commit(self, kind: ObjectKind, chunk_hash: bytes, obj) -> None:
        """Seal an allocated object whose payload is written and store it; takes the reference."""
        try:
            seal(flat(obj), self.namespace.fingerprint, chunk_hash, kind, self.namespace.secret)
        except BaseException:
            release(obj)
            raise
        self._manager.batched_put([self.key(kind, chunk_hash)], [obj])  # takes our reference

    def in_memory(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        """Whether the CPU tier holds the object (a get then costs no I/O)."""
        cpu = self._manager.storage_backends.get("LocalCPUBackend")
        return cpu is not None and self._cpu_buffer is None and cpu.contains(self.key(kind, chunk_hash))

    def get(self, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int):
        """The verified object, or None (missing, or failed its checks and removed).

        The caller must ``release()`` a returned object.
        """
        key = self.key(kind, chunk_hash)
        try:
            obj = self._manager.get(key)
        except Exception as exc:  # a tier failing mid-read is a miss, not a crash
            logger.warning("LMCacheHMA: reading %s chunk %s failed: %s", kind.name, chunk_hash.hex()[:16], exc)
            obj = None
        if self._cpu_buffer is not None:
            # Workaround: with local_cpu: false, LMCache's StorageManager.get still copies
            # what it reads from disk or Redis into LocalCPUBackend's hot cache, and never
            # evicts it there (eviction runs only when local_cpu is on). Once the buffer is
            # full, the next read busy-waits for memory forever: the engine hangs. Drop that
            # copy now; our reference keeps the object alive until release().
            self._cpu_buffer.remove(key)
        if obj is None:
            why = self._redis.unreadable(key, self._object_bytes(payload_bytes)) if self._redis else None
            if why:  # in Redis but not readable (e.g. truncated): LMCache returned None
                self.integrity_failures += 1
                logger.warning("LMCacheHMA: dropping %s chunk %s: %s", kind.name, chunk_hash.hex()[:16], why)
                self.remove(kind, chunk_hash)
                return None
            self.remove(kind, chunk_hash, remote=False)  # drop a stale index entry (e.g. a deleted file)
            return None
        try:
            if flat(obj).dtype != self.dtype:
                raise IntegrityError(f"object has dtype {flat(obj).dtype}, expected {self.dtype}")
            verify(flat(obj), object_elems(payload_bytes, self.dtype), self.namespace.fingerprint,
                   chunk_hash, kind, check_crc=self.verify_checksums, secret=self.namespace.secret)
        except (IntegrityError, RuntimeError) as exc:
            self.integrity_failures += 1
            logger.warning("LMCacheHMA: dropping %s chunk %s: %s", kind.name, chunk_hash.hex()[:16], exc)
            release(obj)
            self.remove(kind, chunk_hash)
            return None
        return obj

    def remove(self, kind: ObjectKind, chunk_hash: bytes, remote: bool = True) -> None:
        """Remove an object from every tier (local tiers only when ``remote`` is False)."""
        key = self.key(kind, chunk_hash)
        local = [t for t in self.tiers if t != RedisTier.NAME]
        try:
            # LMCache's RedisConnector cannot remove (no remove_sync): RedisTier does.
            self._manager.remove(key, locations=None if remote and self._redis is None else local)
        except Exception as exc:
            logger.warning("LMCacheHMA: removing chunk %s failed: %s", chunk_hash.hex()[:16], exc)
        if remote and self._redis is not None:
            self._redis.delete(key)

    def _object_bytes(self, payload_bytes: int) -> int:
        return object_elems(payload_bytes, self.dtype) * torch.empty(0, dtype=self.dtype).element_size()

    def close(self) -> None:
        """Close the tiers, never waiting more than a few seconds.

        Workaround: LMCache's ``StorageManager.close()`` hangs forever with the
        Redis remote backend (its connector awaits a blocking executor shutdown on
        its own event loop), and its event-loop thread is not a daemon, so the
        process could not exit either. ``RedisTier.close`` closes that connector
        first; the rest still runs on a daemon thread with a timeout.
        """
        if self._redis is not None:
            self._redis.close(_CLOSE_TIMEOUT_S / 2)
            self._redis = None
        t = threading.Thread(target=self._manager.close, name="lmcache-hma-close", daemon=True)
        t.start()
        t.join(_CLOSE_TIMEOUT_S)
        if t.is_alive():
            logger.warning("LMCacheHMA: LMCache storage did not close within %.0f s", _CLOSE_TIMEOUT_S)


def _prepare_disk_dir(url) -> None:
    """Create the disk tier's directory private (0700); refuse one others can write.

    Another user who can write there could plant objects for us to load (the
    trailer would refuse them, but only a shared secret makes that airtight) or
    fill the tier; a predictable path under /tmp is exactly that risk.
    """
    if not url:
        return
    from lmcache_hma.config import ConfigError

    path = url[len("file://"):] if url.startswith("file://") else url
    if not os.path.exists(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        return
    st = os.stat(path)
    if st.st_uid != os.getuid():
        problem = f"owned by another user (uid {st.st_uid})"
    elif st.st_mode & 0o002:
        problem = "writable by every user"
    else:
        return
    raise ConfigError(f"local_disk directory {path!r} is {problem}; use a directory only this user "
                      f"can write (or a new path: the connector creates it with mode 0700)")


def flat(obj) -> torch.Tensor:
    """An LMCache memory object's tensor as the 1-D object (a view)."""
    return obj.tensor.reshape(-1)


def release(obj) -> None:
    """Give a fetched LMCache memory object back to its allocator."""
    obj.ref_count_down()
