"""Gated-delta-net recurrent states in a TP-free layout: which bytes of a rank's state page
are which bytes of the canonical state.

This runs in the worker (pure arithmetic: numpy). vLLM shards a gated-delta-net layer's
state over tensor-parallel ranks (``MambaStateShapeCalculator.gated_delta_net_state_shape``):

* the conv state holds ``conv_dim / tp`` channels, the rank's slices of the q, k and v
  projections one after the other (``[q_r | k_r | v_r]``: the conv weight is loaded by
  ``mamba_v2_sharded_weight_loader`` with those three splits, and the forward splits
  ``[q_dim, k_dim, v_dim] / tp``), in vLLM's conv layout "SD" ``[state_len][channels]``
  (default) or "DS" ``[channels][state_len]`` (``VLLM_SSM_CONV_STATE_LAYOUT``);
* the recurrent (SSM) state holds the rank's value heads ``[num_v_heads / tp, head_v_dim,
  head_k_dim]``, heads ``[r*nv/tp, (r+1)*nv/tp)``.

A rank's state page is its conv state followed by its recurrent state (``state_kv``'s part
order). The canonical state of one layer is the TP=1 page in layout "SD": the conv state
``[state_len][conv_dim]`` with all channels in global order (all q, all k, all v), then
the recurrent state ``[num_v_heads][head_v_dim][head_k_dim]``. Every rank holds a disjoint
share of it (vLLM divides heads and channels exactly: no replicas), so every rank writes
its share and a reader at any TP size reads its own. ``gdn_state_runs`` gives the share as
byte runs ``(page offset, canonical offset, length)``: 3 per conv state row and one for the
recurrent state in layout "SD"; one per element of the conv state in "DS" (transposed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmcache_hma.core.layout import LayoutError


@dataclass(frozen=True)
class GdnDims:
    """A gated-delta-net layer's global (TP=1) dimensions, as vLLM's model config gives them."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    num_spec: int = 0  # speculative tokens: extra conv state rows

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_len(self) -> int:
        return self.conv_kernel_size - 1 + self.num_spec

    def rank_shapes(self, tp_size: int, conv_layout: str = "SD") -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, recurrent state shape) of one rank, as vLLM computes them."""
        self._check(tp_size)
        conv = (self.conv_dim // tp_size, self.state_len)
        return (conv if conv_layout == "DS" else conv[::-1],
                (self.num_v_heads // tp_size, self.head_v_dim, self.head_k_dim))

    def canonical_bytes(self, conv_esize: int, ssm_esize: int) -> int:
        """Bytes of one layer's canonical state."""
        return (self.state_len * self.conv_dim * conv_esize
                + self.num_v_heads * self.head_v_dim * self.head_k_dim * ssm_esize)

    def _check(self, tp_size: int) -> None:
        if self.num_k_heads % tp_size or self.num_v_heads % tp_size:
            raise LayoutError(f"gated delta net with {self.num_k_heads} k heads and "
                              f"{self.num_v_heads} v heads does not split over TP size {tp_size}")


def gdn_state_runs(dims: GdnDims, tp_size: int, tp_rank: int, conv_layout: str,
                   conv_esize: int, ssm_esize: int) -> np.ndarray:
    """Byte runs ``[n, 3]`` (int64: page offset, canonical offset, length) mapping rank
    ``tp_rank``'s state page of one layer onto the canonical state of that layer."""
    if conv_layout not in ("SD", "DS"):
        raise LayoutError(f"unknown conv state layout {conv_layout!r} (vLLM: 'SD' or 'DS')")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"rank {tp_rank} outside TP size {tp_size}")
    dims._check(tp_size)
    kd, vd = dims.key_dim // tp_size, dims.value_dim // tp_size
    local_dim, s_len = 2 * kd + vd, dims.state_len
    # (first local channel, first global channel, channels) of the q, k and v slices
    segs = np.array([[0, tp_rank * kd, kd],
                     [kd, dims.key_dim + tp_rank * kd, kd],
                     [2 * kd, 2 * dims.key_dim + tp_rank * vd, vd]], dtype=np.int64)
    rows = np.arange(s_len, dtype=np.int64)[:, None]
    canon = rows * dims.conv_dim + segs[:, 1]  # element offsets, [s_len, 3]
    if conv_layout == "SD":
        page = rows * local_dim + segs[:, 0]
        length = np.broadcast_to(segs[:, 2], page.shape)
        conv = np.stack([page.ravel(), canon.ravel(), length.ravel()], 1) * conv_esize
    else:  # [channels][state_len]: each element on its own (a transposition)
        ch = np.arange(local_dim, dtype=np.int64)
        seg = np.searchsorted(segs[:, 0], ch, side="right") - 1
        global_ch = segs[seg, 1] + ch - segs[seg, 0]
        page = ch[None, :] * s_len + rows
        canon = rows * dims.conv_dim + global_ch[None, :]
        conv = np.stack([page.ravel(), canon.ravel(), np.ones(page.size, np.int64)], 1) * conv_esize
    head_elems = dims.head_v_dim * dims.head_k_dim
    local_heads = dims.num_v_heads // tp_size
    ssm = np.array([[s_len * local_dim * conv_esize,
                     s_len * dims.conv_dim * conv_esize + tp_rank * local_heads * head_elems * ssm_esize,
                     local_heads * head_elems * ssm_esize]], dtype=np.int64)
    return np.concatenate([conv, ssm])


def copy_runs(page: np.ndarray, canonical: np.ndarray, runs: np.ndarray, to_canonical: bool) -> None:
    """Copy the runs between one layer's state page and its canonical state (uint8 arrays):
    the host reference of what a GPU plan built from ``runs`` copies."""
    for p, c, n in runs.tolist():
        if to_canonical:
            canonical[c:c + n] = page[p:p + n]
        else:
            page[p:p + n] = canonical[c:c + n]


def gdn_dims_of_rank(state_shapes, conv_layout: str, tp_size: int) -> GdnDims:
    """The global dimensions of a gated-delta-net layer from one rank's state shapes (vLLM's
    ``MambaSpec.shapes``: the conv state, ``[state_len, conv_dim / tp]`` in layout "SD" or its
    transpose in "DS", and the recurrent state ``[num_v_heads / tp, head_v_dim, head_k_dim]``)
    and the TP size; speculative tokens' extra conv rows count as ``num_spec``."""
    if len(state_shapes) != 2 or len(state_shapes[0]) != 2 or len(state_shapes[1]) != 3:
        raise LayoutError(f"not gated-delta-net state shapes: {state_shapes}")
    conv, (local_v, dv, dk) = state_shapes
    state_len, local_conv = conv if conv_layout == "SD" else conv[::-1]
    num_v = local_v * tp_size
    key_dim2 = local_conv * tp_size - num_v * dv  # 2 * num_k_heads * head_k_dim
    if key_dim2 <= 0 or key_dim2 % (2 * dk):
        raise LayoutError(f"gated-delta-net state shapes {state_shapes} at TP {tp_size} do not split into "
                          f"q, k and v channels")
    return GdnDims(key_dim2 // (2 * dk), num_v, dk, dv, conv_kernel_size=state_len + 1)


def shard_runs(dims: GdnDims, tp_size: int, tp_rank: int, conv_layout: str, shards: int, shard: int,
               conv_esize: int, ssm_esize: int) -> np.ndarray:
    """Byte runs ``[n, 3]`` (page offset, part offset, length) between rank ``tp_rank``'s state page
    of one layer and shard ``shard``'s part of it: the canonical state of shard ``shard`` of
    ``shards`` (the page of that rank at TP ``shards``, layout "SD"). The rank must hold the shard."""
    rank = gdn_state_runs(dims, tp_size, tp_rank, conv_layout, conv_esize, ssm_esize)
    part = gdn_state_runs(dims, shards, shard, "SD", conv_esize, ssm_esize)
    if conv_layout == "DS":  # the rank's conv runs are single elements: split the part's to match
        conv_end = dims.state_len * (dims.conv_dim // shards) * conv_esize
        pieces = []
        for p, c, n in part.tolist():
            if p < conv_end:
                k = np.arange(0, n, conv_esize, dtype=np.int64)
                pieces.append(np.stack([p + k, c + k, np.full(k.size, conv_esize, np.int64)], 1))
            else:
                pieces.append(np.array([[p, c, n]], dtype=np.int64))
        part = np.concatenate(pieces)
    by_canon = rank[np.argsort(rank[:, 1], kind="stable")]
    i = np.searchsorted(by_canon[:, 1], part[:, 1], side="right") - 1
    if (i < 0).any() or (part[:, 1] + part[:, 2] > by_canon[i, 1] + by_canon[i, 2]).any():
        raise LayoutError(f"shard {shard} of {shards} is not held by rank {tp_rank} of TP {tp_size}")
    return np.stack([by_canon[i, 0] + part[:, 1] - by_canon[i, 1], part[:, 0], part[:, 2]], 1)
