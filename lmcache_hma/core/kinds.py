"""The two kinds every module speaks of: KV cache group kinds and stored object kinds."""

from __future__ import annotations

import enum


class GroupKind(enum.Enum):
    """A vLLM KV cache group as this connector serves it (the value labels metrics)."""

    FULL = "full_attention"
    SLIDING = "sliding_window"
    STATE = "recurrent_state"  # gated delta net (vLLM MambaSpec, GDN_ATTN, "align" mode)


# The tiers, fastest first, by their names in metrics.
TIERS = ("cpu", "disk", "redis")


def slowest_tier(*tiers: str) -> str:
    """The slowest of ``tiers`` (a name not in ``TIERS`` counts as slowest)."""
    return max(tiers, key=lambda t: TIERS.index(t) if t in TIERS else len(TIERS))


class ObjectKind(enum.IntEnum):
    """A stored object (the value is in its trailer)."""

    FULL = 1  # a chunk's full-attention KV
    TAIL = 2  # the sliding-window KV a hit at a chunk boundary needs
    STATE = 3  # recurrent (gated-delta-net) states at a boundary
    TURN = 4  # a finished request's last partial chunk: its KV and sliding tail at its end
    TURNMARK = 5  # the turn ends stored after a chunk prefix (their offsets: core.turn_ends)
