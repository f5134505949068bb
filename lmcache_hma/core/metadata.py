"""The one message from the scheduler half to the worker half, per step.

Built in the scheduler (``build_connector_meta``), pickled by vLLM, read in the
worker. Objects are named by kind, chunk index and chunk hash; the worker
derives their blocks from the layout, so the message stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_hma.core.kinds import ObjectKind


@dataclass(frozen=True)
class ObjectRef:
    kind: ObjectKind
    chunk: int  # chunk index; a tail sits at the chunk's end boundary
    chunk_hash: bytes  # prefix digest through the end of ``chunk`` (keys.ChunkHasher)
    # TURN: the turn end (tokens [chunk * C, end) of the partial chunk ``chunk``, keyed by
    # ``keys.ChunkHasher.turn_digest``), and STATE at a turn end (``turn_state``) under the same
    # key; TURNMARK (keyed by chunk - 1's digest): the end to add. 0: at the chunk's end.
    end: int = 0
    # TURN (and its TURNMARK entry): its sliding KV starts at its chunk's start, the window before
    # that being the tail there, which a hit loads beside it (``HybridLayout.turn_needs_tail``);
    # keyed apart (``keys.ChunkHasher.turn_digest``). False: it holds the whole window.
    on_tail: bool = False
    # FULL: chunk - 1's digest (b"" for chunk 0); TURN: the digest its marker is keyed by. The
    # store's eviction keeps what others need (store.value_policy); the rest find theirs by key.
    # Not part of its identity.
    parent: bytes = field(default=b"", compare=False)
    # A boundary object (tail, state, turn end): tokens a hit through it restores beyond what the
    # request that stored it could restore before (0: unknown). Its value to the store's eviction.
    gain: int = field(default=0, compare=False)
    # A turn end (or the tail standing for one): the turn end its request's hit read and extended,
    # with that turn end's tail (``on_tail``) and states. Only a request that diverges exactly there
    # reads them again (a retry of that turn, an edit), the conversation goes on through this one:
    # the store's eviction ranks them as never used (``store.value_policy``).
    supersedes: tuple["ObjectRef", ...] = field(default=(), compare=False)
    # A tail stored on speculation (``scheduler.admission.SPARE``): the worker gathers it only while
    # the local tiers have room (``hma_spare_tail_fill``), and the store's eviction ranks it as
    # never used until a hit reads it (``store.value_policy.Line.spare``).
    spare: bool = field(default=False, compare=False)


def hit_objects(first: int, hashes: Sequence[bytes], has_sliding: bool,
                has_state: bool = False) -> list[ObjectRef]:
    """What a hit through chunks ``first .. first + len(hashes) - 1`` loads: their full
    objects and, for a model with sliding windows, the tail at the hit's boundary; for a
    model with recurrent-state groups, the state at the hit's boundary."""
    refs = _chunks(first, hashes)
    if has_sliding:
        refs.append(ObjectRef(ObjectKind.TAIL, first + len(hashes) - 1, hashes[-1]))
    if has_state:
        refs.append(ObjectRef(ObjectKind.STATE, first + len(hashes) - 1, hashes[-1]))
    return refs


def turn_hit_objects(first: int, hashes: Sequence[bytes], turn: ObjectRef,
                     has_state: bool = False) -> list[ObjectRef]:
    """What a hit at a turn end loads: the full objects of chunks ``first ..
    turn.chunk - 1`` (``hashes``) and the turn end's own object (its partial chunk's KV and
    the sliding tail at its end; ``turn.on_tail``: the tail at ``turn.chunk``'s start holds the
    part of the window before the chunk, unless vLLM's prefix cache has it: no ``hashes``); for
    a model with recurrent-state groups, the states at its end (``turn_state``)."""
    return _chunks(first, hashes) + list(turn_hit_boundary(turn, hashes[-1] if hashes else None, has_state))


def _chunks(first: int, hashes: Sequence[bytes]) -> list[ObjectRef]:
    """The full objects of chunks ``first, ...``, each naming the one before it (the first's is
    not known here)."""
    return [ObjectRef(ObjectKind.FULL, first + i, h, parent=hashes[i - 1] if i else b"") for i, h in enumerate(hashes)]


def turn_hit_boundary(turn: ObjectRef, tail_hash: Optional[bytes], has_state: bool = False) -> tuple[ObjectRef, ...]:
    """The objects a hit at ``turn`` reads beyond whole chunks: the tail at ``turn.chunk``'s start
    where it is ``on_tail`` (``tail_hash``: the digest of the chunk before it; None: not read, vLLM's
    prefix cache has that window), the turn end, its states."""
    out = [ObjectRef(ObjectKind.TAIL, turn.chunk - 1, tail_hash)] if turn.on_tail and tail_hash is not None else []
    out.append(turn)
    if has_state:
        out.append(turn_state(turn))
    return tuple(out)


def turn_state(turn: ObjectRef) -> ObjectRef:
    """The state object of a turn end (``turn``: its TURN ref): the recurrent states after
    ``turn.end`` tokens, under the turn end's key."""
    return ObjectRef(ObjectKind.STATE, turn.chunk, turn.chunk_hash, turn.end)


@dataclass
class LoadSpec:
    """Load ``objects`` into the request's blocks for tokens ``[start, end)``."""

    req_id: str
    block_table: tuple[list[int], ...]
    start: int  # first token to load (vLLM's local hit, block-aligned)
    end: int  # the hit boundary
    objects: list[ObjectRef]
    sync: bool = False  # the worker holds the objects; vLLM computes the request this step
    lookup: int = -1  # the lookup whose held objects a synchronous load takes


@dataclass
class SaveSpec:
    """Store ``objects``, whose KV this step computed, from the request's blocks."""

    req_id: str
    block_table: tuple[list[int], ...]
    objects: list[ObjectRef]
    # STATE objects: chunk -> the block vLLM handed off for the boundary at the chunk's end,
    # one per recurrent-state group (layout order). Never derived from block-table positions.
    state_blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # A finished request's turn end (scheduler.turn_ends): gathered first thing in the step
    # (worker.gathers.gather_turn_ends), before vLLM writes the blocks it gave back; or, where
    # vLLM keeps them for it (``blocks_kept``: request_finished returned True), reported in
    # ``finished_sending`` once gathered.
    finished: bool = False
    blocks_kept: bool = False


@dataclass
class HMAConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # (request, n): lookups of the request numbered up to n will not be used; what they hold goes back
    released: list[tuple[str, int]] = field(default_factory=list)
    # Blocks vLLM allocated in this step: the only ones it writes before and in the forward
    # (new tokens, copy-on-write copies). None: not known, assume any.
    new_blocks: Optional[frozenset[int]] = None
    # vLLM's cache reset reached the connector: workers that do not answer lookups (tensor or
    # pipeline rank > 0) empty their tiers too (rank 0 did when asked)
    reset: bool = False
    # The scheduler's cache resets so far when this was built: a worker that has applied a
    # later reset stores none of its saves (KV computed before a reset, e.g. with old weights)
    epoch: int = 0
    # KV cache events on and the step schedules nothing: the engine steps only to collect the
    # workers' tier records (scheduler.kv_events), which may wait a little for them
    idle: bool = False
