"""The canonical (TP-free, block-size-free) object layout: round trips between ranks of
different TP sizes and block sizes, bit-exact (no engine).

Paged KV is written the way vLLM's CPU backend writes it during a forward pass: by its own
kernel, ``cpu_attn_reshape_and_cache``, into ``[num_blocks, heads, block_size, 2*head]``
layer views of one allocation. So every comparison is against pages vLLM itself filled with
the same keys and values, and against the canonical object computed by plain slicing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_hma.kv_copy import canonical_kv, canonical_plan
from lmcache_hma.kv_copy.canonical_kv import (
    CanonicalShape, HeadRange, RankKV, cpu_layer_kv, hnd_layer_kv, kv_heads_of_rank, split_layer_kv,
)
from lmcache_hma.kv_copy.canonical_state import GdnDims, copy_runs, gdn_state_runs
from lmcache_hma.kv_copy.copy_plan import HostEmulation

ops = pytest.importorskip("vllm._custom_ops")

HEADS, DIM, LAYERS, TOKENS = 2, 64, 3, 256
DTYPES = [torch.float32, torch.bfloat16]


def _kv(dtype, seed=0):
    """Per layer, the keys and values of TOKENS tokens: ``[L, T, H, D]`` each."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype),
            torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype))


class CpuRank:
    """One rank's paged KV, as vLLM CPU allocates it (all layers in one allocation) and
    filled by vLLM's own kernel with the heads ``heads`` of ``keys``/``values``."""

    def __init__(self, keys, values, heads: HeadRange, block_size: int, seed: int,
                 num_blocks: int = 40, upto: int = TOKENS, page_format: str = ""):
        self.heads, self.block_size = heads, block_size
        # vLLM's kernel for these pages (vllm_compat.cpu_page_format): plain unless told
        self.page_format = isa = page_format or ("vec" if block_size % 32 == 0 else "vec16")
        self.alloc = torch.zeros(LAYERS, num_blocks, len(heads), block_size, 2 * DIM, dtype=keys.dtype)
        g = torch.Generator().manual_seed(seed)
        self.block_ids = (torch.randperm(num_blocks - 1, generator=g)[:-(-TOKENS // block_size)] + 1).tolist()
        slots = torch.tensor([self.block_ids[t // block_size] * block_size + t % block_size
                              for t in range(upto)], dtype=torch.int64)
        for layer in range(LAYERS if upto else 0):
            cache = self.alloc[layer].view(num_blocks, len(heads), 2 * block_size, DIM)
            key_cache, value_cache = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                keys[layer, :upto, heads.start:heads.stop].contiguous(),
                values[layer, :upto, heads.start:heads.stop].contiguous(),
                key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        self.kv = RankKV([cpu_layer_kv(self.alloc[layer], isa) for layer in range(LAYERS)], heads)

    def empty_like(self) -> torch.Tensor:
        return torch.zeros_like(self.alloc)


def _reference(keys, values, heads: HeadRange, t0: int, t1: int) -> torch.Tensor:
    """The canonical object by plain slicing: ``[H, L, 2, T, D]``."""
    both = torch.stack([keys, values], 1)[:, :, t0:t1, heads.start:heads.stop]  # [L, 2, T, H, D]
    return both.permute(3, 0, 1, 2, 4).contiguous()


def _gather(rank: CpuRank, t0: int, t1: int, heads: HeadRange, dtype) -> tuple[torch.Tensor, CanonicalShape]:
    shape = CanonicalShape(heads, LAYERS, t1 - t0, DIM, dtype, first_token=t0)
    obj = torch.full((len(heads) * shape.head_elems,), float("nan"), dtype=dtype)
    rank.kv.gather(rank.block_ids, (t0, t1), obj, shape)
    return obj, shape


def _written(rank: CpuRank, t0: int, t1: int) -> torch.Tensor:
    """Which bytes of ``rank``'s allocation a scatter of tokens [t0, t1) owns: the same
    scatter of an all-ones object into a zeroed boolean copy of the allocation."""
    mask = torch.zeros(rank.alloc.shape, dtype=torch.bool)
    kv = RankKV([cpu_layer_kv(mask[layer], rank.page_format) for layer in range(LAYERS)], rank.heads)
    shape = CanonicalShape(rank.heads, LAYERS, t1 - t0, DIM, torch.bool, first_token=t0)
    ones = torch.ones(len(rank.heads) * shape.head_elems, dtype=torch.bool)
    kv.scatter(rank.block_ids, (t0, t1), ones, shape)
    return mask


@pytest.mark.parametrize("block_loop", [False, True], ids=["index_copy", "block_loop"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t0,t1", [(0, 256), (64, 224), (5, 93)])
def test_tp1_writer_to_tp2_readers_and_back(dtype, t0, t1, block_loop, monkeypatch):
    """TP=1 at block size 16 stores tokens [t0, t1) of both heads; each TP=2 rank at block
    size 32 loads its head and gets exactly the pages vLLM's kernel writes for those tokens;
    the two ranks' objects (their heads) concatenate into the TP=1 object, byte for byte,
    which loads into a fresh TP=1 rank at block size 16 exactly. Both ways a scatter writes
    whole blocks (one index_copy_, or one copy_ per block for big blocks)."""
    monkeypatch.setattr(canonical_kv, "_BLOCK_LOOP_BYTES", 0 if block_loop else 1 << 62)
    keys, values = _kv(dtype)
    writer = CpuRank(keys, values, HeadRange(0, 2), 16, seed=1)
    obj, shape = _gather(writer, t0, t1, HeadRange(0, 2), dtype)
    assert torch.equal(shape.view(obj), _reference(keys, values, HeadRange(0, 2), t0, t1))

    halves = []
    for r in range(2):
        heads = kv_heads_of_rank(HEADS, 2, r).heads
        want = CpuRank(keys, values, heads, 32, seed=10 + r)  # vLLM's own pages for these tokens
        reader = CpuRank(keys, values, heads, 32, seed=10 + r, upto=0)  # same blocks, empty
        reader.kv.scatter(reader.block_ids, (t0, t1), obj, shape)
        mask = _written(reader, t0, t1)
        assert int(mask.sum()) == LAYERS * 2 * (t1 - t0) * DIM
        assert torch.equal(reader.alloc[mask], want.alloc[mask])
        assert not reader.alloc[~mask].any()  # nothing outside the range was touched
        half, half_shape = _gather(reader, t0, t1, heads, dtype)
        off, n = shape.head_bytes(heads)
        assert half_shape.nbytes == n
        assert obj.view(torch.uint8)[off:off + n].equal(half.view(torch.uint8))
        halves.append(half)

    joined = torch.cat(halves)
    back = CpuRank(keys, values, HeadRange(0, 2), 16, seed=20, upto=0)
    back.kv.scatter(back.block_ids, (t0, t1), joined, shape)
    want = CpuRank(keys, values, HeadRange(0, 2), 16, seed=20)
    mask = _written(back, t0, t1)
    assert torch.equal(back.alloc[mask], want.alloc[mask]) and not back.alloc[~mask].any()


@pytest.mark.parametrize("t0,t1", [(64, 192), (40, 201)])
def test_load_of_part_of_an_object(t0, t1):
    """A reader loads only tokens [t0, t1) of an object of tokens [0, 256) (the rest it has
    from its own prefix cache, or its window does not need): exactly those, nothing else."""
    keys, values = _kv(torch.float32)
    writer = CpuRank(keys, values, HeadRange(0, 2), 16, seed=1)
    obj, shape = _gather(writer, 0, TOKENS, HeadRange(0, 2), torch.float32)
    heads = HeadRange(1, 2)
    reader = CpuRank(keys, values, heads, 32, seed=2, upto=0)
    reader.kv.scatter(reader.block_ids, (t0, t1), obj, shape)
    want = CpuRank(keys, values, heads, 32, seed=2)
    mask = _written(reader, t0, t1)
    assert int(mask.sum()) == LAYERS * 2 * (t1 - t0) * DIM
    assert torch.equal(reader.alloc[mask], want.alloc[mask]) and not reader.alloc[~mask].any()


@pytest.mark.parametrize("t0,t1", [(0, 256), (5, 93), (40, 201), (17, 30)])
def test_amx_tiled_pages_to_plain_pages_and_back(t0, t1):
    """vLLM CPU's AMX kernel tiles bf16 pages (K: 16 tokens x pairs of dims, V: pairs of tokens
    x 16 dims); vLLM's own writer lays them out on any x86 CPU. A TP=1 writer with AMX pages
    of block 32 stores tokens [t0, t1); TP=2 readers with plain pages of block 16 load exactly
    what vLLM writes there; their halves load into an AMX reader of block 64 exactly, nothing
    outside the range touched (ranges inside one tile, across tiles, across blocks)."""
    dtype = torch.bfloat16
    keys, values = _kv(dtype)
    writer = CpuRank(keys, values, HeadRange(0, 2), 32, seed=1, page_format="amx")
    assert writer.kv.layers[0].tiled
    obj, shape = _gather(writer, t0, t1, HeadRange(0, 2), dtype)
    assert torch.equal(shape.view(obj), _reference(keys, values, HeadRange(0, 2), t0, t1))
    halves = []
    for r in range(2):
        heads = kv_heads_of_rank(HEADS, 2, r).heads
        want = CpuRank(keys, values, heads, 16, seed=10 + r)
        reader = CpuRank(keys, values, heads, 16, seed=10 + r, upto=0)
        reader.kv.scatter(reader.block_ids, (t0, t1), obj, shape)
        mask = _written(reader, t0, t1)
        assert torch.equal(reader.alloc[mask], want.alloc[mask]) and not reader.alloc[~mask].any()
        halves.append(_gather(reader, t0, t1, heads, dtype)[0])
    back = CpuRank(keys, values, HeadRange(0, 2), 64, seed=20, upto=0, page_format="amx")
    back.kv.scatter(back.block_ids, (t0, t1), torch.cat(halves), shape)
    want = CpuRank(keys, values, HeadRange(0, 2), 64, seed=20, page_format="amx")
    mask = _written(back, t0, t1)
    assert int(mask.sum()) == HEADS * LAYERS * 2 * (t1 - t0) * DIM
    assert torch.equal(back.alloc[mask], want.alloc[mask]) and not back.alloc[~mask].any()
    # and read as plain pages, the same bytes are other elements: the format matters
    plain = RankKV([cpu_layer_kv(want.alloc[layer]) for layer in range(LAYERS)], HeadRange(0, 2))
    wrong = torch.zeros_like(obj)
    plain.gather(want.block_ids, (t0, t1), wrong, shape)
    assert not torch.equal(wrong, obj)


def test_reader_with_more_heads_than_the_object_loads_only_those():
    """A TP=1 reader of a TP=2 writer's object (head 1 only) fills head 1 and leaves head 0."""
    keys, values = _kv(torch.float32)
    writer = CpuRank(keys, values, HeadRange(1, 2), 32, seed=3)
    obj, shape = _gather(writer, 32, 160, HeadRange(1, 2), torch.float32)
    reader = CpuRank(keys, values, HeadRange(0, 2), 16, seed=4, upto=0)
    reader.kv.scatter(reader.block_ids, (32, 160), obj, shape)
    full, full_shape = _gather(reader, 32, 160, HeadRange(0, 2), torch.float32)
    view = full_shape.view(full)
    assert torch.equal(view[1], _reference(keys, values, HeadRange(1, 2), 32, 160)[0])
    assert not view[0].any()


def test_layers_in_separate_allocations():
    """Layers that are not evenly spaced views of one allocation are copied one by one."""
    keys, values = _kv(torch.float32)
    rank = CpuRank(keys, values, HeadRange(0, 2), 16, seed=5)
    separate = [rank.alloc[layer].clone() for layer in range(LAYERS)]
    kv = RankKV([cpu_layer_kv(t) for t in separate], HeadRange(0, 2))
    assert len(kv._stacks) == LAYERS and len(rank.kv._stacks) == 1
    shape = CanonicalShape(HeadRange(0, 2), LAYERS, 100, DIM, torch.float32, first_token=7)
    obj = torch.empty(2 * shape.head_elems)
    kv.gather(rank.block_ids, (7, 107), obj, shape)
    assert torch.equal(shape.view(obj), _reference(keys, values, HeadRange(0, 2), 7, 107))


def test_kv_heads_of_rank():
    assert kv_heads_of_rank(2, 1, 0) == kv_heads_of_rank(2, 1, 0)
    assert [kv_heads_of_rank(4, 2, r).heads for r in range(2)] == [HeadRange(0, 2), HeadRange(2, 4)]
    replicated = [kv_heads_of_rank(1, 2, r) for r in range(2)]  # tiny-gemma3 at TP=2
    assert [x.heads for x in replicated] == [HeadRange(0, 1)] * 2
    assert [x.writes for x in replicated] == [True, False]
    assert [kv_heads_of_rank(2, 4, r).heads.start for r in range(4)] == [0, 0, 1, 1]
    assert [kv_heads_of_rank(2, 4, r).writes for r in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError):
        kv_heads_of_rank(3, 2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (128, 256)])
def test_the_page_views_are_where_vllms_writer_puts_each_element(dtype, block_size, head_dim):
    """The probe behind the start-up check: for every kernel vLLM CPU runs here, and AMX
    (its writer lays AMX tiles out on any x86 CPU), ``cpu_layer_kv`` of that format reads
    each element where vLLM's own writer put it; read as another format, the probe fails."""
    from lmcache_hma.vllm_compat import cpu_cache_writer

    formats = ["vec16"] + (["vec"] if block_size % 32 == 0 else [])
    if dtype == torch.bfloat16 and block_size % 32 == 0:
        formats.append("amx")
    for page_format in formats:
        write = cpu_cache_writer(page_format)
        assert canonical_kv.cpu_pages_mismatch(write, dtype, block_size, head_dim, page_format) is None
    if "amx" in formats:
        assert canonical_kv.cpu_pages_mismatch(cpu_cache_writer("amx"), dtype, block_size, head_dim, "vec") == \
            "K is not where 'vec' pages keep it, as this copy reads them"
        assert canonical_kv.cpu_pages_mismatch(cpu_cache_writer("vec"), dtype, block_size, head_dim, "amx") == \
            "K is not where 'amx' pages keep it, as this copy reads them"


def test_the_shared_format_refuses_pages_it_cannot_read():
    """hma_share_parallel_shapes on a CPU whose attention kernel lays pages out in a way the
    copy cannot read (here: a kernel vLLM's writer refuses on this CPU): a clear error at
    start naming the group, never a copy of the wrong elements."""
    from types import SimpleNamespace

    from lmcache_hma.connector import _check_cpu_pages
    from lmcache_hma.core.layout import LayoutError

    spec = SimpleNamespace(dtype=torch.bfloat16, block_size=32, head_size=128)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * 3)
    _check_cpu_pages(config, {0: "vec", 1: "amx", 2: None})  # plain, tiled; a group off the CPU
    with pytest.raises(LayoutError, match=r"group 1 in 'neon' pages \(block 32, head size 128.*option off"):
        _check_cpu_pages(config, {0: "vec", 1: "neon"})


def test_the_per_rank_key_names_the_cpu_page_format():
    """Per-rank objects are vLLM's pages byte for byte: two CPUs whose attention kernels lay a
    page out differently (AMX tiles, plain) must not share them, so the key names the format."""
    from types import SimpleNamespace

    from lmcache_hma.vllm_compat import cpu_page_format

    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                             cache_config=SimpleNamespace(cache_dtype="auto"),
                             device_config=SimpleNamespace(device_type="cpu"))
    assert cpu_page_format(config, SimpleNamespace(block_size=16, head_size=128)) == "vec16"
    assert cpu_page_format(config, SimpleNamespace(block_size=128, head_size=128)) in ("vec", "amx")
    assert cpu_page_format(config, SimpleNamespace(block_size=128, head_size=80)) == "vec16"
    config.device_config.device_type = "cuda"  # a GPU's pages: kv_cache_layout says it
    assert cpu_page_format(config, SimpleNamespace(block_size=16, head_size=128)) is None


def _plan_copy(rank_kv: RankKV, block_ids, tokens, obj, shape, to_payload):
    plan = canonical_plan.build(canonical_plan.RankGeometry(rank_kv), block_ids, tokens,
                                obj.data_ptr(), shape, to_payload)
    HostEmulation().execute(plan, to_payload)
    return plan


@pytest.mark.parametrize("layout", ["cpu", "nhd", "hnd"])
@pytest.mark.parametrize("t0,t1", [(32, 224), (5, 93)])
def test_plan_copies_what_the_torch_path_copies(layout, t0, t1):
    """The GPU plan, run on host memory by the kernel's contract, gathers the torch path's
    object and scatters it back into the same bytes, for each page layout."""
    g = torch.Generator().manual_seed(7)
    nb, n, heads = 24, 16, HeadRange(2, 4)
    if layout == "cpu":
        alloc = torch.randn(LAYERS, nb, 2, n, 2 * DIM, generator=g)
        layers = [cpu_layer_kv(alloc[layer]) for layer in range(LAYERS)]
    elif layout == "nhd":
        alloc = torch.randn(LAYERS, 2, nb, n, 2, DIM, generator=g)
        layers = [split_layer_kv(alloc[layer]) for layer in range(LAYERS)]
    else:
        alloc = torch.randn(LAYERS, nb, 2, 2, n, DIM, generator=g)
        layers = [hnd_layer_kv(alloc[layer]) for layer in range(LAYERS)]
    rank = RankKV(layers, heads)
    ids = (torch.randperm(nb - 1, generator=g)[:-(-TOKENS // n)] + 1).tolist()
    shape = CanonicalShape(HeadRange(0, 4), LAYERS, t1 - t0, DIM, torch.float32, first_token=t0)
    want = torch.zeros(4 * shape.head_elems)
    rank.gather(ids, (t0, t1), want, shape)
    got = torch.zeros_like(want)
    plan = _plan_copy(rank, ids, (t0, t1), got, shape, True)
    assert torch.equal(got, want)
    expect_unit = {"cpu": 4, "nhd": DIM * 4, "hnd": (n if t0 % n == 0 and t1 % n == 0 else 1) * DIM * 4}
    assert plan.unit_bytes == expect_unit[layout]
    before = alloc.clone()
    alloc.zero_()
    _plan_copy(rank, ids, (t0, t1), got, shape, False)
    again = torch.zeros_like(want)
    rank.gather(ids, (t0, t1), again, shape)
    assert torch.equal(again, want)
    written = alloc != 0
    assert torch.equal(alloc[written], before[written])


@pytest.mark.parametrize("layout", ["cpu", "nhd", "hnd"])
@pytest.mark.parametrize("t0,t1", [(48, 208), (33, 100)])
def test_plan_of_part_of_an_object(layout, t0, t1):
    """A plan that loads tokens [t0, t1) of an object of tokens [16, 240) writes what the
    torch path writes, and nothing else."""
    g = torch.Generator().manual_seed(8)
    nb, n, heads = 24, 16, HeadRange(0, 2)
    views = {"cpu": ((LAYERS, nb, 2, n, 2 * DIM), cpu_layer_kv),
             "nhd": ((LAYERS, 2, nb, n, 2, DIM), split_layer_kv),
             "hnd": ((LAYERS, nb, 2, 2, n, DIM), hnd_layer_kv)}
    alloc_shape, view = views[layout]
    ids = (torch.randperm(nb - 1, generator=g)[:-(-TOKENS // n)] + 1).tolist()
    shape = CanonicalShape(HeadRange(0, 2), LAYERS, 224, DIM, torch.float32, first_token=16)
    obj = torch.randn(2 * shape.head_elems, generator=g)
    by_torch, by_plan = torch.zeros(alloc_shape), torch.zeros(alloc_shape)
    RankKV([view(t) for t in by_torch.unbind(0)], heads).scatter(ids, (t0, t1), obj, shape)
    plan = _plan_copy(RankKV([view(t) for t in by_plan.unbind(0)], heads), ids, (t0, t1), obj, shape, False)
    assert len(plan) and torch.equal(by_plan, by_torch)
    assert int((by_torch != 0).sum()) == LAYERS * 2 * 2 * (t1 - t0) * DIM


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_rank_shapes_are_vllms(tp):
    """The per-rank state shapes the runs assume are the ones vLLM computes (layout "SD",
    its default; "DS" is the same conv shape transposed)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, get_conv_state_layout

    if get_conv_state_layout() != "SD":
        pytest.skip("VLLM_SSM_CONV_STATE_LAYOUT is set")
    dims = GdnDims(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=4, conv_kernel_size=4, num_spec=1)
    want = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 4, 8, 8, 4, 4, 1)
    assert dims.rank_shapes(tp, "SD") == tuple(tuple(x) for x in want)
    assert dims.rank_shapes(tp, "DS") == (tuple(want[0])[::-1], tuple(want[1]))


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_state_runs_split_the_canonical_state(conv_layout, tp):
    """Each rank's page, built from the canonical state by vLLM's sharding (conv channels
    [q_r | k_r | v_r], value heads [r*nv/tp, ...)), maps onto exactly its share; together
    the ranks cover the canonical state once."""
    dims = GdnDims(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=4, conv_kernel_size=4)
    g = torch.Generator().manual_seed(9)
    conv = torch.randn(dims.state_len, dims.conv_dim, generator=g)  # canonical: SD, global channels
    ssm = torch.randn(dims.num_v_heads, dims.head_v_dim, dims.head_k_dim, generator=g)
    canonical = torch.cat([conv.reshape(-1), ssm.reshape(-1)]).view(torch.uint8).numpy()
    assert canonical.size == dims.canonical_bytes(4, 4)
    covered = np.zeros(canonical.size, dtype=np.int64)
    kd, vd = dims.key_dim // tp, dims.value_dim // tp
    for r in range(tp):
        channels = torch.cat([torch.arange(r * kd, (r + 1) * kd),
                              dims.key_dim + torch.arange(r * kd, (r + 1) * kd),
                              2 * dims.key_dim + torch.arange(r * vd, (r + 1) * vd)])
        rank_conv = conv[:, channels]
        if conv_layout == "DS":
            rank_conv = rank_conv.T.contiguous()
        conv_shape, ssm_shape = dims.rank_shapes(tp, conv_layout)
        assert tuple(rank_conv.shape) == conv_shape
        rank_ssm = ssm[r * dims.num_v_heads // tp:(r + 1) * dims.num_v_heads // tp]
        assert tuple(rank_ssm.shape) == ssm_shape
        page = torch.cat([rank_conv.reshape(-1), rank_ssm.reshape(-1)]).view(torch.uint8).numpy()
        runs = gdn_state_runs(dims, tp, r, conv_layout, 4, 4)
        out = np.zeros_like(canonical)
        copy_runs(page, out, runs, to_canonical=True)
        for _, c, n in runs.tolist():
            covered[c:c + n] += 1
            assert np.array_equal(out[c:c + n], canonical[c:c + n])
        back = np.zeros_like(page)
        copy_runs(back, canonical, runs, to_canonical=False)
        assert np.array_equal(back, page)
    assert (covered == 1).all()
