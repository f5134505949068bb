"""GPU benchmark: gather/scatter of chunks between paged KV and pinned host memory.

Shapes of gemma-3-27b's full-attention layers: 10 layers, 16 KV heads, head
size 128, block size 16, bf16; 256-token chunks (16 blocks per layer), random
non-contiguous block ids. One call per chunk (``gather``/``scatter``), or one
call for all chunks (``gather_many``/``scatter_many``: one plan, one launch); each
call returns when its copy is done, so a repeat is timed with CUDA events
on the current stream around all its calls (Python and sync overhead included).
Baseline: a plain pinned memcpy of the same bytes (``copy_`` of a contiguous
device tensor to pinned host and back). Prints a table and a last line
``GPU_COPY {json}``.

    python benchmarks/bench_gpu_copy.py [--chunks 64] [--repeats 7]

Runs where only torch (CUDA build) is installed: ``_common`` imports no vLLM or LMCache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CHUNK, HEAD_SIZE, HEADS, LAYERS, bench_main, chunk_rows, median_times, paged_full_attention,
    random_chunks, say, table,
)
from lmcache_hma.kv_copy import copy_ops  # noqa: E402

BLOCK = 16


class CudaTimer:
    """``Timer`` with CUDA events on the current stream: ``t.s`` once the work is done."""

    def __enter__(self):
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record()
        return self

    def __exit__(self, *exc) -> None:
        self._end.record()
        self._end.synchronize()
        self.s = self._start.elapsed_time(self._end) / 1e3


def bench(layout: str, chunks: int, repeats: int) -> dict[str, float]:
    paged, _ = paged_full_attention(layout, BLOCK, chunks, one_allocation=False, device="cuda")
    rows = [chunk_rows(b) for b in random_chunks(BLOCK, chunks)]
    chunk_elems = LAYERS * (CHUNK // BLOCK) * paged.planes * paged.unit_elems
    staging = torch.empty(chunks * chunk_elems, dtype=paged.dtype, pin_memory=True)
    payloads = [staging[c * chunk_elems:(c + 1) * chunk_elems] for c in range(chunks)]
    nbytes = staging.numel() * staging.element_size()

    def gather():
        for r, p in zip(rows, payloads):
            copy_ops.gather(paged, r, p)

    def scatter():
        for r, p in zip(rows, payloads):
            copy_ops.scatter(paged, r, p)

    items = list(zip(rows, payloads))

    for how in (gather, lambda: copy_ops.gather_many(paged, items)):  # the last chunk vs index_select
        staging.zero_()
        how()
        obj = paged.object_view(payloads[-1])
        for ix in paged.index(rows[-1]):
            want = paged.storages[ix.storage].index_select(0, ix.paged_units.cuda()).cpu()
            assert torch.equal(obj[ix.object_units], want), "gather copied the wrong bytes"

    device_buf = torch.empty_like(staging, device="cuda")
    seconds = median_times({
        "gather": gather, "scatter": scatter,
        "gather_many": lambda: copy_ops.gather_many(paged, items),
        "scatter_many": lambda: copy_ops.scatter_many(paged, items),
        "memcpy_d2h": lambda: staging.copy_(device_buf, non_blocking=True),
        "memcpy_h2d": lambda: device_buf.copy_(staging, non_blocking=True),
    }, repeats, timer=CudaTimer)
    return {k: nbytes / t / 1e9 for k, t in seconds.items()} | {"bytes": nbytes}


def run(chunks: int = 64, repeats: int = 7) -> dict:
    say(f"{torch.cuda.get_device_name()}: {LAYERS} layers x {HEADS} heads x {HEAD_SIZE}, block "
        f"{BLOCK}, bf16, {chunks} chunks of {CHUNK} tokens, median of {repeats}")
    res = {}
    for layout in ("kv_split", "block_major"):
        res[layout] = bench(layout, chunks, repeats)
        torch.cuda.empty_cache()  # the first layout's tensors, freed on return
    r = res["kv_split"]  # the headline: FlashAttention's layout on a GPU
    summary = {
        "gather_gbps": r["gather"], "scatter_gbps": r["scatter"],
        "memcpy_d2h_gbps": r["memcpy_d2h"], "memcpy_h2d_gbps": r["memcpy_h2d"],
        "gather_vs_memcpy": r["gather"] / r["memcpy_d2h"],
        "scatter_vs_memcpy": r["scatter"] / r["memcpy_h2d"],
        "gather_many_gbps": r["gather_many"], "scatter_many_gbps": r["scatter_many"],
        "gather_many_vs_memcpy": r["gather_many"] / r["memcpy_d2h"],
        "scatter_many_vs_memcpy": r["scatter_many"] / r["memcpy_h2d"],
        "block_major_gather_gbps": res["block_major"]["gather"],
        "block_major_scatter_gbps": res["block_major"]["scatter"],
        "chunks": chunks, "bytes": r["bytes"],
    }
    summary = {k: round(v, 3) for k, v in summary.items()}
    summary["table"] = table(
        ["layout", "MiB", "gather", "scatter", "gather_many", "scatter_many", "d2h", "h2d"],
        [[name, x["bytes"] / 2**20, x["gather"], x["scatter"], x["gather_many"], x["scatter_many"],
          x["memcpy_d2h"], x["memcpy_h2d"]] for name, x in res.items()])
    return summary


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gpu_copy: no CUDA device; nothing to measure")
        return 0
    return bench_main(__doc__, run, "GPU_COPY", quick=None, tables=[("table", "GB/s:")], options=[
        ("--chunks", dict(type=int, default=64)), ("--repeats", dict(type=int, default=7))])


if __name__ == "__main__":
    sys.exit(main())
