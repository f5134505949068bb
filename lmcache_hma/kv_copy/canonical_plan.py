"""The GPU plan of the canonical copy: byte addresses for the CUDA unit kernel, on the host.

This runs in the worker, on the thread that copies; pure numpy, so it is tested on CPU
tensors (``copy_plan.HostEmulation`` runs a plan by the kernel's contract). The kernel
(``kernels/copy_units.cu``) copies unit ``i`` of ``unit_bytes`` from ``src[i]`` to
``dst[i]``; ``build`` turns ``RankKV.gather`` / ``scatter`` of one object into such units.

A unit is the longest run that is contiguous on both sides for every layer:

* a whole block of one head (``block_size * head_dim`` elements) where the pages are
  head-major (vLLM's layout ``LBHNC``: ``[block][head][token][dim]``) and the token
  range starts and ends on blocks; ``num_heads * num_layers * 2 * blocks`` units;
* one token of one head (``head_dim`` elements) where tokens are not contiguous
  (FlashAttention's NHD ``[block][token][head][dim]``) or the range cuts a block;
* one element where ``dim`` is not contiguous (vLLM CPU's transposed K): correct, and only
  there so that the plan can be proven on the CPU backend's own pages; no GPU has it.

Addresses come from the views' ``data_ptr`` and strides, so a plan holds for as long as
vLLM's KV caches live (they never move).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lmcache_hma.core.layout import LayoutError
from lmcache_hma.kv_copy.canonical_kv import CanonicalShape, HeadRange, RankKV
from lmcache_hma.kv_copy.copy_plan import Plan

_MAX_WORD = 16  # the widest word of kernels/copy_units.cu


class RankGeometry:
    """Byte addresses and strides of every layer's K and V pages of one rank, taken once,
    and the parts of plans that depend only on an object's shape (cached)."""

    def __init__(self, rank: RankKV):
        self.rank = rank
        layers = rank.layers
        if any(lay.tiled for lay in layers):  # vLLM CPU's AMX pages: the torch copy reads them
            raise LayoutError("tiled pages (vLLM CPU's 'amx') have no unit-kernel plan")
        self.esize = es = layers[0].key.element_size()
        views = [(lay.key, lay.value) for lay in layers]
        # [L, 2]: address of element [0, 0, 0, 0]; [L, 2, 4]: strides in bytes (block, head, token, dim)
        self.base = np.array([[t.data_ptr() for t in kv] for kv in views], dtype=np.int64)
        self.strides = np.array([[t.stride() for t in kv] for kv in views], dtype=np.int64) * es
        self.dim_run = bool((self.strides[:, :, 3] == es).all())
        self.token_run = self.dim_run and bool((self.strides[:, :, 2] == rank.head_dim * es).all())
        # the usual case: one block stride and one token stride for every layer, K and V
        self.uniform = self.dim_run and all(len(np.unique(self.strides[:, :, i])) == 1 for i in (0, 2))
        self.address_bits = int(np.bitwise_or.reduce(self.base.ravel()))
        self.address_bits |= int(np.bitwise_or.reduce(self.strides.ravel()))
        self._fixed: dict = {}

    def fixed(self, tokens: tuple[int, int], shape: CanonicalShape, common: HeadRange,
              whole_blocks: bool) -> "_Fixed":
        """What a plan of tokens ``[t0, t1)`` of an object ``shape`` holds whatever the block
        ids and the object's address: built once per (object shape, range, phase in a block)."""
        t0, t1 = tokens
        key = (t0 % self.rank.block_size, t0 - shape.first_token, t1 - t0, shape, common, whole_blocks)
        if key not in self._fixed:
            self._fixed[key] = _fixed(self, key[0], key[1], key[2], shape, common, whole_blocks)
        return self._fixed[key]


@dataclass(frozen=True)
class _Fixed:
    unit: int
    page_rows: np.ndarray  # [Hc, L, 2, 1]: page address of each (head, layer, K/V), block 0 token 0
    obj: np.ndarray  # [units]: object offset of each unit
    block_of_column: np.ndarray  # per column: which of the object's blocks it lies in
    token_offset: np.ndarray  # per column: its byte offset inside the block
    block_stride: int


def _fixed(geo: RankGeometry, phase: int, skip: int, count: int, shape: CanonicalShape,
           common: HeadRange, whole_blocks: bool) -> _Fixed:
    """``count`` tokens from object token ``skip``, the first at ``phase`` in its block."""
    rank, es = geo.rank, geo.esize
    n, d, L, T = rank.block_size, rank.head_dim, rank.num_layers, shape.num_tokens
    h_local = np.arange(common.start - rank.heads.start, common.stop - rank.heads.start, dtype=np.int64)
    h_obj = h_local + rank.heads.start - shape.heads.start
    sb, sh, st = geo.strides[0, 0, 0], geo.strides[:, :, 1], geo.strides[0, 0, 2]
    page_rows = geo.base[None] + h_local[:, None, None] * sh[None]
    if whole_blocks:
        cols = np.arange(count // n, dtype=np.int64)
        block_of_column, token_offset = cols, np.zeros_like(cols)
        obj_col, unit = (skip + cols * n) * d * es, n * d * es
    else:
        pos = phase + np.arange(count, dtype=np.int64)
        block_of_column, token_offset = pos // n, (pos % n) * st
        obj_col, unit = (skip + np.arange(count, dtype=np.int64)) * d * es, d * es
    lkv = (np.arange(L, dtype=np.int64)[:, None] * 2 + np.arange(2, dtype=np.int64)) * T * d * es
    obj = h_obj[:, None, None, None] * L * 2 * T * d * es + lkv[None, :, :, None] + obj_col
    return _Fixed(unit, page_rows[..., None], obj.ravel(), block_of_column, token_offset, int(sb))


def build(geo: RankGeometry, block_ids: Sequence[int], tokens: tuple[int, int],
          object_address: int, shape: CanonicalShape, to_payload: bool) -> Plan:
    """The plan of ``RankKV.gather`` (``to_payload``) or ``scatter`` of tokens ``[t0, t1)``
    between the rank's pages and the object at ``object_address`` (as the copier sees it)."""
    rank = geo.rank
    t0, t1 = tokens
    n = rank.block_size
    if not shape.first_token <= t0 <= t1 <= shape.end_token or shape.num_layers != rank.num_layers \
            or shape.head_dim != rank.head_dim:
        raise ValueError(f"object {shape} does not hold tokens [{t0}, {t1}) of this rank's layers")
    common = rank.heads.intersect(shape.heads)
    if common is None or t1 <= t0:
        return Plan(np.empty(0, np.int64), np.empty(0, np.int64), rank.head_dim * geo.esize, 1)
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) * n < t1:
        raise ValueError(f"{len(ids)} blocks of {n} tokens do not reach token {t1}")
    used = ids[t0 // n: -(-t1 // n)]
    if ((used < 0) | (used >= rank.num_blocks)).any():
        raise ValueError(f"a block id lies outside the KV cache ({rank.num_blocks} blocks)")
    if geo.uniform:
        whole_blocks = geo.token_run and t0 % n == 0 and t1 % n == 0
        f = geo.fixed(tokens, shape, common, whole_blocks)
        # the only per-call arithmetic: each column's block, then one add per unit and side
        column = used[f.block_of_column] * f.block_stride + f.token_offset
        page = (f.page_rows + column).ravel()
        obj = f.obj + object_address
        unit = f.unit
    else:
        page, obj, unit = _general(geo, ids, t0, t1, object_address, shape, common)
    bits = geo.address_bits | int(object_address) | unit
    src, dst = (page, obj) if to_payload else (obj, page)
    return Plan(src, dst, unit, min(bits & -bits, _MAX_WORD))


def _general(geo: RankGeometry, ids: np.ndarray, t0: int, t1: int, object_address: int,
             shape: CanonicalShape, common: HeadRange) -> tuple[np.ndarray, np.ndarray, int]:
    """Layers or K/V whose strides differ (vLLM CPU's pages: K transposed, V not): every
    address computed per call, one token (or, where ``dim`` is strided, one element) a unit."""
    rank, es = geo.rank, geo.esize
    n, d, L, T = rank.block_size, rank.head_dim, rank.num_layers, shape.num_tokens
    h_local = np.arange(common.start - rank.heads.start, common.stop - rank.heads.start, dtype=np.int64)
    h_obj = h_local + rank.heads.start - shape.heads.start
    sb, sh, st, sd = (geo.strides[:, :, i] for i in range(4))  # [L, 2] each
    t = np.arange(t0, t1, dtype=np.int64)
    page_tok = ids[t // n][None, None, :] * sb[:, :, None] + (t % n)[None, None, :] * st[:, :, None]
    page = geo.base[None, :, :, None] + h_local[:, None, None, None] * sh[None, :, :, None] + page_tok[None]
    lkv = (np.arange(L, dtype=np.int64)[:, None] * 2 + np.arange(2, dtype=np.int64)[None, :]) * T * d * es
    obj = (object_address + h_obj[:, None, None, None] * L * 2 * T * d * es
           + lkv[None, :, :, None] + ((t - shape.first_token) * d * es)[None, None, None, :])
    unit = d * es
    if not geo.dim_run:  # one element per unit
        dims = np.arange(d, dtype=np.int64)
        page = page[..., None] + dims * sd[None, :, :, None, None]
        obj = obj[..., None] + dims * es
        unit = es
    return page.ravel(), obj.ravel(), unit
