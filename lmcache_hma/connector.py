"""``LMCacheHMAConnector``: the class vLLM loads. Role dispatch and delegation only.

vLLM builds one instance in the scheduler (role SCHEDULER) and one in each
worker (role WORKER); each builds its half (``scheduler.scheduler_half.SchedulerHalf`` or
``worker.worker_half.WorkerHalf``) from the same configuration and layout.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from lmcache_hma.config.settings import load_config
from lmcache_hma.config.speculative import speculation_plan
from lmcache_hma.config.transfer_role import TransferRole
from lmcache_hma.core.identity import model_identity
from lmcache_hma.core.keys import Namespace
from lmcache_hma.config.errors import ConfigError
from lmcache_hma.core.layout import ChunkSizeError, LayoutError
from lmcache_hma.core.vllm_layout import layout_from_kv_cache_config
from lmcache_hma.metrics import HMAConnectorStats, HMAPromMetrics, SchedulerStats, WorkerStats
from lmcache_hma.scheduler.device_events import DeviceEventDedup, device_events
from lmcache_hma.scheduler.kv_events import KVEventAnnouncer
from lmcache_hma.scheduler.scheduler_half import SchedulerHalf
from lmcache_hma.scheduler.vllm_fields import arrange_state_retention
from lmcache_hma.vllm_compat import (cpu_cache_writer, cpu_page_format, first_call_before_kv_writes,
                                     gathers_may_defer, hash_block_size, hit_sources, kv_events_enabled)
from lmcache_hma.worker.tier_events import TierEventCollector
from lmcache_hma.worker.worker_half import WorkerHalf
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


class LMCacheHMAConnector(KVConnectorBase_V1, SupportsHMA):
    """LMCache-backed KV offload for hybrid models: full attention plus sliding-window and/or
    gated-delta-net (recurrent state) layers."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        speculation = speculation_plan(vllm_config)  # refuses a method it cannot serve exactly
        if speculation.lookahead:
            logger.info("LMCacheHMA: speculative method %s: the draft model's KV is stored with the "
                        "target's; chunk keys cover the %d token(s) after each chunk",
                        speculation.method, speculation.lookahead)
        config = load_config(transfer.kv_connector_extra_config)
        try:
            layout = layout_from_kv_cache_config(kv_cache_config, config.chunk_size)
        except ChunkSizeError as exc:  # the configuration's to fix: name where chunk_size came from
            raise ConfigError(f"{config.source_of('chunk_size')}: {exc}") from None
        page_formats = {g.index: cpu_page_format(vllm_config, kv_cache_config.kv_cache_groups[g.index].kv_cache_spec)
                        for g in layout.paged_groups}  # vLLM CPU's, per attention group (None on GPUs)
        namespace = _namespace(vllm_config, kv_cache_config, layout, role, config.shared_secret,
                               speculation.identity, config.share_parallel_shapes, page_formats)
        engine_id = f"{transfer.engine_id}-dp{vllm_config.parallel_config.data_parallel_index}"
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        self._events: Optional[KVEventAnnouncer] = None  # KV cache events (--kv-events-config) only
        self._device_events: Optional[DeviceEventDedup] = None  # vLLM's own, one per block hash
        events = kv_events_enabled(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            # The cache is an optimisation: a failed load must be recomputed, not
            # fail the request (vLLM's default policy is "fail").
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning("LMCacheHMA: kv_load_failure_policy %r -> 'recompute': a load that "
                               "fails is recomputed, never an error for the request",
                               transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            role = TransferRole.of(transfer.kv_role, config.consumer_stores_answers)
            self._scheduler = SchedulerHalf(config, layout, namespace, engine_id, speculation.lookahead, role)
            # Turn ends are gathered in the next step's first call, where that call comes before
            # vLLM writes KV (the barrier deferred gathers need too); elsewhere vLLM keeps the blocks.
            self._scheduler.keep_blocks_for_turn_ends = not first_call_before_kv_writes(vllm_config)[0]
            if layout.has_state:  # now: vLLM's KV cache manager reads it after this constructor
                arrange_state_retention(kv_cache_config, vllm_config.cache_config,
                                        self._scheduler.checkpoint_interval)
            self._stats = SchedulerStats()
            if events:
                # parts of KV heads (hma_share_parallel_shapes): rank 0's first part stands for the object
                self._events = KVEventAnnouncer(layout, kv_cache_config, namespace.key_world_size,
                                                hash_block_size(kv_cache_config))
                self._scheduler.on_turn_save = self._events.remember  # its request is gone by the step
            logger.info(
                "LMCacheHMA: config %s, %s, chunk %d, checkpoint interval %d, groups: %s",
                config.source, role.name, config.chunk_size, layout.checkpoint_interval(config.checkpoint_interval),
                "; ".join(f"{g.index}:{g.kind.value}(block {g.block_size}, window "
                          f"{g.sliding_window}, {len(g.layer_names)} layers)" for g in layout.groups),
            )
        else:
            defer, why = gathers_may_defer(vllm_config, kv_cache_config)
            logger.info("LMCacheHMA: stores are gathered %s: %s", "beside the next step" if defer
                        else "in the step", why)
            self._worker = WorkerHalf(config, layout, namespace, engine_id, kv_cache_config.num_blocks,
                                      serves_lookups=_is_first_worker(), defer_gathers=defer,
                                      rank_heads=_rank_heads(vllm_config, kv_cache_config, layout, namespace),
                                      tp=(vllm_config.parallel_config.tensor_parallel_size, namespace.rank),
                                      page_formats=page_formats)
            if events:  # parts of objects (hma_share_parallel_shapes) are reported as their object
                self._worker.tier_events = TierEventCollector(
                    namespace, self._worker.event_name if namespace.shares_parallel_shapes else None)
            self._stats = WorkerStats(self._worker)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is only a future miss

    # scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        started = time.perf_counter()
        matched = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        self._stats.on_lookup(request.request_id, matched, started)
        self._stats.on_promises_not_kept(self._scheduler.promises.take_not_kept())
        if self._events is not None and matched[0]:
            self._events.on_hit(self._scheduler.requests[request.request_id], num_computed_tokens)
        return matched

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        by_tier = self._scheduler.hit_tokens_by_tier(request, num_external_tokens)
        return hit_sources(by_tier) if sum(by_tier.values()) == num_external_tokens else \
            super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        self._stats.on_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._events is not None:
            self._events.on_saves(meta.saves, self._scheduler.requests)
            meta.idle = not scheduler_output.num_scheduled_tokens
        return meta

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)
        if self._events is not None:  # vLLM's own events: one per hash, as an index keeps them
            eagle = getattr(kv_cache_manager, "use_eagle", False)
            self._device_events = device_events(self._scheduler.layout, eagle)
            self._device_events.bind(getattr(kv_cache_manager, "block_pool", None))

    def reset_cache(self) -> bool:
        done = self._scheduler.reset()
        if done and self._events is not None:  # the worker's record of it comes with a later step
            self._events.expect_clear()
        return done

    def update_connector_output(self, connector_output) -> None:
        if connector_output.finished_sending:
            self._scheduler.on_finished_sending(connector_output.finished_sending)
        if connector_output.failed_recving:
            self._scheduler.on_failed_loads(connector_output.failed_recving)
            self._stats.on_failed_loads(connector_output.failed_recving)
        if self._events is not None and connector_output.kv_cache_events:
            self._events.on_reports(connector_output.kv_cache_events)

    # KV cache events (scheduler.kv_events; only with --kv-events-config) --------------
    def take_events(self):
        return self._events.take_events() if self._events is not None else ()

    def has_pending_push_work(self) -> bool:
        # a step for the turn ends of requests that finished (scheduler.turn_ends), KV events' records
        return self._scheduler.turn_saves_due or (self._events is not None and self._events.pending_work())

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        self._stats.on_finished(request.request_id)
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        self._stats.on_finished(request.request_id)
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        # finished requests' blocks, kept until their turn ends are gathered (a step or two)
        return bool(self._scheduler.turn_saves_pending)

    # worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    # sleep mode: vLLM 0.33+ calls these around unmapping KV memory (vllm_compat.hears_sleep);
    # supports_sleep_mode keeps its default (True): the KV stays at its addresses.
    def unregister_kv_caches(self) -> None:
        self._worker.before_sleep()

    def restore_kv_caches(self) -> None:
        self._worker.after_wake()

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # first thing in a step, before vLLM writes any KV (copies, zeroing, the forward)
        self._worker.before_step(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saves happen once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_kv_connector_kv_cache_events(self):
        collector = self._worker.tier_events if self._worker is not None else None
        if collector is None:
            return None
        return collector.take(idle=self._get_connector_metadata().idle if self.has_connector_metadata() else False)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # only ever non-empty for a model with one KV cache group (see WorkerHalf._load_sync)
        return self._worker.take_failed_blocks()

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        done, failed = self._worker.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed,
                                          finished_sending=self._worker.take_finished_sending())

    # metrics (both roles; see metrics.py) -------------------------------------
    def get_kv_connector_stats(self) -> Optional[HMAConnectorStats]:
        return self._stats.collect()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> HMAConnectorStats:
        return HMAConnectorStats(data=data) if data is not None else HMAConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HMAPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


def _is_first_worker() -> bool:
    """Tensor- and pipeline-parallel rank 0: the one worker that answers lookups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0 and get_pp_group().rank_in_group == 0


def _namespace(vllm_config, kv_cache_config, layout, role, secret, draft_identity,
               share_parallel_shapes: bool = False, page_formats: Optional[dict] = None) -> Namespace:
    """``page_formats``: vLLM CPU's page format of each attention group by index (None values on
    GPUs, whose layout ``kv_cache_layout`` names)."""
    spec = kv_cache_config.kv_cache_groups[layout.paged_groups[0].index].kv_cache_spec  # attention
    parallel = vllm_config.parallel_config
    page_formats = page_formats or {}
    shared_heads = None
    if share_parallel_shapes:
        if parallel.pipeline_parallel_size > 1:
            raise LayoutError("hma_share_parallel_shapes: pipeline parallelism is not supported (a stage "
                              "would read only its layers of an object); turn the option off")
        _check_cpu_pages(kv_cache_config, page_formats)
        shared_heads = (vllm_config.model_config.get_total_num_kv_heads(), spec.head_size)
        if layout.has_state:  # and the global dimensions of the gated delta net
            from lmcache_hma.kv_copy.canonical_state import gdn_dims_of_rank

            g = layout.state_groups[0]
            dims = gdn_dims_of_rank(g.state_shapes, g.conv_state_layout, parallel.tensor_parallel_size)
            shared_heads += (dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim, dims.state_len)
    rank = 0
    if role == KVConnectorRole.WORKER:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    cpu = "".join(f"cpu-{f}/" for f in dict.fromkeys(page_formats.values()) if f)
    kv_layout = (
        f"{kv_cache_config.kv_cache_layout or 'default'}/{cpu}"
        f"{spec.num_kv_heads}x{spec.head_size}x{spec.page_size_bytes}"
    )
    return Namespace(
        model=vllm_config.model_config.model,
        kv_dtype=spec.dtype,
        layout=layout,
        kv_layout=kv_layout,
        world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        rank=rank,
        identity={**model_identity(vllm_config.model_config, vllm_config.cache_config), **draft_identity},
        secret=secret,
        shared_heads=shared_heads,
    )


def _check_cpu_pages(kv_cache_config, page_formats: dict) -> None:
    """hma_share_parallel_shapes on vLLM CPU: the copy reads pages through views of each
    group's page format (``canonical_kv.cpu_layer_kv``: plain, or AMX tiles); each is checked
    against vLLM's own cache writer, and one the views would misread is refused here."""
    from lmcache_hma.kv_copy.canonical_kv import cpu_pages_mismatch

    for index, page_format in page_formats.items():
        if page_format is None:
            continue
        spec = kv_cache_config.kv_cache_groups[index].kv_cache_spec
        why = cpu_pages_mismatch(cpu_cache_writer(page_format), spec.dtype, spec.block_size, spec.head_size,
                                 page_format)
        if why:
            raise LayoutError(
                f"hma_share_parallel_shapes: vLLM's CPU attention keeps KV cache group {index} in "
                f"'{page_format}' pages (block {spec.block_size}, head size {spec.head_size}, {spec.dtype}), "
                f"which the shared format cannot read ({why}); turn the option off")


def _rank_heads(vllm_config, kv_cache_config, layout, namespace: Namespace):
    """hma_share_parallel_shapes: the global KV heads this worker holds (``kv_heads_of_rank``),
    checked against vLLM's spec; None with the option off."""
    if not namespace.shares_parallel_shapes:
        return None
    from lmcache_hma.kv_copy.canonical_kv import kv_heads_of_rank

    heads = kv_heads_of_rank(namespace.shared_heads[0], vllm_config.parallel_config.tensor_parallel_size,
                             namespace.rank)
    for g in layout.paged_groups:
        spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
        if spec.num_kv_heads != len(heads.heads) or spec.head_size != namespace.shared_heads[1]:
            raise LayoutError(f"hma_share_parallel_shapes: KV cache group {g.index} holds {spec.num_kv_heads} "
                              f"heads of {spec.head_size}; this rank should hold {len(heads.heads)} of "
                              f"{namespace.shared_heads[1]} (heads {heads.heads.start}-{heads.heads.stop - 1})")
    return heads
