"""Every vLLM symbol, field and behaviour the connector relies on, as data.

``test_vllm_versions`` checks each against each supported release's source
(``vllm_sources``); ``python -m tests.vllm_surface`` prints the table of where each is
(file:line per release) that ``docs/vllm_versions.md`` quotes. A ``Use`` names a module-level
class, function or constant (``name``), or a member of a class (``"Class.member"``: a field,
method, property, enum member or an attribute its constructor sets); ``params``: the leading
parameter names a function must take. ``releases``: where it must exist (``None``: all); a
symbol absent from a release the connector supports must be reached through a
``vllm_compat`` predicate, named in ``note``. A ``Behaviour`` is a line of vLLM's code whose
presence the connector's order or recovery depends on (a regex).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ALL = None
FROM_33 = ((0, 33), (0, 34))
UNTIL_33 = ((0, 32), (0, 33))


@dataclass(frozen=True)
class Use:
    path: str  # in the vllm package
    name: str
    by: str  # the project's module that uses it
    params: tuple = ()
    releases: Optional[tuple] = ALL
    note: str = ""


@dataclass(frozen=True)
class Behaviour:
    path: str
    pattern: str
    what: str
    by: str
    releases: Optional[tuple] = ALL


def _members(path: str, cls: str, names: str, by: str, **kw) -> list[Use]:
    return [Use(path, cls, by, **kw)] + [Use(path, f"{cls}.{n}", by, **kw) for n in names.split()]


BASE = "distributed/kv_transfer/kv_connector/v1/base.py"
KVI = "v1/kv_cache_interface.py"
UTILS = "v1/core/kv_cache_utils.py"
OUTPUT = "v1/core/sched/output.py"
POOL = "v1/core/block_pool.py"

USES: list[Use] = [
    # the connector API (connector.py, core/metadata.py)
    *_members(BASE, "KVConnectorRole", "SCHEDULER WORKER", "connector.py"),
    *_members(BASE, "KVConnectorTransferResults", "finished_recving failed_recving", "connector.py"),
    *_members(BASE, "SupportsHMA", "request_finished_all_groups", "connector.py"),
    Use(BASE, "KVConnectorMetadata", "core/metadata.py"),
    *_members(BASE, "KVConnectorBase_V1", "__init__ _get_connector_metadata has_connector_metadata "
              "get_external_cache_hit_sources bind_kv_cache_manager", "connector.py"),
    Use(BASE, "KVConnectorBase_V1.unregister_kv_caches", "connector.py", releases=FROM_33,
        note="sleep mode hooks: vllm_compat.hears_sleep"),
    Use(BASE, "KVConnectorBase_V1.restore_kv_caches", "connector.py", releases=FROM_33,
        note="sleep mode hooks: vllm_compat.hears_sleep"),
    *_members("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorStats",
              "data reset aggregate reduce is_empty", "metrics.py"),
    *_members("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorPromMetrics",
              "__init__ _counter_cls _histogram_cls _gauge_cls", "metrics.py"),
    Use("distributed/parallel_state.py", "get_pp_group", "connector.py"),
    Use("distributed/parallel_state.py", "get_tensor_model_parallel_rank", "connector.py"),
    # KV cache events (scheduler/kv_events.py, core/tier_events.py)
    Use("distributed/kv_events.py", "MEDIUM_CPU", "scheduler/kv_events.py"),
    Use("distributed/kv_events.py", "MEDIUM_STORAGE", "scheduler/kv_events.py"),
    Use("distributed/kv_events.py", "AllBlocksCleared", "scheduler/kv_events.py"),
    *_members("distributed/kv_events.py", "BlockStored", "block_hashes parent_block_hash token_ids "
              "block_size lora_id medium lora_name extra_keys group_idx kv_cache_spec_kind "
              "kv_cache_spec_sliding_window locality ownership", "scheduler/kv_events.py"),
    *_members("distributed/kv_events.py", "BlockRemoved", "block_hashes medium group_idx locality "
              "ownership", "scheduler/kv_events.py"),
    *_members("distributed/kv_events.py", "KVConnectorKVEvents", "add_events aggregate increment_workers "
              "get_all_events get_number_of_workers clear_events", "core/tier_events.py"),
    # KV cache specs and config (core/vllm_layout.py, connector.py, vllm_compat.py)
    *_members(KVI, "FullAttentionSpec", "block_size page_size_bytes num_kv_heads head_size dtype "
              "attention_chunk_size", "core/vllm_layout.py"),
    *_members(KVI, "SlidingWindowSpec", "sliding_window extra_retained_tokens", "core/vllm_layout.py"),
    *_members(KVI, "MambaSpec", "block_size shapes dtypes mamba_type mamba_cache_mode "
              "num_speculative_blocks num_prefill_checkpoint_blocks real_page_size_bytes",
              "core/vllm_layout.py"),
    *_members(KVI, "KVCacheConfig", "num_blocks kv_cache_groups kv_cache_layout hash_block_size "
              "needs_kv_cache_zeroing prefix_cache_retention_interval", "vllm_compat.py"),
    *_members(KVI, "KVCacheGroupSpec", "layer_names kv_cache_spec", "core/vllm_layout.py"),
    Use(KVI, "get_kv_cache_spec_kind", "vllm_compat.py", params=("kv_cache_spec",)),
    Use(KVI, "get_kv_cache_spec_sliding_window", "vllm_compat.py", params=("kv_cache_spec",)),
    Use("model_executor/layers/mamba/mamba_utils.py", "get_conv_state_layout", "core/vllm_layout.py"),
    Use("v1/attention/backends/registry.py", "MambaAttentionBackendEnum.GDN_ATTN", "core/vllm_layout.py"),
    # block hashes and extra keys (vllm_compat.py, core/identity.py)
    Use(UTILS, "resolve_block_hashes", "vllm_compat.py", params=("block_hashes", "hash_block_size", "block_size")),
    Use(UTILS, "maybe_convert_block_hash", "vllm_compat.py", params=("hash_bytes",)),
    Use(UTILS, "generate_block_hash_extra_keys", "core/identity.py",
        params=("request", "start_token_idx", "end_token_idx", "start_mm_idx")),
    Use(UTILS, "to_event_extra_keys", "vllm_compat.py", params=("extra_keys",)),
    # vLLM's device events made one per block hash (scheduler/device_events.py, on the scheduler's pool)
    Use(UTILS, "get_group_id", "scheduler/device_events.py", params=("key",)),
    Use(UTILS, "get_block_hash", "scheduler/device_events.py", params=("key",)),
    Use(POOL, "BlockPool", "scheduler/device_events.py"),
    Use(POOL, "BlockPool.cached_block_hash_to_block", "scheduler/device_events.py"),
    Use(POOL, "BlockPool.cache_full_blocks", "scheduler/device_events.py",
        params=("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")),
    Use(POOL, "BlockPool.cache_partial_block", "scheduler/device_events.py"),
    Use(POOL, "BlockPool._insert_block_hash", "scheduler/device_events.py",
        params=("block_hash_with_group_id", "block", "num_tokens")),
    Use(POOL, "BlockPool._emit_block_removed_events", "scheduler/device_events.py", params=("block_hashes",)),
    Use(POOL, "BlockPool.take_events", "scheduler/device_events.py"),
    Use(POOL, "BlockPool.reset_prefix_cache", "scheduler/device_events.py"),
    Use(POOL, "BlockHashToBlockMap.get_one_block", "scheduler/device_events.py", params=("key",)),
    Use(POOL, "BlockHashToBlockMap.contain", "scheduler/device_events.py", params=("key", "block_id")),
    Use(POOL, "BlockPool.get_cached_block", "scheduler/device_restorable.py",
        params=("block_hash", "kv_cache_group_ids")),
    # the gate's rule is vLLM's: a hit ends at the last block whose state every Mamba group caches
    Use("v1/core/single_type_kv_cache_manager.py", "MambaManager.find_longest_cache_hit",
        "scheduler/device_restorable.py"),
    Use("v1/core/kv_cache_manager.py", "KVCacheManager.block_pool", "connector.py"),
    *_members("v1/metrics/cache_hit_source.py", "CacheHitSource", "HOST DISK P2P EXTERNAL_UNSPECIFIED",
              "vllm_compat.py"),
    # the scheduler's output and the workers' (scheduler/vllm_fields.py, scheduler_half.py)
    *_members(OUTPUT, "SchedulerOutput", "scheduled_new_reqs scheduled_cached_reqs num_scheduled_tokens "
              "new_block_ids_to_zero kv_cache_block_copies kv_connector_block_state preempted_req_ids "
              "finished_req_ids", "scheduler/vllm_fields.py"),
    Use(OUTPUT, "NewRequestData.block_ids", "scheduler/vllm_fields.py"),
    Use(OUTPUT, "CachedRequestData.new_block_ids", "scheduler/vllm_fields.py"),
    Use(OUTPUT, "KVConnectorBlockState.boundary_state_offloads", "scheduler/scheduler_half.py"),
    Use(UTILS, "KVCacheBlockCopy.dst_block_id", "scheduler/vllm_fields.py"),
    *_members("v1/outputs.py", "KVConnectorOutput", "failed_recving kv_cache_events", "connector.py"),
    *_members("v1/request.py", "Request", "request_id block_hashes sampling_params num_prompt_tokens "
              "num_tokens num_computed_tokens all_token_ids lora_request", "scheduler/scheduler_half.py"),
    *_members("lora/request.py", "LoRARequest", "lora_name lora_path adapter_id name", "core/identity.py"),
    Use("sampling_params.py", "SamplingParams.extra_args", "scheduler/vllm_fields.py"),
    # configuration (connector.py, config/speculative.py, core/identity.py, vllm_compat.py)
    *_members("config/vllm.py", "VllmConfig", "kv_transfer_config parallel_config model_config "
              "cache_config speculative_config kv_events_config num_prefill_lookahead_tokens device_config",
              "connector.py"),
    Use("config/device.py", "DeviceConfig.device_type", "vllm_compat.py"),
    # vLLM CPU's page formats (vllm_compat.cpu_page_format, cpu_cache_writer)
    Use("v1/attention/backends/cpu_attn.py", "_get_attn_isa", "vllm_compat.py",
        params=("dtype", "block_size", "head_size", "kv_cache_dtype")),
    Use("_custom_ops.py", "cpu_attn_reshape_and_cache", "vllm_compat.py", releases=UNTIL_33,
        params=("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"),
        note="0.34 moved vLLM CPU's ops to _cpu_ops.py: vllm_compat.cpu_cache_writer"),
    Use("_cpu_ops.py", "cpu_attn_reshape_and_cache", "vllm_compat.py", releases=((0, 34),),
        params=("key", "value", "key_cache", "value_cache", "slot_mapping", "isa")),
    Use("config/vllm.py", "VllmConfig.use_v2_model_runner", "vllm_compat.py", releases=UNTIL_33,
        note="gone in 0.34 (V2 runner only): vllm_compat.only_v2_runner"),
    *_members("config/kv_transfer.py", "KVTransferConfig", "kv_connector_extra_config engine_id "
              "kv_load_failure_policy", "connector.py"),
    Use("config/kv_events.py", "KVEventsConfig.enable_kv_cache_events", "vllm_compat.py"),
    *_members("config/cache.py", "CacheConfig", "prefix_cache_retention_interval cache_dtype", "scheduler/vllm_fields.py"),
    *_members("config/parallel.py", "ParallelConfig", "data_parallel_index tensor_parallel_size "
              "pipeline_parallel_size", "connector.py"),
    *_members("config/model.py", "ModelConfig", "model revision quantization dtype hf_overrides is_hybrid "
              "enable_sleep_mode", "core/identity.py"),
    *_members("config/speculative.py", "SpeculativeConfig", "method draft_model_config uses_draft_kv_cache",
              "config/speculative.py"),
]

BEHAVIOURS: list[Behaviour] = [
    Behaviour(POOL, r"self\.cached_block_hash_to_block\.pop\(block_hash, block\.block_id\)\s*is not None"
              r"\s*\):\s*removed_hashes\.append\(block_hash\)",
              "a copy's eviction announces its hash removed whether or not another copy stays cached",
              "scheduler/device_events.py (BlockRemoved only when the last copy leaves)"),
    Behaviour(UTILS, r"int\.from_bytes\(hash_bytes, byteorder=\"big\"\) & \(\(1 << 64\) - 1\)",
              "an event's block hash: the low 64 bits of vLLM's, big-endian, under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
              "vllm_compat.event_block_hash_converter (the flag read once)"),
    Behaviour("v1/worker/gpu_model_runner.py", r"handle_preemptions\(kv_connector_metadata\)",
              "V1 runner: handle_preemptions first in execute_model, before any KV write",
              "vllm_compat.gathers_may_defer, vllm_compat.first_call_before_kv_writes", UNTIL_33),
    Behaviour("v1/worker/gpu/kv_connector.py", r"self\.kv_connector\.handle_preemptions",
              "V2 runner: handle_preemptions in pre_forward, after update_requests wrote KV",
              "vllm_compat.gathers_may_defer, vllm_compat.first_call_before_kv_writes"),
    Behaviour("v1/worker/gpu/kv_connector.py", r"def finalize_step",
              "V2 runner with a speculator: wait_for_save after the step's events were taken",
              "worker/tier_events.py (BUSY)", FROM_33),
    Behaviour("v1/core/sched/scheduler.py", r"def _handle_invalid_blocks",
              "block-level load errors: refused for several KV cache groups",
              "vllm_compat.recomputes_failed_blocks"),
    Behaviour("v1/engine/core.py", r"hash_block_size",
              "the engine core sets KVCacheConfig.hash_block_size before the scheduler builds the connector",
              "vllm_compat.hash_block_size"),
    Behaviour("v1/core/sched/scheduler.py", r"take_events\(\)",
              "the scheduler publishes the connector's take_events beside its own",
              "vllm_compat.kv_events_enabled"),
    Behaviour("v1/worker/gpu_worker.py", r"get_kv_transfer_group\(\)\.unregister_kv_caches\(\)",
              "sleep / discard: unregister_kv_caches before KV memory is unmapped",
              "vllm_compat.hears_sleep", FROM_33),
    Behaviour("v1/worker/gpu_worker.py", r"get_kv_transfer_group\(\)\.restore_kv_caches\(\)",
              "wake_up: restore_kv_caches once KV memory is mapped again", "vllm_compat.hears_sleep",
              FROM_33),
    Behaviour("model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", r"num_prefill_checkpoint_blocks=1",
              "GDN layers get a prefill checkpoint block under the FlashInfer prefill backend",
              "vllm_compat.prefill_checkpoint_blocks", FROM_33),
    Behaviour("v1/core/sched/scheduler.py",
              r"def reset_prefix_cache\(\s*self, reset_running_requests: bool = False, reset_connector: bool = False"
              r"\s*\)[\s\S]{0,2000}?self\.kv_cache_manager\.reset_prefix_cache\(\)[\s\S]{0,600}?"
              r"if reset_connector:\s*reset_successful = self\.reset_connector_cache\(\)",
              "a reset empties vLLM's prefix cache (refused while a block is in use) before the connector's, "
              "which it resets only with its reset_connector argument",
              "scheduler.kept_blocks (blocks kept for turn ends go back first where the connector is reset; "
              "resets_connector reads that argument)"),
    Behaviour("v1/core/single_type_kv_cache_manager.py", r"req_to_blocks\.pop\(request_id, \[\]\)",
              "KVCacheManager.free of a request already freed frees nothing",
              "scheduler_half.give_back_kept_blocks"),
    Behaviour("distributed/aux_output_connector/connector.py",
              r"def cap_external_hit[\s\S]{0,300}?return num_external\n\s+return 0\n",
              "cap_external_hit keeps an external hit whole or drops it (never shortens it from its end)",
              "scheduler_half.update_state_after_alloc (a load starts at hit - num_external_tokens)",
              FROM_33),
]


def source_paths() -> set[str]:
    """Every file of the vllm package this surface names (what ``make setup`` extracts)."""
    return {u.path for u in USES} | {b.path for b in BEHAVIOURS} | {
        "distributed/kv_transfer/kv_connector/v1/base.py"}


if __name__ == "__main__":
    from tests.vllm_sources import CUDA_RELEASES, Source, installed_root, release_root
    from lmcache_hma.vllm_compat import vllm_version

    sources = [Source(vllm_version(), installed_root())] + [Source(v, release_root(v)) for v in CUDA_RELEASES]
    print("| symbol | file (in `vllm/`) | used by | " + " | ".join(s.version for s in sources) + " |")
    print("|---|---|---|" + "---|" * len(sources))
    for u in USES:
        cls, _, member = u.name.partition(".")
        nodes = [s.member(u.path, cls, member) if member else s.top(u.path, cls) for s in sources]
        cells = [str(n.lineno) if n else "absent" for n in nodes]
        print(f"| `{u.name}` | {u.path} | {u.by} | " + " | ".join(cells) + " |")
    print()
    print("| behaviour | file (in `vllm/`) | relied on by | " + " | ".join(s.version for s in sources) + " |")
    print("|---|---|---|" + "---|" * len(sources))
    for b in BEHAVIOURS:
        cells = [str(s.find(b.path, b.pattern) or "absent") for s in sources]
        print(f"| {b.what} | {b.path} | {b.by} | " + " | ".join(cells) + " |")
