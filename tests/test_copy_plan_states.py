"""Recurrent-state copies planned for the CUDA kernel (``copy_plan.build_states``) against
``StateKV``'s own copies (the oracle), run by the host emulation of the kernel; on a GPU,
by the kernel."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from lmcache_hma.kv_copy import copy_ops, copy_plan, cuda_copy
from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout
from lmcache_hma.kv_copy.state_kv import StateKV

HAS_GPU = torch.cuda.is_available()


@dataclass
class StateCase:
    """Random state layers over one byte buffer that every group aliases, as vLLM lays them out:
    layer ``i`` of each group at slot ``i`` of each page; each layer registered as one raw byte
    tensor or as one tensor per part."""

    layout: HybridLayout
    buffer: torch.Tensor  # uint8, [num_blocks, slots, page]
    as_parts: list[bool]  # per state layer
    num_blocks: int
    items: list[tuple[list[int], int]]  # per object: a block per state group, a payload offset

    def state(self, buffer: torch.Tensor) -> StateKV:
        kv, k = {}, 0
        for g in self.layout.state_groups:
            for slot, name in enumerate(g.layer_names):
                kv[name] = _layer_tensor(buffer, slot, g, self.as_parts[k])
                k += 1
        return StateKV(kv, self.layout, self.num_blocks)


def _layer_tensor(buffer: torch.Tensor, slot: int, g: GroupLayout, as_parts: bool):
    page = buffer[:, slot]  # [num_blocks, page] bytes, block stride slots * page
    if not as_parts:
        return page[:, :g.page_bytes].unsqueeze(1)
    parts, off = [], 0
    for shape, dtype in zip(g.state_shapes, g.state_dtypes):
        dt = getattr(torch, dtype.split(".")[-1])
        n = dt.itemsize * int(torch.tensor(shape).prod())
        parts.append(page[:, off:off + n].view(dt).unflatten(1, shape))
        off += n
    return parts


def make_state_case(seed: int) -> StateCase:
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    groups, index = [], 0
    for _ in range(rnd.randint(1, 3)):
        conv, ssm = (rnd.randint(1, 4), rnd.choice((2, 4, 8))), (rnd.randint(1, 3), 4, rnd.choice((2, 4)))
        page_bytes = 2 * conv[0] * conv[1] + 4 * ssm[0] * ssm[1] * ssm[2]
        names = tuple(f"g{index}.l{i}" for i in range(rnd.randint(1, 2)))
        groups.append(GroupLayout(index, GroupKind.STATE, names, 4, page_bytes, state_shapes=(conv, ssm),
                                  state_dtypes=("torch.bfloat16", "torch.float32"), conv_state_layout="SD"))
        index += 1
    groups.append(GroupLayout(index, GroupKind.FULL, ("attn",), 4, 64))
    layout = HybridLayout(tuple(groups), 8)
    page = max(g.page_bytes for g in groups) + 16 * rnd.randint(0, 3)
    slots = max(len(g.layer_names) for g in groups)
    num_blocks = rnd.randint(8, 16)
    buffer = torch.randint(0, 256, (num_blocks, slots, page), dtype=torch.uint8, generator=gen)
    n_layers = sum(len(g.layer_names) for g in layout.state_groups)
    n_groups = len(layout.state_groups)
    k = rnd.randint(1, (num_blocks - 1) // n_groups)
    ids = rnd.sample(range(1, num_blocks), k * n_groups)  # no block written twice
    items = [(ids[i * n_groups:(i + 1) * n_groups], rnd.randrange(0, 16, 2)) for i in range(k)]
    return StateCase(layout, buffer, [rnd.random() < 0.5 for _ in range(n_layers)], num_blocks, items)


def payloads(case: StateCase, row_bytes: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """bf16 payloads (a KV dtype) of the row rounded up to 16 bytes, at their offsets."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _, offset in case.items:
        n = -(-row_bytes // 16) * 16
        buf = torch.randint(0, 256, (offset + n,), dtype=torch.uint8, generator=gen)
        buf = buf.pin_memory() if device == "pinned" else buf.to(device)
        out.append(buf[offset:].view(torch.bfloat16))
    return out


def run(case: StateCase, seed: int, direction: str, how: str):
    """(buffer, payloads) after the copy: "oracle" (StateKV, one call per object) or
    "emulation" (one plan, the host emulation of the kernel)."""
    buffer = case.buffer.clone()
    state = case.state(buffer)
    pays = payloads(case, state.row_bytes, seed)
    items = [(blocks, p) for (blocks, _), p in zip(case.items, pays)]
    if how == "oracle":
        for blocks, p in items:
            getattr(state, direction)(blocks, p)
    else:
        cuda_copy.copy_states_many(state, items, direction == "gather", executor=copy_plan.HostEmulation())
    return buffer, pays


def same(a, b) -> bool:
    (buf_a, pays_a), (buf_b, pays_b) = a, b
    return torch.equal(buf_a.cpu(), buf_b.cpu()) and all(
        torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(pays_a, pays_b))


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", range(24))
def test_state_plan_copies_what_state_kv_copies(seed, direction):
    case = make_state_case(seed)
    assert same(run(case, seed, direction, "emulation"), run(case, seed, direction, "oracle"))


def test_state_cases_cover_what_they_should():
    cases = [make_state_case(s) for s in range(24)]
    assert {len(c.layout.state_groups) for c in cases} == {1, 2, 3}
    assert any(any(c.as_parts) and not all(c.as_parts) for c in cases)
    assert any(len(c.items) > 1 for c in cases)
    assert any(max(len(g.layer_names) for g in c.layout.state_groups) > 1 for c in cases)
    assert {c.state(c.buffer).unit_bytes % 16 == 0 for c in cases} == {True, False}


@pytest.mark.parametrize("blocks, match", [([0], "not a real block"), ([-1], "not a real block"),
                                           (["n"], "not a real block"), ([1, 2, 3, 4], "state groups")])
def test_state_plan_refuses_blocks_out_of_range_and_copies_nothing(blocks, match):
    case = next(c for c in map(make_state_case, range(50)) if len(c.layout.state_groups) == 1)
    buffer = case.buffer.clone()
    state = case.state(buffer)
    (p,) = payloads(case, state.row_bytes, 0)[:1]
    blocks = [case.num_blocks if b == "n" else b for b in blocks]
    with pytest.raises(ValueError, match=match):
        cuda_copy.copy_states_many(state, [([1], p.clone()), (blocks, p)], False,
                                   executor=copy_plan.HostEmulation())
    assert torch.equal(buffer, case.buffer)
    with pytest.raises(ValueError, match="hold"):
        cuda_copy.copy_states_many(state, [([1], p[:1])], True, executor=copy_plan.HostEmulation())


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_copy_ops_state_batches_on_cpu_are_state_kv_calls(direction):
    case = make_state_case(5)
    want = run(case, 5, direction, "oracle")
    buffer = case.buffer.clone()
    state = case.state(buffer)
    pays = payloads(case, state.row_bytes, 5)
    getattr(copy_ops, f"{direction}_states")(state, [(b, p) for (b, _), p in zip(case.items, pays)])
    assert same((buffer, pays), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("where", ["pinned", "cuda"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("seed", range(12))
def test_kernel_copies_states_as_the_emulation_does(seed, direction, where):
    case = make_state_case(seed)
    want = run(case, seed, direction, "emulation")
    buffer = case.buffer.cuda()
    state = case.state(buffer)
    pays = payloads(case, state.row_bytes, seed, where)
    getattr(copy_ops, f"{direction}_states")(state, [(b, p) for (b, _), p in zip(case.items, pays)])
    assert same((buffer, pays), want)
