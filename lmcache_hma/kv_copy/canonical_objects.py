"""One worker's objects in the parallelism-free format (``hma_share_parallel_shapes``).

This runs in the worker. With the option on, an attention object (a chunk's ``full``
object, a sliding-window ``tail``, a ``turn`` end) is stored as one *part per KV head*,
named by the head's global index (``core.keys.head_part_digest``), never by rank:

    part of head h = for each attention group the object holds (``HybridLayout.token_ranges``):
                     [layer][K|V][token][head_dim]      (``canonical_kv.CanonicalShape``)

Recurrent states are one part per state shard (``CanonicalStates``). A part has no rank, no
TP size and no block size in it, so a rank at any TP size that
vLLM accepts for the model, at any block size, reads the parts of the heads it holds and
writes those it is the first replica of (``canonical_kv.kv_heads_of_rank``). A replica
rank (TP larger than the KV heads) writes its local tiers only: the shared tier gets one
copy (``writes_shared``).

The copy is ``canonical_kv.RankKV`` (torch, any device), per attention group, between a
request's blocks and a part's bytes. On a GPU the part goes through a device buffer (the
objects live in host memory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from lmcache_hma.core.keys import head_part_digest
from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import NULL_BLOCK_ID, HybridLayout, LayoutError
from lmcache_hma.kv_copy.canonical_kv import (CanonicalShape, HeadRange, PagedLayerKV, RankHeads, RankKV,
                                              cpu_layer_kv, split_layer_kv)

KV_KINDS = (ObjectKind.FULL, ObjectKind.TAIL, ObjectKind.TURN)


class PartSegment(NamedTuple):
    """One attention group's share of a part's copy: tokens ``[t0, t1)`` between the request's
    blocks of the group and ``payload[offset:offset + shape's elements]``."""

    group: int  # position in HybridLayout.groups
    kv: RankKV
    block_ids: Sequence[int]  # the request's blocks of the group
    tokens: tuple[int, int]
    shape: CanonicalShape
    offset: int  # elements

    @property
    def nbytes(self) -> int:
        """Bytes this segment's copy moves."""
        return (self.tokens[1] - self.tokens[0]) * self.shape.nbytes // self.shape.num_tokens


@dataclass(frozen=True)
class PartCopy:
    """The copy of one head's part, per attention group (``PartSegment``)."""

    head: int
    segments: tuple[PartSegment, ...]
    block_ids: frozenset  # block ids read or written (the worker's gather barrier)


class CanonicalObjects:
    """The worker's attention layers as ``RankKV`` per group, and the parts of its heads."""

    def __init__(self, layout: HybridLayout, kv_caches: dict, num_blocks: int, rank: RankHeads,
                 secret: Optional[bytes], states: Optional["CanonicalStates"] = None,
                 page_formats: Optional[dict] = None):
        """``page_formats``: vLLM CPU's page format per attention group index
        (``vllm_compat.cpu_page_format``; absent: plain pages)."""
        self.layout, self.rank, self._secret, self.states = layout, rank, secret, states
        self.groups: dict[int, RankKV] = {}  # group position -> its layers
        for pos, g in enumerate(layout.groups):
            if g.kind is GroupKind.STATE:
                continue
            page_format = (page_formats or {}).get(g.index) or "vec"
            self.groups[pos] = RankKV([layer_kv(kv_caches[n], num_blocks, page_format) for n in g.layer_names],
                                      rank.heads)
        first = next(iter(self.groups.values()))
        self.dtype, self.head_dim, self.device = first.dtype, first.head_dim, first.layers[0].key.device
        for pos, kv in self.groups.items():
            if kv.head_dim != self.head_dim or kv.dtype != self.dtype:
                raise LayoutError(f"KV cache group {layout.groups[pos].index}: head size {kv.head_dim} "
                                  f"{kv.dtype}, group {layout.groups[0].index}: {self.head_dim} {self.dtype}; "
                                  f"hma_share_parallel_shapes needs one head size for all attention layers")
        self._esize = torch.empty(0, dtype=self.dtype).element_size()
        self._named: OrderedDict = OrderedDict()  # key of a first part -> its object's name

    @property
    def heads(self) -> range:
        return range(self.rank.heads.start, self.rank.heads.stop)

    @property
    def writes_shared(self) -> bool:
        """Whether this rank's parts go to the shared (remote) tier: the first replica's only."""
        return self.rank.writes

    NAMED = 1 << 16  # first parts whose object's name is kept (``object_of``)

    def splits(self, kind: ObjectKind) -> bool:
        """Whether objects of ``kind`` are stored as parts (``parts``)."""
        return kind in KV_KINDS or (kind is ObjectKind.STATE and self.states is not None)

    def parts(self, kind: ObjectKind, chunk_hash: bytes) -> Optional[list[tuple[int, bytes]]]:
        """``(index, key)`` of each part of object ``kind`` named ``chunk_hash`` this rank holds: per
        KV head (attention objects) or per state shard (``CanonicalStates``); None for an object
        stored whole (a turn-end marker)."""
        if not self.splits(kind):
            return None
        out = (self.states.parts(chunk_hash) if kind is ObjectKind.STATE else
               [(h, head_part_digest(self._secret, chunk_hash, h)) for h in self.heads])
        if len(self._named) >= self.NAMED:
            self._named.popitem(last=False)
        self._named[out[0][1]] = chunk_hash
        return out

    def object_of(self, key: bytes) -> Optional[bytes]:
        """The object name of the part ``key`` if it is the part of this rank's first head of an
        object this worker named lately, else None (KV cache events: one part stands for
        the object)."""
        return self._named.get(key)

    def shapes(self, kind: ObjectKind, chunk: int, end: int = 0, head: int = 0) -> list[tuple[int, CanonicalShape]]:
        """``(group position, shape)`` of each attention group in a part, in payload order."""
        hr = HeadRange(head, head + 1)
        return [(pos, CanonicalShape(hr, len(self.layout.groups[pos].layer_names), t1 - t0, self.head_dim,
                                     self.dtype, first_token=t0))
                for pos, t0, t1 in self.layout.token_ranges(kind, chunk, end)]

    def payload_bytes(self, kind: ObjectKind, chunk: int, end: int = 0) -> int:
        """Bytes of one part's payload (every head's, every shard's part has the same size)."""
        if kind is ObjectKind.STATE:
            return self.states.payload_bytes
        return sum(shape.nbytes for _, shape in self.shapes(kind, chunk, end))

    def plan(self, kind: ObjectKind, chunk: int, end: int, head: int, block_table: Sequence[Sequence[int]],
             min_token: int = 0) -> Optional[PartCopy]:
        """The copy of head ``head``'s part to or from a request's blocks (``block_table``: one
        list per KV cache group), of the tokens from ``min_token`` on (a local prefix-cache
        hit computed those before); None where a block it needs is the null block or past
        the table (a gather then stores nothing; a load recomputes)."""
        segments, blocks, offset = [], set(), 0
        for pos, shape in self.shapes(kind, chunk, end, head):
            kv, table = self.groups[pos], block_table[self.layout.groups[pos].index]
            t0, t1 = max(shape.first_token, min_token), shape.end_token
            if t1 > t0:
                n = kv.block_size
                needed = table[t0 // n: -(-t1 // n)]
                if len(needed) < -(-t1 // n) - t0 // n or NULL_BLOCK_ID in needed:
                    return None
                segments.append(PartSegment(pos, kv, table, (t0, t1), shape, offset))
                blocks.update(needed)
            offset += shape.nbytes // self._esize
        return PartCopy(head, tuple(segments), frozenset(blocks))

    def gather(self, copy: PartCopy, payload: torch.Tensor) -> None:
        """Copy a part from the request's blocks into ``payload`` (1-D, the KV dtype)."""
        for _, kv, table, tokens, shape, offset in copy.segments:
            part = payload[offset: offset + shape.nbytes // self._esize]
            if part.device == self.device:
                kv.gather(table, tokens, part, shape)
            else:  # a host object, device pages: through a device buffer
                staged = torch.empty_like(part, device=self.device)
                kv.gather(table, tokens, staged, shape)
                part.copy_(staged)

    def scatter(self, copy: PartCopy, payload: torch.Tensor) -> None:
        """Copy a part from ``payload`` into the request's blocks."""
        for _, kv, table, tokens, shape, offset in copy.segments:
            part = payload[offset: offset + shape.nbytes // self._esize]
            if part.device != self.device:
                part = part.to(self.device)
            kv.scatter(table, tokens, part, shape)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host buffer is released next


def layer_kv(t: torch.Tensor, num_blocks: int, page_format: str = "vec") -> PagedLayerKV:
    """One attention layer's K and V as ``[num_blocks, heads, block_size, head_dim]`` views of
    vLLM's tensor: the CPU backend's ``[num_blocks, heads, block_size, 2 * head_dim]`` (laid out
    as its kernel ``page_format`` writes it), FlashAttention's ``[2, num_blocks, block_size,
    heads, head_dim]``, or the block-first ``[num_blocks, 2, block_size, heads, head_dim]``
    (FlashInfer; any stride order, e.g. HND)."""
    if t.dim() == 4 and t.device.type == "cpu" and t.shape[0] == num_blocks:
        return cpu_layer_kv(t, page_format)
    if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return split_layer_kv(t)
    if t.dim() == 5 and t.shape[0] == num_blocks and t.shape[1] == 2:
        return PagedLayerKV(t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3))
    raise LayoutError(f"hma_share_parallel_shapes: unsupported KV cache layer {tuple(t.shape)} on "
                      f"{t.device} for {num_blocks} blocks")


class CanonicalStates:
    """Recurrent (gated-delta-net) states in the parallelism-free format: a state object is one
    part per *shard* of ``shards = gcd(k heads, v heads)``, shard ``j`` being what rank ``j``
    holds at TP ``shards`` (its q, k and v conv channels and its value heads' recurrent
    states), in conv layout "SD", for every recurrent layer (``canonical_state``). Every TP size
    vLLM accepts divides both head counts, so a rank holds whole shards, and no shard is held
    by two ranks: every rank writes its own."""

    def __init__(self, layout: HybridLayout, state, tp_size: int, tp_rank: int, secret: Optional[bytes]):
        import math

        from lmcache_hma.kv_copy.canonical_state import gdn_dims_of_rank, shard_runs

        groups = layout.state_groups
        g = groups[0]
        if any((h.state_shapes, h.state_dtypes, h.conv_state_layout) !=
               (g.state_shapes, g.state_dtypes, g.conv_state_layout) for h in groups):
            raise LayoutError("hma_share_parallel_shapes: recurrent-state groups of different shapes")
        self.dims = gdn_dims_of_rank(g.state_shapes, g.conv_state_layout, tp_size)
        self.shards = math.gcd(self.dims.num_k_heads, self.dims.num_v_heads)
        if self.shards % tp_size:
            raise LayoutError(f"hma_share_parallel_shapes: TP {tp_size} does not divide the {self.shards} "
                              f"state shards")
        per = self.shards // tp_size
        self.owned = range(tp_rank * per, (tp_rank + 1) * per)
        conv_es, ssm_es = (torch.empty(0, dtype=_dtype(d)).element_size() for d in g.state_dtypes)
        self.layer_bytes = self.dims.canonical_bytes(conv_es, ssm_es) // self.shards
        self._state, self._secret = state, secret
        self.num_layers = sum(len(h.layer_names) for h in groups)
        # per owned shard: (part of the layer's page, offset in it, offset in the layer's share, bytes)
        sizes = [p.shape[1] for p in state._parts[0][0]]
        starts = np.cumsum([0] + sizes)
        self._runs = {}
        for j in self.owned:
            runs = shard_runs(self.dims, tp_size, tp_rank, g.conv_state_layout, self.shards, j, conv_es, ssm_es)
            part = np.searchsorted(starts, runs[:, 0], side="right") - 1
            if (runs[:, 0] + runs[:, 2] > starts[part + 1]).any():
                raise LayoutError("a state run crosses the page's parts")
            self._runs[j] = [(int(k), int(p - starts[k]), int(o), int(n))
                             for k, p, o, n in zip(part, runs[:, 0], runs[:, 1], runs[:, 2])]

    def parts(self, chunk_hash: bytes) -> list[tuple[int, bytes]]:
        return [(j, head_part_digest(self._secret, chunk_hash, j)) for j in self.owned]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one shard's part, padded to whole elements of any KV dtype."""
        return -(-self.num_layers * self.layer_bytes // 16) * 16

    def _pages(self, blocks: Sequence[int]):
        """Per recurrent layer, in object order: its page's parts in ``blocks`` (one per group)."""
        if len(blocks) != len(self._state._parts):
            raise LayoutError(f"{len(blocks)} state blocks given for {len(self._state._parts)} state groups")
        for layers, block in zip(self._state._parts, blocks):
            if not 0 < block < self._state.num_blocks:
                raise LayoutError(f"state block id {block} is not a real block")
            for parts in layers:
                yield [part[block] for part in parts]

    def gather(self, blocks: Sequence[int], shard: int, payload: torch.Tensor) -> None:
        out = payload.view(torch.uint8)
        for layer, pages in enumerate(self._pages(blocks)):
            base = layer * self.layer_bytes
            for k, p, o, n in self._runs[shard]:
                out[base + o: base + o + n].copy_(pages[k][p:p + n])

    def scatter(self, blocks: Sequence[int], shard: int, payload: torch.Tensor) -> None:
        src = payload.view(torch.uint8)
        for layer, pages in enumerate(self._pages(blocks)):
            base = layer * self.layer_bytes
            for k, p, o, n in self._runs[shard]:
                pages[k][p:p + n].copy_(src[base + o: base + o + n])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
