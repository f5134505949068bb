"""Chunk keys: prefix-chained 256-bit digests of tokens and what produced their KV.

Runs in the scheduler (hashing prompts) and the worker (naming stored objects).

* A chunk's digest is SHA-256 over canonical CBOR of (the previous chunk's
  digest, the chunk's token ids, its extra keys): the same inputs give the same
  key in every process, whatever ``PYTHONHASHSEED``; the full 32 bytes name the
  object (in the LMCache key and in the object trailer), so collisions are not
  a concern at any scale.
* Extra keys (``identity.chunk_extra_keys``) carry what changes KV besides the
  tokens: LoRA adapter, images, ``cache_salt``, prompt embeddings.
* The chain starts from the namespace seed: model and weights identity, KV
  dtype, block sizes, KV layout, layer set and window of every group (and, for
  recurrent-state groups, the state shapes, dtypes and conv-state layout), chunk
  size, parallel size. Two deployments share keys exactly when all of it agrees.
  With ``hma_share_parallel_shapes`` (objects in the parallelism-free format,
  ``kv_copy.canonical_objects``) the parallel size, rank, block sizes and page
  layout leave it: the model's global KV heads and head size take their place.
* With a shared secret (``hma_shared_secret``) every digest is an HMAC-SHA256
  under it, and so are the seed and the namespace fingerprint: keys reveal
  nothing about prompts, and no one without the secret can name or forge an
  object that a deployment with it will load (the trailer is keyed too).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import cbor2
import torch

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import HybridLayout

# hma3: Redis values fitted to its allocator (store/redis/wire.value_bytes): an instance of an
# earlier format and one of this format keep apart in a shared Redis instead of taking each
# other's objects for damaged ones
FORMAT_TAG = "hma3"
STALE_FORMATS = ("hma1", "hma2")  # earlier tags: this namespace's files in them are removed at start
DIGEST_BYTES = 32
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def keyed_sha256(secret: Optional[bytes], data: bytes) -> bytes:
    """SHA-256 of ``data``, or HMAC-SHA256 under ``secret`` when there is one."""
    if secret:
        return hmac.new(secret, data, hashlib.sha256).digest()
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the bytes of one chunk mean what they mean."""

    model: str
    kv_dtype: torch.dtype
    layout: HybridLayout
    kv_layout: str  # vLLM's KV layout name plus the page shape, e.g. "LBHNC/1x128x128"
    world_size: int
    rank: int
    identity: dict = field(default_factory=dict)  # weights and format: identity.model_identity
    secret: Optional[bytes] = field(default=None, repr=False)
    # hma_share_parallel_shapes: (global KV heads, head size[, gated delta net: k heads, v heads,
    # head k dim, head v dim, conv state rows]); None: per-rank pages (the default)
    shared_heads: Optional[tuple[int, ...]] = None
    # the weights generation: connector resets applied since start (``ChunkStore.new_generation``;
    # docs/design.md#resets-and-weight-updates). It names objects (model field, trailer), not the
    # hash chain: the scheduler's digests stay as they are, the keys around them change.
    generation: int = 0

    @property
    def shares_parallel_shapes(self) -> bool:
        return self.shared_heads is not None

    @property
    def key_world_size(self) -> int:
        """The world size LMCache keys carry: 1 for objects every parallel shape reads."""
        return 1 if self.shares_parallel_shapes else self.world_size

    @property
    def key_rank(self) -> int:
        """The rank LMCache keys carry: 0 for objects every parallel shape reads."""
        return 0 if self.shares_parallel_shapes else self.rank

    def describe(self, format_tag: str = FORMAT_TAG) -> dict:
        """What the namespace's keys and trailers are digests of (``format_tag``: another format's,
        to recognise its files: ``stale_fields``)."""
        desc = {
            "format": format_tag,
            "model": self.model,
            "identity": self.identity,
            "kv_dtype": str(self.kv_dtype),
            "chunk_size": self.layout.chunk_size,
            "groups": [_describe_group(g, per_rank=not self.shares_parallel_shapes) for g in self.layout.groups],
        }
        if self.shares_parallel_shapes:
            # no world size, rank, block size or page layout: every parallel shape and block
            # size reads the same objects (a format tag of its own keeps them apart)
            desc.update(format=format_tag + "-canonical2", kv_heads=list(self.shared_heads))
        else:
            desc.update(kv_layout=self.kv_layout, world_size=self.world_size, rank=self.rank)
        if self.generation:  # generation 0 names objects as before generations existed
            desc["generation"] = self.generation
        return desc

    def _digest(self, purpose: bytes, desc: dict) -> bytes:
        return keyed_sha256(self.secret, purpose + json.dumps(desc, sort_keys=True, default=str).encode())

    # Computed once (the namespace is frozen): every object key and trailer uses them.
    @functools.cached_property
    def seed(self) -> bytes:
        """Seed of the hash chain: the namespace less the rank (the scheduler has none) and the
        weights generation (the worker's alone: it names objects, ``model_field``)."""
        return self._digest(b"seed:", {k: v for k, v in self.describe().items() if k not in ("rank", "generation")})

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """16 bytes identifying the namespace (also written in each object trailer)."""
        return self._digest(b"fingerprint:", self.describe())[:16]

    @functools.cached_property
    def _tag(self) -> str:
        return _SAFE.sub("_", self.model.rstrip("/").split("/")[-1])[:48] or "model"

    @functools.cached_property
    def _base(self) -> str:
        """The fingerprint's first 8 bytes at generation 0, in hex: the part of a model field every
        generation of the namespace shares."""
        desc = {k: v for k, v in self.describe().items() if k != "generation"}
        return self._digest(b"fingerprint:", desc)[:8].hex()

    @functools.cached_property
    def _model_fields(self) -> dict:
        gen = f"g{self.generation}" if self.generation else ""
        return {kind: f"{self._tag}.{self._base}{gen}.{kind.name.lower()}" for kind in ObjectKind}

    def model_field(self, kind: ObjectKind) -> str:
        """The ``model_name`` of LMCache keys: readable, file-name safe, unique; ``<model>.<8
        bytes of the fingerprint at generation 0>[g<generation>].<kind>``."""
        return self._model_fields[kind]

    def stale_field(self, field: str) -> bool:
        """Whether ``field`` (a key's model field) is this namespace's under another weights
        generation or an earlier format (``STALE_FORMATS``): objects no lookup of this process
        asks for again (a disk tier removes their files at start, ``local_tiers.reindex_disk``)."""
        if field in self._model_fields.values():
            return False
        if not field.startswith(self._tag + "."):  # the model tag may hold dots itself
            return False
        stem, _, kind = field[len(self._tag) + 1:].rpartition(".")
        if kind not in self._kind_names:
            return False
        generation = stem[len(self._base):] if stem.startswith(self._base) else None
        if generation is not None and re.fullmatch(r"g[1-9][0-9]*", generation):
            return True
        return stem in self._stale_bases

    @functools.cached_property
    def _kind_names(self) -> frozenset:
        return frozenset(kind.name.lower() for kind in ObjectKind)

    @functools.cached_property
    def _stale_bases(self) -> frozenset:
        bases = set()
        for tag in STALE_FORMATS:
            desc = {k: v for k, v in self.describe(tag).items() if k != "generation"}
            bases.add(self._digest(b"fingerprint:", desc)[:8].hex())
        return frozenset(bases)


def _describe_group(g, per_rank: bool = True) -> dict:
    """What a group's bytes mean; ``per_rank`` False (the parallelism-free format): less the
    block size and the per-rank state shapes (the namespace names the global dimensions)."""
    out = {
        "kind": g.kind.value,
        "window": g.sliding_window,
        "extra_retained_tokens": g.extra_retained_tokens,
        "layers": list(g.layer_names),
    }
    if g.kind is GroupKind.STATE:
        out["state_dtypes"] = list(g.state_dtypes)
    if per_rank:
        out["block_size"] = g.block_size
        if g.kind is GroupKind.STATE:  # what the state bytes mean: shapes, conv layout
            out.update(state_shapes=[list(s) for s in g.state_shapes], conv_state_layout=g.conv_state_layout,
                       state_bytes=g.page_bytes)
    return out


def head_part_digest(secret: Optional[bytes], chunk_hash: bytes, head: int) -> bytes:
    """The key of KV head ``head``'s part of the object named ``chunk_hash``, in the
    parallelism-free format (one object per KV head, ``kv_copy.canonical_objects``): keyed
    like a chunk digest, tagged so it equals none, and bound to the head by the trailer."""
    return keyed_sha256(secret, b"kv-head:" + head.to_bytes(4, "little") + chunk_hash)


class ChunkHasher:
    """Prefix-chained digests of a token sequence's full chunks.

    Chunk c's digest covers the digest of chunk c - 1 (the seed for chunk 0), its tokens and
    its extra keys, so a chain can be continued from its last digest (``continue_hashes``):
    the digests of a request's chunks grow with its tokens without rehashing the ones before,
    and equal those of one sequence hashed at once (``chunk_hashes``).
    """

    def __init__(self, namespace: Namespace):
        self._seed = namespace.seed
        self._secret = namespace.secret
        self.chunk_size = namespace.layout.chunk_size

    def chunk_hashes(self, token_ids: Sequence[int], num_chunks: int,
                     extra_keys: Optional[Sequence[Optional[tuple]]] = None,
                     lookahead: int = 0) -> list[bytes]:
        """Digests of the first ``num_chunks`` full chunks; ``extra_keys[c]`` goes into chunk c's.

        ``lookahead`` > 0: chunk c's digest also covers the ``lookahead`` tokens after it (a
        speculative draft model's KV of the chunk's last positions was computed from them, see
        ``config.speculative``); ``token_ids`` must hold them. 0 leaves digests as they were.
        """
        return self.continue_hashes(None, token_ids, 0, num_chunks, extra_keys, lookahead)

    def continue_hashes(self, previous: Optional[bytes], token_ids: Sequence[int], first: int, end: int,
                        extra_keys: Optional[Sequence[Optional[tuple]]] = None,
                        lookahead: int = 0) -> list[bytes]:
        """Digests of chunks ``[first, end)`` of ``token_ids`` (the whole sequence, from token 0),
        chained on ``previous``, the digest of chunk ``first - 1`` (None when ``first`` is 0);
        ``extra_keys[i]`` goes into chunk ``first + i``'s. Other arguments as ``chunk_hashes``."""
        if (previous is None) != (first == 0):
            raise ValueError(f"chunk {first}: the chain continues from chunk {first - 1}'s digest")
        if lookahead and len(token_ids) < end * self.chunk_size + lookahead:
            raise ValueError(f"{end} chunks with a lookahead of {lookahead} need "
                             f"{end * self.chunk_size + lookahead} tokens, got {len(token_ids)}")
        prefix, out = previous or self._seed, []
        for c in range(first, end):
            end_token = (c + 1) * self.chunk_size
            chunk = token_ids[c * self.chunk_size:end_token]
            extra = extra_keys[c - first] if extra_keys is not None else None
            ahead = [list(token_ids[end_token:end_token + lookahead])] if lookahead else []
            try:  # vLLM's token ids are Python ints: encoded as they are (an int() per token
                # would be a large part of hashing a long prompt)
                encoded = cbor2.dumps([prefix, list(chunk), extra, *ahead], canonical=True)
            except cbor2.CBOREncodeError:  # numpy integers and the like
                ahead = [[int(t) for t in a] for a in ahead]
                encoded = cbor2.dumps([prefix, [int(t) for t in chunk], extra, *ahead], canonical=True)
            prefix = keyed_sha256(self._secret, encoded)
            out.append(prefix)
        return out


    def turn_digest(self, previous: bytes, token_ids: Sequence[int], start: int, end: int,
                    extra_keys: Optional[tuple], lookahead: int = 0, on_tail: bool = False) -> bytes:
        """Key of a turn end: tokens ``[start, end)`` of ``token_ids`` (``start`` a chunk
        boundary, ``end`` inside the chunk after it) chained on ``previous``, the digest of
        the chunk before ``start``, with the extra keys of those tokens, and (``lookahead``, as
        ``chunk_hashes``) the tokens after ``end``. Tagged, so it never equals a chunk digest;
        a turn object ``on_tail`` (``ObjectRef.on_tail``: another layout) is tagged apart."""
        tag = "turn-on-tail" if on_tail else "turn"
        if lookahead and len(token_ids) < end + lookahead:
            raise ValueError(f"a turn end at {end} with a lookahead of {lookahead} needs "
                             f"{end + lookahead} tokens, got {len(token_ids)}")
        ahead = [list(token_ids[end:end + lookahead])] if lookahead else []
        tokens = token_ids[start:end]
        try:
            encoded = cbor2.dumps([previous, list(tokens), extra_keys, tag, *ahead], canonical=True)
        except cbor2.CBOREncodeError:  # numpy integers and the like
            ahead = [[int(t) for t in a] for a in ahead]
            encoded = cbor2.dumps([previous, [int(t) for t in tokens], extra_keys, tag, *ahead], canonical=True)
        return keyed_sha256(self._secret, encoded)


# Redis Cluster: LMCache stores an object as two keys, ``<key>metadata`` and
# ``<key>kv_bytes``. With a hash tag (``{...}``, the first one in the key) in
# ``<key>``, Redis hashes only the tag, so both keys of an object are always in the
# same slot, hence on the same shard. LMCache's ``CacheEngineKey.to_string()``
# appends ``@<tag>%<value>`` for each ``request_configs`` entry named
# ``lmcache.tag.<tag>``; the model field before it is file-name safe (no braces),
# so this tag is the key's first ``{``.
SLOT_TAG = "lmcache.tag.slot"


def hash_tag_configs(chunk_hash: bytes) -> dict:
    """``request_configs`` of an object's ``CacheEngineKey``: its hash tag, from its own digest.

    Objects spread over all slots (the digest is uniform); an object's two keys share one.
    """
    return {SLOT_TAG: "{" + chunk_hash[:8].hex() + "}"}
