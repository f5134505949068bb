"""Shared pytest fixtures, and the gate on the greedy comparisons' tie statistics.

``redis_server`` (a real, empty redis-server on a free loopback port) and
``redis_yaml`` (a copy of configs/redis.yaml with a given URL): see tests/redis_server.py.

At the end of a run the comparisons of ``tests.engines.same_greedy`` are counted: how many
ended at a reference near-tie instead of comparing every token. A run where too many did
fails (``tests.engines.tie_verdict``), whatever its tests said.
"""

import pytest

from tests.redis_server import redis_server, redis_yaml  # noqa: F401  (pytest fixtures)


def pytest_terminal_summary(terminalreporter):
    from tests.engines import TIE_STATS, tie_verdict

    if TIE_STATS["comparisons"]:
        terminalreporter.write_line(
            f"greedy comparisons: {TIE_STATS['comparisons']}, ended at a reference near-tie: "
            f"{TIE_STATS['ended_at_a_tie']}")
    verdict = tie_verdict()
    if verdict:
        terminalreporter.write_line(f"FAILED (tie statistics): {verdict}", red=True, bold=True)


def pytest_sessionfinish(session):
    from tests.engines import tie_verdict

    if tie_verdict() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
