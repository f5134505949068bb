"""TEST ONLY: the faults the ``hma_test_*`` keys ask a worker to inject (``FaultPlan``).

The plan is a configuration value (``settings.load_config`` builds it from the keys); the
worker carries it out (``worker.faults.FaultInjector``). With none of the keys set there is no
plan and the worker runs no line of its fault code.
"""

from __future__ import annotations

from dataclasses import dataclass

CORRUPT_KINDS = ("all", "full_attention", "sliding_window", "recurrent_state")


@dataclass(frozen=True)
class FaultPlan:
    fail_loads: int = 0  # asynchronous loads that fail after the hit was promised
    fail_sync_loads: int = 0  # attempts of synchronous loads that fail (a load retries once)
    corrupt_loads: tuple[str, ...] = ()  # per successive load: which group kinds get noise
    lookup_delay_s: float = 0.0  # every lookup answer is sent this long after it was found (late answers)

    def __bool__(self) -> bool:
        return bool(self.fail_loads or self.fail_sync_loads or self.corrupt_loads or self.lookup_delay_s)
