"""The blocks vLLM keeps for turn ends go back before a cache reset only where the reset happens
and resets the connector (``scheduler.kept_blocks``). vLLM's own ``Scheduler.reset_prefix_cache``
(0.32's, the installed one; 0.33's and 0.34's run the same steps: ``tests/vllm_surface.py``) runs
over vLLM's real ``KVCacheManager``, in both orders it can take: the manager's reset alone
(``reset_connector=False``), and the manager's then the connector's. No engine."""

from types import SimpleNamespace

import pytest

from tests.test_resets import finished_inside_a_chunk, keep_blocks, real_kv_cache_manager
from tests.test_scheduler import engine  # noqa: F401 - the fixture


def vllm_reset_prefix_cache(scheduler_half, manager, reset_running_requests=False, reset_connector=False,
                            running=()):
    """vLLM's ``Scheduler.reset_prefix_cache`` itself, on a stand-in scheduler whose KV cache
    manager is ``manager`` and whose connector's reset is ``scheduler_half.reset``: running
    requests preempted (their blocks freed), the manager's reset, then, with
    ``reset_connector``, the connector's (taken as confirmed: this test's lookup server has no
    worker tiers to empty)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    stand_in = SimpleNamespace(running=list(running), kv_cache_manager=manager, prev_step_scheduled_req_ids=set(),
                               aux_output_connector=None,
                               _preempt_request=lambda request, *a, **kw: manager.free(request),
                               reset_connector_cache=lambda: scheduler_half.reset() or True)
    return Scheduler.reset_prefix_cache(stand_in, reset_running_requests, reset_connector)


def kept_turn_end(engine):
    e = engine(interval=16)
    e.sched.keep_blocks_for_turn_ends = True
    manager = real_kv_cache_manager(e.lay)
    (kept, _), r = finished_inside_a_chunk(e)
    assert kept and e.sched.turn_saves_pending == {"r"}
    keep_blocks(manager, r)
    e.sched.bind_kv_cache_manager(manager)
    return e, manager, r


def test_a_reset_that_resets_the_connector_gives_the_blocks_back_and_frees_them_now(engine):
    """The manager's reset, then the connector's: the blocks go back first, the turn end is not
    stored, and the request is no longer a pending free (``has_pending_block_frees`` kept vLLM
    from preempting for room until the next step)."""
    e, manager, r = kept_turn_end(engine)
    assert vllm_reset_prefix_cache(e.sched, manager, reset_running_requests=True, reset_connector=True)
    assert not e.sched.turn_saves_pending  # {"r"} before
    [save] = e.step().saves
    assert (save.req_id, save.objects, save.blocks_kept) == ("r", [], True)


def test_a_reset_of_vllms_cache_alone_keeps_the_turn_end(engine):
    """``reset_connector=False``: the connector's cache stays, and so does the turn end on its way
    to it. vLLM's reset is refused while its blocks are in use (as while any block is), and
    succeeds once the next step stored it. Before, the blocks went back and the turn end was
    dropped."""
    e, manager, r = kept_turn_end(engine)
    assert not vllm_reset_prefix_cache(e.sched, manager)
    assert e.sched.turn_saves_pending == {"r"}
    [save] = e.step().saves
    assert save.objects and save.blocks_kept  # the turn end is stored with this step
    e.sched.on_finished_sending({"r"})
    manager.free(r)  # vLLM's _free_blocks on finished_sending
    assert vllm_reset_prefix_cache(e.sched, manager)


def test_a_reset_that_fails_anyway_gives_nothing_back(engine):
    """Another request holds blocks a reset does not free (one waiting for an asynchronous load
    is not among the running requests it preempts): vLLM's reset fails whatever is given back,
    so the turn end stays and is stored with the next step. Before, its blocks went back and it
    was dropped for a reset that raised."""
    e, manager, r = kept_turn_end(engine)
    from tests.test_scheduler import TOKENS, request

    loading = request("loading", TOKENS[:20])
    loading.num_computed_tokens = 16
    keep_blocks(manager, loading)
    with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
        vllm_reset_prefix_cache(e.sched, manager, reset_running_requests=True, reset_connector=True)
    assert e.sched.turn_saves_pending == {"r"}
    [save] = e.step().saves
    assert save.objects and save.blocks_kept
