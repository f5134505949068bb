"""LMCache keys of this namespace's objects: made, cached, recognised in a file name.

An object's key is LMCache's ``CacheEngineKey``: the namespace's model field for the
object's kind (``core.keys.Namespace``), the world size and rank, the chunk hash, the
KV dtype, and with a Redis Cluster tier a hash tag (``core.keys.hash_tag_configs``) so
both Redis keys of an object share a slot.

A weights generation (``Namespace.generation``, moved by every cache reset: ``set_namespace``)
renames every object: keys are made under the current one only, while ``kind_of`` and ``ours``
still know the generations before it (their objects are evicted or cleared by key).
"""

from __future__ import annotations

from lmcache_hma.core.keys import DIGEST_BYTES, Namespace, hash_tag_configs
from lmcache_hma.core.kinds import ObjectKind


class ObjectKeys:
    KEPT = 1 << 16  # keys remembered (a lookup asks for each of a hit's keys 3-4 times)

    def __init__(self, namespace: Namespace, hash_tags: bool) -> None:
        self.namespace, self.hash_tags = namespace, hash_tags
        self._kinds = {namespace.model_field(k): k for k in ObjectKind}  # model field -> kind
        self._known = dict(self._kinds)  # the same, of every generation this process named
        self._keys: dict = {}  # (kind, chunk hash) -> CacheEngineKey

    def set_namespace(self, namespace: Namespace) -> None:
        """Name objects under ``namespace`` (the next weights generation) from now on."""
        kinds = {namespace.model_field(k): k for k in ObjectKind}
        self._known.update(kinds)
        self.namespace, self._kinds, self._keys = namespace, kinds, {}

    def key(self, kind: ObjectKind, chunk_hash: bytes):
        keys = self._keys  # one generation's: set_namespace replaces the dict
        key = keys.get((kind, chunk_hash))
        if key is None:
            from lmcache.utils import CacheEngineKey

            ns = self.namespace
            tags = dict(request_configs=hash_tag_configs(chunk_hash)) if self.hash_tags else {}
            key = CacheEngineKey(ns.model_field(kind), ns.key_world_size, ns.key_rank, chunk_hash, ns.kv_dtype, **tags)
            if len(keys) >= self.KEPT:
                keys.clear()
            keys[(kind, chunk_hash)] = key
        return key

    def kind_of(self, key):
        """The kind of an object of this namespace's key (any rank, any generation named), else None."""
        return self._known.get(getattr(key, "model_name", None))

    def ours(self, key) -> bool:
        """Whether ``key`` is an object of this namespace and rank (any generation named)."""
        ns = self.namespace
        return key.model_name in self._known and key.world_size == ns.key_world_size and key.worker_id == ns.key_rank

    def stale_file(self, name: str) -> bool:
        """Whether a disk-tier file is this namespace's and rank's under another weights generation
        or an earlier format (``Namespace.stale_field``): never read again."""
        parts = name[:-3].split("@") if name.endswith(".pt") else []
        return (len(parts) in (5, 6) and self.namespace.stale_field(parts[0])
                and parts[1:3] == [str(self.namespace.key_world_size), str(self.namespace.key_rank)])

    def of_file(self, name: str):
        """The key of a disk-tier file (``key.to_string() + ".pt"``) of this namespace and rank,
        else None."""
        parts = name[:-3].split("@") if name.endswith(".pt") else []
        if len(parts) != (6 if self.hash_tags else 5) or parts[0] not in self._kinds:
            return None
        if parts[1:3] != [str(self.namespace.key_world_size), str(self.namespace.key_rank)]:
            return None
        try:
            chunk_hash = bytes.fromhex(parts[3])
        except ValueError:
            return None
        key = self.key(self._kinds[parts[0]], chunk_hash) if len(chunk_hash) == DIGEST_BYTES else None
        return key if key is not None and key.to_string() + ".pt" == name else None
