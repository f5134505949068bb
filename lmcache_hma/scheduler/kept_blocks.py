"""When the blocks vLLM keeps for turn ends go back before a cache reset. Runs in vLLM's scheduler
process (EngineCore), inside vLLM's ``Scheduler.reset_prefix_cache``; reads vLLM's KV cache
manager, changes nothing in it.

vLLM (0.32, 0.33, 0.34: the same code) resets its own prefix cache (``KVCacheManager.
reset_prefix_cache``, refused while any block is in use) *before* the connector's
(``reset_connector_cache``, only with ``reset_connector=True``). Blocks kept for a turn end
(``request_finished`` returned True) are in use until the next step reports them in
``finished_sending``, so a reset right after a request finished (a pause or ``LLM.sleep()``
without a step first) failed. The scheduler half wraps the manager's reset and gives those blocks
back first (``SchedulerHalf.give_back_kept_blocks``: their turn ends are not stored) only where
``gives_back`` says so:

* the reset resets the connector too (``resets_connector``: vLLM's caller's ``reset_connector``),
  which drops the turn ends not stored yet anyway; a reset of vLLM's own cache alone keeps them
  and is refused while they are in use, as it is while any block is (it succeeds after the next
  step, which stores them);
* and vLLM's reset happens once they are back (``only_kept_in_use``): no other block is in use
  (a running request that a reset without ``reset_running_requests`` keeps, a request waiting
  for an asynchronous load). A reset that fails anyway gives nothing back.
"""

from __future__ import annotations

import sys
from collections.abc import Collection


def gives_back(manager, kept: Collection[str], caller_depth: int = 2) -> bool:
    """Whether the manager's reset being called now should first give back the blocks of the
    requests ``kept`` (see the module's docstring). ``caller_depth``: frames from this call up
    to vLLM's ``Scheduler.reset_prefix_cache`` (the wrapper's caller)."""
    return bool(kept) and resets_connector(sys._getframe(caller_depth)) and only_kept_in_use(manager, kept)


def resets_connector(frame) -> bool:
    """Whether ``frame`` is vLLM's ``Scheduler.reset_prefix_cache`` called with
    ``reset_connector=True`` (the connector's reset follows the manager's in the same call).
    False for any other caller: nothing says the connector is reset."""
    return (frame is not None and frame.f_code.co_name == "reset_prefix_cache"
            and frame.f_locals.get("reset_connector") is True)


def only_kept_in_use(manager, kept: Collection[str]) -> bool:
    """Whether every block of ``manager``'s pools in use (but the null block) is held only by the
    requests ``kept``: once they are freed, vLLM's reset succeeds. True where the manager's
    parts are not the ones this reads (another vLLM): the reset decides then."""
    try:
        managers = list(manager.coordinator.single_type_managers)
        held: dict[int, list] = {}  # id(block) -> [block, its pool, references the kept requests hold]
        for stm in managers:
            for req_id in kept:
                for block in stm.req_to_blocks.get(req_id, ()):
                    if not block.is_null:
                        held.setdefault(id(block), [block, stm.block_pool, 0])[2] += 1
        for pool in {id(stm.block_pool): stm.block_pool for stm in managers}.values():
            in_use = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # the null block is always
            freed = sum(1 for block, of, refs in held.values() if of is pool and refs >= block.ref_cnt)
            if in_use > freed:
                return False
    except AttributeError:
        return True
    return True
