"""The GPU plan of the canonical copy: byte addresses for the CUDA unit kernel, on the host.

This runs in the worker, on the thread that copies; pure numpy, so it is tested on CPU
tensors (``copy_plan.HostEmulation`` runs a plan by the kernel's contract). The kernel
(``kernels/copy_units.cu``) copies unit ``i`` of ``unit_bytes`` from ``src[i]`` to
``dst[i]``; ``build`` turns ``RankKV.gather`` / ``scatter`` of one object into such units.

A unit is the longest run that is contiguous on both sides for every layer:

* a whole block of one head (``block_size * head_dim`` elements) where the pages are
  head-major (vLLM's default page interior ``[block][head][token][dim]``) and the token
  range starts and ends on blocks; ``num_heads * num_layers * 2 * blocks`` units;
* one token of one head (``head_dim`` elements) where tokens are not contiguous
  (FlashAttention's NHD ``[block][token][head][dim]``) or the range cuts a block;
* one element where ``dim`` is not contiguous (vLLM CPU's transposed K): correct, and only
  there so that the plan can be proven on the CPU backend's own pages; no GPU has it.

Addresses come from the views' ``data_ptr`` and strides, so a plan holds for as long as
vLLM's KV caches live (they never move).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lmcache_hma.kv_copy.canonical_kv import CanonicalShape, RankKV
from lmcache_hma.kv_copy.copy_plan import Plan

_MAX_WORD = 16  # the widest word of kernels/copy_units.cu


class RankGeometry:
    """Byte addresses and strides of every layer's K and V pages of one rank, taken once."""

    def __init__(self, rank: RankKV):
        self.rank = rank
        layers = rank.layers
        self.esize = layers[0].key.element_size()
        views = [(lay.key, lay.value) for lay in layers]
        # [L, 2]: address of element [0, 0, 0, 0]; [L, 2, 4]: strides in bytes (block, head, token, dim)
        self.base = np.array([[t.data_ptr() for t in kv] for kv in views], dtype=np.int64)
        self.strides = np.array([[t.stride() for t in kv] for kv in views], dtype=np.int64) * self.esize
        dim_contiguous = bool((self.strides[:, :, 3] == self.esize).all())
        self.token_run = dim_contiguous and bool((self.strides[:, :, 2] == rank.head_dim * self.esize).all())
        self.dim_run = dim_contiguous
        self.address_bits = int(np.bitwise_or.reduce(self.base.ravel()))
        self.address_bits |= int(np.bitwise_or.reduce(self.strides.ravel()))


def build(geo: RankGeometry, block_ids: Sequence[int], tokens: tuple[int, int],
          object_address: int, shape: CanonicalShape, to_payload: bool) -> Plan:
    """The plan of ``RankKV.gather`` (``to_payload``) or ``scatter`` of tokens ``[t0, t1)``
    between the rank's pages and the object at ``object_address`` (as the copier sees it)."""
    rank, es = geo.rank, geo.esize
    t0, t1 = tokens
    n, d = rank.block_size, rank.head_dim
    if shape.num_tokens != t1 - t0 or shape.num_layers != rank.num_layers or shape.head_dim != d:
        raise ValueError(f"object {shape} does not hold tokens [{t0}, {t1}) of this rank's layers")
    common = rank.heads.intersect(shape.heads)
    if common is None or t1 <= t0:
        return Plan(np.empty(0, np.int64), np.empty(0, np.int64), d * es, 1)
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) * n < t1:
        raise ValueError(f"{len(ids)} blocks of {n} tokens do not reach token {t1}")
    if ((ids < 0) | (ids >= rank.num_blocks)).any():
        raise ValueError(f"a block id lies outside the KV cache ({rank.num_blocks} blocks)")
    h_local = np.arange(common.start - rank.heads.start, common.stop - rank.heads.start, dtype=np.int64)
    h_obj = h_local + rank.heads.start - shape.heads.start
    L, T = rank.num_layers, shape.num_tokens
    sb, sh, st, sd = (geo.strides[:, :, i] for i in range(4))  # [L, 2] each
    if geo.token_run and t0 % n == 0 and t1 % n == 0:  # whole blocks of one head
        blk = np.arange(t0 // n, t1 // n, dtype=np.int64)
        page_tok = ids[blk][None, None, :] * sb[:, :, None]  # [L, 2, nb]
        obj_tok = (blk * n - t0) * d * es
        unit = n * d * es
    else:
        t = np.arange(t0, t1, dtype=np.int64)
        page_tok = ids[t // n][None, None, :] * sb[:, :, None] + (t % n)[None, None, :] * st[:, :, None]
        obj_tok = (t - t0) * d * es
        unit = d * es
    page = (geo.base[None, :, :, None] + h_local[:, None, None, None] * sh[None, :, :, None]
            + page_tok[None])  # [Hc, L, 2, tokens or blocks]
    lkv = (np.arange(L, dtype=np.int64)[:, None] * 2 + np.arange(2, dtype=np.int64)[None, :]) * T * d * es
    obj = (object_address + h_obj[:, None, None, None] * L * 2 * T * d * es
           + lkv[None, :, :, None] + obj_tok[None, None, None, :])
    if not geo.dim_run:  # one element per unit
        dims = np.arange(d, dtype=np.int64)
        page = page[..., None] + dims * sd[None, :, :, None, None]
        obj = obj[..., None] + dims * es
        unit = es
    page, obj = page.ravel(), obj.ravel()
    bits = geo.address_bits | int(object_address) | unit
    src, dst = (page, obj) if to_payload else (obj, page)
    return Plan(src, dst, unit, min(bits & -bits, _MAX_WORD))
