"""CUDA block copies between vLLM's paged KV (on a GPU) and an object's payload.

Runs in the vLLM worker process, called by ``copy_ops`` (``gather``, ``scatter``,
their batches, state copies) when the KV caches are on a CUDA device; same
semantics as the torch path there (the oracle). The payload (LMCache's staging
buffer) is pinned host memory or a tensor on the same device as the KV caches.

A batch of copies (``gather_many`` / ``scatter_many``: every object of a step, or of
a load) is planned on the host by ``copy_plan`` from ``PagedKV``'s per-layer
addresses, sent to the GPU as one address table in one asynchronous transfer from
pinned memory, and copied by one kernel launch (``kernels/copy_units.cu``): unit
``i`` from ``src[i]`` to ``dst[i]``. Pinned host memory is read or written by the
kernel itself through UVA (zero-copy), so no device-side staging buffer is involved.

Synchronisation: copies run on a dedicated stream per device. It first waits for
``after``, an event from ``ready_marker`` recorded on the stream the forward pass
used, or else for the calling thread's current stream (right only when the caller
is the thread that ran the forward). ``gather*`` return once the copy has
finished: the host may read the payload (LMCache stores it). ``scatter*`` make the
calling thread's current stream wait for the copy (the forward pass reads the KV)
and also return once it has finished: the load is complete and the payload may be
reused.

CuPy is imported lazily: this module imports on machines without CUDA.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from lmcache_hma.kv_copy import copy_plan
from lmcache_hma.kv_copy.copy_plan import Item, Plan
from lmcache_hma.core.layout import Rows
from lmcache_hma.kv_copy.paged_kv import PagedKV
from lmcache_hma.kv_copy.state_kv import StateKV

_KERNEL_FILE = Path(__file__).with_name("kernels") / "copy_units.cu"
_WORD_BYTES = (16, 8, 4, 2, 1)  # kernels copy_units_<W> of copy_units.cu
_UNROLL = 4  # words in flight per thread, as in copy_units.cu
_MAX_THREADS = 256
_CTAS_PER_SM = 8


def kernel_source_path() -> Path:
    return _KERNEL_FILE


def compile_check(arch: str) -> None:
    """Compile ``copy_units.cu`` with the local nvcc for ``arch`` (e.g. ``sm_90``)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-o", f"{tmp}/copy_units.cubin",
               str(_KERNEL_FILE)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


def word_bytes(unit_bytes: int, *addresses: int) -> int:
    """Widest word (16, 8, 4, 2 or 1 bytes) dividing ``unit_bytes`` and every address."""
    return next(w for w in _WORD_BYTES if unit_bytes % w == 0 and all(a % w == 0 for a in addresses))


def unit_addresses(
    paged: PagedKV,
    rows: Rows,
    payload: torch.Tensor,
    device: torch.device | str | None = None,
    payload_address: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Byte addresses of every unit of ``rows``: ``(paged_side, object_side, unit_bytes)``.

    One object at a time, in torch: the per-call planning the batch path (``copy_plan``)
    replaced; kept as its baseline in ``benchmarks/bench_gpu_plan.py``.

    Unit ``i`` is ``unit_bytes`` bytes at ``paged_side[i]`` in paged KV and at
    ``object_side[i]`` in ``payload``: gather copies paged -> object, scatter the
    reverse. Both are int64 tensors on ``device`` (default: the paged KV's).
    ``payload_address`` is the payload's address as the copying device sees it
    (default ``payload.data_ptr()``). Pure arithmetic, on any device; validates
    the payload against ``rows`` and raises ValueError.
    """
    unit_bytes = paged.unit_elems * paged.storages[0].element_size()
    if payload.dtype != paged.dtype:
        raise ValueError(f"payload dtype {payload.dtype} differs from the KV cache dtype {paged.dtype}")
    if not payload.is_contiguous():
        raise ValueError(f"payload of shape {tuple(payload.shape)} is not contiguous")
    if payload.numel() % paged.unit_elems:
        raise ValueError(
            f"payload of {payload.numel()} elements is not a whole number of units of "
            f"{paged.unit_elems} elements ({unit_bytes} bytes)"
        )
    device = paged.device if device is None else torch.device(device)
    index = paged.index(rows)
    if not index:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, unit_bytes
    payload_units = payload.numel() // paged.unit_elems
    for ix in index:
        n_units = paged.storages[ix.storage].shape[0]
        if int(ix.paged_units.min()) < 0 or int(ix.paged_units.max()) >= n_units:
            raise ValueError(f"block ids of rows lie outside their paged KV allocation ({n_units} units)")
        if int(ix.object_units.max()) >= payload_units:
            raise ValueError(
                f"rows need payload unit {int(ix.object_units.max())} but the payload holds "
                f"{payload_units} units ({payload.numel()} elements)"
            )
    counts = torch.tensor([len(ix.paged_units) for ix in index])
    bases = torch.tensor([paged.storages[ix.storage].data_ptr() for ix in index], dtype=torch.int64)
    host = torch.stack([
        torch.cat([ix.paged_units for ix in index]),
        bases.repeat_interleave(counts),
        torch.cat([ix.object_units for ix in index]),
    ])
    paged_units, paged_bases, object_units = host.to(device).unbind(0)  # one copy to the device
    if payload_address is None:
        payload_address = payload.data_ptr()
    return paged_units * unit_bytes + paged_bases, object_units * unit_bytes + payload_address, unit_bytes



def gather(paged: PagedKV, rows: Rows, payload: torch.Tensor, after=None) -> None:
    """Copy the blocks named by ``rows`` from paged KV into ``payload``; returns when done."""
    copy_many(paged, [(rows, payload)], to_payload=True, after=after)


def scatter(paged: PagedKV, rows: Rows, payload: torch.Tensor, after=None) -> None:
    """Copy the rows of ``payload`` named by ``rows`` into paged KV; returns when done."""
    copy_many(paged, [(rows, payload)], to_payload=False, after=after)


def copy_many(paged: PagedKV, items: Sequence[Item], to_payload: bool, after=None,
              executor=None) -> None:
    """Every ``(rows, payload)`` of ``items`` in one plan, one transfer and one launch.

    ``executor``: who runs the plan; default the CUDA executor of the paged KV's device.
    ``copy_plan.HostEmulation()`` runs the same plan on CPU tensors (tests, benchmarks).
    """
    if executor is None:
        executor = _executor(_device_index(paged.device))
    plan = copy_plan.build(paged, items, to_payload, executor.payload_address)
    if len(plan):
        executor.execute(plan, to_payload, after)


def copy_states_many(state: StateKV, items: Sequence[tuple[Sequence[int], torch.Tensor]],
                     to_payload: bool, after=None, executor=None) -> None:
    """Every ``(blocks, payload)`` state copy of ``items`` in one plan, one transfer, one launch."""
    if executor is None:
        executor = _executor(_device_index(state.device))
    plan = copy_plan.build_states(state, items, to_payload, executor.payload_address)
    if len(plan):
        executor.execute(plan, to_payload, after)


def ready_marker(paged: PagedKV) -> Optional[torch.cuda.Event]:
    """An event recorded now on the calling thread's current stream of the paged KV's device:
    pass it as ``after`` from another thread so that its copy waits for this stream's work."""
    if paged.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(paged.device))
    return event


def probe(paged: PagedKV) -> Optional[str]:
    """None when CuPy imports, the kernels compile and pinned host memory can be allocated on
    the paged KV's device; else why not, in one line. (``copy_ops.probe`` adds a round trip.)"""
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return _one_line(f"CuPy does not import ({type(exc).__name__}: {exc}); install lmcache_hma[gpu]")
    try:
        dev = _device_index(paged.device)
        _kernels(dev)
        _executor(dev).staging(1)
    except Exception as exc:
        return _one_line(f"the CUDA copy kernels cannot run on {paged.device}: {type(exc).__name__}: {exc}")
    return None


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[:3]) if lines else text


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"cuda_copy needs the paged KV on a CUDA device, not {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


class _Staging(threading.local):
    """One thread's address tables: pinned on the host, and on the device."""

    host: Optional[torch.Tensor] = None
    host_np: Optional[np.ndarray] = None
    device: Optional[torch.Tensor] = None


class CudaExecutor:
    """Runs plans on one CUDA device: one table transfer, one launch, per plan.

    Address tables are per thread (the gather thread and the step's thread copy at the
    same time) and reused: each ``execute`` returns once its copy has finished.
    """

    def __init__(self, dev: int):
        import cupy

        self.dev = dev
        self.stream = torch.cuda.Stream(device=dev)
        self.cupy_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, dev)
        self._staging = _Staging()
        self._uva: dict[int, int] = {}  # pinned allocation -> (device address - host address)

    def payload_address(self, payload: torch.Tensor) -> int:
        """Where the kernel reaches ``payload``: pinned host memory (UVA) or this device."""
        if payload.device.type == "cuda":
            if payload.device != torch.device("cuda", self.dev):
                raise ValueError(f"payload is on {payload.device}, the paged KV on cuda:{self.dev}")
            return payload.data_ptr()
        if payload.device.type == "cpu" and payload.is_pinned():
            base = payload.untyped_storage().data_ptr()
            if base not in self._uva:
                self._uva[base] = _uva_address(base, self.dev) - base
            return payload.data_ptr() + self._uva[base]
        raise ValueError(
            f"payload must be pinned host memory or on cuda:{self.dev}; got "
            f"{'pageable host memory' if payload.device.type == 'cpu' else payload.device}"
        )

    def staging(self, n_units: int) -> _Staging:
        """This thread's tables, grown to hold ``n_units`` units."""
        st = self._staging
        if st.host is None or st.host.numel() < 2 * n_units:
            size = max(1024, 1 << (2 * n_units - 1).bit_length())
            st.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            st.host_np = st.host.numpy()
            with torch.cuda.stream(self.stream):  # allocated for use on the copy stream
                st.device = torch.empty(size, dtype=torch.int64, device=f"cuda:{self.dev}")
        return st

    def execute(self, plan: Plan, to_payload: bool, after: Optional[torch.cuda.Event] = None) -> None:
        n = len(plan)
        st = self.staging(n)
        plan.pack(st.host_np)
        current = torch.cuda.current_stream(self.dev)
        with torch.cuda.stream(self.stream):
            st.device[:2 * n].copy_(st.host[:2 * n], non_blocking=True)
            if after is not None:
                self.stream.wait_event(after)
            else:
                self.stream.wait_stream(current)
            table = st.device.data_ptr()
            _launch(self.dev, self.cupy_stream, table, table + 8 * n, n, plan.unit_bytes, plan.word)
            done = torch.cuda.Event()
            done.record(self.stream)
        if not to_payload:
            current.wait_event(done)
        done.synchronize()  # the tables may be reused, the payload read or reused


@functools.lru_cache(maxsize=None)
def _executor(dev: int) -> CudaExecutor:
    return CudaExecutor(dev)


def _launch(dev: int, cupy_stream, src: int, dst: int, n_units: int, unit_bytes: int,
            word: int) -> None:
    """Launch ``copy_units_<word>`` over ``n_units`` units; ``src``, ``dst``: device address tables."""
    import cupy

    rounds = -(-unit_bytes // (word * _UNROLL))  # one thread per UNROLL words, up to a CTA
    threads = min(_MAX_THREADS, max(32, -(-rounds // 32) * 32))
    kernels, sm_count = _kernels(dev)
    grid = min(n_units, sm_count * _CTAS_PER_SM)
    args = (np.uint64(src), np.uint64(dst), np.uint64(n_units), np.uint64(unit_bytes))
    with cupy.cuda.Device(dev), cupy_stream:  # RawKernel launches on CuPy's current stream
        kernels[word]((grid,), (threads,), args)


@functools.lru_cache(maxsize=None)
def _kernels(dev: int):
    """``{word_bytes: kernel}`` compiled for device ``dev``, and its SM count."""
    import cupy

    with cupy.cuda.Device(dev):
        module = cupy.RawModule(code=_KERNEL_FILE.read_text(), options=("-std=c++17",))
        kernels = {w: module.get_function(f"copy_units_{w}") for w in _WORD_BYTES}
    return kernels, torch.cuda.get_device_properties(dev).multi_processor_count


def _uva_address(host_ptr: int, dev: int) -> int:
    """The address at which device ``dev`` reaches pinned host memory at ``host_ptr``."""
    import cupy

    with cupy.cuda.Device(dev):
        address = cupy.cuda.runtime.pointerGetAttributes(host_ptr).devicePointer
    if not address:
        raise ValueError(f"pinned payload at {host_ptr:#x} is not mapped for cuda:{dev}")
    return address
