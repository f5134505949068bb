"""Defects from the project's history, re-introduced one at a time by a switch (a monkeypatch of
the product for the duration of a run; nothing of it is left in the product), to show that the
simulator finds each class of defect. ``applied(name)`` is the switch; ``MUTATIONS`` names them
with the commit that fixed each (docs/testing.md has the table of schedules until found)."""

from __future__ import annotations

import contextlib

MUTATIONS: dict = {}


def mutation(name: str, fixed_by: str, what: str):
    def register(fn):
        MUTATIONS[name] = (fn, fixed_by, what)
        return fn
    return register


@contextlib.contextmanager
def applied(name):
    if not name:
        yield
        return
    fn, _, _ = MUTATIONS[name]
    undo = []

    def patch(obj, attr, value):
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    fn(patch)
    try:
        yield
    finally:
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)


@contextlib.contextmanager
def redis_for_sim(wanted: bool):
    """A real redis-server on loopback for the run (None when not wanted)."""
    if not wanted:
        yield None
        return
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
