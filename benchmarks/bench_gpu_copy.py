"""GPU benchmark: gather/scatter of chunks between paged KV and pinned host memory.

Shapes of gemma-3-27b's full-attention layers: 10 layers, 16 KV heads, head
size 128, block size 16, bf16; 256-token chunks (16 blocks per layer), random
non-contiguous block ids. One call per chunk, as LMCache stores/loads objects;
each call returns when its copy is done, so a repeat is timed with CUDA events
on the current stream around all its calls (Python and sync overhead included).
Baseline: a plain pinned memcpy of the same bytes (``copy_`` of a contiguous
device tensor to pinned host and back). Prints a table and a last line
``GPU_COPY {json}``.

    python benchmarks/bench_gpu_copy.py [--chunks 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache_hma import copy_ops  # noqa: E402
from lmcache_hma.layout import GroupKind, GroupLayout, HybridLayout, Rows  # noqa: E402
from lmcache_hma.paged_kv import PagedKV  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 10, 16, 128, 16, 256
DTYPE = torch.bfloat16


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_paged(kv_split: bool, num_blocks: int) -> PagedKV:
    names = tuple(f"layer.{i}" for i in range(LAYERS))
    block = (BLOCK, HEADS, HEAD_SIZE)
    shape = (2, num_blocks, *block) if kv_split else (num_blocks, 2, *block)  # FlashAttn / FlashInfer
    kv = {n: torch.randn(shape, dtype=DTYPE, device="cuda") for n in names}
    page_bytes = 2 * BLOCK * HEADS * HEAD_SIZE * torch.finfo(DTYPE).bits // 8
    group = GroupLayout(0, GroupKind.FULL, names, block_size=BLOCK, page_bytes=page_bytes)
    layout = HybridLayout((group,), CHUNK)
    return PagedKV(kv, layout, num_blocks)


def chunk_rows(chunks: int, num_blocks: int, seed: int = 0) -> list[Rows]:
    """Rows of each chunk's object (layer, then block), blocks drawn at random."""
    per_chunk = CHUNK // BLOCK
    ids = random.Random(seed).sample(range(1, num_blocks), chunks * per_chunk)
    out = []
    for c in range(chunks):
        blocks = ids[c * per_chunk:(c + 1) * per_chunk]
        pairs = [(layer, b) for layer in range(LAYERS) for b in blocks]
        out.append(Rows(list(range(len(pairs))), [p[0] for p in pairs], [p[1] for p in pairs]))
    return out


def bench(kv_split: bool, chunks: int, repeats: int) -> dict[str, float]:
    num_blocks = 2 * chunks * CHUNK // BLOCK + 1
    paged = make_paged(kv_split, num_blocks)
    rows = chunk_rows(chunks, num_blocks)
    chunk_elems = LAYERS * (CHUNK // BLOCK) * paged.planes * paged.unit_elems
    staging = torch.empty(chunks * chunk_elems, dtype=DTYPE, pin_memory=True)
    payloads = [staging[c * chunk_elems:(c + 1) * chunk_elems] for c in range(chunks)]
    nbytes = staging.numel() * staging.element_size()

    def gather():
        for r, p in zip(rows, payloads):
            copy_ops.gather(paged, r, p)

    def scatter():
        for r, p in zip(rows, payloads):
            copy_ops.scatter(paged, r, p)

    gather()  # check the last chunk against index_select on the device
    obj = paged.object_view(payloads[-1])
    for ix in paged.index(rows[-1]):
        want = paged.storages[ix.storage].index_select(0, ix.paged_units.cuda()).cpu()
        assert torch.equal(obj[ix.object_units], want), "gather copied the wrong bytes"

    device_buf = torch.empty_like(staging, device="cuda")
    results = {
        "gather": timed(gather, repeats),
        "scatter": timed(scatter, repeats),
        "memcpy_d2h": timed(lambda: staging.copy_(device_buf, non_blocking=True), repeats),
        "memcpy_h2d": timed(lambda: device_buf.copy_(staging, non_blocking=True), repeats),
    }
    del paged, device_buf, staging
    torch.cuda.empty_cache()
    return {k: nbytes / t / 1e9 for k, t in results.items()} | {"bytes": nbytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_copy: no CUDA device; nothing to measure")
        return 0
    print(f"{torch.cuda.get_device_name()}: {LAYERS} layers x {HEADS} heads x {HEAD_SIZE}, block "
          f"{BLOCK}, {DTYPE}, {args.chunks} chunks of {CHUNK} tokens, median of {args.repeats}")
    table = {"kv_split": bench(True, args.chunks, args.repeats),
             "block_major": bench(False, args.chunks, args.repeats)}
    print(f"{'layout':<12} {'MiB':>7} {'gather':>8} {'scatter':>8} {'d2h':>8} {'h2d':>8}  GB/s")
    for name, r in table.items():
        print(f"{name:<12} {r['bytes'] / 2**20:>7.0f} {r['gather']:>8.1f} {r['scatter']:>8.1f} "
              f"{r['memcpy_d2h']:>8.1f} {r['memcpy_h2d']:>8.1f}")
    r = table["kv_split"]  # the headline: FlashAttention's layout on a GPU
    summary = {
        "gather_gbps": r["gather"], "scatter_gbps": r["scatter"],
        "memcpy_d2h_gbps": r["memcpy_d2h"], "memcpy_h2d_gbps": r["memcpy_h2d"],
        "gather_vs_memcpy": r["gather"] / r["memcpy_d2h"],
        "scatter_vs_memcpy": r["scatter"] / r["memcpy_h2d"],
        "block_major_gather_gbps": table["block_major"]["gather"],
        "block_major_scatter_gbps": table["block_major"]["scatter"],
        "chunks": args.chunks, "bytes": r["bytes"],
    }
    print("GPU_COPY " + json.dumps({k: round(v, 3) for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
