"""Block copies between vLLM's paged KV and an object's payload.

One signature for every device: ``gather(paged, rows, payload)`` (paged KV ->
object) and ``scatter(paged, rows, payload)`` (object -> paged KV). The torch
implementation below is the CPU path and the oracle the CUDA kernels
(``cuda_copy``) are tested against; ``paged.device`` picks the implementation.
"""

from __future__ import annotations

import torch

from lmcache_hma.layout import Rows
from lmcache_hma.paged_kv import PagedKV


def gather(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    """Copy the blocks named by ``rows`` from paged KV into ``payload``."""
    if paged.device.type == "cuda":
        from lmcache_hma import cuda_copy

        cuda_copy.gather(paged, rows, payload)
        return
    obj = paged.object_view(payload)
    for ix in paged.index(rows):
        src = paged.storages[ix.storage]
        if ix.dense:
            torch.index_select(src, 0, ix.paged_units, out=obj[: len(ix.paged_units)])
        else:
            obj.index_copy_(0, ix.object_units, src.index_select(0, ix.paged_units))


def scatter(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    """Copy the rows of ``payload`` named by ``rows`` into their paged KV blocks."""
    if paged.device.type == "cuda":
        from lmcache_hma import cuda_copy

        cuda_copy.scatter(paged, rows, payload)
        return
    obj = paged.object_view(payload)
    for ix in paged.index(rows):
        dst = paged.storages[ix.storage]
        src = obj[: len(ix.object_units)] if ix.dense else obj.index_select(0, ix.object_units)
        # index_put_ rather than index_copy_: torch's CPU index_copy_ kernel is about
        # half as fast for page-sized rows (measured in benchmarks/bench_copy.py).
        dst.index_put_((ix.paged_units,), src)
