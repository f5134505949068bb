"""Block copies between vLLM's paged KV and an object's payload.

One signature for every device: ``gather(paged, rows, payload)`` (paged KV ->
object) and ``scatter(paged, rows, payload)`` (object -> paged KV), and their
batches ``gather_many`` / ``scatter_many`` over ``[(rows, payload), ...]``, which
copy exactly what one call per item would (recurrent states: ``gather_states`` /
``scatter_states`` over ``[(blocks, payload), ...]``, as ``StateKV`` copies them).
The torch implementation below is the CPU path and the oracle the CUDA kernels
(``cuda_copy``) are tested against; the KV caches' device picks the implementation.
The torch path indexes pages with host (numpy) indices: it refuses pages on any other
device than the host's (``_on_host``) rather than mixing devices.
On a GPU a batch is planned on the host in one pass and copied by one kernel
launch, so the worker should hand over all objects of a step (or of a load) at once.

``after``: on a GPU the copy waits for the work queued on the calling thread's
current stream, unless ``after`` (``ready_marker(paged)``, taken on the thread that
ran the forward pass) names what to wait for: a copy on another thread needs it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lmcache_hma.kv_copy.copy_plan import Item
from lmcache_hma.core.layout import Rows
from lmcache_hma.kv_copy.paged_kv import PagedKV
from lmcache_hma.kv_copy.state_kv import StateKV


def gather(paged: PagedKV, rows: Rows, payload: torch.Tensor, after=None) -> None:
    """Copy the blocks named by ``rows`` from paged KV into ``payload``."""
    gather_many(paged, [(rows, payload)], after)


def scatter(paged: PagedKV, rows: Rows, payload: torch.Tensor, after=None) -> None:
    """Copy the rows of ``payload`` named by ``rows`` into their paged KV blocks."""
    scatter_many(paged, [(rows, payload)], after)


def gather_many(paged: PagedKV, items: Sequence[Item], after=None) -> None:
    """``gather`` of every ``(rows, payload)``; on a GPU one launch for all, returning when
    done. Nothing is copied when an item does not fit (ValueError) on a GPU."""
    if paged.device.type == "cuda":
        from lmcache_hma.kv_copy import cuda_copy

        cuda_copy.copy_many(paged, items, to_payload=True, after=after)
        return
    _on_host(paged)
    for rows, payload in items:
        _gather_cpu(paged, rows, payload)


def scatter_many(paged: PagedKV, items: Sequence[Item], after=None) -> None:
    """``scatter`` of every ``(rows, payload)``; on a GPU one launch for all, returning when
    done. Items must not write the same block of the same layer (one launch copies them in no
    set order)."""
    if paged.device.type == "cuda":
        from lmcache_hma.kv_copy import cuda_copy

        cuda_copy.copy_many(paged, items, to_payload=False, after=after)
        return
    _on_host(paged)
    for rows, payload in items:
        _scatter_cpu(paged, rows, payload)


def gather_states(state: StateKV, items: Sequence[tuple[Sequence[int], torch.Tensor]], after=None) -> None:
    """``state.gather(blocks, payload)`` of every ``(blocks, payload)``; on a GPU one launch."""
    if state.device.type == "cuda":
        from lmcache_hma.kv_copy import cuda_copy

        cuda_copy.copy_states_many(state, items, to_payload=True, after=after)
        return
    for blocks, payload in items:
        state.gather(blocks, payload)


def scatter_states(state: StateKV, items: Sequence[tuple[Sequence[int], torch.Tensor]], after=None) -> None:
    """``state.scatter(blocks, payload)`` of every ``(blocks, payload)``; on a GPU one launch.
    Items must not write the same block of a group twice."""
    if state.device.type == "cuda":
        from lmcache_hma.kv_copy import cuda_copy

        cuda_copy.copy_states_many(state, items, to_payload=False, after=after)
        return
    for blocks, payload in items:
        state.scatter(blocks, payload)


def ready_marker(paged: PagedKV):
    """What a copy on another thread must wait for: on a GPU an event recorded now on this
    thread's current stream (call it on the thread that ran the forward pass), else None."""
    if paged.device.type != "cuda":
        return None
    from lmcache_hma.kv_copy import cuda_copy

    return cuda_copy.ready_marker(paged)


def probe(paged: PagedKV) -> Optional[str]:
    """None when gather and scatter can run on ``paged``'s device; else why not, in one line.

    A GPU needs CuPy, the kernels compiled and pinned host memory (``cuda_copy.probe``).
    Then, on any device, one page (layer 0, the null block 0) goes to a scratch payload and
    back, and must come back as it was: call it when the KV caches are registered, before
    anything else uses them (block 0 is rewritten with its own bytes).
    """
    if paged.device.type == "cuda":
        from lmcache_hma.kv_copy import cuda_copy

        reason = cuda_copy.probe(paged)
        if reason is not None:
            return reason
    try:
        if paged.device.type != "cuda":
            _on_host(paged)
        return _round_trip(paged)
    except Exception as exc:
        return f"a test copy on {paged.device} failed: {type(exc).__name__}: {exc}".splitlines()[0]


def _round_trip(paged: PagedKV) -> Optional[str]:
    rows = Rows([0], [0], [0])
    (ix,) = paged.index(rows)  # one layer: one allocation
    want = paged.storages[ix.storage][ix.paged_units.to(paged.device)].cpu()
    pinned = paged.device.type == "cuda"
    first, second = (torch.zeros(want.numel(), dtype=paged.dtype, pin_memory=pinned) for _ in range(2))
    gather(paged, rows, first)
    scatter(paged, rows, first)
    gather(paged, rows, second)
    if not (torch.equal(first.view(torch.uint8), want.reshape(-1).view(torch.uint8))
            and torch.equal(second.view(torch.uint8), first.view(torch.uint8))):
        return f"a test copy on {paged.device} did not copy the bytes it should have"
    return None


def _on_host(paged: PagedKV) -> None:
    """The torch path's pages must be host memory (``probe`` reports it, the worker then copies nothing)."""
    if paged.device.type != "cpu":
        raise ValueError(f"KV caches on {paged.device}: copied on the host (torch) or on a CUDA GPU only")


def _gather_cpu(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    obj = paged.object_view(payload)
    for ix in paged.index(rows):
        src = paged.storages[ix.storage]
        if ix.run is not None:  # torch's index_select runs near memcpy for page rows
            torch.index_select(src, 0, ix.paged_units, out=obj[ix.run: ix.run + len(ix.paged_units)])
        else:
            _rows(obj)[ix.object_units.numpy()] = _rows(src)[ix.paged_units.numpy()]


def _scatter_cpu(paged: PagedKV, rows: Rows, payload: torch.Tensor) -> None:
    obj = paged.object_view(payload)
    for ix in paged.index(rows):
        src = (_rows(obj)[ix.run: ix.run + len(ix.object_units)] if ix.run is not None
               else _rows(obj)[ix.object_units.numpy()])
        # numpy's fancy assignment copies each row with memcpy (about memcpy speed for page
        # rows); torch's CPU index_put_ / index_copy_ are several times slower (bench_copy.py).
        _rows(paged.storages[ix.storage])[ix.paged_units.numpy()] = src


def _rows(t: torch.Tensor):
    """A ``[n, unit_elems]`` CPU tensor as a numpy array of byte rows (any dtype, fp8 too)."""
    return t.view(torch.uint8).numpy()
