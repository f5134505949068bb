"""The simulator (``tests/sim``, docs/testing.md): a fixed budget of seeded schedules, every seed
that ever failed (``tests/sim/regression_seeds.txt``), the re-introduced defects it must find,
and replay from the seed.

The budget: ``BUDGET_LOCAL`` schedules on CPU (and disk) tiers and ``BUDGET_REDIS`` with a real
redis-server drawn into their setups; ``make sim SEEDS=N`` runs many more."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.sim import mutations, simulator
from tests.sim.simulator import Violation, quiet, run

BUDGET_LOCAL = range(0, 160)
BUDGET_REDIS = range(10_000, 10_050)
REGRESSIONS = Path(__file__).parent / "sim" / "regression_seeds.txt"


def regression_seeds():
    """``(seed, redis, known_open)`` per line of the regression list; a line whose expectation is
    ``xfail`` names a defect still open whose fix lands elsewhere: it is expected to fail until
    then (non-strict: the fix shows as an XPASS; make the line ``pass``)."""
    out = []
    for line in REGRESSIONS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        seed, redis, known, expect, *note = line.split()
        marks = [pytest.mark.xfail(reason=" ".join(note), raises=Violation, strict=False)] if expect == "xfail" else []
        known_open = None if known == "default" else set(known.split(",")) - {"-"}
        out.append(pytest.param(int(seed), redis == "redis", known_open,
                                id=f"{seed}-{redis}-{expect}", marks=marks))
    return out


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """vLLM's and torch's objects out of the store's ``gc.collect`` (it runs at every schedule's
    start): a second per schedule otherwise."""
    restore = quiet()
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    restore()


def _run_all(seeds, redis=None):
    failed = []
    for seed in seeds:
        try:
            run(seed, redis=redis)
        except Violation as v:
            failed.append(str(v))
    assert not failed, "\n\n".join(failed)


def open_seeds() -> set[int]:
    """Seeds of the regression list's ``xfail`` lines: open defects, replayed there, not here."""
    return {p.values[0] for p in regression_seeds() if p.marks}


def test_budget_local_tiers():
    _run_all(s for s in BUDGET_LOCAL if s not in open_seeds())


def test_budget_with_redis(module_redis):
    _run_all((s for s in BUDGET_REDIS if s not in open_seeds()), module_redis)


@pytest.mark.parametrize("seed, with_redis, known_open", regression_seeds())
def test_regression_seed(seed, with_redis, known_open, module_redis):
    """Every seed that ever failed passes (``xfail`` lines: see ``regression_seeds``)."""
    run(seed, redis=module_redis if with_redis else None, known_open=known_open)


FOUND = mutations.FOUND_BY  # mutation -> (seed, with_redis): the first schedule that found it
SEARCH = 6  # schedules tried from that seed on
HANG_LIMIT_S = 10.0  # the step limit under a mutation (the default is long: a loaded machine)


@pytest.mark.parametrize("name", sorted(FOUND))
def test_a_reintroduced_defect_is_found(name, module_redis, monkeypatch):
    """The seed that found the mutation (or one of the few after it: a schedule's lookups and
    holds run against the machine's clock, so on a loaded machine the interleaving that showed
    the defect may come a schedule or two later) fails with it, and passes without it."""
    seed, with_redis = FOUND[name]
    redis = module_redis if with_redis else None
    found = None
    # a mutation that hangs a step is found by the watchdog: a step takes milliseconds
    monkeypatch.setattr(simulator, "STEP_LIMIT_S", HANG_LIMIT_S)
    with mutations.applied(name):
        for s in range(seed, seed + SEARCH):
            try:
                run(s, redis=redis)
            except Violation:
                found = s
                break
    monkeypatch.undo()
    assert found is not None, f"{name}: no violation in seeds {seed}-{seed + SEARCH - 1}"
    run(found, redis=redis)


def test_a_seed_replays_its_history():
    a, b = run(3), run(3)
    assert a.history == b.history and a.steps == b.steps and len(a.history) > 50
