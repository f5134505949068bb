"""Host time of the GPU copy path's planning, on CPU tensors (no GPU needed).

What the CUDA path does on the host before its launch: the batch path
(``cuda_copy.copy_many``: ``copy_plan.build``, then packing the address table as
the CUDA executor does; the transfer and the launch stubbed) against the
per-object planning it replaced (``cuda_copy.unit_addresses``, one call per object;
its copy of the table to the device is a no-op here, so the baseline is if
anything flattered). Shapes of gemma-3-27b's full-attention layers: 10 layers,
16 KV heads x 128, block 16, bf16, FlashAttention's ``[2, num_blocks, ...]``, one
tensor per layer (as vLLM allocates on a GPU); one object = one 256-token chunk =
160 rows = 320 units; a step = 64 objects. Keys ``gpu_plan_us_per_object`` (one
object per call) and ``gpu_plan_ms_per_step`` (64 objects in one call). Prints a
table and a last line ``GPU_PLAN {json}``. Each call is timed alone and the median
taken, so that the figures hold on a machine shared with other work.

    python benchmarks/bench_gpu_plan.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CHUNK, HEAD_SIZE, HEADS, LAYERS, bench_main, chunk_rows, median, pool_blocks, random_chunks,
    say, table, torch_threads,
)
from lmcache_hma.kv_copy import copy_plan, cuda_copy  # noqa: E402
from lmcache_hma.core.kinds import GroupKind  # noqa: E402
from lmcache_hma.core.layout import GroupLayout, HybridLayout  # noqa: E402
from lmcache_hma.kv_copy.paged_kv import PagedKV  # noqa: E402

BLOCK = 16
STEP_OBJECTS = 64


def paged_kv(one_allocation: bool) -> PagedKV:
    """Gemma-3-27b's full-attention pages, never touched (planning reads no KV byte)."""
    num_blocks = pool_blocks(BLOCK, STEP_OBJECTS)
    shape = (2, num_blocks, BLOCK, HEADS, HEAD_SIZE)
    layers = (list(torch.empty((LAYERS, *shape), dtype=torch.bfloat16).unbind(0)) if one_allocation
              else [torch.empty(shape, dtype=torch.bfloat16) for _ in range(LAYERS)])
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    group = GroupLayout(0, GroupKind.FULL, names, BLOCK, page_bytes=2 * BLOCK * HEADS * HEAD_SIZE * 2)
    return PagedKV(dict(zip(names, layers)), HybridLayout((group,), CHUNK), num_blocks)


def bench(one_allocation: bool, repeats: int) -> dict[str, float]:
    paged = paged_kv(one_allocation)
    rows = [chunk_rows(b) for b in random_chunks(BLOCK, STEP_OBJECTS)]
    chunk_elems = len(rows[0]) * paged.planes * paged.unit_elems
    staging = torch.empty(STEP_OBJECTS * chunk_elems, dtype=paged.dtype)  # untouched, like rows
    items = [(r, staging[i * chunk_elems:(i + 1) * chunk_elems]) for i, r in enumerate(rows)]
    stub = copy_plan.HostEmulation(copy=False)  # packs the table; no transfer, no launch
    assert len(copy_plan.build(paged, items[:1], True, stub.payload_address)) == 320

    def new(batch):
        cuda_copy.copy_many(paged, batch, True, executor=stub)

    def old(batch):
        for r, p in batch:
            cuda_copy.unit_addresses(paged, r, p, device="cpu")

    objects = [items[i % STEP_OBJECTS: i % STEP_OBJECTS + 1] for i in range(10 * repeats)]
    return {"new_us_per_object": 1e6 * per_call(new, objects),
            "old_us_per_object": 1e6 * per_call(old, objects),
            "new_ms_per_step": 1e3 * per_call(new, [items] * 4 * repeats),
            "old_ms_per_step": 1e3 * per_call(old, [items] * max(3, repeats // 3))}


def per_call(fn, batches: list) -> float:
    """Median seconds of ``fn(batch)`` over ``batches``, each call timed alone: on a shared
    machine a call that lost its core is an outlier, not a share of every figure."""
    fn(batches[0])
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - t0)
    return median(times)


def run(quick: bool = False) -> dict:
    repeats = 10 if quick else 30
    say(f"GPU copy planning on the host: {LAYERS} layers x {HEADS} heads x {HEAD_SIZE}, block "
        f"{BLOCK}, bf16, [2, blocks, ...]; 320-unit objects, {STEP_OBJECTS} per step; medians of "
        f"single calls, 1 torch thread; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with torch_threads(1):  # the baseline's small torch ops; more threads only wait for each other
        res = {"separate": bench(False, repeats), "one": bench(True, repeats)}
    r = res["separate"]  # the headline: one allocation per layer, as on a GPU
    summary = {
        "gpu_plan_us_per_object": r["new_us_per_object"],
        "gpu_plan_ms_per_step": r["new_ms_per_step"],
        "baseline_us_per_object": r["old_us_per_object"],
        "baseline_ms_per_step": r["old_ms_per_step"],
        "speedup_per_object": r["old_us_per_object"] / r["new_us_per_object"],
        "speedup_per_step": r["old_ms_per_step"] / r["new_ms_per_step"],
        "one_allocation_us_per_object": res["one"]["new_us_per_object"],
        "one_allocation_ms_per_step": res["one"]["new_ms_per_step"],
    }
    summary = {k: round(v, 3) for k, v in summary.items()}
    summary["table"] = table(
        ["KV allocations", "batch us/object", "per-object us/object", "batch ms/step",
         "per-object ms/step"],
        [[f"{'1' if name == 'one' else LAYERS} ({name})", x["new_us_per_object"], x["old_us_per_object"],
          x["new_ms_per_step"], x["old_ms_per_step"]] for name, x in res.items()])
    return summary


def main() -> int:
    return bench_main(__doc__, run, "GPU_PLAN", quick="fewer repeats",
                      tables=[("table", "host planning (batch: copy_plan; per-object: unit_addresses):")])


if __name__ == "__main__":
    sys.exit(main())
