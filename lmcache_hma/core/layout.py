"""The hybrid KV layout: which layer groups exist, and which blocks a chunk needs.

Pure logic, no vLLM process state: it runs in the scheduler and in the worker.

vLLM gives every KV cache group its own block table (``block_ids[g][j]``: the
``j``-th block of group ``g``). Three kinds of group are supported:

* full attention: every block of the prefix is real;
* sliding window (window ``W``): only blocks holding one of the last ``W-1``
  tokens before the next token are real, the others are the null block (id 0);
* recurrent state (gated delta net, vLLM's ``MambaSpec`` in "align" mode): one
  block holds a layer's whole state after ``h`` tokens, at index
  ``(h - 1) // block_size``; for a hit of ``h`` tokens every other position is null.

Example, block size 4, window 8, a hit of 12 tokens: the next token (12) reads
tokens 5..11, so the sliding group's table is ``[NULL, block7, block8]`` and the
full group's table is ``[block3, block4, block5]``.

Three kinds of stored object follow from that (``docs/design.md`` explains why):

* ``full`` object of chunk ``c``: the full-attention blocks of tokens
  ``[c*C, (c+1)*C)`` of every full-attention layer;
* ``tail`` object at boundary ``h``: the sliding-window blocks a hit at ``h``
  needs, ``[first_window_block(h), h / block_size)``, of every sliding layer;
* ``state`` object at boundary ``h``: the state block of every recurrent-state
  layer (its unpadded bytes), taken from the block vLLM hands off for ``h``.
* ``turn`` object at a finished request's end ``L`` inside chunk ``k``: the
  full-attention blocks of tokens ``[k*C, L)`` (the last one partly filled) and the
  sliding-window blocks a hit at ``L`` needs, ``[first_window_block(L), ceil(L / block_size))``;
  with recurrent-state groups, a ``state`` object at ``L`` beside it (the block at
  ``(L - 1) // block_size``, where vLLM keeps a running request's state).

Rows of an object are ordered group, then layer, then block. Full and tail rows are
paged KV pages (``paged_kv``); state rows are state pages (``state_kv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from lmcache_hma.core.kinds import GroupKind, ObjectKind

NULL_BLOCK_ID = 0


class LayoutError(ValueError):
    """The model's KV cache layout cannot be served by this connector."""


class ChunkSizeError(LayoutError):
    """``chunk_size`` is not a multiple of a KV cache group's block size (a configuration fix)."""


@dataclass(frozen=True)
class GroupLayout:
    """One vLLM KV cache group as this connector sees it."""

    index: int  # position in kv_cache_config.kv_cache_groups
    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int  # tokens per block
    page_bytes: int  # bytes of one block of one layer
    sliding_window: int = 0  # tokens; 0 for full attention
    extra_retained_tokens: int = 0  # vLLM keeps this many more tokens below the window
    # Recurrent state only: what one layer's page holds (``page_bytes`` is their sum, unpadded).
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    conv_state_layout: str = ""  # vLLM's VLLM_SSM_CONV_STATE_LAYOUT: "SD" or "DS"

    def state_block(self, boundary: int) -> int:
        """Index of the block holding the state after ``boundary`` tokens (recurrent state)."""
        return (boundary - 1) // self.block_size

    def first_token_needed(self, boundary: int) -> int:
        """The first token the token at ``boundary`` reads (0 for full attention)."""
        if self.kind is GroupKind.FULL:
            return 0
        return max(0, boundary - self.sliding_window + 1 - self.extra_retained_tokens)

    def first_block_needed(self, boundary: int) -> int:
        """Index of the first block the token at ``boundary`` reads."""
        return self.first_token_needed(boundary) // self.block_size


@dataclass(frozen=True)
class Segment:
    """``num_blocks`` consecutive block indices of one group, all its layers."""

    group: int  # index into HybridLayout.groups
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class HybridLayout:
    """All groups, in vLLM's order, plus the chunk size they are cut into."""

    groups: tuple[GroupLayout, ...]
    chunk_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise LayoutError("the model has no KV cache groups")
        if self.chunk_size <= 0:
            raise LayoutError(f"chunk_size must be positive, got {self.chunk_size}")
        if not self.paged_groups:
            raise LayoutError("the model has no attention layers (a pure recurrent model): "
                              "LMCacheHMAConnector serves hybrids with attention layers only")
        bad = [g for g in self.groups if self.chunk_size % g.block_size]
        if bad:  # one line, whatever the number of groups and layers
            need = math.lcm(*(g.block_size for g in self.groups))
            sizes = "/".join(str(b) for b in sorted({g.block_size for g in bad}))
            hint = (" (a recurrent-state group's block holds one state: vLLM logs 'Setting attention block "
                    "size to N tokens'; --block-size B makes it a multiple of B)"
                    if any(g.kind is GroupKind.STATE for g in bad) else "")
            raise ChunkSizeError(
                f"chunk_size {self.chunk_size} is not a multiple of the block size {sizes} of KV cache "
                f"group(s) {', '.join(str(g.index) for g in bad)} "
                f"({', '.join(sorted({g.kind.value for g in bad}))}; {sum(len(g.layer_names) for g in bad)} "
                f"layers); set chunk_size to a multiple of {need} (e.g. {_round_up(self.chunk_size, need)}) "
                f"or change vLLM's --block-size{hint}")

    @property
    def full_groups(self) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.FULL)

    @property
    def sliding_groups(self) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.SLIDING)

    @property
    def has_sliding(self) -> bool:
        return bool(self.sliding_groups)

    @property
    def state_groups(self) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.STATE)

    @property
    def has_state(self) -> bool:
        return bool(self.state_groups)

    @property
    def paged_groups(self) -> tuple[GroupLayout, ...]:
        """The attention groups (full and sliding): their blocks are KV pages."""
        return tuple(g for g in self.groups if g.kind is not GroupKind.STATE)

    @property
    def group_of_layer(self) -> tuple[GroupLayout, ...]:
        """The group of each attention layer, by the worker's paged layer index (``layer_names``)."""
        return tuple(g for g in self.paged_groups for _ in g.layer_names)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every attention layer once, grouped by group: the worker's paged layer index order
        (``Rows.layer_indices``). Recurrent-state layers are ``state_layer_names``."""
        return tuple(name for g in self.paged_groups for name in g.layer_names)

    @property
    def state_layer_names(self) -> tuple[str, ...]:
        return tuple(name for g in self.state_groups for name in g.layer_names)

    @property
    def state_bytes(self) -> int:
        """Payload bytes of one state object: every recurrent layer's state, unpadded."""
        return sum(g.page_bytes * len(g.layer_names) for g in self.state_groups)

    def full_segments(self, chunk: int) -> list[Segment]:
        """Blocks of the full object of chunk ``chunk``."""
        segs = []
        for pos, g in enumerate(self.groups):
            if g.kind is GroupKind.FULL:
                per_chunk = self.chunk_size // g.block_size
                segs.append(Segment(pos, chunk * per_chunk, per_chunk))
        return segs

    def tail_segments(self, boundary: int) -> list[Segment]:
        """Blocks of the tail object at token ``boundary`` (a chunk boundary)."""
        segs = []
        for pos, g in enumerate(self.groups):
            if g.kind is GroupKind.SLIDING:
                first = g.first_block_needed(boundary)
                end = boundary // g.block_size
                if end > first:
                    segs.append(Segment(pos, first, end - first))
        return segs

    def turn_segments(self, chunk: int, end: int, on_tail: bool = False) -> list[Segment]:
        """Blocks of the turn object at token ``end`` inside chunk ``chunk``: the blocks of
        tokens ``[chunk * C, end)`` of every full-attention group (the last one partly
        filled) and, of every sliding group, those the token at ``end`` reads; ``on_tail``
        (``ObjectRef.on_tail``): of those only the ones from ``chunk * C`` on, the window
        before it being the tail at ``chunk * C`` (``turn_needs_tail``)."""
        segs = []
        for pos, g in enumerate(self.groups):
            last = -(-end // g.block_size)  # blocks up to and with the one holding token end - 1
            if g.kind is GroupKind.FULL:
                first = chunk * self.chunk_size // g.block_size
            elif g.kind is GroupKind.SLIDING:
                first = g.first_block_needed(end)
                if on_tail:
                    first = max(first, chunk * self.chunk_size // g.block_size)
            else:
                continue
            if last > first:
                segs.append(Segment(pos, first, last - first))
        return segs

    def turn_needs_tail(self, chunk: int, end: int) -> bool:
        """Whether a sliding group's window before a turn end at ``end`` (in chunk ``chunk``)
        reaches before the chunk's start: a turn object ``on_tail`` then leaves those blocks to
        the tail at ``chunk * C``, which a hit there loads beside it (``metadata.turn_hit_objects``)."""
        start = chunk * self.chunk_size
        return chunk >= 1 and any(g.first_block_needed(end) < start // g.block_size for g in self.sliding_groups)

    def token_ranges(self, kind: "ObjectKind", chunk: int, end: int = 0) -> list[tuple[int, int, int]]:
        """``(group position, first token, end token)`` of each attention group's tokens in object
        ``kind`` of chunk ``chunk`` (a turn object's end: ``end``) in the parallelism-free
        format (``kv_copy.canonical_objects``), which has no block size: a full object's
        chunk, a turn object's ``[chunk * C, end)``, and of a sliding group the tokens the next
        token reads (``first_token_needed``) from a multiple of ``range_alignment`` on, so that
        every reader's blocks the range touches are whole in it."""
        if kind is ObjectKind.FULL:
            lo, hi, kinds = chunk * self.chunk_size, (chunk + 1) * self.chunk_size, (GroupKind.FULL,)
        elif kind is ObjectKind.TAIL:
            lo, hi, kinds = 0, (chunk + 1) * self.chunk_size, (GroupKind.SLIDING,)
        elif kind is ObjectKind.TURN:
            lo, hi, kinds = chunk * self.chunk_size, end, (GroupKind.FULL, GroupKind.SLIDING)
        else:
            raise ValueError(f"{kind.name} objects hold no attention KV")
        out = []
        for pos, g in enumerate(self.groups):
            if g.kind in kinds:
                first = lo if g.kind is GroupKind.FULL else self._range_start(g, hi)
                if hi > first:
                    out.append((pos, first, hi))
        return out

    def range_alignment(self, group: GroupLayout) -> int:
        """The tokens a sliding group's range in the parallelism-free format (``token_ranges``)
        starts on a multiple of: the largest divisor of the chunk size not above the window.

        Why: vLLM marks every full block of a loaded hit computed and caches it, so a later
        request may read a loaded sliding block's tokens before this hit's window; a load must
        therefore write whole blocks. The format has no block size (instances of several share
        it), so the range starts where every reader's block starts: every block size of an
        instance using the format must divide this (``CanonicalObjects`` checks it at start).
        Not above the window: a range holds at most ``alignment - 1`` tokens more than the
        window, and where the window is a multiple of it (real models: 128, 512, 1024 ... with
        chunks of 256) a tail at a chunk boundary starts one token before the window, on a block
        that a writer of any such block size still holds."""
        return _largest_divisor_at_most(self.chunk_size, max(1, group.sliding_window))

    def _range_start(self, group: GroupLayout, boundary: int) -> int:
        """The first token of a sliding group's range ending at ``boundary`` (``token_ranges``)."""
        align = self.range_alignment(group)
        return group.first_token_needed(boundary) // align * align

    def checkpoint_interval(self, configured: int = 0) -> int:
        """Tokens between stored tails (and recurrent states): ``configured``, or by default
        the largest window rounded up to whole chunks. A tail holds a whole window, so
        storing one every window costs about as much sliding KV as the model has; more
        often costs more. A model without sliding windows gets one chunk: for recurrent
        states vLLM only has one where a prefill step ends, so they are sparse already.
        """
        if configured:
            return configured
        window = max((g.sliding_window for g in self.sliding_groups), default=0)
        return max(self.chunk_size, _round_up(window, self.chunk_size))

    def tail_interval(self) -> int:
        """Tokens between stored tails under ``hma_tail_admission: branch`` (besides prompt ends
        and branch points): the span whose full-attention KV weighs as much as one tail, in whole
        chunks, so tails at most double what is stored. One chunk where a tail is small (a
        window under a chunk, few sliding layers: every boundary keeps its tail, as before);
        5 windows on a Gemma-3 shape (five sliding layers to one full). A model without sliding
        windows: ``checkpoint_interval()``."""
        if not self.has_sliding:
            return self.checkpoint_interval()
        window = max(g.sliding_window for g in self.sliding_groups)
        boundary = _round_up(window, self.chunk_size) + self.chunk_size
        tail = sum(len(self.groups[s.group].layer_names) * s.num_blocks * self.groups[s.group].page_bytes
                   for s in self.tail_segments(boundary))
        per_token = sum(len(g.layer_names) * g.page_bytes / g.block_size for g in self.full_groups)
        if not per_token:
            return self.checkpoint_interval()
        return max(self.chunk_size, _round_up(math.ceil(tail / per_token), self.chunk_size))

    def num_rows(self, segments: Sequence[Segment]) -> int:
        return sum(len(self.groups[s.group].layer_names) * s.num_blocks for s in segments)

    def state_segments(self, boundary: int) -> list[Segment]:
        """Blocks of the state object at token ``boundary``: one per recurrent-state group."""
        return [Segment(pos, g.state_block(boundary), 1)
                for pos, g in enumerate(self.groups) if g.kind is GroupKind.STATE]

    def segments(self, kind: "ObjectKind", chunk: int, end: int = 0, on_tail: bool = False) -> list[Segment]:
        """Blocks of object ``kind`` of chunk ``chunk`` (a tail or state sits at the chunk's end;
        a turn object, and a turn end's state, at ``end``, see ``turn_segments``; ``on_tail``:
        a turn object's, ``ObjectRef.on_tail``)."""
        if kind is ObjectKind.FULL:
            return self.full_segments(chunk)
        if kind is ObjectKind.STATE:  # at a turn end: ``end``
            return self.state_segments(end or (chunk + 1) * self.chunk_size)
        if kind is ObjectKind.TURN:
            return self.turn_segments(chunk, end, on_tail)
        if kind is ObjectKind.TAIL:
            return self.tail_segments((chunk + 1) * self.chunk_size)
        raise ValueError(f"{kind.name} objects hold no KV blocks")

    def payload_bytes(self, kind: "ObjectKind", chunk: int, page_bytes: int, end: int = 0,
                      on_tail: bool = False) -> int:
        """Payload bytes of object ``kind`` of chunk ``chunk`` (``page_bytes``: one KV page;
        ``end``, ``on_tail``: a turn object's)."""
        if kind is ObjectKind.STATE:  # padded so that it is whole elements of any KV dtype
            return _round_up(self.state_bytes, 16)
        if kind is ObjectKind.TURNMARK:
            from lmcache_hma.core.turn_ends import MARK_BYTES

            return MARK_BYTES
        return self.num_rows(self.segments(kind, chunk, end, on_tail)) * page_bytes


@dataclass(frozen=True)
class Rows:
    """Rows of one object to copy: the object row, and where it lives in paged KV."""

    object_rows: list[int]
    layer_indices: list[int]  # index into HybridLayout.layer_names
    block_ids: list[int]

    def __len__(self) -> int:
        return len(self.object_rows)


def plan_rows(
    layout: HybridLayout,
    segments: Sequence[Segment],
    block_table: Sequence[Sequence[int]],
    min_token: int = 0,
) -> Rows:
    """Map the rows of an object to (layer, block id) of a request's block table.

    ``block_table`` is the request's ``tuple[list[int], ...]``, one list per group.
    Rows whose block lies wholly before ``min_token`` (already computed, e.g. a
    local prefix-cache hit) and rows whose block id is the null block are left
    out: nothing is loaded twice and nothing is written to the null block.
    Segments of attention groups only (recurrent states: ``state_kv``).
    """
    layer_base = _layer_bases(layout)
    obj_rows: list[int] = []
    layers: list[int] = []
    blocks: list[int] = []
    row = 0
    for seg in segments:
        g = layout.groups[seg.group]
        table = block_table[g.index]
        first_kept = -(-min_token // g.block_size)  # first block starting >= min_token
        for li in range(len(g.layer_names)):
            for j in range(seg.first_block, seg.first_block + seg.num_blocks):
                if j >= first_kept:
                    if j >= len(table):
                        raise LayoutError(
                            f"block table of group {g.index} has {len(table)} blocks, "
                            f"block {j} needed"
                        )
                    if table[j] != NULL_BLOCK_ID:
                        obj_rows.append(row)
                        layers.append(layer_base[seg.group] + li)
                        blocks.append(table[j])
                row += 1
    return Rows(obj_rows, layers, blocks)


def _layer_bases(layout: HybridLayout) -> list[int]:
    """Per group, the paged index of its first layer (state groups are not paged)."""
    bases, n = [], 0
    for g in layout.groups:
        bases.append(n)
        if g.kind is not GroupKind.STATE:
            n += len(g.layer_names)
    return bases


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return next(d for d in range(min(n, cap), 0, -1) if n % d == 0)
