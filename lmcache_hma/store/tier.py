"""The interface every storage tier implements, and the tiers of a storage manager.

``ChunkStore`` iterates its tiers in LMCache's order (CPU memory, local disk,
remote) through this interface and never names one. A tier answers for many keys
at once because a lookup asks for every object of a hit together and a remote tier
answers them in one round trip.

Per key, ``fetch_many`` gives a memory object (the caller releases it), None (not
there, the tier in trouble, no room: a miss) or a str: the object is there but
unreadable or damaged (the store then removes it from every tier).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

Allocate = Callable[[int], object]  # key index -> a memory object of its size, or None
Check = Callable[[int, object], Optional[str]]  # (key index, object) -> why it is damaged, or None
Stored = Callable[[object], None]  # key -> None: the object is durable in the tier


class Tier:
    label: str = ""  # kinds.TIERS: how hits from it are counted and reported to vLLM
    local = True  # this instance's own (a cache reset empties it); False: shared by the fleet
    memory = False  # objects read from the other tiers are kept here
    trusted = False  # holds only objects sealed here or verified on their way in
    reads_into_new_memory = False  # fetch_many fills objects from ``allocate`` (else the tier's own)

    def usable(self) -> bool:
        """False while the tier is down or bypassed (every call is then a miss or a no-op)."""
        return True

    def fill(self) -> Optional[float]:
        """How full the tier is, a fraction of its size; None: not known."""
        return None

    def present_many(self, keys: Sequence) -> list[bool]:
        raise NotImplementedError

    def touch(self, keys: Sequence) -> None:
        """A hit used the objects under ``keys`` (another tier served them, or this one did
        without its eviction hearing of it): tell the tier's eviction. Nothing by default."""

    def fetch_many(self, keys: Sequence, object_bytes: Sequence[int], allocate: Allocate,
                   check: Optional[Check] = None, deadline: Optional[float] = None) -> list:
        """The objects under ``keys`` (see ``ChunkStore.get_many``); none is read past
        ``deadline`` (``time.monotonic()``): those not in by then are None, like a miss."""
        raise NotImplementedError

    def store_many(self, keys: Sequence, objs: Sequence,
                   on_stored: Optional[Stored] = None, expires: Optional[Sequence[bool]] = None) -> object:
        """Store sealed objects; the tier takes its own references (the caller keeps its own).
        ``on_stored(key)`` runs for each object once it is durable in the tier (never for one
        the tier skipped or failed to write), possibly on another thread. Returns a list: per
        object, whether the tier took it (False: it will never hold it); anything else (None, a
        count) where it cannot tell which. ``expires``: per object, whether it is a part of a
        turn end its key does not name as one (``ChunkStore.commit_many``); a tier without
        expiry ignores it."""
        raise NotImplementedError

    def wait_written(self, key, deadline: float) -> None:
        """Wait (until ``deadline``, ``time.monotonic()``) while a write of ``key`` is under way
        (a rewrite of it would be refused meanwhile). Nothing by default."""

    def make_way(self, key) -> None:
        """Before a rewrite of ``key`` (a turn-end marker): remove what the tier holds under it
        (LMCache's local tiers ignore a put of a key they hold). Nothing by default."""

    def remove(self, key) -> None:
        raise NotImplementedError

    def clear(self, ours: Callable[[object], bool]) -> int:
        """Remove every object whose key is ``ours``; how many. Only local tiers are cleared."""
        return 0

    def observe_removals(self, removed: Stored) -> None:
        """Call ``removed(key)`` whenever the tier drops an object by itself (evictions). A tier
        that cannot tell (a remote tier other instances also write) does nothing."""

    def writes_pending(self) -> bool:
        """Whether puts are still under way (not durable yet)."""
        return False

    def counters(self) -> dict:
        """Counters for the worker's stats (``metrics.METRICS`` names), non-zero ones only."""
        return {}

    def gauges(self) -> dict:
        return {}

    def close(self, timeout_s: float) -> None:
        pass


def tiers_of(manager, lmcache_config) -> list[Tier]:
    """The tiers over LMCache's storage backends, in LMCache's order."""
    from lmcache_hma.store import local_tiers
    from lmcache_hma.store.redis import redis_tiers_for

    tiers: list = []
    for name, backend in manager.storage_backends.items():
        found = local_tiers.for_backend(manager, name, backend)
        if found is None:
            found = redis_tiers_for(manager, name, backend, lmcache_config)
        if found is None:
            raise RuntimeError(f"LMCache storage backend {name} has no lmcache_hma tier")
        tiers.extend(found)
    return tiers
