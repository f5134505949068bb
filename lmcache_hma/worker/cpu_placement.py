"""Which CPUs the worker's background threads run on.

vLLM's CPU worker binds its compute threads (the forward's OpenMP threads, the
worker's main thread among them) to its cores and leaves the others
(``VLLM_CPU_NUM_OF_RESERVED_CPU``) to the front end and the engine core. A thread
starts with the binding of the thread that starts it, so the connector's
background threads (the gathers beside the next step, the store writer's sealing
and puts, LMCache's own writers and event loop) would run on the forward's cores
and slow it down. They run on the other CPUs instead (``benchmarks/bench_ttft.py``
measures a first request's cost with the connector against a run without it).

The lookup server's thread stays where it is. A hit waits for its answer, and on
the worker's core it was faster. Without a binding (a GPU worker, or vLLM bound
to every CPU it may use) there are no other CPUs, and nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def unbound_cpus() -> frozenset[int]:
    """CPUs this process may use that the calling thread is not bound to (empty: none).

    "May use" is the parent process's binding (vLLM binds only the worker's threads), so
    CPUs an operator left out (``taskset``, a cpuset) are never taken.
    """
    try:
        allowed = os.sched_getaffinity(os.getppid())
        bound = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux, or the parent is not ours to inspect
        return frozenset()
    return frozenset(allowed - bound)


def move_here(cpus: frozenset[int]) -> None:
    """Bind the calling thread to ``cpus`` (nothing if empty or refused, e.g. by a cpuset)."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int]) -> Iterator[None]:
    """Threads that the calling thread starts inside the block run on ``cpus`` (they inherit
    its binding, which is restored afterwards); nothing changes if ``cpus`` is empty."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
