"""The scheduler half: lookups, per-request tracking, the step's metadata.

This class runs in vLLM's scheduler (EngineCore) process. It never touches KV
bytes: it hashes prompts, asks the worker's lookup server how far a hit goes,
plans which objects to load into which blocks, and which objects each step's
computed KV produces.

Loads are reported to vLLM as asynchronous: the request waits one step while
the worker loads; a failed load is reported as ``failed_recving`` and vLLM
recomputes the request. (vLLM 0.32 refuses block-level load errors,
``invalid_block_ids``, for models with several KV cache groups.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lmcache_hma.config import HMAConfig
from lmcache_hma.identity import UncacheableRequest, chunk_extra_keys
from lmcache_hma.keys import ChunkHasher, Namespace
from lmcache_hma.layout import GroupKind, HybridLayout, plan_rows
from lmcache_hma.lookup import LookupClient, socket_address
from lmcache_hma.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec
from lmcache_hma.objects import ObjectKind
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


@dataclass
class RequestState:
    request: Any  # vllm.v1.request.Request
    hashes: list[bytes]  # prefix digests of the prompt's full chunks ([] if uncacheable)
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save from this request
    hit: int = 0  # boundary the last lookup answered
    logged: bool = False
    load_failed: bool = False  # a promised load failed: no more external hits


class SchedulerHalf:
    def __init__(self, config: HMAConfig, layout: HybridLayout, namespace: Namespace, engine_id: str):
        self.config = config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.hasher = ChunkHasher(namespace)
        self.client = LookupClient(socket_address(engine_id), config.lookup_timeout_s)
        self.requests: dict[str, RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._kv_cache_manager = None
        self._group_of_layer = [g for g in layout.groups for _ in g.layer_names]
        self.checkpoint_interval = layout.checkpoint_interval(config.checkpoint_interval)

    def bind_kv_cache_manager(self, manager) -> None:
        self._kv_cache_manager = manager

    # lookup -----------------------------------------------------------------
    def _state(self, request) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(request, self._hashes(request))
            self.requests[request.request_id] = state
        return state

    def _hashes(self, request) -> list[bytes]:
        """Chunk keys of the prompt: its tokens and everything else that shaped their KV."""
        num_chunks = request.num_prompt_tokens // self.chunk_size
        try:
            extra = chunk_extra_keys(request, num_chunks, self.chunk_size)
        except UncacheableRequest as exc:
            logger.warning("LMCacheHMA: %s is not cached: %s", request.request_id, exc)
            return []
        tokens = request.all_token_ids[:request.num_prompt_tokens]
        return self.hasher.chunk_hashes(tokens, num_chunks, extra)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        if state.load_failed:
            return 0, False  # vLLM retries a failed load from scratch: recompute it
        first = num_computed_tokens // self.chunk_size
        # A hit must leave at least one token to compute.
        last = min(len(state.hashes), (request.num_tokens - 1) // self.chunk_size)
        chunks = first + self.client.lookup(state.hashes[first:last]) if last > first else 0
        state.hit = chunks * self.chunk_size
        if state.hit <= num_computed_tokens:
            state.hit = 0
            return 0, False
        return state.hit - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is None:
            return
        load_bytes = {}
        if num_external_tokens > 0:
            start = state.hit - num_external_tokens
            table = blocks.get_block_ids()
            objects = self._load_objects(state, start // self.chunk_size, state.hit // self.chunk_size)
            self._loads.append(LoadSpec(request.request_id, table, start, state.hit, objects))
            state.saved_chunks = max(state.saved_chunks, state.hit // self.chunk_size)
            load_bytes = self._bytes_by_kind(objects, table, start)
        if num_external_tokens > 0 or not state.logged:  # once, and at every load
            state.logged = True
            self._log_request(state, num_external_tokens, load_bytes)

    def _load_objects(self, state: RequestState, first: int, end: int) -> list[ObjectRef]:
        """Full objects of chunks ``[first, end)`` and the tail at the end boundary."""
        refs = [ObjectRef(ObjectKind.FULL, c, state.hashes[c]) for c in range(first, end)]
        if self.layout.has_sliding:
            refs.append(ObjectRef(ObjectKind.TAIL, end - 1, state.hashes[end - 1]))
        return refs

    def _bytes_by_kind(self, objects, table, start: int) -> dict[str, int]:
        out = {k.value: 0 for k in GroupKind}
        for ref in objects:
            rows = plan_rows(self.layout, self.layout.segments(ref.kind, ref.chunk), table, start)
            for layer in rows.layer_indices:
                g = self._group_of_layer[layer]
                out[g.kind.value] += g.page_bytes
        return out

    def _log_request(self, state: RequestState, need_to_load: int, b: dict[str, int]) -> None:
        req = state.request
        hit = state.hit if need_to_load else 0
        all_layers = sum(g.page_bytes * len(g.layer_names) * (need_to_load // g.block_size)
                         for g in self.layout.groups)
        logger.info(
            "Reqid: %s, Total tokens %d, LMCache hit tokens: %d, need to load: %d, "
            "bytes to load: full_attention=%d sliding_window=%d (all-layers connector: %d)",
            req.request_id, req.num_tokens, hit, need_to_load,
            b.get(GroupKind.FULL.value, 0), b.get(GroupKind.SLIDING.value, 0), all_layers,
        )

    # per step ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> HMAConnectorMetadata:
        meta = HMAConnectorMetadata(loads=self._loads)
        self._loads = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or state.saved_chunks >= len(state.hashes):
                continue
            before = state.request.num_computed_tokens
            done = min(len(state.hashes), (before + num_new) // self.chunk_size)
            objects = []
            for c in range(state.saved_chunks, done):
                # KV of chunks that ended before this step came from vLLM's local
                # cache; their sliding blocks may be gone, so they are not stored.
                if (c + 1) * self.chunk_size > before:
                    objects.append(ObjectRef(ObjectKind.FULL, c, state.hashes[c]))
                    if self._wants_tail(c, len(state.hashes)):
                        objects.append(ObjectRef(ObjectKind.TAIL, c, state.hashes[c]))
            state.saved_chunks = max(state.saved_chunks, done)
            if objects:
                table = self._kv_cache_manager.get_block_ids(req_id)
                meta.saves.append(SaveSpec(req_id, table, objects))
        return meta

    def _wants_tail(self, chunk: int, num_chunks: int) -> bool:
        if not self.layout.has_sliding:
            return False
        boundary = (chunk + 1) * self.chunk_size
        return boundary % self.checkpoint_interval == 0 or chunk + 1 == num_chunks

    def on_failed_loads(self, req_ids) -> None:
        """A promised load failed: vLLM recomputes; store what it recomputes.

        The request gets no second external hit: a store that fails the same way
        again would make vLLM retry forever.
        """
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.saved_chunks = 0
                state.load_failed = True

    def request_finished(self, request) -> tuple[bool, Optional[dict]]:
        self.requests.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        self.client.close()
