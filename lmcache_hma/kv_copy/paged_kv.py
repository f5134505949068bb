"""vLLM's paged KV tensors, addressed as equal-size rows ("units").

This runs in the worker. A block of one layer is copied whole, as opaque bytes:
inside a block vLLM's CPU backend stores K transposed per head, so nothing here
looks at heads or tokens.

Every layer tensor is a view into some allocation (with the hybrid manager all
groups overlay the same bytes). Each allocation is viewed once as a 2-D tensor
``[num_units, unit_elems]``; a (layer, block) pair is then ``planes`` unit rows at
``offset[layer] + block * block_stride[layer] + p * plane_stride[layer]``. That
turns a copy of many layers and many blocks into one ``index_select`` /
``index_put_`` per allocation (torch), or one kernel launch (CUDA).

Two block layouts are understood:
* block-major ``[num_blocks, ...]`` per layer (vLLM CPU, FlashInfer): one plane;
* K/V split ``[2, num_blocks, ...]`` per layer (FlashAttention): two planes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from lmcache_hma.core.layout import HybridLayout, LayoutError, Rows


@dataclass(frozen=True)
class UnitIndex:
    """Where the rows of one copy live: per allocation, unit rows on both sides."""

    storage: int  # index into PagedKV.storages
    paged_units: torch.Tensor  # int64, rows of PagedKV.storages[storage]
    object_units: torch.Tensor  # int64, rows of the object's [n, unit_elems] view
    run: Optional[int]  # object_units == arange(run, run + len): copy straight into/out of the object


class PagedKV:
    """The registered KV caches of the layers in ``layout``."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: HybridLayout, num_blocks: int):
        names = layout.layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV cache for layers {missing}")
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        self.dtype = first.dtype
        self.device = first.device
        self.planes, self.unit_elems = _block_shape(first, num_blocks)
        self.page_bytes = self.planes * self.unit_elems * first.element_size()
        self.storages: list[torch.Tensor] = []
        storage_ptrs: list[int] = []
        offsets, block_strides, plane_strides, storage_of = [], [], [], []
        for name, t in zip(names, tensors):
            if t.dtype != self.dtype or _block_shape(t, num_blocks) != (self.planes, self.unit_elems):
                raise LayoutError(
                    f"layer {name}: KV cache {tuple(t.shape)} {t.dtype} differs in page "
                    f"layout from {names[0]} {tuple(first.shape)} {first.dtype}"
                )
            ptr = t.untyped_storage().data_ptr()
            if ptr not in storage_ptrs:
                storage_ptrs.append(ptr)
                self.storages.append(self._flat_view(t))
            storage_of.append(storage_ptrs.index(ptr))
            byte_off = t.data_ptr() - ptr
            elem_off, block_stride = byte_off // t.element_size(), t.stride(self.planes - 1)
            plane_stride = t.stride(0) if self.planes == 2 else 0
            for what, value in (("offset", elem_off), ("block stride", block_stride),
                                ("plane stride", plane_stride)):
                if value % self.unit_elems:
                    raise LayoutError(f"layer {name}: {what} {value} is not a whole page")
            offsets.append(elem_off // self.unit_elems)
            block_strides.append(block_stride // self.unit_elems)
            plane_strides.append(plane_stride // self.unit_elems)
        # numpy, not torch: a hit indexes tens of objects of a few rows each, where a torch
        # op's dispatch would cost more than the planning itself
        self._storage_of = np.array(storage_of, dtype=np.int64)
        self._offset = np.array(offsets, dtype=np.int64)
        self._block_stride = np.array(block_strides, dtype=np.int64)
        self._plane_stride = np.array(plane_strides, dtype=np.int64)
        self._planes = np.arange(self.planes, dtype=np.int64)
        self._set_addresses(num_blocks, first.element_size())

    def _set_addresses(self, num_blocks: int, element_size: int) -> None:
        """Byte addresses of every layer's block 0, and its strides: fixed for as long as
        vLLM's KV caches live (they never move), so a copy plan is arithmetic on these
        (``copy_plan``), with nothing asked of torch per copy."""
        self.num_blocks = num_blocks
        self.unit_bytes = self.unit_elems * element_size
        ptrs = np.array([s.data_ptr() for s in self.storages], dtype=np.int64)
        self.layer_address = ptrs[self._storage_of] + self._offset * self.unit_bytes
        self.block_stride_bytes = self._block_stride * self.unit_bytes
        self.plane_stride_bytes = self._plane_stride * self.unit_bytes
        # every paged address is a storage pointer plus whole units: their common low bits
        self.address_bits = int(np.bitwise_or.reduce(ptrs)) | self.unit_bytes

    def _flat_view(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        n_units = storage.nbytes() // (self.unit_elems * t.element_size())
        flat = torch.empty(0, dtype=t.dtype, device=t.device)
        return flat.set_(storage, 0, (n_units, self.unit_elems))

    def object_view(self, payload: torch.Tensor) -> torch.Tensor:
        """An object's payload (1-D, KV dtype) as ``[rows * planes, unit_elems]``."""
        return payload.view(-1, self.unit_elems)

    def index(self, rows: Rows) -> list[UnitIndex]:
        """Unit rows of ``rows`` on both sides, split by allocation."""
        if not len(rows):
            return []
        layer = np.array(rows.layer_indices, dtype=np.int64)
        base = self._offset[layer] + np.array(rows.block_ids, dtype=np.int64) * self._block_stride[layer]
        obj = np.array(rows.object_rows, dtype=np.int64)
        if self.planes == 1:
            paged, objs = base, obj
        else:
            paged = (base[:, None] + self._planes[None, :] * self._plane_stride[layer][:, None]).reshape(-1)
            objs = (obj[:, None] * self.planes + self._planes[None, :]).reshape(-1)
        if len(self.storages) == 1:
            run = int(objs[0]) if (np.diff(obj) == 1).all() else None  # consecutive object rows
            return [UnitIndex(0, torch.from_numpy(paged), torch.from_numpy(objs), run)]
        storage = np.repeat(self._storage_of[layer], self.planes)
        out = []
        for s in np.unique(storage).tolist():
            sel = storage == s
            out.append(UnitIndex(s, torch.from_numpy(paged[sel]), torch.from_numpy(objs[sel]), None))
        return out


def _block_shape(t: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """(planes, elements per plane of one block) of a layer's KV tensor."""
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        planes, inner = 1, t[0]
    elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        planes, inner = 2, t[0, 0]
    else:
        raise LayoutError(
            f"unsupported KV cache shape {tuple(t.shape)} for {num_blocks} blocks: expected "
            f"[num_blocks, ...] or [2, num_blocks, ...]"
        )
    if not inner.is_contiguous():
        raise LayoutError(f"KV cache block of shape {tuple(inner.shape)} is not contiguous")
    return planes, math.prod(inner.shape)
