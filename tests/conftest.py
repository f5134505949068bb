"""Shared pytest fixtures.

``redis_server`` (a real, empty redis-server on a free loopback port) and
``redis_yaml`` (a copy of configs/redis.yaml with a given URL): see tests/redis_server.py.
"""

from tests.redis_server import redis_server, redis_yaml  # noqa: F401  (pytest fixtures)
