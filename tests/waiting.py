"""Waiting in tests: poll a condition until it holds or a deadline passes, never a fixed sleep."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 10.0, what: str = "a condition",
             interval: float = 0.02) -> T:
    """``condition()``'s first truthy value, polled every ``interval`` s; AssertionError naming
    ``what`` once ``timeout`` s passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout} s")
        time.sleep(interval)


def on_disk(store, objects) -> bool:
    """Whether every (kind, chunk hash) of ``objects`` is written to ``store``'s disk tier.

    LMCache's disk tier writes a file on its own thread and indexes the key only once the
    file is complete (``LocalDiskBackend.async_save_bytes_to_disk``).
    """
    disk = store._manager.storage_backends["LocalDiskBackend"]
    return all(disk.contains(store.key(kind, h)) for kind, h in objects)
