"""lmcache_hma's own keys (``hma_*``): each one's type, default, meaning, range and choices.

Given under ``extra_config`` in the LMCache YAML or directly in vLLM's
``kv_connector_extra_config``; ``settings`` reads and checks them, ``lmcache_keys`` renders this
table into docs/configuration.md.
"""

from __future__ import annotations

from typing import Any

from lmcache_hma.config.remote_url import DEFAULT_TIMEOUT_S, DEFAULT_TURN_END_TTL_S

# adapter key -> (type, default, meaning)
ADAPTER_KEYS: dict[str, tuple[type, Any, str]] = {
    "hma_checkpoint_interval": (
        int, 0,
        "tokens between stored sliding-window tails, besides prompt ends and branch points, and "
        "where vLLM keeps recurrent states (its prefix_cache_retention_interval, unless set); a "
        "multiple of chunk_size. 0: with hma_tail_admission branch, the span whose full-attention KV "
        "weighs as much as one tail (tails at most double what is stored); with interval, and for "
        "states, the largest sliding window rounded up to chunk_size",
    ),
    "hma_tail_admission": (
        str, "branch",
        "where sliding-window tails and recurrent states are stored: 'branch' at each prompt's last "
        "whole chunk and at branch points lookups find (a run of stored chunks past the last stored "
        "tail: the request that computes past it stores the tail there), a turn end after a stored "
        "tail holding its own chunk only, and turn ends sampled where none is read; 'interval' also "
        "at every hma_checkpoint_interval, every turn end whole (more bytes, hits on a cold branch "
        "one request sooner)",
    ),
    "hma_spare_tail_fill": (
        float, 0.5,
        "with hma_tail_admission branch and hma_eviction value: also store a prompt's tails at every "
        "checkpoint interval (the largest window rounded up to chunk_size) that branch skips, while "
        "every local tier (CPU, "
        "disk) is below this fraction of its size, each worth nothing until a hit reads it (dropped "
        "first): the first prompt sharing part of another hits there instead of up to a sparse "
        "interval short; 0: never (nor with a Redis tier alone, whose fill this instance cannot see, "
        "nor with hma_share_parallel_shapes)",
    ),
    "hma_eviction": (
        str, "value",
        "what the CPU and disk tiers drop when full: 'value' keeps them prefix-closed (only objects "
        "no other stored object needs are dropped, unreachable ones first) and drops the least "
        "value per byte (hits x tokens restored / bytes, aged), and makes room the same way in a "
        "Redis under maxmemory before each write; 'lru' is LMCache's cache_policy (and Redis's own "
        "eviction alone)",
    ),
    "hma_redis_turn_end_ttl_s": (
        float, DEFAULT_TURN_END_TTL_S,
        "Redis: turn ends (a finished request's last partial chunk) expire after this many seconds "
        "unless a later turn read them (a read renews it); every part of a turn end expires with it "
        "(its recurrent states, its marker: renewed by each turn end it lists); 0: they never expire. "
        "Nothing else gets a TTL: with maxmemory-policy allkeys-lfu (docs/redis.md) Redis drops what is read least",
    ),
    "hma_store_answers": (
        bool, None,
        "store the KV a request computes while decoding (its answer) as well as its prompt's, so a "
        "conversation's next turn hits the answer too; false: prompt chunks only (e.g. for "
        "sampling-heavy traffic whose answers are never sent back). Unset: true, but false for "
        "models with recurrent-state (gated delta net) layers, whose states computed while decoding "
        "are not bit-equal to a prefill's (a later turn can then differ from recomputing, as with "
        "vLLM's own prefix cache); true turns it on for them too",
    ),
    "hma_share_parallel_shapes": (
        bool, False,
        "store KV and recurrent states in a format with no tensor-parallel size, rank or block size in "
        "it (one object per KV head, per state shard), so instances of different TP sizes and block "
        "sizes share one store; KV computed at another TP size may differ in its last bits "
        "(docs/tp_sharing.md); not with pipeline parallelism",
    ),
    "hma_consumer_stores_answers": (
        bool, False,
        "disaggregated prefill: a kv_consumer (decode instance) stores the KV of its answers (the "
        "chunks past the prompt and the turn end) for a conversation's next turn, whichever instance "
        "prefills it; off, a kv_consumer writes nothing (its prompts' KV came from the producer)",
    ),
    "hma_verify_checksums": (bool, True, "check each loaded object's CRC32"),
    "hma_lookup_timeout_s": (float, 5.0, "scheduler waits this long for a lookup answer, then treats it as a miss"),
    "hma_stats_file": (str, "", "worker writes its byte counters here as JSON (for tests and benchmarks)"),
    "hma_remote_timeout_s": (
        float, DEFAULT_TIMEOUT_S,
        "Redis remote tier: deadline of each whole call (connect, handshake, every send and "
        "receive; reads and writes get their bytes' time at 64 MiB/s on top), and of the health "
        "check that bypasses an unreachable Redis until it answers again",
    ),
    "hma_shared_secret": (
        str, "",
        "a secret shared by every deployment trusted to write the shared tiers (at least 16 "
        "characters; ${ENV_VAR} is expanded): keys and object trailers are HMACs under it, so "
        "objects written without it are never loaded and keys reveal nothing about prompts",
    ),
    "hma_store_queue_objects": (
        int, 256,
        "stores are sealed and put on a background thread; at most this many wait, past it a "
        "store is dropped (a future miss, counted) instead of blocking the engine",
    ),
    "hma_test_corrupt_loads": (
        str, "",
        "TEST ONLY: overwrite loaded KV with noise after the checks, to prove tests can fail: a "
        "comma list applied to successive loads, each 'all', 'full_attention', 'sliding_window' or "
        "'recurrent_state'",
    ),
    "hma_test_fail_loads": (int, 0, "TEST ONLY: fail this many asynchronous loads after the hit was promised"),
    "hma_test_fail_sync_loads": (
        int, 0, "TEST ONLY: fail this many attempts of synchronous loads (each load retries once)",
    ),
    "hma_test_lookup_delay_s": (float, 0.0, "TEST ONLY: send every lookup answer this many seconds after it was found"),
}

# adapter key -> (bound, comparison) its value must satisfy (every other number: >= 0)
ADAPTER_LIMITS: dict[str, tuple[float, str]] = {
    "hma_lookup_timeout_s": (0, ">"),
    "hma_remote_timeout_s": (0, ">"),
    "hma_store_queue_objects": (1, ">="),
}
# adapter key -> the values it may take
ADAPTER_CHOICES: dict[str, tuple[str, ...]] = {
    "hma_tail_admission": ("branch", "interval"),
    "hma_eviction": ("value", "lru"),
}
