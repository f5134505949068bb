"""What a worker tells the scheduler about its tiers, for vLLM's KV cache events.

A worker knows when an object landed in (or left) one of its tiers, but not vLLM's
block hashes of the blocks it covers; the scheduler knows those hashes (the requests'
``block_hashes``) but not what the tiers did. So each worker reports plain records,
carried to the scheduler in ``KVConnectorOutput.kv_cache_events`` (vLLM's channel for
connector events, ``get_kv_connector_kv_cache_events``), and the scheduler turns them
into vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
(``scheduler.kv_events``).

A record is a tuple ``(rank, op, tier, kind, chunk_hash)``:

* ``STORED``: object ``(kind, chunk_hash)`` is durable in ``tier`` (``kinds.TIERS``): the
  tier's put succeeded (CPU memory: inserted; disk: file written; Redis: ``+OK``);
* ``REMOVED``: it left ``tier`` (LMCache evicted it, a damaged object was dropped, a reset);
* ``CLEARED``: the worker is about to empty its local tiers (a cache reset); ``tier``,
  ``kind`` and ``chunk_hash`` are None. Records before it describe objects the reset removes;
* ``BUSY``: stores of this worker are still on their way (gathers, the writer's queue, disk
  writes): more records will follow, the scheduler keeps the engine stepping to collect them.

``rank`` is the worker's tensor/pipeline-parallel rank: an object is announced once every
rank stored its share. Records keep their order (one worker's list is in the order things
happened in its tiers).
"""

from __future__ import annotations

from typing import Optional

from vllm.distributed.kv_events import KVConnectorKVEvents

STORED, REMOVED, CLEARED, BUSY = "stored", "removed", "cleared", "busy"

Record = tuple  # (rank, op, tier | None, kind: int | None, chunk_hash: bytes | None)


class TierReports(KVConnectorKVEvents):
    """The records of one step, from one worker, or (after vLLM's ``KVOutputAggregator``
    added the others' ``get_all_events()``) from all of them. Picklable: it crosses from the
    worker processes to the engine core."""

    def __init__(self, records: Optional[list] = None, num_workers: int = 1) -> None:
        self.records: list = list(records or ())
        self.num_workers = num_workers

    def add_events(self, events: list) -> None:
        self.records.extend(events)

    def aggregate(self) -> "TierReports":
        return self  # every worker's records count (an object is announced once all ranks stored it)

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list:
        return self.records

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.records = []

    def __repr__(self) -> str:
        return f"<TierReports {len(self.records)} records from {self.num_workers} workers>"
