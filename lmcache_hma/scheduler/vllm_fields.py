"""vLLM's fields the scheduler side reads or sets beyond the connector API's arguments.

A request's ``lmcache.skip_save`` (in its ``kv_transfer_params``), the blocks vLLM allocated
in a step (from its scheduler output, sent to the workers: their gathers must end before
those blocks are written), and the retention interval of recurrent states (set in vLLM's KV
cache config when the connector is built, so that vLLM keeps states for the connector to
store). Each reads or writes vLLM's own objects and nothing of the connector's, so the
scheduler half and the connector share them from here.
"""

from __future__ import annotations

from typing import Optional

from lmcache_hma.log import get_logger

logger = get_logger(__name__)


def skips_save(request) -> bool:
    """Whether ``request`` asks not to be stored: LMCache's request config ``lmcache.skip_save``
    in its ``kv_transfer_params`` (``SamplingParams.extra_args``, or the OpenAI API's
    ``kv_transfer_params`` field), as LMCache's own vLLM connector reads it."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    value = params.get("lmcache.skip_save", False) if isinstance(params, dict) else False
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # JSON clients send strings
        value = value.strip().lower() == "true"
    if not isinstance(value, bool):  # never read "false" (or 0) as true, as truthiness would
        logger.warning("LMCacheHMA: request %s: lmcache.skip_save %r is not true or false; the request is "
                       "stored", getattr(request, "request_id", "?"), value)
        return False
    return value


def new_blocks(scheduler_output) -> Optional[frozenset[int]]:
    """Every block vLLM allocated in this step (None if the output does not say): the
    scheduled requests' new blocks (a new request's whole table), copy-on-write targets,
    blocks to zero. The worker's gathers from the last step must end before these are written."""
    try:
        out: set[int] = set()
        for req in scheduler_output.scheduled_new_reqs:
            for ids in req.block_ids:
                out.update(ids)
        for per_group in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for ids in per_group or ():
                out.update(ids)
    except AttributeError:  # an output without these fields (not vLLM 0.32's): any block
        return None
    out.update(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    out.update(c.dst_block_id for c in getattr(scheduler_output, "kv_cache_block_copies", None) or ())
    return frozenset(out)


def arrange_state_retention(kv_cache_config, cache_config, interval: int) -> Optional[int]:
    """Make vLLM keep (and hand off) a recurrent state every ``interval`` tokens.

    Runs in the scheduler process, when the connector is built: before vLLM's KV cache
    manager reads ``kv_cache_config.prefix_cache_retention_interval``. vLLM's default, 0,
    keeps a state only at a prompt's end and at shared-prefix junctions it saw locally,
    so a prompt sharing only part of a stored one would find no state to resume from.
    A value the user set (a positive interval, or None: every state) is left alone.
    Returns the interval now in force, or None when nothing was changed.
    """
    current = kv_cache_config.prefix_cache_retention_interval
    if current != 0:
        logger.info("LMCacheHMA: prefix_cache_retention_interval %s (set by the user) decides where "
                    "vLLM keeps recurrent states for the connector to store", current)
        return None
    kv_cache_config.prefix_cache_retention_interval = interval
    cache_config.prefix_cache_retention_interval = interval
    logger.info("LMCacheHMA: prefix_cache_retention_interval 0 -> %d (the checkpoint interval): "
                "vLLM keeps the recurrent state of every prefill step ending on a multiple of %d "
                "tokens, and the connector stores it", interval, interval)
    return interval
