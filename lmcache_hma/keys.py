"""Chunk keys: LMCache's prefix-chained chunk hashes in a layout namespace.

Runs in the scheduler (hashing prompts) and the worker (making store keys).

* Hashes come from LMCache's ``ChunkedTokenDatabase`` with a cryptographic hash
  (``sha256_cbor`` unless the YAML names ``sha256``), chained from a fixed seed:
  the same tokens give the same key in every process, whatever ``PYTHONHASHSEED``.
* The namespace (model, KV dtype, block sizes, KV layout, layer set per group,
  chunk size, parallel rank) goes into every key, so two layouts sharing one
  store never read each other's bytes; the object trailer checks it again.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import torch

from lmcache_hma.layout import HybridLayout
from lmcache_hma.objects import ObjectKind

FORMAT_TAG = "hma1"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the bytes of one chunk mean what they mean."""

    model: str
    kv_dtype: torch.dtype
    layout: HybridLayout
    kv_layout: str  # vLLM's KV layout name plus the page shape, e.g. "LBHNC/1x128x128"
    world_size: int
    rank: int

    def describe(self) -> dict:
        return {
            "format": FORMAT_TAG,
            "model": self.model,
            "kv_dtype": str(self.kv_dtype),
            "kv_layout": self.kv_layout,
            "chunk_size": self.layout.chunk_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "groups": [
                {
                    "kind": g.kind.value,
                    "block_size": g.block_size,
                    "window": g.sliding_window,
                    "layers": list(g.layer_names),
                }
                for g in self.layout.groups
            ],
        }

    @property
    def seed(self) -> bytes:
        """Seed of the hash chain: the namespace less the rank (the scheduler has none)."""
        desc = {k: v for k, v in self.describe().items() if k != "rank"}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()

    @property
    def fingerprint(self) -> bytes:
        """8 bytes identifying the namespace (also written in each object trailer)."""
        blob = json.dumps(self.describe(), sort_keys=True).encode()
        return hashlib.sha256(blob).digest()[:8]

    def model_field(self, kind: ObjectKind) -> str:
        """The ``model_name`` of LMCache keys: readable, file-name safe, unique."""
        tag = _SAFE.sub("_", self.model.rstrip("/").split("/")[-1])[:48] or "model"
        return f"{tag}.{self.fingerprint.hex()}.{kind.name.lower()}"


class ChunkHasher:
    """Prefix-chained hashes of full chunks, through LMCache's token database."""

    def __init__(self, lmcache_config, namespace_seed: bytes):
        self._db = _make_token_database(lmcache_config)
        self._seed = int.from_bytes(hashlib.sha256(b"lmcache_hma:" + namespace_seed).digest()[:8], "little")
        self.chunk_size = lmcache_config.chunk_size

    def chunk_hashes(self, token_ids, num_chunks: int) -> list[int]:
        """Hashes of the first ``num_chunks`` full chunks of ``token_ids``."""
        prefix, out = self._seed, []
        for c in range(num_chunks):
            chunk = token_ids[c * self.chunk_size:(c + 1) * self.chunk_size]
            prefix = self._db._hash_tokens(list(chunk), prefix)
            out.append(prefix)
        return out


def short_key(chunk_hash: int) -> bytes:
    """8 bytes of a chunk hash, written in the object trailer."""
    return (chunk_hash & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")


def _make_token_database(lmcache_config):
    """LMCache's ChunkedTokenDatabase, without its side effect on vLLM.

    Workaround: ``TokenDatabase.__init__`` re-initialises vLLM's process-global
    ``NONE_HASH`` (vllm.v1.core.kv_cache_utils.init_none_hash) with LMCache's hash
    function, silently changing the seed of vLLM's own prefix-cache hashes in the
    scheduler process. We save and restore it. We also never chain from LMCache's
    ``NONE_HASH``: it depends on ``PYTHONHASHSEED``; ``ChunkHasher`` uses its own seed.
    """
    from lmcache.v1.token_database import ChunkedTokenDatabase
    from vllm.v1.core import kv_cache_utils

    names = ("NONE_HASH", "_NONE_HASH_SEED")
    missing = object()
    saved = {n: getattr(kv_cache_utils, n, missing) for n in names}
    try:
        return ChunkedTokenDatabase(lmcache_config, None)
    finally:
        for n, value in saved.items():
            if value is missing:
                if hasattr(kv_cache_utils, n):
                    delattr(kv_cache_utils, n)
            else:
                setattr(kv_cache_utils, n, value)
