"""LMCache's ``StorageManager`` as the chunk store opens it, and the memory objects it gives.

The manager is made for one namespace (LMCache's metadata: the full-attention model field,
world size and rank, KV dtype, chunk size), with a workaround for the environment it
changes; its allocator gives every object its memory (``chunk_store.ChunkStore.allocate``).
An object is handled as one flat tensor (``flat``) and given back when done (``release``):
the chunk store, the worker's loads, gathers and holds, the tests and the benchmarks all
use these two, without the rest of the chunk store.
"""

from __future__ import annotations

import gc
import os

import torch

from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind

_PROM_DIR = "PROMETHEUS_MULTIPROC_DIR"


def open_storage_manager(lmcache_config, namespace: Namespace):
    """LMCache's ``StorageManager`` (its tiers and its allocator) for ``namespace``'s objects."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    n_layers = len(namespace.layout.layer_names)
    metadata = LMCacheMetadata(
        model_name=namespace.model_field(ObjectKind.FULL),
        world_size=namespace.world_size,
        local_world_size=namespace.world_size,
        worker_id=namespace.rank,
        local_worker_id=namespace.rank,
        kv_dtype=namespace.kv_dtype,
        kv_shape=(n_layers, 2, lmcache_config.chunk_size, 1, 1),
        role="worker",
        chunk_size=lmcache_config.chunk_size,
    )
    # Workaround: LMCache's PrometheusLogger sets PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus
    # in this process's environment when it is unset; every process started from here later
    # (a test's or a benchmark's vLLM server) then sums stale metric files of other
    # processes in that shared directory into its /metrics. Restore the environment.
    saved = os.environ.get(_PROM_DIR)
    # Workaround: a memory object LMCache never freed frees itself when garbage-collected
    # (``MemoryObj.__del__`` -> allocator ``free``), and that takes LMCache's shared, non-reentrant
    # observability lock. A collection that runs while this thread holds that lock (e.g. inside
    # ``LocalCPUBackend._setup_metrics`` here) deadlocks the thread for good: a test process hung
    # so after an earlier store's objects became garbage. Collect before taking it here.
    gc.collect()
    try:
        return StorageManager(lmcache_config, metadata, EventManager())
    finally:
        if saved is None:
            os.environ.pop(_PROM_DIR, None)


def flat(obj) -> torch.Tensor:
    """An LMCache memory object's tensor as the 1-D object (a view)."""
    return obj.tensor.reshape(-1)


def release(obj) -> None:
    """Give a fetched LMCache memory object back to its allocator."""
    obj.ref_count_down()


def retain(obj) -> None:
    """One more reference to a fetched LMCache memory object (each one ``release``d once)."""
    obj.ref_count_up()
