"""Copies with the KV pages on a device and the payload in host memory, as on a GPU, where
LMCache's buffer is pinned host memory: the canonical copy (``hma_share_parallel_shapes``) of
attention parts and state shards, and ``copy_ops``' torch path.

No GPU runs here, so the device is torch's ``meta``: it checks every op's devices and shapes and
holds no data. A copy that mixes the pages' device with the host (an index built on the host, a
buffer on the wrong side) fails here as it fails on a GPU. The same code runs on CPU pages,
where the bytes are checked. ``HostTransfers`` counts the copies between the host and the
device (a part moves in one copy per attention group, or one per state shard, through a buffer
on the device) and lets a copy out of ``meta`` leave the host bytes as they are: the one thing
a meta run cannot do.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout
from lmcache_hma.kv_copy.canonical_kv import HeadRange, RankHeads
from lmcache_hma.kv_copy.canonical_objects import CanonicalObjects, CanonicalStates

HEADS, DIM, BLOCK, CHUNK, WINDOW, NUM_BLOCKS, TOKENS = 2, 8, 16, 64, 40, 16, 192
SLIDING, FULL = ("s0", "s1"), ("f0", "f1")
OBJECTS = [(ObjectKind.FULL, 1, 0), (ObjectKind.TAIL, 1, 0), (ObjectKind.TURN, 2, 150)]
DEVICES = ["cpu", "meta"]


class HostTransfers(TorchDispatchMode):
    """Counts copies between devices by (source, destination) device type; a copy out of
    ``meta`` into host memory copies nothing (meta tensors hold no data)."""

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            dst, src = args[0], args[1]
            self.count[(src.device.type, dst.device.type)] += 1
            if src.device.type == "meta":
                assert dst.shape == src.shape and dst.dtype == src.dtype
                return dst
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") not in (None, args[0].device):
            self.count[(args[0].device.type, torch.device(kwargs["device"]).type)] += 1
            if args[0].device.type == "meta":
                return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype,
                                   device=kwargs["device"])
        return func(*args, **kwargs)


def attention_layout() -> HybridLayout:
    page = HEADS * BLOCK * 2 * DIM * 4
    return HybridLayout((GroupLayout(0, GroupKind.SLIDING, SLIDING, BLOCK, page, WINDOW),
                         GroupLayout(1, GroupKind.FULL, FULL, BLOCK, page)), CHUNK)


def attention_caches(device: str, pages: str, fill: bool) -> dict:
    """The layers as a GPU backend allocates them (all layers in one allocation): FlashAttention's
    ``[2, num_blocks, block, heads, dim]`` or the block-first ``[num_blocks, 2, block, heads, dim]``."""
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, DIM) if pages == "flash" else (NUM_BLOCKS, 2, BLOCK, HEADS, DIM)
    names = (*SLIDING, *FULL)
    alloc = (torch.randn((len(names), *shape), generator=torch.Generator().manual_seed(3)) if fill
             else torch.zeros((len(names), *shape))).to(device)
    return {name: alloc[i] for i, name in enumerate(names)}


def attention_objects(device: str, pages: str, fill: bool) -> CanonicalObjects:
    return CanonicalObjects(attention_layout(), attention_caches(device, pages, fill), NUM_BLOCKS,
                            RankHeads(HeadRange(0, HEADS), True), b"s" * 16)


TABLE = list(range(1, 1 + TOKENS // BLOCK))  # the request's blocks, the same in both groups


def reader_table(boundary: int) -> list:
    """A hit of ``boundary`` tokens as vLLM allocates it: null sliding blocks before the window."""
    first = attention_layout().groups[0].first_token_needed(boundary) // BLOCK
    return [[0] * first + TABLE[first:], TABLE]


def tokens_of(objects: CanonicalObjects, pos: int, table, t0: int, t1: int) -> torch.Tensor:
    """Tokens ``[t0, t1)`` of group ``pos`` in the pages: ``[layer][K|V][token][head][dim]``."""
    kv = objects.groups[pos]
    return torch.stack([torch.stack([torch.stack([view[table[t // BLOCK], :, t % BLOCK] for t in range(t0, t1)])
                                     for view in (lay.key, lay.value)]) for lay in kv.layers])


@pytest.mark.parametrize("pages", ["flash", "block_first"])
@pytest.mark.parametrize("kind, chunk, end", OBJECTS)
@pytest.mark.parametrize("device", DEVICES)
def test_parts_gather_and_scatter_with_pages_on_a_device(device, kind, chunk, end, pages):
    """Every part of a full, a tail and a turn object is gathered from pages on ``device`` into a
    host payload and scattered from it into other pages there: the block index is on the pages'
    device, each group's tokens cross once each way, and on the CPU the reader's pages hold the
    writer's tokens."""
    writer, reader = attention_objects(device, pages, fill=True), attention_objects(device, pages, fill=False)
    boundary = end or (chunk + 1) * CHUNK
    for head in range(HEADS):
        payload = torch.zeros(writer.payload_bytes(kind, chunk, end) // 4)  # LMCache's host buffer
        stored = writer.plan(kind, chunk, end, head, [TABLE, TABLE])
        loaded = reader.plan_load(kind, chunk, end, head, reader_table(boundary))
        for copy in (stored, loaded):
            assert all(seg.span.whole.device.type == device for seg in copy.segments)
        with HostTransfers() as moved:
            writer.gather(stored, payload)
        assert moved.count == Counter({(device, "cpu"): len(stored.segments)} if device != "cpu" else {})
        with HostTransfers() as moved:
            reader.scatter(loaded, payload)
        assert moved.count == Counter({("cpu", device): len(loaded.segments)} if device != "cpu" else {})
    if device == "cpu":
        for seg in loaded.segments:
            t0, t1 = seg.tokens
            table = reader_table(boundary)[reader.layout.groups[seg.group].index]
            assert torch.equal(tokens_of(reader, seg.group, table, t0, t1), tokens_of(writer, seg.group, TABLE, t0, t1))


@pytest.mark.parametrize("block_loop", [False, True], ids=["index_copy", "block_loop"])
@pytest.mark.parametrize("page_format, block", [("vec", 16), ("amx", 32)])
@pytest.mark.parametrize("t0, t1", [(0, 256), (5, 93), (17, 30)])
def test_rank_copies_on_a_device_whatever_the_page_views(t0, t1, page_format, block, block_loop, monkeypatch):
    """``RankKV`` over vLLM CPU's page views (plain, and AMX tiles) with pages and object on a
    device: whole blocks (an index on the device; a scatter of big blocks: one copy per block),
    partial blocks and parts of tiles, as ``test_canonical_kv`` copies them on the CPU."""
    from lmcache_hma.kv_copy import canonical_kv
    from lmcache_hma.kv_copy.canonical_kv import CanonicalShape, RankKV, cpu_layer_kv

    monkeypatch.setattr(canonical_kv, "_BLOCK_LOOP_BYTES", 0 if block_loop else 1 << 62)
    layers, dim = 3, 64
    alloc = torch.empty(layers, 40, HEADS, block, 2 * dim, dtype=torch.bfloat16, device="meta")
    kv = RankKV([cpu_layer_kv(alloc[i], page_format) for i in range(layers)], HeadRange(0, HEADS))
    shape = CanonicalShape(HeadRange(0, HEADS), layers, t1 - t0, dim, torch.bfloat16, first_token=t0)
    span = kv.span(list(range(1, 1 + 256 // block)), (t0, t1))
    assert span.whole.device.type == "meta"
    obj = torch.empty(HEADS * shape.head_elems, dtype=torch.bfloat16, device="meta")
    kv.copy(span, obj, shape, to_object=True)
    kv.copy(span, obj, shape, to_object=False)


# -- recurrent-state shards -----------------------------------------------------------------------

def state_objects(device: str, tp: int, rank: int, fill: bool):
    """A gated-delta-net rank (2 k heads, 4 v heads, conv kernel 4, two layers; bf16 conv and
    float32 recurrent states, one tensor per part) with its pages on ``device``."""
    from lmcache_hma.kv_copy.canonical_state import GdnDims
    from lmcache_hma.kv_copy.state_kv import StateKV

    conv, ssm = GdnDims(2, 4, 8, 4, 4).rank_shapes(tp, "SD")
    names = ("g0", "g1")
    page = conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4
    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("f0",), 16, 64),
                        GroupLayout(1, GroupKind.STATE, names, 16, page, state_shapes=(conv, ssm),
                                    state_dtypes=("torch.bfloat16", "torch.float32"), conv_state_layout="SD")),
                       64)
    g = torch.Generator().manual_seed(11)

    def part(shape, dtype):
        t = torch.randn((6, *shape), generator=g).to(dtype) if fill else torch.zeros((6, *shape), dtype=dtype)
        return t.to(device)

    caches = {n: [part(conv, torch.bfloat16), part(ssm, torch.float32)] for n in names}
    return CanonicalStates(lay, StateKV(caches, lay, 6), tp, rank, None), caches


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_state_shards_gather_and_scatter_with_pages_on_a_device(device, tp):
    """A rank's state shards go from pages on ``device`` to a host payload and back into other
    pages there, each in one copy each way (a buffer on the device); on the CPU, the reader's
    block holds the writer's states and no other block changed."""
    writer, written = state_objects(device, tp, 0, fill=True)
    reader, read = state_objects(device, tp, 0, fill=False)
    for shard in writer.owned:
        payload = torch.zeros(writer.payload_bytes, dtype=torch.uint8)
        with HostTransfers() as moved:
            writer.gather([3], shard, payload)
        assert moved.count == Counter({(device, "cpu"): 1} if device != "cpu" else {})
        with HostTransfers() as moved:
            reader.scatter([3], shard, payload)
        assert moved.count == Counter({("cpu", device): 1} if device != "cpu" else {})
    if device == "cpu":
        for name in read:
            for got, want in zip(read[name], written[name]):
                assert torch.equal(got[3], want[3]) and not got[:3].any() and not got[4:].any()


# -- copy_ops' torch path ---------------------------------------------------------------------------

def test_the_torch_page_copy_refuses_pages_off_the_host():
    """``copy_ops``' torch path indexes pages with host indices: pages on another device than the
    host's (a GPU's go to ``cuda_copy``) are refused before anything is copied, and the start-up
    probe says so (the worker then serves no hits and stores nothing)."""
    from lmcache_hma.core.layout import plan_rows
    from lmcache_hma.kv_copy import copy_ops
    from lmcache_hma.kv_copy.paged_kv import PagedKV
    from tests.fakes import kv_caches, layout

    lay = layout("SF")
    paged = PagedKV({k: v.to("meta") for k, v in kv_caches(lay).items()}, lay, num_blocks=32)
    rows = plan_rows(lay, lay.full_segments(0), ([1, 2], [3, 4]))
    payload = torch.zeros(len(rows) * paged.planes * paged.unit_elems, dtype=torch.bfloat16)
    for copy in (copy_ops.gather, copy_ops.scatter):
        with pytest.raises(ValueError, match="KV caches on meta: copied on the host"):
            copy(paged, rows, payload)
    assert "KV caches on meta" in copy_ops.probe(paged)
