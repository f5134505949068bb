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
request's blocks and a part's bytes. A part in host memory (LMCache's buffer) moves to or
from the pages' device through a buffer there, in one copy per attention group (state
shards: one per shard); the block index lives on the pages' device, built once per plan.
Every torch op runs on the calling thread's current stream: a gather on another thread than
the forward's first waits for the forward's stream (``after``, ``copy_ops.ready_marker``).

Ranges: a sliding group's range starts on a multiple of ``HybridLayout.range_alignment``,
which every block size of an instance using the format divides (checked at start), so that a
load writes every block it touches whole: vLLM caches every full block of a loaded hit, and a
later request may read a loaded block's tokens before this hit's window. A load skips the
sliding blocks vLLM left null before the window (``plan_load``); a gather needs every block of
the range (``plan``): a writer that freed one stores nothing.
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
from lmcache_hma.kv_copy.canonical_kv import (BlockSpan, CanonicalShape, HeadRange, PagedLayerKV, RankHeads,
                                              RankKV, cpu_layer_kv, split_layer_kv)

KV_KINDS = (ObjectKind.FULL, ObjectKind.TAIL, ObjectKind.TURN)


class PartSegment(NamedTuple):
    """One attention group's share of a part's copy: tokens ``[t0, t1)`` (``span``) between the
    request's blocks of the group and ``payload[offset:offset + shape's elements]``."""

    group: int  # position in HybridLayout.groups
    kv: RankKV
    span: BlockSpan  # the tokens, in the request's blocks of the group
    shape: CanonicalShape
    offset: int  # elements

    @property
    def tokens(self) -> tuple[int, int]:
        return self.span.tokens

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
        for g in layout.sliding_groups:
            align = layout.range_alignment(g)
            if align % g.block_size:
                raise LayoutError(f"KV cache group {g.index}: block size {g.block_size} does not divide {align}, "
                                  f"where hma_share_parallel_shapes starts a sliding window's tokens (the "
                                  f"largest divisor of chunk_size {layout.chunk_size} not above the window "
                                  f"{g.sliding_window}): a load would write part of a block; use a block size "
                                  f"dividing {align}")
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

    def plan(self, kind: ObjectKind, chunk: int, end: int, head: int,
             block_table: Sequence[Sequence[int]]) -> Optional[PartCopy]:
        """The gather of head ``head``'s part from a request's blocks (``block_table``: one list per
        KV cache group): every token of the part; None where a block holding one is the null
        block (a sliding block vLLM freed: the writer no longer has those tokens) or past the
        table: the part is not stored."""
        return self._plan(kind, chunk, end, head, block_table, min_token=0, load=False)

    def plan_load(self, kind: ObjectKind, chunk: int, end: int, head: int, block_table: Sequence[Sequence[int]],
                  min_token: int = 0) -> Optional[PartCopy]:
        """The load of head ``head``'s part into a hit's blocks: its tokens from ``min_token`` on (a
        local prefix-cache hit computed those before), less a sliding group's tokens in the null
        blocks vLLM allocates before the window of the token at the range's end. Every block
        it writes is written whole (up to the range's end); None where it cannot be: a block it
        needs is null or past the table, or a range would start inside a real block (the load
        fails and vLLM recomputes)."""
        return self._plan(kind, chunk, end, head, block_table, min_token, load=True)

    def _plan(self, kind, chunk, end, head, block_table, min_token: int, load: bool) -> Optional[PartCopy]:
        segments, blocks, offset = [], set(), 0
        for pos, shape in self.shapes(kind, chunk, end, head):
            kv, table = self.groups[pos], block_table[self.layout.groups[pos].index]
            tokens = self._tokens(pos, shape, table, min_token, load)
            if tokens is None:
                return None
            t0, t1 = tokens
            if t1 > t0:
                n = kv.block_size
                segments.append(PartSegment(pos, kv, kv.span(table, tokens), shape, offset))
                blocks.update(table[t0 // n: -(-t1 // n)])
            offset += shape.nbytes // self._esize
        return PartCopy(head, tuple(segments), frozenset(blocks))

    def _tokens(self, pos: int, shape: CanonicalShape, table: Sequence[int], min_token: int,
                load: bool) -> Optional[tuple[int, int]]:
        """The tokens of group ``pos``'s range ``shape`` to copy with the blocks ``table``, or None
        (``plan``, ``plan_load``)."""
        g, n = self.layout.groups[pos], self.groups[pos].block_size
        t0, t1 = max(shape.first_token, min_token), shape.end_token
        if load and g.kind is GroupKind.SLIDING:  # vLLM allocates no block before the window
            window = g.first_token_needed(t1) // n
            while t0 < t1 and t0 // n < min(window, len(table)) and table[t0 // n] == NULL_BLOCK_ID:
                t0 = (t0 // n + 1) * n
        if t1 <= t0:
            return t0, t0
        needed = table[t0 // n: -(-t1 // n)]
        if len(needed) < -(-t1 // n) - t0 // n or NULL_BLOCK_ID in needed:
            return None
        if load and t0 % n and t0 != min_token:  # tokens before t0 in its block: in no object
            return None
        return t0, t1

    def gather(self, copy: PartCopy, payload: torch.Tensor, after=None) -> None:
        """Copy a part (``plan``) from the request's blocks into ``payload`` (1-D, the KV dtype, in
        host memory or on the pages' device); returns once ``payload`` holds it. On a GPU the copy
        waits for ``after`` (``copy_ops.ready_marker``, taken on the forward's thread: a gather
        on another thread needs it), else for the calling thread's current stream."""
        _wait_for(after, self.device)
        for _, kv, span, shape, offset in copy.segments:
            part = payload[offset: offset + shape.nbytes // self._esize]
            if part.device == self.device:
                kv.copy(span, part, shape, to_object=True)
            else:  # a host payload, device pages: through a buffer on the device, one transfer
                staged = torch.empty(part.shape, dtype=part.dtype, device=self.device)
                kv.copy(span, staged, shape, to_object=True)
                part.copy_(staged)

    def scatter(self, copy: PartCopy, payload: torch.Tensor) -> None:
        """Copy a part (``plan_load``) from ``payload`` into the request's blocks, on the calling
        thread's current stream (the forward's: it reads them next); returns once done."""
        for _, kv, span, shape, offset in copy.segments:
            part = payload[offset: offset + shape.nbytes // self._esize]
            if part.device != self.device:  # through a buffer on the device, one transfer
                part = part.to(self.device)
            kv.copy(span, part, shape, to_object=False)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host buffer is released next


def _wait_for(after, device: torch.device) -> None:
    """Make the calling thread's current stream on ``device`` wait for the event ``after``
    (``copy_ops.ready_marker``; None off a GPU, or when the caller ran the forward itself)."""
    if after is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(after)


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
        self._state, self._secret, self.device = state, secret, state.device
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
        """Copy shard ``shard`` of the states in ``blocks`` (one block id per state group) into
        ``payload`` (host memory or the pages' device; its padding is left as it is), on the
        calling thread's current stream; returns once ``payload`` holds it."""
        out = payload.view(torch.uint8)[:self.num_layers * self.layer_bytes]
        staged = out if out.device == self.device else torch.empty(out.shape, dtype=torch.uint8, device=self.device)
        for layer, pages in enumerate(self._pages(blocks)):
            base = layer * self.layer_bytes
            for k, p, o, n in self._runs[shard]:
                staged[base + o: base + o + n].copy_(pages[k][p:p + n])
        if staged is not out:  # a host payload: the runs went to a buffer on the device, one transfer
            out.copy_(staged)

    def scatter(self, blocks: Sequence[int], shard: int, payload: torch.Tensor) -> None:
        """Copy shard ``shard`` from ``payload`` into the states in ``blocks``, on the calling thread's
        current stream (the forward's: it reads them next); ``payload`` may be reused on return."""
        src = payload.view(torch.uint8)[:self.num_layers * self.layer_bytes]
        if src.device != self.device:  # one transfer (a blocking one: the payload is free after it)
            src = src.to(self.device)
        for layer, pages in enumerate(self._pages(blocks)):
            base = layer * self.layer_bytes
            for k, p, o, n in self._runs[shard]:
                pages[k][p:p + n].copy_(src[base + o: base + o + n])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
