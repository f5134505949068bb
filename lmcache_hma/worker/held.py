"""Objects fetched and verified at lookup time, held until the step that loads them.

Runs in the worker (rank 0: the lookup server's thread holds, the step takes).
A lookup fetches and verifies every object of a hit at once (from CPU memory,
disk or Redis) and holds them here under the request's id and the lookup's
number; the scheduler then promises the hit as a synchronous load (no extra
engine step), and the load scatters from these references. LMCache never evicts
an object that someone else references, and a reference keeps the bytes alive
even if the entry is removed meanwhile.

Every hold is given back on every path: taken by the load of its lookup; released
when the scheduler says it will not use lookups up to a number (a late answer, a
timed-out or superseded lookup, a hit vLLM did not take, a finished request). A
release may overtake the answer it voids (the answer was late): the void is
remembered, and that answer's objects are given back instead of held.

Voids are remembered by time, not by count: a hold is taken only before its lookup's
deadline (checked under the same lock as releases), and a lookup's deadline is at most
one lookup timeout after the scheduler sent it, hence after any release that voids it.
So a void older than ``void_keep_s`` (the lookup timeout) can void nothing any more,
however many other releases came in between.

A cache reset never takes away what a step already promised: the load of a built
step may still run after the reset (under vLLM's async scheduling the engine runs
utility calls such as ``reset_prefix_cache`` between scheduling step N and the
worker's ``start_load_kv`` of step N). The reset only stops holds made before it
from serving a *new* lookup (``forget_for_new_lookups``); each is still taken by its
own lookup's load or released by the scheduler as usual.

Held bytes are bounded: past ``max_bytes`` a lookup does not hold (the hit is
then loaded asynchronously: fetched in the step, the request waiting for it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from lmcache_hma.store.lmcache_storage import release

Objects = dict  # (ObjectKind, chunk hash) -> (LMCache memory object, the tier it came from)


@dataclass
class Hold:
    lookup: int  # the scheduler's number of the lookup that holds it
    first: int  # the hit's first chunk
    hashes: tuple[bytes, ...]  # the hit's chunk digests
    objects: Objects
    nbytes: int
    tiers: tuple[str, ...] = ()  # where each chunk's objects were (the lookup's answer)
    deadline: Optional[float] = None  # time.monotonic() past which it is not held (None: no limit)
    reusable: bool = True  # may serve a later lookup of its request (False once a reset came)
    turn_end: int = 0  # the hit ends at this turn end (its object is among ``objects``)
    turn_on_tail: bool = False  # ... stored ``on_tail`` (ObjectRef.on_tail)
    marks_unread: bool = False  # the marker after its chunks could not be read (late, damaged)


class HeldObjects:
    def __init__(self, max_bytes: int, void_keep_s: float):
        self.max_bytes = max_bytes
        self.void_keep_s = void_keep_s  # at least the lookup timeout (see the module's docstring)
        self._by_request: dict[str, Hold] = {}
        # req -> (lookups up to this number are void, time.monotonic() of the release); oldest first
        self._voided: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def room_for(self, nbytes: int) -> bool:
        with self._lock:
            return self._bytes + nbytes <= self.max_bytes

    def hold(self, req_id: str, hold: Hold) -> bool:
        """Keep ``hold`` for ``req_id`` (replacing what it held). False, and its objects given
        back, if over budget, past its deadline, or if its lookup was voided already."""
        with self._lock:
            old = self._pop(req_id)
            ok = (hold.lookup > self._void_up_to(req_id)
                  and (hold.deadline is None or time.monotonic() < hold.deadline)
                  and self._bytes + hold.nbytes <= self.max_bytes)
            if ok:
                self._by_request[req_id] = hold
                self._bytes += hold.nbytes
        if old is not None:
            release_all(old.objects)
        if not ok:
            release_all(hold.objects)
        return ok

    def reuse(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
              turn_ends: bool = False) -> Optional[Hold]:
        """The hold of ``req_id`` that answers this lookup too (same first chunk, its digests
        all of ``hashes``), now tagged with ``lookup``; None if there is none.
        vLLM asks again about a request it could not allocate for (KV pressure): the held
        objects serve the new lookup without another fetch inside ``schedule()``. A hold of
        fewer chunks than asked about does not: more of them may be stored since (the
        request's own saves before a preemption), and the lookup answers the longer hit. Nor
        does a hold whose lookup found a marker it could not read (too late, damaged) answer a
        lookup that asks for turn ends (``turn_ends``): read now, the marker may name one."""
        with self._lock:
            hold = self._by_request.get(req_id)
            if (hold is None or not hold.reusable or lookup <= self._void_up_to(req_id)
                    or hold.first != first or tuple(hashes) != hold.hashes
                    or (turn_ends and hold.marks_unread)):
                return None
            hold.lookup = lookup
            return hold

    def take(self, req_id: str, lookup: int) -> Optional[Objects]:
        """The objects lookup ``lookup`` holds for ``req_id`` (the caller releases them), or None.
        A hold of another lookup stays (it is released by its own path)."""
        with self._lock:
            hold = self._by_request.get(req_id)
            if hold is None or hold.lookup != lookup:
                return None
            return self._pop(req_id).objects

    def release(self, req_id: str, up_to: int) -> None:
        """Lookups of ``req_id`` numbered ``up_to`` or lower will not be used: give back what
        they hold, and what they will hold if their answer is still under way."""
        with self._lock:
            now = time.monotonic()
            self._voided[req_id] = (max(up_to, self._void_up_to(req_id)), now)
            self._voided.move_to_end(req_id)
            while self._voided:  # oldest first: drop the voids that can void nothing any more
                oldest = next(iter(self._voided.values()))
                if now - oldest[1] <= self.void_keep_s:
                    break
                self._voided.popitem(last=False)
            hold = self._by_request.get(req_id)
            hold = self._pop(req_id) if hold is not None and hold.lookup <= up_to else None
        if hold is not None:
            release_all(hold.objects)

    def forget_for_new_lookups(self) -> None:
        """A cache reset: no hold made before it serves a new lookup (``reuse``); each is still
        taken by its own lookup's load (a step may have promised it) or released as usual."""
        with self._lock:
            for hold in self._by_request.values():
                hold.reusable = False

    def _void_up_to(self, req_id: str) -> int:
        void = self._voided.get(req_id)
        return void[0] if void is not None else -1

    def release_everything(self) -> None:
        with self._lock:
            holds = [self._pop(r) for r in list(self._by_request)]
        for hold in holds:
            release_all(hold.objects)

    def _pop(self, req_id: str) -> Optional[Hold]:
        hold = self._by_request.pop(req_id, None)
        if hold is not None:
            self._bytes -= hold.nbytes
        return hold

    @property
    def held_bytes(self) -> int:
        return self._bytes


def release_all(objects: Objects) -> None:
    """Give back every object of an ``Objects`` mapping."""
    for obj, _ in objects.values():
        release(obj)
