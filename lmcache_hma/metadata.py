"""The one message from the scheduler half to the worker half, per step.

Built in the scheduler (``build_connector_meta``), pickled by vLLM, read in the
worker. Objects are named by kind, chunk index and chunk hash; the worker
derives their blocks from the layout, so the message stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_hma.objects import ObjectKind


@dataclass(frozen=True)
class ObjectRef:
    kind: ObjectKind
    chunk: int  # chunk index; a tail sits at the chunk's end boundary
    chunk_hash: bytes  # prefix digest through the end of ``chunk`` (keys.ChunkHasher)


@dataclass
class LoadSpec:
    """Load ``objects`` into the request's blocks for tokens ``[start, end)``."""

    req_id: str
    block_table: tuple[list[int], ...]
    start: int  # first token to load (vLLM's local hit, block-aligned)
    end: int  # the hit boundary
    objects: list[ObjectRef]


@dataclass
class SaveSpec:
    """Store ``objects``, whose KV this step computed, from the request's blocks."""

    req_id: str
    block_table: tuple[list[int], ...]
    objects: list[ObjectRef]


@dataclass
class HMAConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
