"""What making vLLM's device events one per block hash, and on a hybrid announcing a block only
where vLLM's hit can reach, costs the scheduler's step (``lmcache_hma/scheduler/device_events.py``,
``device_restorable.py``, bound to vLLM's block pool with --kv-events-config).

    python benchmarks/bench_device_events.py [--quick]

vLLM's own ``BlockPool`` (events on), driven as its scheduler drives it: requests of 2,048
tokens in blocks of 16 (128 blocks each) cached, their events taken, freed; every other request
repeats the one before (recomputed: each of its blocks a second copy of a cached hash), and the
pool is small enough that caching evicts. Per case, vLLM's events as they are (the baseline) and
with the dedup bound, the same operations in the same run: microseconds per cached block
(caching, evicting and taking the events together), and the block announcements that reach a
router (stores and removals). Then two hybrids, vLLM's events against the rewriting with its
gate: a sliding-window group beside the full-attention one (a window of 1,024 tokens: a hit
needs the 64 blocks before its end), and two recurrent-state groups (a state kept every 256
tokens, where vLLM's prefill steps would end, and at the prompt's end).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import bench_main, fmt, table  # noqa: E402

BLOCK = 16
BLOCKS_PER_REQUEST = 128
POOL_BLOCKS = 1024  # eight requests' worth: caching evicts


WINDOW = 1024
STATE_EVERY = 16  # blocks: a state every 256 tokens


def one_run(rewrite: bool, requests: int, repeat: bool, shape: str = "full") -> tuple[float, int]:
    """(seconds, block announcements of the full-attention group) of ``requests`` requests
    through a fresh pool; ``shape``: "full", "sliding" (group 1 a sliding window), "states"
    (groups 1 and 2 recurrent states)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from lmcache_hma.scheduler.device_events import DeviceEventDedup
    from lmcache_hma.scheduler.device_restorable import DeviceRestorable

    init_none_hash(sha256)
    others = {"full": 0, "sliding": 1, "states": 2}[shape]
    pool = BlockPool(POOL_BLOCKS * (1 + (shape == "sliding")), enable_caching=True, hash_block_size=BLOCK,
                     enable_kv_cache_events=True)
    if rewrite:
        gate = None
        if shape == "sliding":
            gate = DeviceRestorable([0], windows=[([1], -(-(WINDOW - 1) // BLOCK))])
        elif shape == "states":
            gate = DeviceRestorable([0], states=[1, 2])
        DeviceEventDedup([0], gate).bind(pool)
    hasher = get_request_block_hasher(BLOCK, sha256)
    reqs = []
    for r in range(requests):  # built before the clock: the hashing is vLLM's, whatever the events
        base = r - 1 if repeat and r % 2 else r
        tokens = [(base * 7919 + i) % 30000 + 1 for i in range(BLOCK * BLOCKS_PER_REQUEST)]
        reqs.append(Request(str(r), tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher))
    states = {i for i in range(BLOCKS_PER_REQUEST) if (i + 1) % STATE_EVERY == 0} | {BLOCKS_PER_REQUEST - 1}
    announced = 0
    t0 = time.perf_counter()
    for req in reqs:
        blocks = pool.get_new_blocks(BLOCKS_PER_REQUEST)
        pool.cache_full_blocks(req, blocks, 0, BLOCKS_PER_REQUEST, BLOCK, 0)
        held = [blocks]
        for g in range(1, others + 1):
            if shape == "sliding":
                group = pool.get_new_blocks(BLOCKS_PER_REQUEST)
            else:
                group = [pool.get_new_blocks(1)[0] if i in states else pool.null_block
                         for i in range(BLOCKS_PER_REQUEST)]
            pool.cache_full_blocks(req, group, 0, BLOCKS_PER_REQUEST, BLOCK, g)
            held.append([b for b in group if not b.is_null])
        for e in pool.take_events():
            if isinstance(e, (BlockStored, BlockRemoved)) and e.group_idx == 0:
                announced += len(e.block_hashes)
        for group in reversed(held):
            pool.free_blocks(reversed(group))
    return time.perf_counter() - t0, announced


def run(quick: bool = False) -> dict:
    requests, repeats = (64, 5) if quick else (256, 9)
    rows, out = [], {}
    cases = (("distinct prompts", "full", False, "distinct"), ("every other prompt repeated", "full", True, "repeated"),
             ("sliding-window hybrid, every other repeated", "sliding", True, "sliding"),
             ("recurrent-state hybrid, every other repeated", "states", True, "states"))
    for case, shape, repeat, tag in cases:
        got = {}
        for rewrite in (False, True):
            runs = [one_run(rewrite, requests, repeat, shape) for _ in range(repeats)]
            got[rewrite] = (statistics.median(t for t, _ in runs), runs[0][1])
        per_block = {d: got[d][0] / (requests * BLOCKS_PER_REQUEST) * 1e6 for d in got}
        rows.append([case, fmt(per_block[False]), fmt(per_block[True]), fmt(per_block[True] / per_block[False]),
                     got[False][1], got[True][1]])
        name = "dedup" if shape == "full" else "gated"
        out[f"{tag}_us_per_block_vllm"] = round(per_block[False], 3)
        out[f"{tag}_us_per_block_{name}"] = round(per_block[True], 3)
        out[f"{tag}_announcements_vllm"] = got[False][1]
        out[f"{tag}_announcements_{name}"] = got[True][1]
    out["table"] = table(["case", "us/block, vLLM's events", "rewritten", "x", "announcements, vLLM's",
                          "rewritten"], rows)
    out["notes"] = [f"{requests} requests of {BLOCKS_PER_REQUEST} blocks of {BLOCK} tokens, a pool of {POOL_BLOCKS} "
                    f"per group; median of {repeats} runs; caching, evicting and taking events timed together, "
                    f"per full-attention block; rewritten: one per hash, and on the hybrids gated (window "
                    f"{WINDOW} tokens; a state every {STATE_EVERY * BLOCK} tokens and at the prompt's end)"]
    return out


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__, run, "BENCH_DEVICE_EVENTS"))
