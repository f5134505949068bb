"""The gate on tie statistics (conftest.py): a run whose greedy comparisons mostly ended at a
near-tie fails, even when each test passed; a run of a few comparisons is not judged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines import ENGINE_LOG, ENGINE_LOG_OWNER, TIE_STATS, TIE_TESTS, TIE_TOL, Gen, same_greedy, tie_verdict

REPO = Path(__file__).resolve().parents[1]
DEMO = "LMCACHE_HMA_TIE_DEMO"  # "ties,comparisons" for test_comparisons_on_request


def test_tie_verdict_judges_only_enough_comparisons():
    assert tie_verdict({"comparisons": 0, "ended_at_a_tie": 0}) is None
    assert tie_verdict({"comparisons": 5, "ended_at_a_tie": 5}) is None  # a few tests selected
    assert tie_verdict({"comparisons": 100, "ended_at_a_tie": 5}) is None
    assert "6 of 100" in tie_verdict({"comparisons": 100, "ended_at_a_tie": 6})
    assert tie_verdict({"comparisons": 20, "ended_at_a_tie": 2}) is not None


@pytest.fixture
def own_stats():
    """These made-up comparisons do not count in the run's tie statistics."""
    saved, tests = dict(TIE_STATS), list(TIE_TESTS)
    yield
    TIE_STATS.update(saved)
    TIE_TESTS[:] = tests


def test_same_greedy_stops_only_at_a_near_tie_after_two_tokens(own_stats):
    ref = Gen([1, 2, 3, 4], 0, [1.0, 1.0, TIE_TOL / 2, 1.0])
    assert same_greedy(ref, Gen([1, 2, 9, 9], 0, []))  # ended at the tie at position 2
    assert not same_greedy(ref, Gen([1, 2, 3, 9], 0, []))  # position 3 was decisive
    assert not same_greedy(Gen([1, 2, 3], 0, [1.0, TIE_TOL / 2, 1.0]), Gen([1, 9, 3], 0, []))  # too early
    assert not same_greedy(ref, Gen([1, 2, 9, 9], 0, []), tol=TIE_TOL / 4)


@pytest.mark.skipif(DEMO not in os.environ, reason="run by test_a_run_with_too_many_ties_fails")
def test_comparisons_on_request():
    ties, n = map(int, os.environ[DEMO].split(","))
    ref = Gen([1, 2, 3], 0, [1.0, 1.0, 0.0])
    for i in range(n):  # each ends at the tie at position 2, or agrees throughout
        assert same_greedy(ref, Gen([1, 2, 9 if i < ties else 3], 0, []))


@pytest.mark.parametrize("ties,n,fails,workers", [(1, 20, False, 0), (3, 3, False, 0), (3, 20, True, 0),
                                                   (1, 20, False, 2), (3, 20, True, 2)])
def test_a_run_with_too_many_ties_fails(ties, n, fails, workers):
    """In one process, and under pytest-xdist (``make test``), where a worker makes the
    comparisons and the controller judges them."""
    env = {k: v for k, v in os.environ.items() if k not in (ENGINE_LOG, ENGINE_LOG_OWNER)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                          f"{Path(__file__).relative_to(REPO)}::test_comparisons_on_request"],
                         cwd=REPO, env={**env, DEMO: f"{ties},{n}"}, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert "1 passed" in out and f"greedy comparisons: {n}, ended at a reference near-tie: {ties}" in out, out
    assert (run.returncode != 0) == fails and ("FAILED (tie statistics)" in out) == fails, out
