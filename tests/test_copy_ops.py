"""The torch copy path against a per-block Python reference."""

import random

import pytest
import torch

from lmcache_hma.kv_copy import copy_ops
from lmcache_hma.core.layout import plan_rows
from lmcache_hma.kv_copy.paged_kv import PagedKV
from tests.fakes import kv_caches, layout


def reference_block(kv, name, block, split):
    t = kv[name]
    return torch.cat([t[0, block].reshape(-1), t[1, block].reshape(-1)]) if split else t[block].reshape(-1)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_gather_scatter_match_reference(shared, split, dtype):
    lay = layout("SFS")
    kv = kv_caches(lay, dtype=dtype, shared=shared, split=split)  # shared: layers alias one buffer
    paged = PagedKV(kv, lay, num_blocks=32)
    rng = random.Random(0)
    ids = rng.sample(range(1, 32), 8)
    table = tuple(list(ids) for _ in lay.groups)
    segs = lay.full_segments(0) + lay.tail_segments(16)
    rows = plan_rows(lay, segs, table)
    unit = paged.planes * paged.unit_elems
    payload = torch.empty(len(rows) * unit, dtype=dtype)
    copy_ops.gather(paged, rows, payload)
    names = lay.layer_names
    for r, (li, b) in enumerate(zip(rows.layer_indices, rows.block_ids)):
        assert torch.equal(payload[r * unit:(r + 1) * unit], reference_block(kv, names[li], b, split))
    # scatter into a fresh cache gives back exactly those blocks, nothing else
    kv2 = {k: torch.zeros_like(v) for k, v in kv.items()}
    paged2 = PagedKV(kv2, lay, num_blocks=32)
    copy_ops.scatter(paged2, rows, payload)
    for li, b in zip(rows.layer_indices, rows.block_ids):
        assert torch.equal(reference_block(kv2, names[li], b, split), reference_block(kv, names[li], b, split))
    untouched = [b for b in range(32) if b not in ids]
    for name in names:
        for b in untouched:
            assert not reference_block(kv2, name, b, split).any()


def test_scatter_sparse_rows_writes_only_those():
    lay = layout("SF")
    kv = kv_caches(lay)
    paged = PagedKV(kv, lay, num_blocks=32)
    table = ([0, 0, 5, 6], [1, 2, 3, 4])
    rows = plan_rows(lay, lay.full_segments(1), table, min_token=12)  # only block index 3
    unit = paged.planes * paged.unit_elems
    payload = torch.randn(4 * unit).to(torch.bfloat16)
    before = {k: v.clone() for k, v in kv.items()}
    copy_ops.scatter(paged, rows, payload)
    assert rows.object_rows == [1, 3]
    assert torch.equal(kv["L2"][4].reshape(-1), payload[unit:2 * unit])
    assert torch.equal(kv["L2"][3], before["L2"][3])  # block before the local hit untouched


@pytest.mark.parametrize("split", [False, True])
def test_rows_that_are_a_run_inside_the_object_copy_to_and_from_that_run(split):
    """Object rows ``[2, 3]`` (e.g. a local hit covers the object's first blocks): the copy
    goes straight to/from those rows of the payload; rows before and after are untouched."""
    from lmcache_hma.core.layout import Rows

    lay = layout("SF")
    kv = kv_caches(lay, split=split)
    paged = PagedKV(kv, lay, num_blocks=32)
    rows = Rows([2, 3], [1, 3], [7, 9])
    assert paged.index(rows)[0].run == 2 * paged.planes
    unit = paged.planes * paged.unit_elems
    payload = torch.full((5 * unit,), 3.0).to(torch.bfloat16)
    copy_ops.gather(paged, rows, payload)
    names = lay.layer_names
    assert torch.equal(payload[2 * unit:3 * unit], reference_block(kv, names[1], 7, split))
    assert torch.equal(payload[3 * unit:4 * unit], reference_block(kv, names[3], 9, split))
    assert (payload[:2 * unit] == 3).all() and (payload[4 * unit:] == 3).all()
    payload[2 * unit:4 * unit] = torch.randn(2 * unit).to(torch.bfloat16)
    copy_ops.scatter(paged, rows, payload)
    assert torch.equal(reference_block(kv, names[1], 7, split), payload[2 * unit:3 * unit])
    assert torch.equal(reference_block(kv, names[3], 9, split), payload[3 * unit:4 * unit])
