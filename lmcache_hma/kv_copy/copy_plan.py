"""Copy plans: the byte address of every unit of a batch of copies, built on the host.

This runs in the worker, on the thread that copies. The CUDA kernel's contract is
one line: copy unit ``i`` (``unit_bytes`` bytes) from ``src[i]`` to ``dst[i]``.
Everything else is host arithmetic, done here with numpy for every object of a
step at once: which bytes of which layer a row names (``PagedKV``'s per-layer
addresses, fixed when the KV caches are registered), checking that every row lies
inside its layer and its payload, and the widest word all addresses allow.

A batch is one ``Plan``. An executor packs it into one table ``[src..., dst...]``
and runs it: ``cuda_copy``'s sends the table to the GPU in one transfer and
launches the kernel once; ``HostEmulation`` below copies host memory by the same
contract, so that the tests prove everything before the launch byte-exact on CPU
tensors against the torch path of ``copy_ops``.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from lmcache_hma.core.layout import Rows
from lmcache_hma.kv_copy.paged_kv import PagedKV
from lmcache_hma.kv_copy.state_kv import StateKV

Item = tuple[Rows, torch.Tensor]  # the rows of one object, and its payload
_MAX_WORD = 16  # the widest word of kernels/copy_units.cu


@dataclass(frozen=True)
class Plan:
    """Unit ``i`` is ``unit_bytes`` bytes copied from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray  # int64 byte addresses, one per unit
    dst: np.ndarray
    unit_bytes: int
    word: int  # the widest of 16, 8, 4, 2, 1 bytes dividing unit_bytes and every address

    def __len__(self) -> int:
        return len(self.src)

    def pack(self, out: np.ndarray) -> np.ndarray:
        """``[src..., dst...]`` written into the start of ``out`` (int64), as the kernel reads it."""
        n = len(self.src)
        table = out[:2 * n]
        table[:n] = self.src
        table[n:] = self.dst
        return table


def build(paged: PagedKV, items: Sequence[Item], to_payload: bool,
          payload_address: Callable[[torch.Tensor], int]) -> Plan:
    """The plan of copying every ``(rows, payload)`` of ``items``: paged KV -> payload when
    ``to_payload`` (a gather), else payload -> paged KV (a scatter). ``payload_address(p)`` is
    where the copier sees payload ``p``; it raises ValueError where the copier cannot reach it.
    Raises ValueError, before anything is copied, for a payload of the wrong dtype or shape and
    for a row outside its layer's blocks or its payload."""
    addresses, capacity = _payloads(paged, [p for _, p in items], payload_address)
    counts = [len(rows.object_rows) for rows, _ in items]
    obj, layer, block = _rows([rows for rows, _ in items], sum(counts))
    item = np.repeat(np.arange(len(items), dtype=np.int64), counts)
    _check(paged, obj, layer, block, item, capacity)
    paged_side = _planes(paged.layer_address[layer] + block * paged.block_stride_bytes[layer],
                         paged.plane_stride_bytes[layer], paged.planes)
    object_side = _planes(addresses[item] + obj * paged.page_bytes, paged.unit_bytes, paged.planes)
    bits = paged.address_bits | int(np.bitwise_or.reduce(addresses, initial=0))
    src, dst = (paged_side, object_side) if to_payload else (object_side, paged_side)
    return Plan(src, dst, paged.unit_bytes, min(bits & -bits, _MAX_WORD))


def build_states(state: StateKV, items: Sequence[tuple[Sequence[int], torch.Tensor]],
                 to_payload: bool, payload_address: Callable[[torch.Tensor], int]) -> Plan:
    """The plan of copying recurrent states: every ``(blocks, payload)`` of ``items`` (one block
    id per state group, a state object's payload), states -> payload when ``to_payload``, as
    ``StateKV.gather`` / ``scatter`` would. Raises ValueError before anything is copied."""
    n_groups = len(state.groups)
    blocks = [list(b) for b, _ in items]
    if any(len(b) != n_groups for b in blocks):
        raise ValueError(f"state blocks {blocks} given for {n_groups} state groups")
    blocks = np.array(blocks, dtype=np.int64).reshape(len(items), n_groups)
    bad = (blocks.view(np.uint64) - np.uint64(1)) >= np.uint64(state.num_blocks - 1)  # 0 < b < n
    if bad.any():
        raise ValueError(f"state block id {int(blocks[bad][0])} is not a real block "
                         f"(1..{state.num_blocks - 1})")
    addresses = []
    for _, p in items:  # payloads are bytes of any dtype; the unpadded row must fit
        if not p.is_contiguous() or p.numel() * p.element_size() < state.row_bytes:
            raise ValueError(f"a state payload must be contiguous and hold {state.row_bytes} bytes; "
                             f"got {tuple(p.shape)} {p.dtype}")
        addresses.append(payload_address(p))
    addresses = np.array(addresses, dtype=np.int64)
    state_side = state.unit_address + blocks[:, state.unit_group] * state.unit_stride
    object_side = addresses[:, None] + state.unit_offset
    bits = state.address_bits | int(np.bitwise_or.reduce(addresses, initial=0))
    src, dst = (state_side, object_side) if to_payload else (object_side, state_side)
    return Plan(src.reshape(-1), dst.reshape(-1), state.unit_bytes, min(bits & -bits, _MAX_WORD))


def _planes(first: np.ndarray, stride, planes: int) -> np.ndarray:
    """Each row's ``planes`` unit addresses (K, V: consecutive units of the object), row-major.
    Column by column: numpy broadcasting over a last axis of 2 runs one inner loop per row."""
    if planes == 1:
        return first
    out = np.empty((len(first), planes), dtype=np.int64)
    out[:, 0] = first
    for p in range(1, planes):
        np.add(out[:, p - 1], stride, out=out[:, p])
    return out.reshape(-1)


def _payloads(paged: PagedKV, payloads: list[torch.Tensor],
              payload_address: Callable[[torch.Tensor], int]) -> tuple[np.ndarray, np.ndarray]:
    """Each payload's address and capacity in rows, once each is known to fit the KV layout."""
    addresses, capacity = [], []
    page_elems = paged.planes * paged.unit_elems
    for p in payloads:  # a few attribute reads per object; rows are handled in bulk
        if p.dtype != paged.dtype:
            raise ValueError(f"payload dtype {p.dtype} differs from the KV cache dtype {paged.dtype}")
        if not p.is_contiguous():
            raise ValueError(f"payload of shape {tuple(p.shape)} is not contiguous")
        n = p.numel()
        if n % paged.unit_elems:
            raise ValueError(f"payload of {n} elements is not a whole number of units of "
                             f"{paged.unit_elems} elements ({paged.unit_bytes} bytes)")
        addresses.append(payload_address(p))
        capacity.append(n // page_elems)
    return np.array(addresses, dtype=np.int64), np.array(capacity, dtype=np.int64)


def _rows(rows_list: list[Rows], n: int) -> list[np.ndarray]:
    """(object rows, layer indices, block ids) of every object, concatenated, as int64 arrays.
    Rows given as numpy arrays are concatenated; lists of Python ints are converted in C."""
    out = []
    for field in ("object_rows", "layer_indices", "block_ids"):
        parts = [getattr(rows, field) for rows in rows_list]
        if parts and all(isinstance(x, np.ndarray) and x.dtype.kind in "iu" for x in parts):
            values = np.concatenate(parts).astype(np.int64, copy=False)
        else:
            flat: list[int] = []
            for x in parts:
                flat += x
            values = _int64(flat)
        if len(values) != n:
            raise ValueError("rows whose object rows, layer indices and block ids differ in number")
        out.append(values)
    return out


def _int64(values: list) -> np.ndarray:
    """Python ints as int64: through bytes when all lie in [0, 256) (layer indices, the rows of
    most objects: a few times faster), else one struct pack (numpy's list conversion is slower)."""
    try:
        return np.frombuffer(bytearray(values), dtype=np.uint8).astype(np.int64)
    except (ValueError, TypeError):
        pass
    try:
        return np.frombuffer(struct.pack(f"{len(values)}q", *values), dtype=np.int64)
    except struct.error as exc:
        raise ValueError(f"rows hold a value that is not a 64-bit integer ({exc})") from None


def _check(paged: PagedKV, obj: np.ndarray, layer: np.ndarray, block: np.ndarray,
           item: np.ndarray, capacity: np.ndarray) -> None:
    """Every row names a real layer, a block inside its KV tensor and a row of its payload.
    Compared as unsigned: a negative value is then out of range too."""
    u = np.uint64
    bad_layer = layer.view(u) >= u(len(paged.layer_address))
    bad_block = block.view(u) >= u(paged.num_blocks)
    bad_obj = obj.view(u) >= capacity[item].view(u)
    bad = bad_layer | bad_block | bad_obj
    if not bad.any():
        return
    i = int(np.argmax(bad))
    where = f"object {int(item[i])} (of this batch), row for object row {int(obj[i])}"
    if bad_layer[i]:
        raise ValueError(f"{where}: layer index {int(layer[i])} is not one of the "
                         f"{len(paged.layer_address)} layers")
    if bad_block[i]:
        raise ValueError(f"{where}: block id {int(block[i])} lies outside the KV cache "
                         f"({paged.num_blocks} blocks)")
    raise ValueError(f"{where}: the payload holds {int(capacity[item[i]])} rows of "
                     f"{paged.page_bytes} bytes")


class HostEmulation:
    """An executor that runs a plan on host memory by the kernel's contract.

    The tests' stand-in for the GPU: the paged KV and the payloads are CPU tensors, their
    addresses plain pointers. It packs the table as the CUDA executor does and then copies
    unit ``i`` from ``table[i]`` to ``table[n + i]``, checking the word alignment the kernel
    relies on. ``copy=False`` packs only (the planning benchmark's stubbed device).
    """

    def __init__(self, copy: bool = True):
        self.copy = copy
        self._table = np.empty(0, dtype=np.int64)

    def payload_address(self, payload: torch.Tensor) -> int:
        if payload.device.type != "cpu":
            raise ValueError(f"host emulation copies CPU tensors, not a payload on {payload.device}")
        return payload.data_ptr()

    def execute(self, plan: Plan, to_payload: bool, after: Optional[object] = None) -> None:
        if len(self._table) < 2 * len(plan):
            self._table = np.empty(2 * len(plan), dtype=np.int64)
        table = plan.pack(self._table)
        if self.copy:
            copy_units(table, len(plan), plan.unit_bytes, plan.word)


def copy_units(table: np.ndarray, n_units: int, unit_bytes: int, word: int) -> None:
    """``kernels/copy_units.cu`` on host memory: unit ``i`` from ``table[i]`` to ``table[n + i]``."""
    if unit_bytes % word or (table % word).any():
        raise AssertionError(f"an address or the unit size is not a multiple of the {word}-byte word")
    for s, d in zip(table[:n_units].tolist(), table[n_units:2 * n_units].tolist()):
        ctypes.memmove(d, s, unit_bytes)
