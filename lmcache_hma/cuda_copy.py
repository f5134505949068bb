"""CUDA block copies between vLLM's paged KV (on a GPU) and an object's payload.

Runs in the vLLM worker process, called by ``copy_ops.gather/scatter`` when the
paged KV is on a CUDA device; same semantics as the torch path there (the oracle).
The payload (LMCache's staging buffer) is pinned host memory or a tensor on the
same device as the paged KV.

Each call is one kernel launch (``kernels/copy_units.cu``): the byte addresses of
all units of the call, in paged KV and in the payload, are computed with torch on
the GPU (``unit_addresses``), and the kernel copies unit ``i`` from ``src[i]`` to
``dst[i]``. Pinned host memory is read or written by the kernel itself through
UVA (zero-copy), so no cudaMemcpy or device-side staging buffer is involved.

Synchronisation: copies run on a dedicated stream per device, which first waits
for the current torch stream (the forward pass wrote the KV, or the payload if
it is on the device). ``gather`` returns once the copy has finished: the host may
read the payload (LMCache stores it). ``scatter`` makes the current stream wait
for the copy (the forward pass reads the KV) and also returns once it has
finished: the load is complete and the payload may be reused.

CuPy is imported lazily: this module imports on machines without CUDA.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lmcache_hma.layout import Rows
from lmcache_hma.paged_kv import PagedKV

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


def gather(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    """Copy the blocks named by ``rows`` from paged KV into ``payload``; returns when done."""
    _copy(paged, rows, payload, to_payload=True)


def scatter(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    """Copy the rows of ``payload`` named by ``rows`` into paged KV; returns when done."""
    _copy(paged, rows, payload, to_payload=False)


def _copy(paged: PagedKV, rows: Rows, payload: torch.Tensor, to_payload: bool) -> None:
    device = paged.device
    if device.type != "cuda":
        raise ValueError(f"cuda_copy needs the paged KV on a CUDA device, not {device}")
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if payload.device.type == "cuda":
        if payload.device != torch.device("cuda", dev):
            raise ValueError(f"payload is on {payload.device}, the paged KV on cuda:{dev}")
        address = payload.data_ptr()
    elif payload.device.type == "cpu" and payload.is_pinned():
        address = _uva_address(payload.data_ptr(), dev)
    else:
        raise ValueError(
            f"payload must be pinned host memory or on cuda:{dev}; got "
            f"{'pageable host memory' if payload.device.type == 'cpu' else payload.device}"
        )
    stream, cupy_stream = _copy_stream(dev)
    current = torch.cuda.current_stream(dev)
    with torch.cuda.stream(stream):
        paged_side, object_side, unit_bytes = unit_addresses(paged, rows, payload, device, address)
        if not len(paged_side):
            return
        src, dst = (paged_side, object_side) if to_payload else (object_side, paged_side)
        word = word_bytes(unit_bytes, address, *(s.data_ptr() for s in paged.storages))
        stream.wait_stream(current)
        _launch(dev, cupy_stream, src, dst, unit_bytes, word)
        done = torch.cuda.Event()
        done.record(stream)
    if not to_payload:
        current.wait_event(done)
    done.synchronize()


def _launch(dev: int, cupy_stream, src: torch.Tensor, dst: torch.Tensor, unit_bytes: int,
            word: int) -> None:
    import cupy
    import numpy as np

    n_units = len(src)
    rounds = -(-unit_bytes // (word * _UNROLL))  # one thread per UNROLL words, up to a CTA
    threads = min(_MAX_THREADS, max(32, -(-rounds // 32) * 32))
    kernels, sm_count = _kernels(dev)
    grid = min(n_units, sm_count * _CTAS_PER_SM)
    args = (np.uint64(src.data_ptr()), np.uint64(dst.data_ptr()), np.uint64(n_units),
            np.uint64(unit_bytes))
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


@functools.lru_cache(maxsize=None)
def _copy_stream(dev: int):
    """The copy stream of device ``dev``, as a torch stream and as a CuPy stream."""
    import cupy

    stream = torch.cuda.Stream(device=dev)
    return stream, cupy.cuda.ExternalStream(stream.cuda_stream, dev)


def _uva_address(host_ptr: int, dev: int) -> int:
    """The address at which device ``dev`` reaches pinned host memory at ``host_ptr``."""
    import cupy

    with cupy.cuda.Device(dev):
        address = cupy.cuda.runtime.pointerGetAttributes(host_ptr).devicePointer
    if not address:
        raise ValueError(f"pinned payload at {host_ptr:#x} is not mapped for cuda:{dev}")
    return address
