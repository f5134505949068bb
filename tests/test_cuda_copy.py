"""The CUDA copy path (``cuda_copy``) against the torch path of ``copy_ops`` (the oracle).

Without a GPU: the kernel compiles with nvcc, and the per-unit addresses the
kernel is given, used by ``ctypes.memmove`` on CPU tensors, copy exactly what the
torch path copies. With a GPU: the kernel itself, payload pinned or on device.
"""

from __future__ import annotations

import ctypes
import random
import shutil
from dataclasses import dataclass

import pytest
import torch

from lmcache_hma.kv_copy import copy_ops, cuda_copy
from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout, Rows
from lmcache_hma.kv_copy.paged_kv import PagedKV

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
BLOCK_SHAPES = ((2, 4, 8), (1, 3, 1), (3, 1, 5), (2, 2, 3), (4, 16, 4))  # (heads, tokens, head size)
SEEDS = range(40)
HAS_GPU = torch.cuda.is_available()


@dataclass
class Case:
    """Random paged KV: layers placed in allocations, rows to copy, a payload."""

    dtype: torch.dtype
    kv_split: bool  # [2, num_blocks, B, H, D] per layer, else [num_blocks, H, B, D]
    block: tuple[int, int, int]
    num_blocks: int
    slots: int  # layer slots per allocation
    interleaved: list[bool]  # per allocation: slots interleaved per block, else slot-major
    placement: list[tuple[int, int]]  # per layer: (allocation, slot); equal = same bytes
    allocations: list[torch.Tensor]  # 1-D, dtype
    rows: Rows
    payload: torch.Tensor  # 1-D, dtype
    payload_offset: int  # elements: the payload starts this far into its buffer

    @property
    def names(self) -> list[str]:
        return [f"layer.{i}" for i in range(len(self.placement))]

    def paged(self, allocations: list[torch.Tensor]) -> PagedKV:
        b, h, d = self.block[1], self.block[0], self.block[2]
        kv = {}
        for name, (a, s) in zip(self.names, self.placement):
            buf, n, w = allocations[a], self.num_blocks, self.slots
            if self.kv_split and self.interleaved[a]:
                kv[name] = buf.view(2, n, w, b, h, d)[:, :, s]
            elif self.kv_split:
                kv[name] = buf.view(w, 2, n, b, h, d)[s]
            elif self.interleaved[a]:
                kv[name] = buf.view(n, w, h, b, d)[:, s]
            else:
                kv[name] = buf.view(w, n, h, b, d)[s]
        page_bytes = (2 if self.kv_split else 1) * b * h * d * self.allocations[0].element_size()
        half = max(1, len(self.names) // 2)  # two groups, as a hybrid model has
        groups = (
            GroupLayout(0, GroupKind.SLIDING, tuple(self.names[:half]), block_size=b,
                        page_bytes=page_bytes, sliding_window=4 * b),
            GroupLayout(1, GroupKind.FULL, tuple(self.names[half:]), block_size=b,
                        page_bytes=page_bytes),
        )
        groups = tuple(g for g in groups if g.layer_names)
        return PagedKV(kv, HybridLayout(groups, 4 * b), self.num_blocks)

    def payload_on(self, where: str) -> torch.Tensor:
        """A copy of the payload, ``payload_offset`` elements into a fresh buffer."""
        buf = torch.zeros(self.payload_offset + self.payload.numel(), dtype=self.dtype)
        if where == "pinned":
            buf = buf.pin_memory()
        elif where == "cuda":
            buf = buf.cuda()
        out = buf[self.payload_offset:]
        out.copy_(self.payload)
        return out


def random_bytes(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype)


def make_case(seed: int, num_blocks: int | None = None, block=None, dtype=None) -> Case:
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dtype = dtype or rnd.choice(DTYPES)
    kv_split = rnd.random() < 0.5
    block = block or rnd.choice(BLOCK_SHAPES)
    num_blocks = num_blocks or rnd.randint(3, 12)
    n_layers = rnd.randint(1, 5)
    n_allocs = rnd.randint(1, n_layers)
    slots = rnd.randint(1, 3)
    placement = [(rnd.randrange(n_allocs), rnd.randrange(slots)) for _ in range(n_layers)]
    planes = 2 if kv_split else 1
    unit = block[0] * block[1] * block[2]
    allocations = [random_bytes(gen, slots * planes * num_blocks * unit, dtype) for _ in range(n_allocs)]

    # Layers overlaying the same bytes get disjoint block ids: no unit is written twice.
    blocks_of: dict[int, list[int]] = {}
    for place in set(placement):
        sharing = [i for i, p in enumerate(placement) if p == place]
        ids = rnd.sample(range(num_blocks), num_blocks)
        for k, layer in enumerate(sharing):
            mine = ids[k::len(sharing)]
            blocks_of[layer] = rnd.sample(mine, rnd.randint(0, len(mine)))
    pairs = [(layer, b) for layer, ids in blocks_of.items() for b in ids]
    rnd.shuffle(pairs)
    extra = 0 if rnd.random() < 0.4 else rnd.randint(0, 5)
    object_rows = rnd.sample(range(len(pairs) + extra), len(pairs))
    if not extra:
        object_rows.sort()  # dense: the object is exactly these rows, in order
    rows = Rows(object_rows, [p[0] for p in pairs], [p[1] for p in pairs])
    payload = random_bytes(gen, (len(pairs) + extra) * planes * unit, dtype)
    payload_offset = rnd.randrange(16) if dtype == torch.uint8 else rnd.randrange(8)
    interleaved = [rnd.random() < 0.5 for _ in range(n_allocs)]
    return Case(dtype, kv_split, block, num_blocks, slots, interleaved, placement, allocations,
                rows, payload, payload_offset)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def oracle(case: Case, direction: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(allocations, payload) after the torch path's copy."""
    allocations = [a.clone() for a in case.allocations]
    payload = case.payload.clone()
    getattr(copy_ops, direction)(case.paged(allocations), case.rows, payload)
    return allocations, payload


def memmove_units(src: torch.Tensor, dst: torch.Tensor, unit_bytes: int) -> None:
    for s, d in zip(src.tolist(), dst.tolist()):
        ctypes.memmove(d, s, unit_bytes)


# --- no GPU needed ---------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles(arch):
    cuda_copy.compile_check(arch)


def test_compile_check_reports_nvcc_errors():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    with pytest.raises(RuntimeError, match="sm_0"):
        cuda_copy.compile_check("sm_0")


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", SEEDS)
def test_unit_addresses_copy_what_torch_copies(seed, direction):
    case = make_case(seed)
    want_allocations, want_payload = oracle(case, direction)

    allocations = [a.clone() for a in case.allocations]
    paged = case.paged(allocations)
    payload = case.payload_on("cpu")
    paged_side, object_side, unit_bytes = cuda_copy.unit_addresses(paged, case.rows, payload)
    assert unit_bytes == paged.unit_elems * payload.element_size()
    assert len(paged_side) == len(object_side) == len(case.rows) * paged.planes
    if direction == "gather":
        memmove_units(paged_side, object_side, unit_bytes)
    else:
        memmove_units(object_side, paged_side, unit_bytes)

    assert same_bytes(payload, want_payload)
    assert all(same_bytes(a, b) for a, b in zip(allocations, want_allocations))


def test_cases_cover_what_they_should():
    cases = [make_case(s) for s in SEEDS]
    assert {c.dtype for c in cases} == set(DTYPES)
    assert {c.kv_split for c in cases} == {True, False}
    assert any(len(c.allocations) > 1 for c in cases)
    assert any(len(set(c.placement)) < len(c.placement) for c in cases)  # overlaid layers
    assert any(c.rows.object_rows != list(range(len(c.rows))) for c in cases)
    assert any(c.rows.object_rows == list(range(len(c.rows))) and len(c.rows) for c in cases)
    words = set()
    for c in cases:
        payload = c.payload_on("cpu")
        unit_bytes = c.paged(c.allocations).unit_elems * payload.element_size()
        words.add(cuda_copy.word_bytes(unit_bytes, payload.data_ptr()))
    assert words == {1, 2, 4, 8, 16}


def test_word_bytes():
    assert cuda_copy.word_bytes(64 * 1024, 0x7F0000000000, 0x10) == 16
    assert cuda_copy.word_bytes(64 * 1024, 0x7F0000000008) == 8
    assert cuda_copy.word_bytes(6, 0x1000) == 2  # 3 fp16 elements
    assert cuda_copy.word_bytes(12, 0x1000, 0x2000) == 4
    assert cuda_copy.word_bytes(16, 0x1001) == 1
    assert cuda_copy.word_bytes(5) == 1


def test_unit_addresses_validate_the_payload():
    cases = (make_case(s, dtype=torch.float16, block=(2, 4, 8)) for s in range(100))
    case = next(c for c in cases if len(c.rows))
    paged = case.paged(case.allocations)
    with pytest.raises(ValueError, match="dtype"):
        cuda_copy.unit_addresses(paged, case.rows, case.payload.float())
    with pytest.raises(ValueError, match="contiguous"):
        cuda_copy.unit_addresses(paged, case.rows, case.payload.repeat(2)[::2])
    with pytest.raises(ValueError, match="whole number of units"):
        cuda_copy.unit_addresses(paged, case.rows, case.payload[1:])
    with pytest.raises(ValueError, match="holds"):
        cuda_copy.unit_addresses(paged, case.rows, case.payload[:0])
    far = Rows(case.rows.object_rows, case.rows.layer_indices, [10**6] * len(case.rows))
    with pytest.raises(ValueError, match="outside"):
        cuda_copy.unit_addresses(paged, far, case.payload)
    empty = cuda_copy.unit_addresses(paged, Rows([], [], []), case.payload)
    assert len(empty[0]) == len(empty[1]) == 0


def test_cuda_copy_refuses_a_cpu_paged_kv():
    case = make_case(5)
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_copy.gather(case.paged(case.allocations), case.rows, case.payload)


# --- GPU ----------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")


def run_on_gpu(case: Case, direction: str, where: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(allocations, payload) after the CUDA path's copy, via copy_ops' dispatch."""
    allocations = [a.cuda() for a in case.allocations]
    payload = case.payload_on(where)
    getattr(copy_ops, direction)(case.paged(allocations), case.rows, payload)
    return allocations, payload  # no explicit synchronisation: the contract provides it


@gpu
@pytest.mark.parametrize("where", ["pinned", "cuda"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_copy_matches_torch_path(seed, direction, where):
    want_allocations, want_payload = oracle(make_case(seed), direction)
    allocations, payload = run_on_gpu(make_case(seed), direction, where)
    assert same_bytes(payload, want_payload)
    assert all(same_bytes(a, b) for a, b in zip(allocations, want_allocations))


@gpu
@pytest.mark.parametrize("where", ["pinned", "cuda"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("shape", ["large units", "many units"])
def test_gpu_copy_at_size(shape, direction, where):
    # 64 KiB units (uint4 path, several unrolled rounds), or more units than CTAs.
    kw = dict(num_blocks=64, block=(16, 16, 128), dtype=torch.bfloat16) if shape == "large units" \
        else dict(num_blocks=6000, block=(1, 4, 8), dtype=torch.float32)
    case = make_case(7, **kw)
    assert len(case.rows) * (2 if case.kv_split else 1) > (64 if shape == "large units" else 4000)
    want_allocations, want_payload = oracle(case, direction)
    allocations, payload = run_on_gpu(make_case(7, **kw), direction, where)
    assert same_bytes(payload, want_payload)
    assert all(same_bytes(a, b) for a, b in zip(allocations, want_allocations))


@gpu
def test_gpu_copy_refuses_pageable_payload():
    case = make_case(11)
    allocations = [a.cuda() for a in case.allocations]
    with pytest.raises(ValueError, match="pinned"):
        cuda_copy.gather(case.paged(allocations), case.rows, case.payload)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_copy_refuses_payload_on_another_device():
    case = make_case(12)
    allocations = [a.cuda(0) for a in case.allocations]
    with pytest.raises(ValueError, match="cuda:1"):
        cuda_copy.gather(case.paged(allocations), case.rows, case.payload.cuda(1))
