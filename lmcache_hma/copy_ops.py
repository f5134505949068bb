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
        if ix.run is not None:  # torch's index_select runs near memcpy for page rows
            torch.index_select(src, 0, ix.paged_units, out=obj[ix.run: ix.run + len(ix.paged_units)])
        else:
            _rows(obj)[ix.object_units.numpy()] = _rows(src)[ix.paged_units.numpy()]


def scatter(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    """Copy the rows of ``payload`` named by ``rows`` into their paged KV blocks."""
    if paged.device.type == "cuda":
        from lmcache_hma import cuda_copy

        cuda_copy.scatter(paged, rows, payload)
        return
    obj = paged.object_view(payload)
    for ix in paged.index(rows):
        src = (_rows(obj)[ix.run: ix.run + len(ix.object_units)] if ix.run is not None
               else _rows(obj)[ix.object_units.numpy()])
        # numpy's fancy assignment copies each row with memcpy (about memcpy speed for page
        # rows); torch's CPU index_put_ / index_copy_ reach 0.1-0.45x of it (bench_copy.py).
        _rows(paged.storages[ix.storage])[ix.paged_units.numpy()] = src


def _rows(t: torch.Tensor):
    """A ``[n, unit_elems]`` CPU tensor as a numpy array of byte rows (any dtype, fp8 too)."""
    return t.view(torch.uint8).numpy()
