"""CPU copy path: gather (paged KV -> object) and scatter (object -> paged KV), GB/s.

Shapes of gemma-3-27b's full-attention layers: 10 layers, 16 KV heads, head size
128, bf16 (a page of one layer is 16 heads x BS tokens x 2*128 elements: 128 KiB
at block size 16, 1 MiB at block size 128); 256-token chunks; the blocks of each
chunk are drawn at random (non-contiguous) from a paged pool twice the size of
what is copied. All layers are views of one allocation, as vLLM CPU allocates
them (a second row uses one allocation per layer).

Three ways to move the same bytes, each one call per 256-token chunk (the unit
LMCache stores and loads):

* ``lmcache_hma``: ``copy_ops.gather`` / ``copy_ops.scatter`` on ``PagedKV``
  (whole blocks, one ``index_select`` / ``index_copy_`` per allocation);
* ``lmcache``: LMCache 0.5.6's own CPU transfer, ``device_ops.multi_layer_kv_transfer``
  (``CpuDeviceOps`` -> ``torch_ops.mem_kernels``), called as its vLLM GPU connector
  calls it: a KV_2LTD object ``[2, layers, 256, heads*head]``, an int64 tensor of
  layer pointers and a per-token slot mapping (D2H = gather, H2D = scatter). Its
  torch fallback handles NHD layouts only, so the paged layouts are FlashInfer's
  ``[blocks, 2, BS, heads, head]`` ("block-major", same opaque-page shape as vLLM
  CPU's ``[blocks, heads, BS, 2*head]``) and FlashAttention's
  ``[2, blocks, BS, heads, head]`` ("kv-split");
* ``memcpy``: one contiguous ``copy_`` of all the bytes (the limit here).

Timing: methods are interleaved within each repeat; medians over repeats. One
torch thread by default (``--threads``): on this 2-core machine vLLM's CPU worker
runs on one core once ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` reserves the other, and
multi-threaded copies were erratic (up to 100x slower) whenever other processes
competed for the cores.
The slot mappings and block lists are built outside the timed region for both
connectors (vLLM hands both of them block ids); ``PagedKV.index`` runs inside.

    python benchmarks/bench_copy.py [--quick]

Prints a table and a last line ``COPY {json}``. The headline ratios
(``copy_vs_memcpy``, ``copy_vs_lmcache``) are the MIN over gather and scatter
and over block sizes 16 and 128, block-major layout, one allocation.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CHUNK, HEAD_SIZE, HEADS, LAYERS, bench_main, chunk_rows, median, median_times,
    paged_full_attention, pool_blocks, random_chunks, say, table, torch_threads,
)


def _build(layout: str, block: int, chunks: int, per_layer_alloc: bool) -> dict:
    """The paged KV, each chunk's rows (ours) and slot mapping (LMCache's), object buffers."""
    import torch

    paged, layers = paged_full_attention(layout, block, chunks, one_allocation=not per_layer_alloc)
    blocks = random_chunks(block, chunks)
    chunk_elems = LAYERS * CHUNK * 2 * HEADS * HEAD_SIZE
    return dict(
        paged=paged, layers=layers, block=block, num_blocks=pool_blocks(block, chunks),
        chunk_elems=chunk_elems,
        rows=[chunk_rows(b) for b in blocks],
        slots=[torch.cat([torch.arange(b * block, (b + 1) * block) for b in bs]) for bs in blocks],
        ours=torch.zeros(chunks * chunk_elems, dtype=torch.bfloat16),
        lmc=torch.zeros(chunks * chunk_elems, dtype=torch.bfloat16),
        ptrs=torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64))


def _methods(st: dict, layout: str):
    import torch
    from lmcache import device_ops
    from lmcache.lmcache_native import EngineKVFormat, TransferDirection

    from lmcache_hma.kv_copy import copy_ops

    fmt = (EngineKVFormat.NL_X_NB_TWO_BS_NH_HS if layout == "block_major"
           else EngineKVFormat.NL_X_TWO_NB_BS_NH_HS)
    paged, rows, slots, ptrs = st["paged"], st["rows"], st["slots"], st["ptrs"]
    n, ce, block = len(rows), st["chunk_elems"], st["block"]
    ours = [st["ours"][c * ce:(c + 1) * ce] for c in range(n)]
    lmc = [st["lmc"][c * ce:(c + 1) * ce].view(2, LAYERS, CHUNK, HEADS * HEAD_SIZE) for c in range(n)]
    page_buffer = st["num_blocks"] * block
    cpu = torch.device("cpu")

    def lmc_call(c, direction):
        device_ops.multi_layer_kv_transfer(
            lmc[c], ptrs, slots[c], cpu, page_buffer, direction, fmt,
            block_size=block, head_size=HEAD_SIZE)

    from lmcache_hma.core.objects import crc32

    ours_u8 = [o.view(torch.uint8).numpy() for o in ours]
    gather = {
        "lmcache_hma": lambda: [copy_ops.gather(paged, rows[c], ours[c]) for c in range(n)],
        "lmcache": lambda: [lmc_call(c, TransferDirection.D2H) for c in range(n)],
        "memcpy": lambda: st["lmc"].copy_(st["ours"]),
        # not a copy: the CRC32 lmcache_hma's objects.seal/verify compute over every
        # object on store and on load (the same function), per chunk
        "crc32": lambda: [crc32(u) for u in ours_u8],
    }
    def rowloop_scatter(c):
        """NOT lmcache_hma's code: its scatter with one copy_ per unit row instead of one
        indexed write, to show what limits the scatter figure."""
        obj = paged.object_view(ours[c])
        for ix in paged.index(rows[c]):
            dst = paged.storages[ix.storage]
            for i, j in zip(ix.object_units.tolist(), ix.paged_units.tolist()):
                dst[j].copy_(obj[i])

    scatter = {
        "lmcache_hma": lambda: [copy_ops.scatter(paged, rows[c], ours[c]) for c in range(n)],
        "lmcache": lambda: [lmc_call(c, TransferDirection.H2D) for c in range(n)],
        "memcpy": lambda: st["ours"].copy_(st["lmc"]),
        "rowloop": lambda: [rowloop_scatter(c) for c in range(n)],
    }
    return gather, scatter, ours, lmc


def _check(st: dict, layout: str, ours, lmc) -> None:
    """Both connectors gathered the same bytes, in their own object formats."""
    import torch

    block = st["block"]
    nb = CHUNK // block
    for c in (0, len(ours) - 1):
        # object rows: [layer, block][plane K|V][BS, H, D] for both layouts
        mine = ours[c].view(LAYERS, nb, 2, block, HEADS * HEAD_SIZE).permute(2, 0, 1, 3, 4)
        mine = mine.reshape(2, LAYERS, CHUNK, HEADS * HEAD_SIZE)
        if not torch.equal(mine, lmc[c]):
            raise AssertionError(f"lmcache_hma and LMCache gathered different bytes ({layout})")
        b0 = st["rows"][c].block_ids[0]  # and the first row against the paged tensor itself
        first = st["layers"][0][b0] if layout == "block_major" else st["layers"][0][:, b0]
        if not torch.equal(ours[c][: first.numel()], first.reshape(-1)):
            raise AssertionError(f"gather copied the wrong bytes ({layout})")


def bench_case(layout: str, block: int, chunks: int, repeats: int, per_layer_alloc=False) -> dict:
    import torch

    st = _build(layout, block, chunks, per_layer_alloc)
    gather, scatter, ours, lmc = _methods(st, layout)
    gather["lmcache_hma"]()
    gather["lmcache"]()
    _check(st, layout, ours, lmc)
    # scatter must restore what gather read: scatter our objects back and compare one layer
    before = st["layers"][3].clone()
    scatter["lmcache_hma"]()
    assert torch.equal(before, st["layers"][3]), "scatter(gather(x)) changed the paged KV"
    scatter["lmcache"]()
    assert torch.equal(before, st["layers"][3]), "LMCache H2D(D2H(x)) changed the paged KV"
    del before
    fns = {**{f"gather_{m}": fn for m, fn in gather.items()}, **{f"scatter_{m}": fn for m, fn in scatter.items()}}
    seconds = median_times(fns, repeats, warm_up=False)
    nbytes = st["ours"].numel() * st["ours"].element_size()
    gbps = {k: nbytes / s / 1e9 for k, s in seconds.items()}
    del st
    return {"layout": layout, "block": block, "alloc": "per-layer" if per_layer_alloc else "one",
            "bytes": nbytes, **gbps}


def scatter_op() -> str:
    """How ``copy_ops.scatter`` writes on CPU (read from its source)."""
    import inspect

    from lmcache_hma.kv_copy import copy_ops

    src = inspect.getsource(copy_ops.scatter)
    if "_rows(" in src:
        return "numpy fancy assignment"
    for op in ("index_put_", "index_copy_", "index_add_"):
        if op in src:
            return op
    return "unknown"


def run(quick: bool = False, threads: int = 1) -> dict:
    import torch

    chunks, repeats = (8, 3) if quick else (16, 7)
    cases = [("block_major", 16, False), ("block_major", 128, False),
             ("kv_split", 16, False), ("kv_split", 128, False), ("block_major", 16, True)]
    results = []
    with torch_threads(threads):
        say(f"[copy] {LAYERS} layers x {HEADS} KV heads x head {HEAD_SIZE}, bf16, {chunks} chunks of "
            f"{CHUNK} tokens, median of {repeats}, torch threads {torch.get_num_threads()}")
        for layout, block, per_layer in cases:
            r = bench_case(layout, block, chunks, repeats, per_layer)
            results.append(r)
            say(f"[copy] {layout} block {block} alloc {r['alloc']}: gather {r['gather_lmcache_hma']:.2f} "
                f"/ lmcache {r['gather_lmcache']:.2f} / memcpy {r['gather_memcpy']:.2f} GB/s; scatter "
                f"{r['scatter_lmcache_hma']:.2f} / {r['scatter_lmcache']:.2f} / {r['scatter_memcpy']:.2f} "
                f"(row-loop scatter {r['scatter_rowloop']:.2f}, crc32 {r['gather_crc32']:.2f})")
    for r in results:
        for d in ("gather", "scatter"):
            r[f"{d}_vs_memcpy"] = r[f"{d}_lmcache_hma"] / r[f"{d}_memcpy"]
            r[f"{d}_vs_lmcache"] = r[f"{d}_lmcache_hma"] / r[f"{d}_lmcache"]
    head = [r for r in results if r["layout"] == "block_major" and r["alloc"] == "one"]
    mins = {f"{d}_vs_{b}": min(r[f"{d}_vs_{b}"] for r in head)
            for b in ("memcpy", "lmcache") for d in ("gather", "scatter")}
    summary = {
        "copy_vs_memcpy": min(mins["gather_vs_memcpy"], mins["scatter_vs_memcpy"]),
        "copy_vs_lmcache": min(mins["gather_vs_lmcache"], mins["scatter_vs_lmcache"]),
        **mins,
        "rowloop_scatter_vs_memcpy": min(r["scatter_rowloop"] / r["scatter_memcpy"] for r in head),
        "crc32_gbps": median(r["gather_crc32"] for r in head),
        "headline": "min over gather/scatter and block sizes 16/128; block-major layout, one allocation",
        "scatter_op": scatter_op(),
        "chunks": chunks, "repeats": repeats, "torch_threads": threads,
        "cases": results,
    }
    summary["table"] = table(
        ["layout", "block", "alloc", "MiB", "gather hma", "gather lmcache", "gather memcpy",
         "scatter hma", "scatter lmcache", "scatter memcpy", "scatter row-loop*", "crc32*",
         "hma/memcpy (g, s)", "hma/lmcache (g, s)"],
        [[r["layout"], r["block"], r["alloc"], r["bytes"] / 2**20, r["gather_lmcache_hma"],
          r["gather_lmcache"], r["gather_memcpy"], r["scatter_lmcache_hma"], r["scatter_lmcache"],
          r["scatter_memcpy"], r["scatter_rowloop"], r["gather_crc32"], f"{r['gather_vs_memcpy']:.2f}, {r['scatter_vs_memcpy']:.2f}",
          f"{r['gather_vs_lmcache']:.1f}, {r['scatter_vs_lmcache']:.1f}"] for r in results])
    return summary


def main() -> int:
    return bench_main(__doc__, run, "COPY", tables=[("table", "GB/s (median):")], options=[
        ("--threads", dict(type=int, default=1,
                           help="torch threads (default 1: what vLLM's CPU worker gets here)"))])


if __name__ == "__main__":
    sys.exit(main())
