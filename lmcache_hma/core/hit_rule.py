"""The hit rule: the longest chunk boundary whose KV can be restored for every group.

A hit at boundary ``k * C`` needs the full-attention objects of chunks ``[first, k)``
(chunks before ``first`` are in vLLM's local prefix cache) and, when the model has
sliding-window or recurrent-state groups, the boundary objects at ``k * C`` (the
sliding tail, the recurrent states). Where they are missing the hit backs off to the
last boundary that has them: the hybrid fixed point vLLM's own coordinator computes
for its local prefix cache.
"""

from __future__ import annotations

from typing import Optional, Sequence


def longest_hit(full: Sequence[bool], boundaries: Optional[Sequence[bool]]) -> int:
    """Chunks (from the first) that can be restored.

    ``full[i]``: chunk ``first + i`` has its full-attention object; ``boundaries[i]``:
    every boundary object at that chunk's end (sliding tail, recurrent states) is
    stored (they are keyed by the chunk's hash); None for a model with full
    attention only.
    """
    n = next((i for i, found in enumerate(full) if not found), len(full))
    if boundaries is None:
        return n
    return next((k for k in range(n, 0, -1) if boundaries[k - 1]), 0)
