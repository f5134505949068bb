"""The CUDA executor's host side, with torch.cuda and the launch faked on CPU memory.

What a GPU would do is stood in for: streams and events record what waits for what,
"pinned" and "device" tables are CPU tensors, and the launch runs the host emulation
of the kernel on the table the executor transferred. So the executor's own code (its
tables, their transfer, which stream waits for which event, the launch's arguments)
runs here; the kernel itself is tested on a GPU (``test_copy_plan.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from lmcache_hma.kv_copy import copy_ops, copy_plan, cuda_copy
from tests.test_copy_plan import assert_same, run_batch, split_items
from tests.test_cuda_copy import make_case


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.recorded_on = None
        self.synchronized = False

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        self.synchronized = True


class FakeStream:
    def __init__(self, name="copy", device=None):
        self.name, self.cuda_stream = name, 0
        self.waited: list = []

    def wait_event(self, event):
        self.waited.append(("event", event))

    def wait_stream(self, stream):
        self.waited.append(("stream", stream))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda faked on CPU memory; yields (the calling thread's current stream, launches)."""
    current, launches, real_empty = FakeStream("current"), [], torch.empty
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)

    def empty(*shape, pin_memory=False, device=None, **kw):
        return real_empty(*shape, **kw)  # "pinned" and "device" tables: plain CPU memory

    def launch(dev, cupy_stream, src, dst, n_units, unit_bytes, word):
        import numpy as np

        table = np.concatenate([np.frombuffer((ctypes_buf(src, n_units)), dtype=np.int64),
                                np.frombuffer((ctypes_buf(dst, n_units)), dtype=np.int64)])
        copy_plan.copy_units(table, n_units, unit_bytes, word)
        launches.append((n_units, unit_bytes, word))

    monkeypatch.setattr(cuda_copy.torch, "empty", empty)
    monkeypatch.setattr(cuda_copy, "_launch", launch)
    monkeypatch.setattr(cuda_copy, "_uva_address", lambda ptr, dev: ptr)
    yield current, launches


def ctypes_buf(address: int, n: int):
    import ctypes

    return (ctypes.c_int64 * n).from_address(address)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", range(8))
def test_executor_transfers_the_table_and_launches_once(fake_cuda, seed, direction):
    current, launches = fake_cuda
    case = make_case(100 + seed)
    want = run_batch(case, seed, direction, "oracle")
    allocations = [a.clone() for a in case.allocations]
    items = split_items(case, seed)
    executor = cuda_copy.CudaExecutor(0)
    cuda_copy.copy_many(case.paged(allocations), items, direction == "gather", executor=executor)
    assert_same((allocations, [p for _, p in items]), want)
    assert len(launches) == (1 if any(len(r) for r, _ in items) else 0)
    if launches:
        assert executor.stream.waited == [("stream", current)]  # no marker: the caller's stream
        if direction == "scatter":  # the forward that follows waits for the load
            (kind, done), = current.waited
            assert kind == "event" and done.recorded_on is executor.stream and done.synchronized


def test_executor_waits_for_the_marker_not_the_current_stream(fake_cuda):
    current, launches = fake_cuda
    case = next(c for c in map(make_case, range(100, 200)) if len(c.rows))
    executor = cuda_copy.CudaExecutor(0)
    marker = FakeEvent()
    cuda_copy.copy_many(case.paged(case.allocations), [(case.rows, case.payload.clone())], True,
                        after=marker, executor=executor)
    assert executor.stream.waited == [("event", marker)] and current.waited == []


def test_executor_tables_grow_and_are_reused(fake_cuda):
    _, launches = fake_cuda
    executor = cuda_copy.CudaExecutor(0)
    small = executor.staging(10)
    assert executor.staging(500).host is small.host  # 1024 entries hold 512 units
    assert executor.staging(513).host.numel() >= 2 * 513


def test_executor_refuses_payloads_it_cannot_reach(fake_cuda, monkeypatch):
    executor = cuda_copy.CudaExecutor(0)
    case = make_case(3)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    with pytest.raises(ValueError, match="pinned"):
        executor.payload_address(case.payload)


def test_ready_marker_records_on_the_current_stream(fake_cuda):
    current, _ = fake_cuda
    case = make_case(3)
    paged = case.paged(case.allocations)
    paged.device = torch.device("cuda", 0)  # what the marker looks at
    marker = copy_ops.ready_marker(paged)
    assert isinstance(marker, FakeEvent) and marker.recorded_on is current


def test_each_thread_has_its_own_tables(fake_cuda):
    from concurrent.futures import ThreadPoolExecutor

    executor = cuda_copy.CudaExecutor(0)
    mine = executor.staging(10).host
    with ThreadPoolExecutor(1) as other:
        theirs = other.submit(lambda: executor.staging(10).host).result()
    assert theirs is not mine and theirs.data_ptr() != mine.data_ptr()
