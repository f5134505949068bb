"""Small builders of layouts and paged KV for unit tests (no vLLM engine)."""

from __future__ import annotations

import hashlib

import torch

from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout

PAGE = 1 * 4 * 8  # heads x block x (2*head) elements


def digest(n: int | bytes) -> bytes:
    """A stand-in 32-byte chunk digest, numbered for readable tests (a digest passes through)."""
    return n if isinstance(n, bytes) else hashlib.sha256(b"chunk %d" % n).digest()


def layout(kinds="SSF", block=4, window=8, chunk=8, page_bytes=PAGE * 2) -> HybridLayout:
    """Groups of two layers each, named L<i>, in the order ``kinds`` gives (S or F)."""
    groups, n = [], 0
    for i, k in enumerate(kinds):
        names = (f"L{n}", f"L{n + 1}")
        n += 2
        if k == "F":
            groups.append(GroupLayout(i, GroupKind.FULL, names, block, page_bytes))
        else:
            groups.append(GroupLayout(i, GroupKind.SLIDING, names, block, page_bytes, window))
    return HybridLayout(tuple(groups), chunk)


def kv_caches(lay: HybridLayout, num_blocks=32, dtype=torch.bfloat16, shared=True, split=False,
              seed=0) -> dict[str, torch.Tensor]:
    """Random KV tensors like vLLM's: layers of one 'slot' alias one allocation when shared."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, 4, 1, 4) if split else (num_blocks, 1, 4, 8)
    names = lay.layer_names
    per_group = len(lay.groups[0].layer_names)
    out = {}
    if shared:
        buf = (torch.randn((per_group, *shape), generator=g) * 50).to(dtype)
        for i, name in enumerate(names):
            out[name] = buf[i % per_group]
    else:
        for name in names:
            out[name] = (torch.randn(shape, generator=g) * 50).to(dtype)
    return out
