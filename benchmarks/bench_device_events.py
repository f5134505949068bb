"""What making vLLM's device events one per block hash costs the scheduler's step
(``lmcache_hma/scheduler/device_events.py``, bound to vLLM's block pool with --kv-events-config).

    python benchmarks/bench_device_events.py [--quick]

vLLM's own ``BlockPool`` (events on), driven as its scheduler drives it: requests of 2,048
tokens in blocks of 16 (128 blocks each) cached, their events taken, freed; every other request
repeats the one before (recomputed: each of its blocks a second copy of a cached hash), and the
pool is small enough that caching evicts. Per case, vLLM's events as they are (the baseline) and
with the dedup bound, the same operations in the same run: microseconds per cached block
(caching, evicting and taking the events together), and the block announcements that reach a
router (stores and removals).
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


def one_run(dedup: bool, requests: int, repeat: bool) -> tuple[float, int]:
    """(seconds, block announcements) of ``requests`` requests through a fresh pool."""
    from vllm import SamplingParams
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from lmcache_hma.scheduler.device_events import DeviceEventDedup

    init_none_hash(sha256)
    pool = BlockPool(POOL_BLOCKS, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    if dedup:
        DeviceEventDedup([0]).bind(pool)
    hasher = get_request_block_hasher(BLOCK, sha256)
    reqs = []
    for r in range(requests):  # built before the clock: the hashing is vLLM's, whatever the events
        base = r - 1 if repeat and r % 2 else r
        tokens = [(base * 7919 + i) % 30000 + 1 for i in range(BLOCK * BLOCKS_PER_REQUEST)]
        reqs.append(Request(str(r), tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher))
    announced = 0
    t0 = time.perf_counter()
    for req in reqs:
        blocks = pool.get_new_blocks(BLOCKS_PER_REQUEST)
        pool.cache_full_blocks(req, blocks, 0, BLOCKS_PER_REQUEST, BLOCK, 0)
        for e in pool.take_events():
            if isinstance(e, (BlockStored, BlockRemoved)):
                announced += len(e.block_hashes)
        pool.free_blocks(reversed(blocks))
    return time.perf_counter() - t0, announced


def run(quick: bool = False) -> dict:
    requests, repeats = (64, 5) if quick else (256, 9)
    rows, out = [], {}
    for case, repeat in (("distinct prompts", False), ("every other prompt repeated", True)):
        got = {}
        for dedup in (False, True):
            runs = [one_run(dedup, requests, repeat) for _ in range(repeats)]
            got[dedup] = (statistics.median(t for t, _ in runs), runs[0][1])
        per_block = {d: got[d][0] / (requests * BLOCKS_PER_REQUEST) * 1e6 for d in got}
        rows.append([case, fmt(per_block[False]), fmt(per_block[True]), fmt(per_block[True] / per_block[False]),
                     got[False][1], got[True][1]])
        tag = "repeated" if repeat else "distinct"
        out[f"{tag}_us_per_block_vllm"] = round(per_block[False], 3)
        out[f"{tag}_us_per_block_dedup"] = round(per_block[True], 3)
        out[f"{tag}_announcements_vllm"] = got[False][1]
        out[f"{tag}_announcements_dedup"] = got[True][1]
    out["table"] = table(["case", "us/block, vLLM's events", "one per hash", "x", "announcements, vLLM's",
                          "one per hash"], rows)
    out["notes"] = [f"{requests} requests of {BLOCKS_PER_REQUEST} blocks, a pool of {POOL_BLOCKS}; median of "
                    f"{repeats} runs; caching, evicting and taking events timed together"]
    return out


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__, run, "BENCH_DEVICE_EVENTS"))
