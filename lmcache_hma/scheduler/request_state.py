"""What the scheduler half tracks of one request (vLLM's scheduler process, EngineCore): its keys,
its last lookup's answer, what it stored, what its producer promised. Plain data: the rules that
read and move it are the scheduler half's and its helpers' (``turn_ends``, ``promises``,
``turn_end_landing``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.scheduler.promises import NONE, Promise
from lmcache_hma.scheduler.request_keys import RequestKeys


@dataclass
class RequestState:
    request: Any  # vllm.v1.request.Request
    keys: RequestKeys  # its chunk digests, extended as its tokens grow (request_keys)
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save from this request
    hit: int = 0  # boundary the last lookup answered
    held: bool = False  # the worker holds the objects of that hit: a synchronous load
    lookup: int = -1  # number of the last lookup sent for this request (the worker tags holds with it)
    hit_tiers: tuple[str, ...] = ()  # the tier of each chunk of the hit, from its first chunk on
    stored_run: int = 0  # chunks [0, stored_run) had full objects stored at its last lookup
    turn_counted: bool = False  # a turn end it hit was counted (scheduler.admission)
    tails: set = field(default_factory=set)  # chunks whose tail it stored or its hit loaded (turn_ends.turn_end_save)
    last_boundary: int = 0  # the last boundary whose tail or state it stored (ObjectRef.gain)
    turn: Optional[ObjectRef] = None  # the hit ends at this stored turn end (scheduler.turn_ends)
    logged: bool = False
    load_failed: bool = False  # a promised load failed: no more external hits
    state_floor: int = 0  # recurrent states at boundaries <= this came from the store
    saved_states: set = field(default_factory=set)  # chunks whose state this request stored
    skip_save: bool = False  # the request asked not to be stored (it may still hit)
    computed_from: int = -1  # tokens it had computed (hits) when first scheduled; -1: not yet
    prompt_turn: int = 0  # kv_producer: the turn end at L - 1 it stores (save_plan.StepSaves._prompt_turn_end)
    promise: Promise = NONE  # kv_consumer: what its producer said it stored (scheduler.promises)
    waits: int = 0  # kv_consumer: lookups that found less than promised (asked again next step)

    @property
    def hashes(self) -> list[bytes]:
        """The digests hashed so far (``keys.ensure`` extends them)."""
        return self.keys.digests
