"""The canonical (TP-free, block-size-free) copy against today's per-rank page copy.

Same bytes both ways: gemma-3-27b's full-attention shapes (10 layers, 16 KV heads x 128,
bf16, 256-token chunks, every chunk's blocks drawn at random from a pool twice the size),
in vLLM CPU's page layout ``[blocks, heads, BS, 2*head]`` (K transposed per head inside a
block), all layers views of one allocation as vLLM allocates them. One call per chunk:

* ``today``: ``copy_ops.gather`` / ``scatter`` on ``PagedKV`` (whole pages, opaque);
* ``canonical``: ``RankKV.gather`` / ``scatter`` into / out of the canonical object
  ``[head][layer][K|V][token][dim]`` (``canonical_kv``), every head (a TP=1 rank);
* ``canonical_tp2``: the same for a TP=2 rank (8 of the 16 heads: half the bytes, GB/s
  over the bytes it copies).

The same copy out of / into vLLM CPU's AMX-tiled pages (``cpu_layer_kv(t, "amx")``) against
plain pages, at blocks 32 and 128.

And the host planning of the GPU path (``canonical_plan.build`` on CPU tensors, the
address table the CUDA unit kernel copies), per object, for GPU page layouts (head-major
``[blocks, 2, heads, BS, head]`` and FlashAttention's ``[2, blocks, BS, heads, head]``),
against today's ``copy_plan.build`` of the same chunk.

Timing: methods interleaved within each repeat, medians; one torch thread (see
``bench_copy.py``). Prints a table and a last line ``CANONICAL_COPY {json}``.

    python benchmarks/bench_canonical_copy.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CHUNK, HEAD_SIZE, HEADS, LAYERS, bench_main, chunk_rows, median, median_times,
    paged_full_attention, pool_blocks, random_chunks, say, table, torch_threads,
)


def _cpu_pages(block: int, chunks: int):
    """vLLM CPU's layers ``[blocks, heads, BS, 2*head]`` (views of one allocation), the
    ``PagedKV`` of today's copy over the same tensors, and the canonical ``RankKV``s."""
    import torch

    from lmcache_hma.core.layout import GroupKind, GroupLayout, HybridLayout
    from lmcache_hma.kv_copy.canonical_kv import HeadRange, RankKV, cpu_layer_kv
    from lmcache_hma.kv_copy.paged_kv import PagedKV

    num_blocks = pool_blocks(block, chunks)
    g = torch.Generator().manual_seed(0)
    alloc = torch.randn(LAYERS, num_blocks, HEADS, block, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16)
    layers = list(alloc.unbind(0))
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    group = GroupLayout(0, GroupKind.FULL, names, block, page_bytes=2 * block * HEADS * HEAD_SIZE * 2)
    paged = PagedKV(dict(zip(names, layers)), HybridLayout((group,), CHUNK), num_blocks)
    full = RankKV([cpu_layer_kv(t) for t in layers], HeadRange(0, HEADS))
    # a TP=2 rank's pages: its own allocation of HEADS/2 heads
    half_alloc = alloc[:, :, :HEADS // 2].contiguous()
    half = RankKV([cpu_layer_kv(t) for t in half_alloc.unbind(0)], HeadRange(0, HEADS // 2))
    return paged, full, half, alloc, half_alloc


def bench_cpu(block: int, chunks: int, repeats: int) -> dict:
    import torch

    from lmcache_hma.kv_copy import copy_ops
    from lmcache_hma.kv_copy.canonical_kv import CanonicalShape, HeadRange

    paged, full, half, alloc, half_alloc = _cpu_pages(block, chunks)
    blocks = random_chunks(block, chunks)
    rows = [chunk_rows(b) for b in blocks]
    elems = LAYERS * CHUNK * 2 * HEADS * HEAD_SIZE
    today = [torch.zeros(elems, dtype=torch.bfloat16) for _ in range(chunks)]
    canon = [torch.zeros(elems, dtype=torch.bfloat16) for _ in range(chunks)]
    shape = CanonicalShape(HeadRange(0, HEADS), LAYERS, CHUNK, HEAD_SIZE, torch.bfloat16)
    half_shape = CanonicalShape(HeadRange(0, HEADS // 2), LAYERS, CHUNK, HEAD_SIZE, torch.bfloat16)
    halves = [torch.zeros(elems // 2, dtype=torch.bfloat16) for _ in range(chunks)]
    span = (0, CHUNK)
    fns = {
        "gather_today": lambda: [copy_ops.gather(paged, rows[c], today[c]) for c in range(chunks)],
        "gather_canonical": lambda: [full.gather(blocks[c], span, canon[c], shape) for c in range(chunks)],
        "gather_canonical_tp2": lambda: [half.gather(blocks[c], span, halves[c], half_shape)
                                         for c in range(chunks)],
        "scatter_today": lambda: [copy_ops.scatter(paged, rows[c], today[c]) for c in range(chunks)],
        "scatter_canonical": lambda: [full.scatter(blocks[c], span, canon[c], shape) for c in range(chunks)],
        "scatter_canonical_tp2": lambda: [half.scatter(blocks[c], span, halves[c], half_shape)
                                          for c in range(chunks)],
    }
    before = alloc.clone()
    fns["gather_canonical"]()
    fns["gather_canonical_tp2"]()
    fns["scatter_canonical"]()  # the canonical copy must give back exactly what it read
    if not torch.equal(before, alloc):
        raise AssertionError("canonical scatter(gather(x)) changed the paged KV")
    if not torch.equal(canon[0].view(HEADS, -1)[:HEADS // 2].reshape(-1), halves[0]):
        raise AssertionError("a TP=2 rank's object is not its heads' share of the TP=1 object")
    del before
    seconds = median_times(fns, repeats)
    nbytes = chunks * elems * 2
    gbps = {k: (nbytes / 2 if k.endswith("tp2") else nbytes) / s / 1e9 for k, s in seconds.items()}
    out = {"block": block, "bytes": nbytes, **gbps}
    for d in ("gather", "scatter"):
        out[f"{d}_ratio"] = gbps[f"{d}_canonical"] / gbps[f"{d}_today"]
    return out


def bench_amx(block: int, chunks: int, repeats: int) -> dict:
    """The canonical copy out of / into vLLM CPU's AMX-tiled pages against plain pages of the
    same shapes (``cpu_layer_kv(t, "amx")``; bf16, a block a multiple of 32), GB/s."""
    import torch

    from lmcache_hma.kv_copy.canonical_kv import CanonicalShape, HeadRange, RankKV, cpu_layer_kv

    g = torch.Generator().manual_seed(0)
    alloc = torch.randn(LAYERS, pool_blocks(block, chunks), HEADS, block, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16)
    blocks = random_chunks(block, chunks)
    shape = CanonicalShape(HeadRange(0, HEADS), LAYERS, CHUNK, HEAD_SIZE, torch.bfloat16)
    objs = [torch.zeros(shape.nbytes // 2, dtype=torch.bfloat16) for _ in range(chunks)]
    fns = {}
    for fmt in ("plain", "amx"):
        kv = RankKV([cpu_layer_kv(t, "vec" if fmt == "plain" else fmt) for t in alloc.unbind(0)], HeadRange(0, HEADS))
        fns[f"gather_{fmt}"] = lambda kv=kv: [kv.gather(blocks[c], (0, CHUNK), objs[c], shape) for c in range(chunks)]
        fns[f"scatter_{fmt}"] = lambda kv=kv: [kv.scatter(blocks[c], (0, CHUNK), objs[c], shape)
                                                for c in range(chunks)]
    seconds = median_times(fns, repeats)
    return {"block": block, **{k: chunks * shape.nbytes / s / 1e9 for k, s in seconds.items()}}


def _plan_us(fn, repeats: int) -> float:
    """Median µs of ``fn()``, each call timed alone."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times) * 1e6


def bench_plan(repeats: int) -> dict:
    import torch

    from lmcache_hma.kv_copy import canonical_plan, copy_plan
    from lmcache_hma.kv_copy.canonical_kv import (
        CanonicalShape, HeadRange, RankKV, hnd_layer_kv, split_layer_kv,
    )

    block, out = 16, {}
    today_paged, _ = paged_full_attention("kv_split", block, 1)
    (blocks,) = random_chunks(block, 1)
    rows = chunk_rows(blocks)
    payload = torch.zeros(LAYERS * CHUNK * 2 * HEADS * HEAD_SIZE, dtype=torch.bfloat16)
    address = payload.data_ptr
    out["today"] = _plan_us(lambda: copy_plan.build(today_paged, [(rows, payload)], True,
                                                    lambda p: p.data_ptr()), repeats)
    num_blocks = pool_blocks(block, 1)
    for name, shape, head_axis, view in (
            ("hnd", (num_blocks, 2, HEADS, block, HEAD_SIZE), 2, hnd_layer_kv),
            ("nhd", (2, num_blocks, block, HEADS, HEAD_SIZE), 3, split_layer_kv)):
        for tp in (1, 2):
            heads = HeadRange(0, HEADS // tp)
            layer_shape = list(shape)
            layer_shape[head_axis] = HEADS // tp
            alloc = torch.zeros(LAYERS, *layer_shape, dtype=torch.bfloat16)
            geo = canonical_plan.RankGeometry(RankKV([view(t) for t in alloc.unbind(0)], heads))
            obj = CanonicalShape(heads, LAYERS, CHUNK, HEAD_SIZE, torch.bfloat16)
            out[f"{name}_tp{tp}"] = _plan_us(
                lambda: canonical_plan.build(geo, blocks, (0, CHUNK), address(), obj, True), repeats)
            plan = canonical_plan.build(geo, blocks, (0, CHUNK), address(), obj, True)
            out[f"{name}_tp{tp}_units"] = len(plan)
    return out


def run(quick: bool = False, threads: int = 1) -> dict:
    chunks, repeats = (2, 3) if quick else (4, 7)
    results = []
    with torch_threads(threads):
        say(f"[canonical] {LAYERS} layers x {HEADS} KV heads x head {HEAD_SIZE}, bf16, vLLM CPU pages, "
            f"{chunks} chunks of {CHUNK} tokens, median of {repeats}")
        for block in (16, 128):
            r = bench_cpu(block, chunks, repeats)
            results.append(r)
            say(f"[canonical] block {block}: gather today {r['gather_today']:.2f} / canonical "
                f"{r['gather_canonical']:.2f} / tp2 {r['gather_canonical_tp2']:.2f} GB/s; scatter "
                f"{r['scatter_today']:.2f} / {r['scatter_canonical']:.2f} / {r['scatter_canonical_tp2']:.2f}")
        amx = [bench_amx(block, chunks, repeats) for block in (32, 128)]
        for r in amx:
            say(f"[canonical] AMX-tiled pages, block {r['block']}: gather {r['gather_amx']:.2f} (plain "
                f"{r['gather_plain']:.2f}) GB/s, scatter {r['scatter_amx']:.2f} (plain {r['scatter_plain']:.2f})")
        plan = bench_plan(200 if quick else 1000)
    say(f"[canonical] GPU host plan per object (µs): today {plan['today']:.1f}, head-major TP=1 "
        f"{plan['hnd_tp1']:.1f} / TP=2 {plan['hnd_tp2']:.1f}, NHD TP=1 {plan['nhd_tp1']:.1f} / "
        f"TP=2 {plan['nhd_tp2']:.1f}")
    summary = {
        "cpu_gather_ratio": min(r["gather_ratio"] for r in results),
        "cpu_scatter_ratio": min(r["scatter_ratio"] for r in results),
        "headline": "canonical / today GB/s, min over block sizes 16 and 128 (vLLM CPU pages)",
        **{f"gpu_plan_us_{k}": v for k, v in plan.items() if not k.endswith("units")},
        **{f"gpu_plan_{k}": v for k, v in plan.items() if k.endswith("units")},
        "chunks": chunks, "repeats": repeats, "torch_threads": threads, "cases": results, "amx_cases": amx,
    }
    summary["table"] = table(
        ["block", "MiB", "gather today", "gather canonical", "gather canonical TP=2", "scatter today",
         "scatter canonical", "scatter canonical TP=2", "canonical/today (g, s)"],
        [[r["block"], r["bytes"] / 2**20, r["gather_today"], r["gather_canonical"], r["gather_canonical_tp2"],
          r["scatter_today"], r["scatter_canonical"], r["scatter_canonical_tp2"],
          f"{r['gather_ratio']:.2f}, {r['scatter_ratio']:.2f}"] for r in results])
    return summary


def main() -> int:
    return bench_main(__doc__, run, "CANONICAL_COPY", tables=[("table", "GB/s (median):")], options=[
        ("--threads", dict(type=int, default=1,
                           help="torch threads (default 1: what vLLM's CPU worker gets here)"))])


if __name__ == "__main__":
    sys.exit(main())
