"""The canonical object layout: attention KV that depends on neither TP size nor block size.

This runs in the worker. Today's objects (``paged_kv``) are whole vLLM pages of one
rank, copied as opaque bytes, so they only fit a reader with the same TP size, rank and
block size. Here an object of ``num_layers`` attention layers (full-attention or
sliding-window rows alike) over tokens ``[t0, t1)`` holds, for every KV head of a head
range ``[h0, h1)`` named by *global* KV head index (never by rank)::

    payload = [head][layer][kv][token][dim]      kv: 0 = K, 1 = V

Why this order:

* head outermost: the share of a rank (its heads ``[h0, h1)``) is one contiguous byte
  range of the object (``CanonicalShape.head_bytes``). A reader fetches only its range
  (a range read from a store), and the objects of two TP=2 writers, each of its own
  heads, concatenate into the TP=1 object byte for byte.
* token-major inside a head (``[token][dim]``), the order every attention kernel writes
  (a token's K and V come out of the QKV projection as ``[head][dim]``) and the order of
  vLLM's head-major page interior (layout ``LBHNC``: ``[block][head][token][dim]``):
  there a block of one head lands as one run of ``block_size * head_dim`` elements, so
  the copy is block runs whatever the two block sizes are; FlashAttention's NHD pages
  give runs of ``head_dim``. vLLM's CPU backend stores V token-major too (runs of a whole
  block) but K transposed per head (``[head][dim][token]`` inside a block, for its dot
  products): K is transposed on the way in and out, the one part of this copy that is
  not block runs on CPU (its cost: ``benchmarks/bench_canonical_copy.py``). Its AMX
  kernel tiles both (``cpu_layer_kv``): read through views that split the token and dim
  axes in two.

A rank's paged KV is described per layer by ``PagedLayerKV``: K and V as strided views
``[num_blocks, rank_heads, block_size, head_dim]`` over vLLM's own tensor
(``cpu_layer_kv`` for the CPU backend, ``split_layer_kv`` for FlashAttention's
``[2, num_blocks, block_size, heads, head_dim]``, ``hnd_layer_kv`` for head-major
``[num_blocks, 2, heads, block_size, head_dim]``), so one copy routine serves every layout.
``RankKV.gather`` / ``scatter`` copy a token range between the rank's pages (its block
ids, its block size) and an object, for the heads both hold (nothing else of either side
is touched), in one ``index_select`` / ``index_copy_`` per run of evenly spaced layers and
per K/V (a scatter of big blocks: one ``copy_`` per block), plus one ``copy_`` for each
partial block at the range's ends, where the range does not start or end on a block.
Pages and object are on one device (any: torch ops on the calling thread's current stream);
the block index is built on it once per range (``RankKV.span``, ``BlockSpan``), since torch
indexes a device's pages only with an index on that device.

Heads: vLLM gives rank ``r`` of ``tp`` the KV heads ``[r*H/tp, (r+1)*H/tp)``, or, when
``tp > H``, replicates head ``r // (tp/H)`` on ``tp/H`` ranks (``kv_heads_of_rank``): only
the first replica writes (``RankHeads.writes``), the others read.

Recurrent states (gated delta net) follow the same rule (``canonical_state``); the GPU
plan of this copy (byte addresses for the CUDA unit kernel) is ``canonical_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lmcache_hma.core.layout import LayoutError

# Scatter: from this many bytes per block (all layers of a stack, the shared heads), one
# strided copy_ per block beats torch's CPU index_copy_ into a strided view (1.3x for K,
# 2.4x for V at gemma-27b's shapes, block 128: bench_canonical_copy.py); below it, a
# copy_'s dispatch costs more than the bytes.
_BLOCK_LOOP_BYTES = 64 << 10


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``[start, stop)``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative head range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def intersect(self, other: "HeadRange") -> Optional["HeadRange"]:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(lo, hi) if lo < hi else None


@dataclass(frozen=True)
class RankHeads:
    """The KV heads a rank holds, and whether it is the one replica that writes them."""

    heads: HeadRange
    writes: bool


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> RankHeads:
    """vLLM's split of ``num_kv_heads`` over ``tp_size`` ranks (``QKVParallelLinear``):
    contiguous equal shares when ``tp_size`` divides the heads; when ``tp_size`` is a
    multiple of the heads, head ``rank // replicas`` on ``replicas = tp_size / num_kv_heads``
    ranks, of which the first writes. Other combinations vLLM refuses, and so does this."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"rank {tp_rank} outside TP size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not split over TP size {tp_size}")
        per = num_kv_heads // tp_size
        return RankHeads(HeadRange(tp_rank * per, (tp_rank + 1) * per), True)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP size {tp_size} is not a multiple of {num_kv_heads} KV heads")
    replicas = tp_size // num_kv_heads
    head = tp_rank // replicas
    return RankHeads(HeadRange(head, head + 1), tp_rank % replicas == 0)


@dataclass(frozen=True)
class CanonicalShape:
    """An object's payload: ``[heads][num_layers][2][num_tokens][head_dim]`` of ``dtype``,
    tokens ``[first_token, first_token + num_tokens)`` of the sequence."""

    heads: HeadRange
    num_layers: int
    num_tokens: int
    head_dim: int
    dtype: torch.dtype
    first_token: int = 0

    @property
    def end_token(self) -> int:
        return self.first_token + self.num_tokens

    @property
    def head_elems(self) -> int:
        return self.num_layers * 2 * self.num_tokens * self.head_dim

    @property
    def nbytes(self) -> int:
        return len(self.heads) * self.head_elems * _esize(self.dtype)

    def view(self, payload: torch.Tensor) -> torch.Tensor:
        """``payload`` (contiguous, this dtype, ``nbytes``) as ``[H, L, 2, T, D]``."""
        if payload.dtype != self.dtype or not payload.is_contiguous():
            raise ValueError(f"payload must be contiguous {self.dtype}, got {payload.dtype}")
        if payload.numel() * _esize(self.dtype) != self.nbytes:
            raise ValueError(f"payload of {payload.numel()} elements, canonical object of "
                             f"{self.nbytes // _esize(self.dtype)}")
        return payload.view(len(self.heads), self.num_layers, 2, self.num_tokens, self.head_dim)

    def head_bytes(self, heads: HeadRange) -> tuple[int, int]:
        """(offset, length) in bytes of the heads ``heads`` (inside this object's)."""
        if heads.intersect(self.heads) != heads:
            raise ValueError(f"heads {heads} are not all in the object's {self.heads}")
        per = self.head_elems * _esize(self.dtype)
        return (heads.start - self.heads.start) * per, len(heads) * per


@dataclass(frozen=True)
class PagedLayerKV:
    """One attention layer of one rank: K and V as ``[num_blocks, heads, block_size, head_dim]``
    strided views of vLLM's tensor (same storage, any strides); or, for pages that tile tokens
    and dims (vLLM CPU's AMX kernel), as ``[num_blocks, heads, block_size / tb, tb,
    head_dim / db, db]`` (token ``a * tb + b``, dim ``c * db + e``), K and V tiled alike or not."""

    key: torch.Tensor
    value: torch.Tensor

    def __post_init__(self) -> None:
        if self.key.dim() not in (4, 6) or self.value.dim() not in (4, 6) or \
                _logical(self.key) != _logical(self.value):
            raise LayoutError(f"K {tuple(self.key.shape)} and V {tuple(self.value.shape)} must be "
                              f"[num_blocks, heads, block_size, head_dim] alike")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(num_blocks, heads, block_size, head_dim)``."""
        return _logical(self.key)

    @property
    def tiled(self) -> bool:
        return self.key.dim() == 6 or self.value.dim() == 6


def _logical(t: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, heads, block_size, head_dim)`` of a plain or tiled page view."""
    if t.dim() == 4:
        return tuple(t.shape)
    nb, h, ta, tb, da, db = t.shape
    return nb, h, ta * tb, da * db


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """A page view as ``[num_blocks, heads, ta, tb, da, db]`` (a plain one: one tile of each)."""
    return t if t.dim() == 6 else t.unsqueeze(4).unsqueeze(2)


def cpu_layer_kv(t: torch.Tensor, page_format: str = "vec") -> PagedLayerKV:
    """vLLM CPU backend's layer ``[num_blocks, heads, block_size, 2*head_dim]``: per head a
    block is ``[2*block_size, head_dim]`` elements, K's half then V's, laid out as the kernel
    vLLM picked writes them (``cpu_attn_reshape_and_cache``; ``vllm_compat.cpu_page_format``):

    * ``vec``, ``vec16`` (and any other, checked at start by ``cpu_pages_mismatch``): K
      transposed, ``[head_dim][block_size]``, then V token-major;
    * ``amx``: K in tiles of 16 tokens, each ``[head_dim / 2][16 tokens][2 dims]``
      (element ``(t, d)`` at ``(t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2``), then V
      in tiles of 16 dims, each ``[block_size / 2][16 dims][2 tokens]`` (``(d // 16) * 16 * N +
      (t // 2) * 32 + (d % 16) * 2 + t % 2``): the VNNI order AMX tiles load."""
    if t.dim() != 4 or t.shape[-1] % 2 or t[0].stride() != _contiguous(t.shape[1:]):
        raise LayoutError(f"not a vLLM CPU KV layer: {tuple(t.shape)} strides {t.stride()}")
    nb, h, n, d2 = t.shape
    d = d2 // 2
    off, sb, sh = t.storage_offset(), t.stride(0), t.stride(1)
    if page_format == "amx":
        if n % 16 or d % 16:
            raise LayoutError(f"vLLM CPU 'amx' pages of block {n} and head size {d}: not whole tiles")
        key = t.as_strided((nb, h, n // 16, 16, d // 2, 2), (sb, sh, 16 * d, 2, 32, 1), off)
        value = t.as_strided((nb, h, n // 2, 2, d // 16, 16), (sb, sh, 32, 1, 16 * n, 2), off + n * d)
        return PagedLayerKV(key, value)
    key = t.as_strided((nb, h, n, d), (sb, sh, 1, n), off)
    value = t.as_strided((nb, h, n, d), (sb, sh, d, 1), off + n * d)
    return PagedLayerKV(key, value)


def cpu_pages_mismatch(write, dtype: torch.dtype, block_size: int, head_dim: int,
                       page_format: str) -> Optional[str]:
    """Whether ``cpu_layer_kv(page_format)`` reads what vLLM's own CPU cache writer ``write``
    (``vllm_compat.cpu_cache_writer``) puts into a page: None when it does, else what differs.
    vLLM's CPU backend picks a page format per kernel (``vllm_compat.cpu_page_format``); this
    writes one block of two heads, every element a distinct bit pattern, and reads it back."""
    bits = {2: torch.int16, 4: torch.int32}.get(_esize(dtype))
    if bits is None:
        return f"{dtype} pages are quantized by vLLM's writer, not copied"
    heads, n = 2, block_size * head_dim
    pattern = torch.arange(2 * n, dtype=torch.int64).to(bits).view(dtype)  # K's n, then V's n
    key, value = (p.view(block_size, 1, head_dim).expand(block_size, heads, head_dim).contiguous()
                  for p in pattern.view(2, n))
    cache = torch.zeros(2, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(2, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    try:
        write(key, value, key_cache, value_cache, torch.arange(block_size, dtype=torch.int64) + block_size)
        read = cpu_layer_kv(cache, page_format)
    except (RuntimeError, LayoutError) as e:  # the writer refuses it here, or the views cannot tile it
        return str(e).splitlines()[0]
    for name, want, page in (("K", key, read.key[1]), ("V", value, read.value[1])):
        page = page.reshape(heads, block_size, head_dim)  # a tiled view, untiled
        if not torch.equal(page.transpose(0, 1).view(bits), want.view(bits)):  # [token][head][dim]
            return f"{name} is not where '{page_format}' pages keep it, as this copy reads them"
    return None


def split_layer_kv(t: torch.Tensor) -> PagedLayerKV:
    """FlashAttention's layer ``[2, num_blocks, block_size, heads, head_dim]`` (NHD)."""
    if t.dim() != 5 or t.shape[0] != 2:
        raise LayoutError(f"not a K/V split layer: {tuple(t.shape)}")
    return PagedLayerKV(t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3))


def hnd_layer_kv(t: torch.Tensor) -> PagedLayerKV:
    """Head-major pages ``[num_blocks, 2, heads, block_size, head_dim]`` (HND)."""
    if t.dim() != 5 or t.shape[1] != 2:
        raise LayoutError(f"not a head-major block-first layer: {tuple(t.shape)}")
    return PagedLayerKV(t[:, 0], t[:, 1])


@dataclass(frozen=True)
class _Stack:
    """Evenly spaced layers ``[first, first + count)`` as one 7-D view per K/V:
    ``[count, num_blocks, heads, ta, tb, da, db]`` (``_tiles``)."""

    first: int
    kv: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockSpan:
    """Tokens ``[t0, t1)`` of a request's blocks at one rank, prepared for ``RankKV.copy``: the
    blocks the range covers whole, as ids on the host and as an index on the pages' device
    (torch indexes pages only with an index on their device; built once per plan, not per copy),
    and the blocks it covers in part, as ``(block index, block id, first token, end token)``."""

    tokens: tuple[int, int]
    first_whole: int  # block index of the first whole block
    whole_ids: tuple[int, ...]
    whole: torch.Tensor  # whole_ids, int64 on the pages' device
    partial: tuple[tuple[int, int, int, int], ...]


class RankKV:
    """The attention layers of one rank (in object layer order), its heads and block size."""

    def __init__(self, layers: Sequence[PagedLayerKV], heads: HeadRange):
        if not layers:
            raise LayoutError("no layers")
        k0 = layers[0].key
        self.num_blocks, h, self.block_size, self.head_dim = layers[0].shape
        if h != len(heads):
            raise LayoutError(f"layers hold {h} heads, the rank's range {heads} has {len(heads)}")
        for lay in layers:
            if lay.shape != layers[0].shape or lay.key.dtype != k0.dtype or lay.key.device != k0.device:
                raise LayoutError(f"layers differ in shape or device: {lay.shape} on {lay.key.device} vs "
                                  f"{layers[0].shape} on {k0.device}")
        self.heads, self.dtype, self.device, self.num_layers = heads, k0.dtype, k0.device, len(layers)
        self.layers = tuple(layers)
        self._stacks = _stack(self.layers)

    def span(self, block_ids: Sequence[int], tokens: tuple[int, int]) -> BlockSpan:
        """Tokens ``[t0, t1)`` of the blocks ``block_ids`` (``block_ids[j]``: the block holding tokens
        ``[j*block_size, (j+1)*block_size)``), for ``copy``."""
        t0, t1 = tokens
        n = self.block_size
        if t1 <= t0:
            return BlockSpan((t0, t1), 0, (), torch.empty(0, dtype=torch.int64, device=self.device), ())
        if len(block_ids) * n < t1:
            raise ValueError(f"{len(block_ids)} blocks of {n} tokens do not reach token {t1}")
        first_whole, end_whole = -(-t0 // n), t1 // n
        whole = tuple(block_ids[first_whole:end_whole])
        partial = tuple((j, block_ids[j], lo, hi) for j, lo, hi in _partial_blocks(t0, t1, n, first_whole, end_whole))
        return BlockSpan((t0, t1), first_whole, whole,
                         torch.as_tensor(whole, dtype=torch.int64, device=self.device), partial)

    def gather(self, block_ids: Sequence[int], tokens: tuple[int, int], obj: torch.Tensor,
               shape: CanonicalShape) -> None:
        """Copy tokens ``[t0, t1)`` (``block_ids[j]``: the block holding tokens
        ``[j*block_size, (j+1)*block_size)``) of the heads this rank and the object share
        into ``obj``, the object's payload (``shape``: its heads and tokens, which hold
        ``[t0, t1)``)."""
        self.copy(self.span(block_ids, tokens), obj, shape, to_object=True)

    def scatter(self, block_ids: Sequence[int], tokens: tuple[int, int], obj: torch.Tensor,
                shape: CanonicalShape) -> None:
        """Copy tokens ``[t0, t1)`` of the shared heads from the object into this rank's blocks
        (a part of the object's tokens: what a local prefix-cache hit left to load)."""
        self.copy(self.span(block_ids, tokens), obj, shape, to_object=False)

    def copy(self, span: BlockSpan, obj: torch.Tensor, shape: CanonicalShape, to_object: bool) -> None:
        """``gather`` (``to_object``) or ``scatter`` of a prepared ``span``; ``obj`` on the pages'
        device. Torch ops on the calling thread's current stream."""
        t0, t1 = span.tokens
        if not shape.first_token <= t0 <= t1 <= shape.end_token or shape.num_layers != self.num_layers \
                or shape.head_dim != self.head_dim or shape.dtype != self.dtype:
            raise ValueError(f"object {shape} does not hold tokens [{t0}, {t1}) of "
                             f"{self.num_layers} layers x {self.head_dim} {self.dtype}")
        o0 = shape.first_token  # object token i is token o0 + i
        common = self.heads.intersect(shape.heads)
        if common is None or t1 <= t0:
            return
        n = self.block_size
        view = shape.view(obj)[common.start - shape.heads.start: common.stop - shape.heads.start]
        hs = slice(common.start - self.heads.start, common.stop - self.heads.start)
        first_full, end_full = span.first_whole, span.first_whole + len(span.whole_ids)
        for st in self._stacks:
            for kv, paged in enumerate(st.kv):
                paged = paged[:, :, hs]  # [Ls, B, Hc, TA, TB, DA, DB]: tokens a*TB+b, dims c*DB+e
                tb, db = paged.shape[4], paged.shape[6]
                obj_kv = view[:, st.first: st.first + paged.shape[0], kv].unflatten(3, (-1, db))  # [Hc, Ls, T, DA, DB]
                if end_full > first_full:
                    mid = obj_kv[:, :, first_full * n - o0: end_full * n - o0]
                    mid = mid.unflatten(2, (end_full - first_full, -1, tb)).permute(1, 2, 0, 3, 4, 5, 6)
                    if to_object:  # writes through the strided view of the payload
                        torch.index_select(paged, 1, span.whole, out=mid)
                    elif mid[:, 0].numel() * mid.element_size() >= _BLOCK_LOOP_BYTES:
                        for j, b in enumerate(span.whole_ids):
                            paged[:, b].copy_(mid[:, j])
                    else:
                        paged.index_copy_(1, span.whole, mid)
                for j, b, lo, hi in span.partial:
                    for a0, a1, b0, b1 in _tile_pieces(lo - j * n, hi - j * n, tb):
                        page = paged[:, b, :, a0:a1, b0:b1].transpose(0, 1)  # [Hc, Ls, a, b, DA, DB]
                        first = j * n + a0 * tb + b0 - o0
                        part = obj_kv[:, :, first: first + (a1 - a0) * (b1 - b0)].unflatten(2, (a1 - a0, b1 - b0))
                        (part.copy_(page) if to_object else page.copy_(part))


def _partial_blocks(t0: int, t1: int, n: int, first_full: int, end_full: int):
    """(block index, first token, end token) of the blocks the range covers only in part."""
    if first_full > end_full:  # the range lies inside one block
        return [(t0 // n, t0, t1)]
    out = []
    if t0 % n:
        out.append((t0 // n, t0, first_full * n))
    if t1 % n:
        out.append((end_full, end_full * n, t1))
    return out


def _tile_pieces(lo: int, hi: int, tb: int) -> list[tuple[int, int, int, int]]:
    """Tokens ``[lo, hi)`` of one block whose tokens are tiled ``tb`` at a time (token
    ``a * tb + b``) as rectangles ``(a0, a1, b0, b1)``: a part of one tile, whole tiles, a part
    of one tile; each a contiguous token range. A plain page is one tile of the block."""
    if lo // tb == (hi - 1) // tb:
        a = lo // tb
        return [(a, a + 1, lo - a * tb, hi - a * tb)]
    out, whole = [], (-(-lo // tb), hi // tb)
    if lo % tb:
        out.append((lo // tb, lo // tb + 1, lo % tb, tb))
    if whole[1] > whole[0]:
        out.append((whole[0], whole[1], 0, tb))
    if hi % tb:
        out.append((hi // tb, hi // tb + 1, 0, hi % tb))
    return out


def _stack(layers: Sequence[PagedLayerKV]) -> list[_Stack]:
    """Runs of consecutive layers whose K (and V) views differ only by a constant storage
    offset, each as one 5-D view: one index op per run instead of per layer."""
    stacks, i = [], 0
    while i < len(layers):
        j = i + 1
        while j < len(layers) and _spacing(layers, i, j) is not None:
            j += 1
        stride = _spacing(layers, i, i + 1) if j > i + 1 else (0, 0)
        kv = []
        for which, step in zip(("key", "value"), stride):
            t = _tiles(getattr(layers[i], which))
            kv.append(t.as_strided((j - i, *t.shape), (step, *t.stride()), t.storage_offset()))
        stacks.append(_Stack(i, tuple(kv)))
        i = j
    return stacks


def _spacing(layers: Sequence[PagedLayerKV], first: int, j: int) -> Optional[tuple[int, int]]:
    """The (K, V) storage offset step from layer ``j-1`` to ``j``, when layers ``first..j``
    share one storage and strides and are evenly spaced; else None."""
    steps = []
    for which in ("key", "value"):
        a, b = getattr(layers[j - 1], which), getattr(layers[j], which)
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.stride() != b.stride():
            return None
        steps.append(b.storage_offset() - a.storage_offset())
    if steps[0] <= 0 or steps[0] != steps[1]:
        return None
    if j - first > 1:
        prev = getattr(layers[j - 1], "key").storage_offset() - getattr(layers[j - 2], "key").storage_offset()
        if prev != steps[0]:
            return None
    return steps[0], steps[1]


def _contiguous(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
