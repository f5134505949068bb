"""Objects fetched and verified at lookup time, held until the step that loads them.

Runs in the worker (rank 0: the lookup server's thread holds, the step takes).
A lookup fetches and verifies every object of a hit at once (from CPU memory,
disk or Redis) and holds them here under the request's id; the scheduler then
promises the hit as a synchronous load (no extra engine step), and the load
scatters from these references. LMCache never evicts an object that someone
else references, and a reference keeps the bytes alive even if the entry is
removed meanwhile: the promised load cannot fail (vLLM could not recompute a
failed synchronous load of a model with several KV cache groups).

Held bytes are bounded: past ``max_bytes`` a lookup does not hold (the hit is
then loaded asynchronously, as from disk or Redis).
"""

from __future__ import annotations

import threading
from typing import Optional

from lmcache_hma.store import release

Held = dict  # (ObjectKind, chunk hash) -> (LMCache memory object, the tier it came from)


class HeldObjects:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._by_request: dict[str, tuple[Held, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def room_for(self, nbytes: int) -> bool:
        with self._lock:
            return self._bytes + nbytes <= self.max_bytes

    def hold(self, req_id: str, objects: Held, nbytes: int) -> bool:
        """Keep ``objects`` for ``req_id`` (replacing what it held); False (and released) if over budget."""
        self.release(req_id)
        with self._lock:
            if self._bytes + nbytes <= self.max_bytes:
                self._by_request[req_id] = (objects, nbytes)
                self._bytes += nbytes
                return True
        release_all(objects)
        return False

    def take(self, req_id: str) -> Optional[Held]:
        """The objects held for ``req_id`` (the caller releases them), or None."""
        with self._lock:
            entry = self._by_request.pop(req_id, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            return entry[0]

    def release(self, req_id: str) -> None:
        objects = self.take(req_id)
        if objects:
            release_all(objects)

    def release_everything(self) -> None:
        with self._lock:
            ids = list(self._by_request)
        for req_id in ids:
            self.release(req_id)

    @property
    def held_bytes(self) -> int:
        return self._bytes


def release_all(objects: Held) -> None:
    """Give back every object of a ``Held`` mapping."""
    for obj, _ in objects.values():
        release(obj)
