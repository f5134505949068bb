"""One store for instances of different TP sizes and block sizes (``hma_share_parallel_shapes``).

Three ``lmcache-hma serve`` processes on the tiny Gemma-3 (sliding window and full attention,
one KV head) share one Redis with the option on: ``tp1`` (TP=1, block 16), ``tp2`` (TP=2,
block 16: both ranks hold the one KV head, rank 0 writes it) and ``blk32`` (TP=1, block 32).
Each serves what another stored, and its tokens equal its own cold run (a ``cache_salt``)
within the float32 tie gate: KV computed at another TP size may differ in its last bits
(docs/tp_sharing.md). Redis holds one copy of a prefix that every instance ran.

Two more on the tiny Qwen3-Next (gated delta net and full attention, 2 KV heads, 2 k and 2 v
heads, bf16), TP=1 and TP=2: at TP=2 each rank holds one KV head and one state shard, so an
object is written half by each rank and read whole by the TP=1 instance, and the other way.
"""

from __future__ import annotations

import secrets

import pytest

from tests.engines import BF16_TIE_TOL, same_answer
from tests.servers import serve_fleet
from tests.test_redis import wait_until

HELLO = "Hello, how are you?"
PROMPT = HELLO * 500 + "Tell me a very long story"  # 3007 tokens: 11 full chunks of 256
EXPECTED_HIT = 11 * 256


def prompt(tag: str) -> str:
    return f"{tag}: " + PROMPT


# vLLM's CPU build binds each TP rank's threads to a NUMA node unless told which cores
TP2 = (["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})


def serve_shapes(work, model_name: str, extra_config: dict, shapes: dict):
    """``tests.servers.serve_fleet`` of one server per ``shapes`` entry (name -> (arguments,
    environment)), all with ``hma_share_parallel_shapes`` on."""
    servers = {name: {"extra_args": args, "env_extra": env} for name, (args, env) in shapes.items()}
    yield from serve_fleet(work, model_name, {**extra_config, "hma_share_parallel_shapes": True}, servers)


@pytest.fixture(scope="class")
def fleet(tmp_path_factory):
    yield from serve_shapes(tmp_path_factory.mktemp("shared_shapes"), "tiny-gemma3",
                           {"hma_shared_secret": secrets.token_hex(16)},
                           {"tp1": (["--block-size", "16"], {}), "tp2": (["--block-size", "16", *TP2[0]], TP2[1]),
                            "blk32": (["--block-size", "32"], {})})


def redis_bytes(redis) -> tuple[int, int]:
    """(keys, bytes of values) in Redis."""
    client = redis.client()
    keys = client.keys("*")
    return len(keys), sum(client.strlen(k) for k in keys)


def settled(redis) -> tuple[int, int]:
    """Redis's (keys, bytes) once writes stopped landing."""
    last = None

    def still():
        nonlocal last
        now = redis_bytes(redis)
        done, last = now == last, now
        return done

    wait_until(still, timeout=20, step=0.5)
    return last


def serve_other(writer, reader, redis, tag: str):
    """``writer`` runs a prompt cold; ``reader`` runs it cold (salted) and then hits what
    ``writer`` stored: the hit and whether its tokens equal the reader's own cold run."""
    p = prompt(tag)
    assert writer.complete(p)[2] == 0
    settled(redis)
    cold = reader.complete(p, salt="cold")
    assert cold[2] == 0
    ref = (cold[0], cold[1], reader.last_margins)
    text, ids, hit, _ = reader.complete(p)
    return hit, same_answer(ref, (text, ids)), (ref, ids)


# -- gated delta net ---------------------------------------------------------------------------

@pytest.fixture(scope="class")
def gdn_fleet(tmp_path_factory):
    bf16 = ["--dtype", "bfloat16"]  # the gated delta net runs in bf16 only on vLLM's CPU build
    yield from serve_shapes(tmp_path_factory.mktemp("shared_shapes_gdn"), "tiny-qwen3next", {},
                           {"tp1": (bf16, {}), "tp2": ([*bf16, *TP2[0]], TP2[1])})


class TestSlidingWindow:
    """Tiny Gemma-3: the fleet's three servers stop after this class (never five at once)."""

    @pytest.mark.parametrize("writer, reader", [("tp1", "tp2"), ("tp2", "tp1"), ("tp1", "blk32"), ("blk32", "tp2")])
    def test_an_instance_serves_what_another_shape_stored(self, fleet, writer, reader):
        hit, same, detail = serve_other(fleet[writer], fleet[reader], fleet["redis"], f"{writer} to {reader}")
        assert hit == EXPECTED_HIT, fleet[reader].text()[-3000:]
        assert same, detail

    def test_redis_holds_one_copy_for_the_fleet(self, fleet):
        """A prefix every instance ran is in Redis once: the second and third instance add no key
        and no byte (they hit it, and what they store of it has the same keys and bytes)."""
        redis, p = fleet["redis"], prompt("one copy")
        fleet["tp1"].complete(p)
        after_one = settled(redis)
        assert fleet["tp2"].complete(p)[2] == EXPECTED_HIT
        assert fleet["blk32"].complete(p)[2] == EXPECTED_HIT
        assert settled(redis) == after_one

    def test_a_part_corrupted_in_redis_is_a_miss_not_wrong_tokens(self, fleet):
        """A KV head's part overwritten in Redis (valid length, one byte flipped) fails its MAC when
        the reader loads it: the load fails and vLLM recomputes, with the reader's own cold run's
        tokens."""
        redis, tp1, tp2 = fleet["redis"], fleet["tp1"], fleet["tp2"]
        p = prompt("corrupt")
        before = set(redis.client().keys("*kv_bytes*"))
        tp1.complete(p)
        settled(redis)
        new = sorted(set(redis.client().keys("*kv_bytes*")) - before)
        full = [k for k in new if b".full@" in k]
        assert full
        client = redis.client()
        value = bytearray(client.get(full[0]))
        value[100] ^= 0xFF
        client.set(full[0], bytes(value))
        cold = tp2.complete(p, salt="cold")
        ref = (cold[0], cold[1], tp2.last_margins)
        damaged = tp2.text().count("are gone or damaged")
        text, ids, hit, _ = tp2.complete(p)
        assert hit == EXPECTED_HIT  # the lookup saw every part; the load finds one damaged
        assert wait_until(lambda: tp2.text().count("are gone or damaged") > damaged, timeout=10)
        assert same_answer(ref, (text, ids)), (ref, ids)


class TestRecurrentState:
    """Tiny Qwen3-Next at TP=1 and TP=2."""

    @pytest.mark.parametrize("writer, reader", [("tp1", "tp2"), ("tp2", "tp1")])
    def test_recurrent_states_cross_tp_sizes(self, gdn_fleet, writer, reader):
        """A gated-delta-net model's chunks and states stored at one TP size serve the other: the
        hit reaches the last stored state (chunk 8 of 11: vLLM hands states over where a prefill
        step ends, 2048 tokens here, and at the checkpoints after it), tokens as the reader's own
        cold run within the bf16 tie gate."""
        w, r, redis = gdn_fleet[writer], gdn_fleet[reader], gdn_fleet["redis"]
        p = prompt(f"gdn {writer} to {reader}")
        assert w.complete(p)[2] == 0
        settled(redis)
        cold = r.complete(p, salt="cold")
        ref = (cold[0], cold[1], r.last_margins)
        text, ids, hit, _ = r.complete(p)
        assert hit >= 2048, r.text()[-3000:]
        assert same_answer(ref, (text, ids), BF16_TIE_TOL), (ref, ids)
        # hma_store_answers unset: no answers or turn ends for a recurrent-state model
        assert not redis.client().keys("*.turn*")
