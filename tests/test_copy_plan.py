"""The GPU path's host half (``copy_plan``, ``cuda_copy.copy_many``) against the torch path.

The CUDA executor and ``copy_plan.HostEmulation`` share everything but the last step:
the plan (registration's addresses, the batch's rows, the bounds checks, the word) and
its packed table. The emulation copies by the kernel's contract on CPU tensors, so these
tests prove every byte the kernel would be told to move, without a GPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmcache_hma.kv_copy import copy_ops, copy_plan, cuda_copy
from lmcache_hma.core.layout import Rows
from tests.test_cuda_copy import make_case, same_bytes

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
SEEDS = range(24)


def split_items(case, seed: int, device: str = "cpu") -> list[tuple[Rows, torch.Tensor]]:
    """The case's rows cut into 1-4 objects, each with its own copy of the payload placed at
    its own offset into a fresh buffer (``device``: "cpu", "pinned" or "cuda")."""
    rnd = random.Random(seed)
    n = len(case.rows)
    cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(0, 3)))) if n > 1 else []
    items = []
    for lo, hi in zip([0] + cuts, cuts + [n]):
        rows = Rows(case.rows.object_rows[lo:hi], case.rows.layer_indices[lo:hi], case.rows.block_ids[lo:hi])
        offset = rnd.randrange(17 if case.dtype in (torch.uint8, torch.float8_e4m3fn) else 9)
        buf = torch.zeros(offset + case.payload.numel(), dtype=case.dtype)
        buf = buf.pin_memory() if device == "pinned" else buf.to(device)
        payload = buf[offset:]
        payload.copy_(case.payload.to(device) if device == "cuda" else case.payload)
        items.append((rows, payload))
    return items


def run_batch(case, seed: int, direction: str, how: str):
    """(allocations, payloads) after copying the case's items, by ``how``: "oracle" (one torch
    call per item) or "emulation" (one plan for the batch, run by HostEmulation)."""
    allocations = [a.clone() for a in case.allocations]
    paged = case.paged(allocations)
    items = split_items(case, seed)
    if how == "oracle":
        for rows, payload in items:
            getattr(copy_ops, direction)(paged, rows, payload)
    else:
        cuda_copy.copy_many(paged, items, to_payload=direction == "gather",
                            executor=copy_plan.HostEmulation())
    return allocations, [p for _, p in items]


def assert_same(got, want):
    (got_alloc, got_payloads), (want_alloc, want_payloads) = got, want
    assert all(same_bytes(a, b) for a, b in zip(got_alloc, want_alloc))
    assert all(same_bytes(a, b) for a, b in zip(got_payloads, want_payloads))


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", SEEDS)
def test_batch_plan_copies_what_torch_copies(seed, direction):
    case = make_case(100 + seed, dtype=DTYPES[seed % len(DTYPES)])
    assert_same(run_batch(case, seed, direction, "emulation"), run_batch(case, seed, direction, "oracle"))


def test_cases_cover_what_they_should():
    cases = [make_case(100 + s, dtype=DTYPES[s % len(DTYPES)]) for s in SEEDS]
    assert {c.dtype for c in cases} == set(DTYPES)
    assert {c.kv_split for c in cases} == {True, False}  # FlashAttention's [2, blocks, ...] too
    assert any(len(c.allocations) > 1 for c in cases)
    assert any(len(set(c.placement)) < len(c.placement) for c in cases)  # layers alias bytes
    assert sum(len(split_items(c, s)) > 1 for s, c in zip(SEEDS, cases)) >= len(cases) // 2


@pytest.mark.parametrize("seed", range(8))
def test_plan_word_is_the_widest_every_address_allows(seed):
    case = make_case(200 + seed)
    paged = case.paged(case.allocations)
    items = split_items(case, seed)
    plan = copy_plan.build(paged, items, True, lambda p: p.data_ptr())
    want = cuda_copy.word_bytes(paged.unit_bytes, *(p.data_ptr() for _, p in items),
                                *(s.data_ptr() for s in paged.storages))
    assert plan.word == want
    assert len(plan) == sum(len(r) for r, _ in items) * paged.planes


@pytest.mark.parametrize("seed", range(8))
def test_layer_addresses_are_where_the_torch_path_reads(seed):
    case = make_case(300 + seed)
    paged = case.paged(case.allocations)
    for layer in range(len(case.names)):
        for block in (0, paged.num_blocks - 1):
            (ix,) = paged.index(Rows([0], [layer], [block]))
            storage = paged.storages[ix.storage]
            want = [storage.data_ptr() + u * paged.unit_bytes for u in ix.paged_units.tolist()]
            base = paged.layer_address[layer] + block * paged.block_stride_bytes[layer]
            assert [base + p * paged.plane_stride_bytes[layer] for p in range(paged.planes)] == want


# --- validation ----------------------------------------------------------------


def _valid_case():
    case = next(c for c in (make_case(s, dtype=torch.float16) for s in range(100)) if len(c.rows) > 1)
    return case, case.paged(case.allocations)


@pytest.mark.parametrize("field, value, match", [
    ("block_ids", 10**6, "outside the KV cache"),
    ("block_ids", -1, "outside the KV cache"),
    ("block_ids", "num_blocks", "outside the KV cache"),
    ("layer_indices", -1, "not one of the"),
    ("layer_indices", 99, "not one of the"),
    ("object_rows", -1, "payload holds"),
    ("object_rows", 10**4, "payload holds"),
    ("block_ids", 2**70, "64-bit"),
])
def test_plan_refuses_rows_out_of_range_and_copies_nothing(field, value, match):
    case, paged = _valid_case()
    before = [a.clone() for a in case.allocations]
    bad = {f: list(getattr(case.rows, f)) for f in ("object_rows", "layer_indices", "block_ids")}
    bad[field][-1] = paged.num_blocks if value == "num_blocks" else value
    good_payload = case.payload.clone()
    items = [(case.rows, good_payload), (Rows(**bad), case.payload.clone())]
    with pytest.raises(ValueError, match=match):
        cuda_copy.copy_many(paged, items, to_payload=False, executor=copy_plan.HostEmulation())
    assert all(same_bytes(a, b) for a, b in zip(case.allocations, before))  # not even the good item


def test_plan_refuses_payloads_that_do_not_fit():
    case, paged = _valid_case()
    run = lambda payload: cuda_copy.copy_many(  # noqa: E731
        paged, [(case.rows, payload)], to_payload=True, executor=copy_plan.HostEmulation())
    with pytest.raises(ValueError, match="dtype"):
        run(case.payload.float())
    with pytest.raises(ValueError, match="contiguous"):
        run(case.payload.repeat(2)[::2])
    with pytest.raises(ValueError, match="whole number of units"):
        run(case.payload[1:])
    with pytest.raises(ValueError, match="payload holds"):
        run(case.payload[:0])
    with pytest.raises(ValueError, match="different|differ in number"):
        cuda_copy.copy_many(paged, [(Rows([0, 1], [0], [1]), case.payload)], True,
                            executor=copy_plan.HostEmulation())


def test_emulated_kernel_refuses_misaligned_addresses():
    table = np.array([16, 32], dtype=np.int64)
    with pytest.raises(AssertionError, match="word"):
        copy_plan.copy_units(table + 2, 1, 64, 16)
    with pytest.raises(AssertionError, match="word"):
        copy_plan.copy_units(table, 1, 6, 4)


def test_an_empty_batch_copies_nothing():
    case, paged = _valid_case()
    cuda_copy.copy_many(paged, [], to_payload=True, executor=copy_plan.HostEmulation())
    cuda_copy.copy_many(paged, [(Rows([], [], []), case.payload)], to_payload=True,
                        executor=copy_plan.HostEmulation())


# --- copy_ops' batch API on CPU ---------------------------------------------------


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_copy_ops_many_is_one_call_per_item(direction):
    case = make_case(7, dtype=torch.bfloat16)
    want = run_batch(case, 7, direction, "oracle")
    allocations = [a.clone() for a in case.allocations]
    items = split_items(case, 7)
    getattr(copy_ops, f"{direction}_many")(case.paged(allocations), items, after=None)
    assert_same((allocations, [p for _, p in items]), want)


def test_ready_marker_is_none_on_cpu_and_after_none_is_accepted():
    case = make_case(9)
    paged = case.paged([a.clone() for a in case.allocations])
    marker = copy_ops.ready_marker(paged)
    assert marker is None
    copy_ops.gather(paged, case.rows, case.payload.clone(), after=marker)
    copy_ops.scatter(paged, case.rows, case.payload.clone(), after=marker)


@pytest.mark.parametrize("seed", range(6))
def test_probe_passes_on_cpu_and_leaves_the_kv_as_it_was(seed):
    case = make_case(seed)
    allocations = [a.clone() for a in case.allocations]
    assert copy_ops.probe(case.paged(allocations)) is None
    assert all(same_bytes(a, b) for a, b in zip(allocations, case.allocations))


def test_probe_reports_a_copy_that_goes_wrong(monkeypatch):
    case = make_case(4)
    paged = case.paged([a.clone() for a in case.allocations])

    def broken(paged, rows, payload):
        payload.view(torch.uint8).fill_(7)

    monkeypatch.setattr(copy_ops, "_gather_cpu", broken)
    reason = copy_ops.probe(paged)
    assert reason and "\n" not in reason and "did not copy" in reason

    def raising(paged, rows, payload):
        raise RuntimeError("no\nway")

    monkeypatch.setattr(copy_ops, "_gather_cpu", raising)
    reason = copy_ops.probe(paged)
    assert reason and "\n" not in reason and "RuntimeError" in reason


def test_the_cuda_path_refuses_a_cpu_paged_kv_without_an_executor():
    case = make_case(4)
    paged = case.paged(case.allocations)
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_copy.copy_many(paged, [(case.rows, case.payload)], True)
    reason = cuda_copy.probe(paged)
    assert reason and "\n" not in reason


# --- GPU: the kernel runs the same plans ------------------------------------------

HAS_GPU = torch.cuda.is_available()


def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")(fn))


def gpu_items(case, seed: int, where: str):
    """``split_items`` with payloads pinned, on the device, or alternating ("mixed")."""
    items = split_items(case, seed, "pinned" if where != "cuda" else "cuda")
    if where == "mixed":
        items = [(r, p.cuda() if i % 2 else p) for i, (r, p) in enumerate(items)]
    return items


@gpu
@pytest.mark.parametrize("where", ["pinned", "cuda", "mixed"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kernel_runs_the_batch_as_the_emulation_does(seed, direction, where):
    case = make_case(100 + seed, dtype=DTYPES[seed % len(DTYPES)])
    want = run_batch(case, seed, direction, "emulation")
    assert_same(want, run_batch(case, seed, direction, "oracle"))
    allocations = [a.cuda() for a in case.allocations]
    items = gpu_items(case, seed, where)
    getattr(copy_ops, f"{direction}_many")(case.paged(allocations), items)  # returns when done
    assert_same((allocations, [p for _, p in items]), want)


@gpu
def test_kernel_path_refuses_out_of_range_rows_and_copies_nothing():
    case, _ = _valid_case()
    allocations = [a.cuda() for a in case.allocations]
    paged = case.paged(allocations)
    bad = Rows(case.rows.object_rows, case.rows.layer_indices, [paged.num_blocks] * len(case.rows))
    items = [(case.rows, case.payload.pin_memory()), (bad, case.payload.pin_memory())]
    with pytest.raises(ValueError, match="outside the KV cache"):
        copy_ops.scatter_many(paged, items)
    assert all(same_bytes(a, b) for a, b in zip(allocations, case.allocations))


def _forward_then_gather(after_marker: bool):
    """The step's thread writes the KV on its stream (slowly: the GPU sleeps first) and takes
    a marker; another thread gathers. Returns (payloads gathered, payloads wanted)."""
    from concurrent.futures import ThreadPoolExecutor

    case = next(c for c in (make_case(s, num_blocks=64, block=(8, 16, 64), dtype=torch.bfloat16)
                            for s in range(13, 100)) if len(c.rows) > 8)
    written = [torch.randint_like(a, 0, 100) for a in case.allocations]  # what the forward writes
    want = split_items(case, 13)
    for rows, p in want:
        copy_ops.gather(case.paged([w.clone() for w in written]), rows, p)
    allocations = [a.cuda() for a in case.allocations]
    written = [w.cuda() for w in written]
    paged = case.paged(allocations)
    items = gpu_items(case, 13, "pinned")
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(500_000_000)  # some 0.2 s of GPU clock before the forward writes
        for a, w in zip(allocations, written):
            a.copy_(w)
        marker = copy_ops.ready_marker(paged)
    assert marker is not None
    with ThreadPoolExecutor(1) as gather_thread:  # its current stream is not ``forward``
        gather_thread.submit(copy_ops.gather_many, paged, items, marker if after_marker else None).result()
    torch.cuda.synchronize()
    return [p for _, p in items], [p for _, p in want]


@gpu
def test_a_gather_on_another_thread_waits_for_the_forward_stream_marker():
    got, want = _forward_then_gather(after_marker=True)
    assert all(same_bytes(g, w) for g, w in zip(got, want))


@gpu
def test_without_the_marker_another_thread_reads_before_the_forward_wrote():
    """The control: the bug the marker fixes is visible to the test above."""
    got, want = _forward_then_gather(after_marker=False)
    assert not all(same_bytes(g, w) for g, w in zip(got, want))


@gpu
def test_probe_passes_on_the_gpu_and_leaves_the_kv_as_it_was():
    case = make_case(6)
    allocations = [a.cuda() for a in case.allocations]
    assert copy_ops.probe(case.paged(allocations)) is None
    assert all(same_bytes(a, b) for a, b in zip(allocations, case.allocations))
