"""TEST ONLY: faults injected into a real engine's worker, to prove the tests can fail.

Switched on by the ``hma_test_*`` keys of the adapter's configuration (``config.settings``
builds a ``config.faults.FaultPlan`` from them);
with none of them set the worker holds no ``FaultInjector`` and runs no line of this
module. End-to-end tests use them through the same YAML a user writes; unit tests may
build a ``FaultPlan`` directly.
"""

from __future__ import annotations

import threading
import time

from lmcache_hma.config.faults import CORRUPT_KINDS, FaultPlan  # noqa: F401 (the plan is configuration)


class InjectedFault(RuntimeError):
    """A failure the test asked for."""


class FaultInjector:
    """The worker's side of a ``FaultPlan``; each fault is used up once it fires."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self._fail_loads = plan.fail_loads
        self._fail_sync = plan.fail_sync_loads
        self._corrupt = list(plan.corrupt_loads)

    @property
    def forces_async(self) -> bool:
        """While asynchronous load failures are pending no hit is held: the hit is loaded
        asynchronously, where the failure is injected."""
        return self._fail_loads > 0

    def fail_load(self, sync: bool) -> None:
        """Raise ``InjectedFault`` if this load attempt is to fail."""
        with self._lock:
            if sync and self._fail_sync > 0:
                self._fail_sync -= 1
            elif not sync and self._fail_loads > 0:
                self._fail_loads -= 1
            else:
                return
        raise InjectedFault(f"injected {'synchronous' if sync else 'asynchronous'} load failure")

    def corruption(self) -> str | None:
        """The group kind ('all', ...) to overwrite with noise after this load, if any."""
        with self._lock:
            return self._corrupt.pop(0) if self._corrupt else None

    def delay_answer(self) -> None:
        if self.plan.lookup_delay_s:
            time.sleep(self.plan.lookup_delay_s)


def corrupt_rows(paged, rows, picked: list[int]) -> None:
    """Overwrite the pages of ``rows`` at positions ``picked`` with Gaussian noise."""
    import torch

    from lmcache_hma.kv_copy import copy_ops

    noise = torch.randn(len(picked), paged.planes * paged.unit_elems).to(paged.dtype)
    copy_ops.scatter(paged, type(rows)(list(range(len(picked))), [rows.layer_indices[i] for i in picked],
                                       [rows.block_ids[i] for i in picked]), noise.reshape(-1))


def noise_like(payload):
    """Gaussian noise of ``payload``'s shape and dtype: a whole part (hma_share_parallel_shapes)."""
    import torch

    return torch.randn(payload.shape).to(payload.dtype)


def corrupt_part(canonical, copy, layout, kind: str, payload) -> None:
    """Overwrite the tokens a just-loaded part (``PartCopy``) wrote of the groups of ``kind``
    ("all" or a group kind) with noise."""
    from dataclasses import replace

    picked = tuple(s for s in copy.segments if kind in ("all", layout.groups[s.group].kind.value))
    if picked:
        canonical.scatter(replace(copy, segments=picked), noise_like(payload))


def state_noise(layout):
    """A state object's payload of Gaussian noise in each state part's own dtype."""
    import torch

    parts = []
    for g in layout.state_groups:
        for _ in g.layer_names:
            for shape, dtype in zip(g.state_shapes, g.state_dtypes):
                noise = torch.randn(shape).to(getattr(torch, dtype.split(".")[-1]))
                parts.append(noise.reshape(-1).view(torch.uint8))
    return torch.cat(parts)
