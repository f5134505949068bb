"""Shared pytest fixtures.

``redis_server`` (a real, empty redis-server on a free loopback port) and
``redis_yaml`` (a copy of configs/redis.yaml with a given URL): see tests/redis_server.py.
"""

from tests.redis_server import redis_server, redis_yaml  # noqa: F401  (pytest fixtures)


def pytest_terminal_summary(terminalreporter):
    from tests.engines import TIE_STATS

    if TIE_STATS["comparisons"]:
        terminalreporter.write_line(
            f"greedy comparisons: {TIE_STATS['comparisons']}, ended at a reference near-tie: "
            f"{TIE_STATS['ended_at_a_tie']}")
