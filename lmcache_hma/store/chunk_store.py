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
from typing import Callable, Optional, Sequence

import torch

from lmcache_hma.store import lmcache_compat
from lmcache_hma.core.keys import DIGEST_BYTES, Namespace
from lmcache_hma.store.redis.redis_tier import RedisTier, hash_tag_configs, uses_hash_tags
from lmcache_hma.core.kinds import TIERS, ObjectKind
from lmcache_hma.core.objects import IntegrityError, object_elems, payload_of, seal, verify_bytes
from lmcache_hma.log import get_logger
from lmcache_hma.core.hit_rule import longest_hit

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_CPU = "LocalCPUBackend"
# LMCache backend -> the tier's name (kinds.TIERS)
TIER_LABELS = dict(zip((_CPU, "LocalDiskBackend", RedisTier.NAME), TIERS))
_PROM_DIR = "PROMETHEUS_MULTIPROC_DIR"


class ChunkStore:
    """Objects by (kind, chunk hash) in LMCache's tiers."""

    events = None  # KV cache events: worker.tier_events.TierEventCollector (see watch), else None

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
        self._keys: dict = {}  # (kind, chunk hash) -> CacheEngineKey (see key)
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
        cpu = self._manager.storage_backends.get(_CPU)
        # local_cpu: true -> the CPU tier; false -> only LMCache's staging buffer for the others
        self._cpu_tier = cpu if cpu is not None and lmcache_compat.is_cpu_tier(cpu) else None
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
        elem = self.dtype.itemsize
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
            if not lmcache_compat.disk_index_add(disk, self.key(kind, chunk_hash), size,
                                                 torch.Size([1, 1, size // elem]), self.dtype, MemoryFormat.KV_2LTD):
                break
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
    _KEYS_KEPT = 1 << 16  # keys remembered (a lookup asks for each of a hit's keys 3-4 times)

    def key(self, kind: ObjectKind, chunk_hash: bytes):
        key = self._keys.get((kind, chunk_hash))
        if key is None:
            from lmcache.utils import CacheEngineKey

            ns = self.namespace
            tags = dict(request_configs=hash_tag_configs(chunk_hash)) if self._hash_tags else {}
            key = CacheEngineKey(ns.model_field(kind), ns.world_size, ns.rank, chunk_hash, ns.kv_dtype, **tags)
            if len(self._keys) >= self._KEYS_KEPT:
                self._keys.clear()
            self._keys[(kind, chunk_hash)] = key
        return key

    # lookups ----------------------------------------------------------------
    def count_full_prefix(self, chunk_hashes: Sequence[bytes]) -> int:
        """How many of ``chunk_hashes``, from the first, have a full object."""
        return longest_hit(self.present(ObjectKind.FULL, chunk_hashes), None)

    def present(self, kind: ObjectKind, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``chunk_hashes`` have an object of ``kind`` in some tier."""
        return [tier is not None for tier in self.present_kinds((kind,), chunk_hashes)[kind]]

    def present_kinds(self, kinds: Sequence[ObjectKind], chunk_hashes: Sequence[bytes]) -> dict:
        """``{kind: [the tier (``TIERS``) holding chunk_hashes[i]'s object of kind, or None]}``.

        One pass over the tiers for all of them (a lookup asks for every kind of
        every boundary at once): local tiers answer from memory, Redis in one
        pipelined round trip, every shard's at the same time.
        """
        keys = [self.key(kind, h) for kind in kinds for h in chunk_hashes]
        found: list = [None] * len(keys)
        for name, backend in self._manager.storage_backends.items():
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            if name == RedisTier.NAME and self._redis is not None:
                flags = self._redis.exists_many([keys[i] for i in todo])
            elif name in lmcache_compat.bypassed(self._manager):  # a tier down
                continue
            else:
                flags = [backend.contains(keys[i]) for i in todo]
            for i, flag in zip(todo, flags):
                found[i] = TIER_LABELS.get(name, name) if flag else None
        n = len(chunk_hashes)
        return {kind: found[j * n:(j + 1) * n] for j, kind in enumerate(kinds)}

    def has(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        return self.present(kind, [chunk_hash])[0]

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

    def _allocate_free(self, sizes: Sequence[int]) -> list:
        """Objects for payloads of ``sizes`` from free memory, one LMCache batched allocation per
        size; None where there is none free (``allocate`` then evicts for it). A hit's Redis
        fetch is bound by the reader's CPU, and one by one its 33 objects cost ~1 ms.

        Workaround: LMCache 0.5.6's batched allocation cannot evict our objects (it evicts by
        layer keys, ``split_layers``), so it is asked only for free memory.
        """
        out: list = [None] * len(sizes)
        by_size: dict = {}
        for n, size in enumerate(sizes):
            by_size.setdefault(size, []).append(n)
        for size, ns in by_size.items():
            shape = torch.Size([1, 1, object_elems(size, self.dtype)])
            objs = self._manager.batched_allocate(shape, self.dtype, len(ns), eviction=False, busy_loop=False)
            for n, obj in zip(ns, objs or ()):
                out[n] = obj
        return out

    def commit(self, kind: ObjectKind, chunk_hash: bytes, obj) -> None:
        """Seal an allocated object whose payload is written and store it; takes the reference."""
        self.commit_many([(kind, chunk_hash, obj)])

    def commit_many(self, items: Sequence[tuple[ObjectKind, bytes, object]]) -> None:
        """``commit`` for several objects: one put into the tiers (one pipelined round trip per
        Redis shard); takes every reference, also when sealing or a tier fails."""
        try:
            for kind, chunk_hash, obj in items:
                seal(flat(obj), self.namespace.fingerprint, chunk_hash, kind, self.namespace.secret)
        except BaseException:
            for _, _, obj in items:
                release(obj)
            raise
        keys, objs = [self.key(kind, h) for kind, h, _ in items], [obj for _, _, obj in items]
        try:
            # Local tiers take their own references (LMCache's StorageManager.batched_put, minus
            # its remote backend: Redis is written here, RedisTier.store_many).
            for name, backend in self._manager.storage_backends.items():
                if name != RedisTier.NAME and name not in lmcache_compat.bypassed(self._manager):
                    backend.batched_submit_put_task(keys, objs, on_complete_callback=self._stored(name))
            if self._redis is not None:  # while it is bypassed, nothing is written (counted)
                written = self._stored(RedisTier.NAME)
                self._redis.store_many(keys, objs, on_written=written and (lambda ks: [written(k) for k in ks]))
        finally:
            for obj in objs:
                release(obj)

    def in_memory(self, kind: ObjectKind, chunk_hash: bytes) -> bool:
        """Whether the CPU tier holds the object (a get then costs no I/O)."""
        return self._cpu_tier is not None and self._cpu_tier.contains(self.key(kind, chunk_hash))

    def get(self, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int):
        """The verified object, or None (missing, or failed its checks and removed).

        The caller must ``release()`` a returned object.
        """
        return self.get_many([(kind, chunk_hash, payload_bytes)])[0][0]

    def get_many(self, wanted: Sequence[tuple[ObjectKind, bytes, int]]) -> list[tuple]:
        """``get`` for each (kind, chunk hash, payload bytes): (verified object, the tier that
        served it: ``TIER_LABELS``' values), (None, None) where missing or damaged. The
        caller must ``release()`` every returned object.

        Tiers in LMCache's order. The CPU tier holds only objects sealed here or verified
        on their way in, so its objects get the trailer check without a pass over the
        payload (CRC32 runs at ~4 GB/s, the MAC slower: that pass was most of a hit's
        lookup). An object read from disk or Redis is verified, then kept in the CPU
        tier, as LMCache's own reads keep it. Objects only Redis holds come in pipelined
        round trips (``RedisTier.fetch_many``).

        Workaround: reads go to each backend here, not through ``StorageManager.get``,
        which copies what it reads into the CPU tier before we can verify it (another
        thread could then take it there unverified), and with ``local_cpu: false`` into
        LMCache's staging buffer, where it is never evicted (the next read then
        busy-waits for memory forever: the engine hangs).
        """
        out: list = [(None, None)] * len(wanted)
        keys = [self.key(kind, chunk_hash) for kind, chunk_hash, _ in wanted]
        remote = []
        for i, ((kind, chunk_hash, payload_bytes), key) in enumerate(zip(wanted, keys)):
            obj, tier = self._read_local(key, kind, chunk_hash)
            if obj is not None:
                obj = self._checked(obj, kind, chunk_hash, payload_bytes, trusted=tier == _CPU)
                if obj is not None and tier != _CPU:
                    self._keep_in_memory(key, obj)
                out[i] = (obj, TIER_LABELS[tier]) if obj is not None else (None, None)
            elif self._redis is not None:
                remote.append(i)
        if not remote:
            return out
        sizes = [wanted[i][2] for i in remote]
        ready = self._allocate_free(sizes)
        given: set = set()

        def allocate(n: int):  # the fetch owns what it is given (and may ask again after a retry)
            obj = ready[n] if n not in given else None
            given.add(n)
            return obj if obj is not None else self.allocate(sizes[n])

        try:
            fetched = self._redis.fetch_many([keys[i] for i in remote], [self._object_bytes(n) for n in sizes],
                                             allocate, lambda n, obj: self._damage(obj, *wanted[remote[n]]))
        finally:
            for n, obj in enumerate(ready):
                if obj is not None and n not in given:  # not in Redis after all
                    release(obj)
        for i, got in zip(remote, fetched):
            kind, chunk_hash, _ = wanted[i]
            if isinstance(got, str):  # in Redis but not readable (e.g. truncated) or damaged
                self._drop(kind, chunk_hash, got)
            elif got is not None:  # verified as it arrived
                self._keep_in_memory(keys[i], got)
                out[i] = (got, TIER_LABELS[RedisTier.NAME])
        return out

    def _read_local(self, key, kind: ObjectKind, chunk_hash: bytes):
        """(object, tier name) from the first local tier that has ``key``, else (None, None).

        A tier that lists the key but cannot read it (a deleted file) drops its entry.
        """
        for name, backend in self._manager.storage_backends.items():
            if (name == RedisTier.NAME or (name == _CPU and self._cpu_tier is None)
                    or name in lmcache_compat.bypassed(self._manager) or not backend.contains(key)):
                continue
            try:
                obj = backend.get_blocking(key)
            except Exception as exc:  # a tier failing mid-read is a miss, not a crash
                logger.warning("LMCacheHMA: reading %s chunk %s from %s failed: %s", kind.name,
                               chunk_hash.hex()[:16], name, exc)
                obj = None
            if obj is not None:
                return obj, name
            if name != _CPU:  # evicted from memory meanwhile is normal; a file gone is stale
                self._remove_from(key, [name])
        return None, None

    def _keep_in_memory(self, key, obj) -> None:
        if self._cpu_tier is not None:
            self._cpu_tier.submit_put_task(key, obj, on_complete_callback=self._stored(_CPU))  # takes its own reference

    def _checked(self, obj, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int, trusted: bool = False):
        """``obj`` if it is the intact object of (kind, chunk hash), else None (it is released
        and removed from every tier)."""
        why = self._damage(obj, kind, chunk_hash, payload_bytes, trusted)
        if why is None:
            return obj
        release(obj)
        self._drop(kind, chunk_hash, why)
        return None

    def _damage(self, obj, kind: ObjectKind, chunk_hash: bytes, payload_bytes: int,
                trusted: bool = False) -> Optional[str]:
        """Why ``obj`` is not the intact object of (kind, chunk hash), or None."""
        # on the object's bytes: a tensor view per object cost more than the CRC pass
        try:
            dtype = obj.get_dtype()
            if dtype != self.dtype:
                raise IntegrityError(f"object has dtype {dtype}, expected {self.dtype}")
            raw, expected = obj.byte_array, self._object_bytes(payload_bytes)
            if raw.nbytes != expected:
                raise IntegrityError(f"object has {raw.nbytes} bytes, expected {expected}")
            verify_bytes(raw, self.namespace.fingerprint, chunk_hash, kind, check_crc=self.verify_checksums,
                         secret=self.namespace.secret, trusted=trusted)
        except (IntegrityError, RuntimeError) as exc:
            return str(exc)
        return None

    def _drop(self, kind: ObjectKind, chunk_hash: bytes, why) -> None:
        """Count and remove a damaged object from every tier."""
        self.integrity_failures += 1
        logger.warning("LMCacheHMA: dropping %s chunk %s: %s", kind.name, chunk_hash.hex()[:16], why)
        self.remove(kind, chunk_hash)

    def remove(self, kind: ObjectKind, chunk_hash: bytes, remote: bool = True) -> None:
        """Remove an object from every tier (local tiers only when ``remote`` is False)."""
        key = self.key(kind, chunk_hash)
        # LMCache's RedisConnector cannot remove (no remove_sync): RedisTier does.
        self._remove_from(key, None if remote and self._redis is None else
                          [t for t in self.tiers if t != RedisTier.NAME])
        if remote and self._redis is not None:
            self._redis.delete(key)
            if self.events is not None:
                self.events.removed(TIER_LABELS[RedisTier.NAME], key)

    def clear_local(self) -> int:
        """Remove every object of this namespace and rank from CPU memory and the local disk
        (nothing else: another deployment's objects in a shared directory stay). Returns how
        many. Redis is not cleared: its objects are the fleet's."""
        kinds = {self.namespace.model_field(k) for k in ObjectKind}
        ns = self.namespace
        removed = 0
        for name in (_CPU, "LocalDiskBackend"):
            backend = self._manager.storage_backends.get(name)
            if backend is None:
                continue
            for key in lmcache_compat.local_keys(backend):
                if key.model_name in kinds and key.world_size == ns.world_size and key.worker_id == ns.rank:
                    self._remove_from(key, [name])
                    removed += 1
        return removed

    def _remove_from(self, key, locations) -> None:
        try:
            self._manager.remove(key, locations=locations)
        except Exception as exc:
            logger.warning("LMCacheHMA: removing %s failed: %s", key.to_string(), exc)

    # KV cache events --------------------------------------------------------
    def watch(self, events) -> None:
        """Tell ``events`` (``worker.tier_events``) what becomes durable in each tier (the puts
        LMCache completes) and what leaves it (LMCache's evictions, removals)."""
        self.events = events
        for name in (_CPU, "LocalDiskBackend"):
            backend = self._manager.storage_backends.get(name)
            if backend is not None and (name != _CPU or self._cpu_tier is not None):
                label = TIER_LABELS[name]
                lmcache_compat.observe_removals(backend, lambda key, label=label: events.removed(label, key))

    def _stored(self, backend_name: str) -> Optional[Callable]:
        return None if self.events is None else self.events.put_callback(TIER_LABELS[backend_name])

    def writes_pending(self) -> bool:
        """Whether the disk tier is still writing files (stores not durable yet)."""
        disk = self._manager.storage_backends.get("LocalDiskBackend")
        return disk is not None and lmcache_compat.disk_writes_pending(disk)

    @property
    def redis(self) -> Optional[RedisTier]:
        """The Redis tier, if any (for its counters and health)."""
        return self._redis

    def _object_bytes(self, payload_bytes: int) -> int:
        return object_elems(payload_bytes, self.dtype) * self.dtype.itemsize

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
    from lmcache_hma.config.settings import ConfigError

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
