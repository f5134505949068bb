"""Qwen3.5 as shipped: a tiny ``Qwen3_5ForConditionalGeneration`` (a vision tower in front of
6 gated-delta-net + 2 full-attention layers, ``lmcache_hma.testing.tiny_qwen35``) on the real vLLM
engine (CPU build), with text prompts and prompts holding an image, on the CPU, disk and Redis tiers.

vLLM makes 3 state groups (2 GDN layers each) and 1 full-attention group, block size 256. A hit
at h restores the full-attention KV of [0, h) and every GDN layer's state after h tokens; these
prompts are one prefill step long, so the only state stored is at the prompt's last block boundary.
vLLM runs the "align" Mamba cache mode (the only one with prefix caching in 0.32; "none" is refused
at start, see ``test_state.py``).

Prompt lengths: vLLM 0.32 raises the block size to 256 in the worker process only; its scheduler
(in the engine-core process) still reads the default 128 when it stops a prefill at the prompt's
last checkpoint, ``(n - 1) // 128 * 128``. Where that is not a multiple of 256 (e.g. 1408 for a
1507-token prompt) no Mamba block boundary is reached, vLLM hands off no state, and a repeat of the
prompt gets no hit (a miss, never a wrong answer; Qwen3-Next alike). The prompts here end where
both agree, except UNALIGNED, which shows the miss and that ``block_size=256`` given to vLLM
(``--block-size``) avoids it.

Four engine starts: a reference with no connector (``tests.engines.Reference``); a writer on all
three tiers (its CPU tier serves its hits); a fresh engine reading the disk tier; a fresh engine
reading Redis, whose first load gets noise in the recurrent states (so these checks can fail).
Every check empties vLLM's own prefix cache (``reset_prefix_cache``) before the run that must hit,
and asserts what the connector loaded. The image is in the prompt's first chunk: a hit on another
image's chunks would be a hit of the same text; the keys name the image, so a different image gets
none.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from lmcache_hma.testing.tiny_qwen35 import IMAGE_PLACEHOLDER, IMAGE_SIZE, build_tiny_qwen35
from lmcache_hma.testing.tiny_vlm import shim_everywhere
from tests.engines import (BF16_TIE_TOL, Reference, Writer, diff, generate, hold, make_llm, read_stats, shutdown,
                           write_yaml)
from tests.engines import same_greedy as _same_greedy
from tests.waiting import wait_for

CHUNK = 256
TEXT = "Hello, how are you?" * 220 + "Tell me a very long story"  # 1327 tokens
TEXT_HIT = 1280  # (1327 - 1) // 256 * 256: the state at the prompt's last block boundary
VARIANT = "Tell" + TEXT[5:]  # another first word
UNALIGNED = "Tell me a very long story" * 251  # 1507 tokens, no prefix shared with the others
# BOS, "Hello", the image (vision start, 16 image tokens, vision end), 1080 text tokens: 1100.
IMAGE_TEXT = "Hello" + IMAGE_PLACEHOLDER + "Hello, how are you?" * 180
IMAGE_HIT = 1024  # covers the image (positions 2-19)

IMAGE_A = Image.fromarray(np.random.default_rng(0).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3),
                                                            dtype=np.uint8))  # seeded noise
IMAGE_B = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 120, 40))  # a plain canvas
IMAGE_C, IMAGE_D = (Image.fromarray(np.random.default_rng(seed).integers(
    0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for seed in (1, 2))  # C: first seen in a batch
IMAGES = {"A": IMAGE_A, "B": IMAGE_B, "C": IMAGE_C, "D": IMAGE_D}  # D: never stored

# 6 GDN layers: conv (3, 768) bf16 + recurrent (2, 128, 128) fp32 each
STATE_BYTES = 6 * (3 * 768 * 2 + 2 * 128 * 128 * 4)
FULL_CHUNK = 2 * 256 * 2 * 2 * 128 * 2  # one 256-token chunk of the 2 full-attention layers
KV_CACHE_BYTES = 2**28  # ~1000 blocks: plenty for these prompts, and small beside other engines


def image_prompt(name: str) -> dict:
    return {"prompt": IMAGE_TEXT, "multi_modal_data": {"image": IMAGES[name]}}


# GDN layers run only in bf16 on vLLM's CPU build (``CPU GDN attention requires BF16``).
ENGINE_KWARGS = dict(kv_cache_memory_bytes=KV_CACHE_BYTES, dtype="bfloat16",
                     limit_mm_per_prompt={"image": 1, "video": 0})


def engine(model, yaml=None, extra=None, **kwargs):
    return make_llm(model, yaml, extra, **ENGINE_KWARGS, **kwargs)


def same_greedy(ref, out) -> bool:
    """``out`` against the no-connector reference, which split the prompt otherwise: in bf16 a
    reference near-tie within ``BF16_TIE_TOL`` is decided by rounding (see tests/engines.py)."""
    return _same_greedy(ref, out, BF16_TIE_TOL)


@pytest.fixture(scope="module")
def model():
    """The model, with the torchvision shim here and in vLLM's child processes."""
    with shim_everywhere():
        yield build_tiny_qwen35()


# Tokens of every prompt used below, from an engine with no connector (tests.engines.Reference).
REFERENCES = {**{name: Reference(build_tiny_qwen35, prompt, **ENGINE_KWARGS)
                 for name, prompt in (("text", TEXT), ("variant", VARIANT), ("unaligned", UNALIGNED))},
              **{name: Reference(build_tiny_qwen35, image_prompt(name), **ENGINE_KWARGS) for name in IMAGES}}


@pytest.fixture(scope="module")
def reference(model):  # the model fixture puts the shim on vLLM's path
    return {name: ref.get() for name, ref in REFERENCES.items()}


@pytest.fixture(scope="module")
def redis(module_redis):
    return module_redis


@pytest.fixture(scope="module")
def tiers(tmp_path_factory, redis):
    """YAMLs: all three tiers (the writer), the disk tier alone, Redis alone."""
    d = tmp_path_factory.mktemp("tiers")
    disk = {"local_disk": f"file://{d / 'disk'}/", "max_local_disk_size": 1}
    remote = {"remote_url": redis.url, "remote_serde": "naive"}
    return {
        "all": write_yaml(d / "all.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5,
                          **disk, **remote),
        "disk": write_yaml(d / "disk.yaml", chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.2,
                           **disk),
        "redis": write_yaml(d / "redis.yaml", chunk_size=CHUNK, local_cpu=False,
                            max_local_cpu_size=0.2, **remote),
    }


@pytest.fixture(scope="module")
def writer(model, reference, tiers, tmp_path_factory):  # after the reference: one engine at a time
    stats = tmp_path_factory.mktemp("writer") / "stats.json"
    w = Writer(hold(engine(model, tiers["all"], {"hma_stats_file": str(stats)})), stats=stats)
    yield w
    w.close()


@pytest.fixture(scope="module")
def stored(writer):
    """The text and images A, B, C stored on every tier (already, when the writer's tests ran),
    then the writer shut down: the fresh engines below read what it flushed, nothing is in flight."""
    assert writer.alive, "the writer was closed before its prompts were stored"
    generate(writer.llm, [TEXT] + [image_prompt(name) for name in "ABC"])
    writer.close()


def redis_grew_and_settled(redis, before: int) -> bool:
    """Whether Redis holds more keys than ``before`` and no more arrived for half a second."""
    n = redis.client().dbsize()
    time.sleep(0.5)
    return n > before and redis.client().dbsize() == n


def loaded(stats, before: dict, key: str = "loaded_tokens") -> int:
    return read_stats(stats).get(key, 0) - before.get(key, 0)


def test_output_depends_on_distant_context_and_on_the_image(reference):
    """Otherwise the checks below could not fail: the first word changes the output, and so
    does the image (each pair decisively, not by rounding)."""
    for a, b in ((reference["text"], reference["variant"]), (reference["A"], reference["B"]),
                 (reference["A"], reference["C"]), (reference["A"], reference["D"])):
        i = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        assert i is not None, f"same tokens: {a.tokens}"
        assert max(a.margins[i], b.margins[i]) >= BF16_TIE_TOL


# -- the writer: its CPU tier serves the hits ---------------------------------------------------

def test_text_hit_from_cpu_tier_loads_kv_and_states_and_is_exact(writer, reference):
    llm, stats = writer.llm, writer.stats
    [cold] = generate(llm, TEXT)
    assert cold.cached == 0 and same_greedy(reference["text"], cold), diff(reference["text"], cold)
    llm.reset_prefix_cache()
    [hit] = generate(llm, TEXT)
    assert hit.cached == TEXT_HIT and same_greedy(reference["text"], hit), diff(reference["text"], hit)
    s = read_stats(stats)
    assert s["loads_ok"] == 1 and s["loaded_tokens"] == s["loaded_tokens_cpu"] == TEXT_HIT
    assert s["loaded_bytes_full_attention"] == TEXT_HIT // CHUNK * FULL_CHUNK
    assert s["loaded_bytes_recurrent_state"] == STATE_BYTES  # one state per GDN layer
    assert s["stored_bytes_recurrent_state"] == STATE_BYTES  # the state at 1280 only


def test_other_image_gets_no_hit_and_same_image_hits(writer, reference):
    llm, stats = writer.llm, writer.stats
    [a] = generate(llm, image_prompt("A"))  # stores image A's chunks and state
    assert a.cached == 0 and same_greedy(reference["A"], a), diff(reference["A"], a)
    llm.reset_prefix_cache()
    before = read_stats(stats)
    [b] = generate(llm, image_prompt("B"))  # the same token ids: only the image differs
    assert same_greedy(reference["B"], b), f"{diff(reference['B'], b)}; loaded {loaded(stats, before)}"
    assert b.cached == 0 and loaded(stats, before) == 0, f"image B hit image A's chunks: cached {b.cached}"
    llm.reset_prefix_cache()
    before = read_stats(stats)
    [a] = generate(llm, image_prompt("A"))
    assert a.cached == IMAGE_HIT and loaded(stats, before) == IMAGE_HIT
    assert loaded(stats, before, "loaded_bytes_recurrent_state") == STATE_BYTES
    assert same_greedy(reference["A"], a), diff(reference["A"], a)


def test_batch_of_text_and_images_is_exact(writer, reference):
    llm, stats = writer.llm, writer.stats
    generate(llm, [TEXT, image_prompt("A"), image_prompt("B")])  # stored already unless run alone
    llm.reset_prefix_cache()
    before = read_stats(stats)
    names = ["text", "A", "B", "C"]
    outs = generate(llm, [TEXT] + [image_prompt(n) for n in names[1:]])
    assert all(same_greedy(reference[n], o) for n, o in zip(names, outs)), \
        [diff(reference[n], o) for n, o in zip(names, outs)]
    assert [o.cached for o in outs] == [TEXT_HIT, IMAGE_HIT, IMAGE_HIT, 0]  # C was never stored
    assert loaded(stats, before) == TEXT_HIT + 2 * IMAGE_HIT


def test_prompt_ending_off_the_mamba_block_gets_no_state_and_no_hit(writer, reference):
    """vLLM's scheduler stops this prompt's prefill at 1408 (its stale block size 128): no state
    at a 256-token boundary is handed off, so nothing can be hit; the answer is still exact."""
    llm = writer.llm
    [cold] = generate(llm, UNALIGNED)
    llm.reset_prefix_cache()
    [again] = generate(llm, UNALIGNED)
    assert all(same_greedy(reference["unaligned"], o) for o in (cold, again))
    assert again.cached == 0, ("vLLM now stops at the Mamba block boundary: a hit of "
                               f"{again.cached}; update this test and the module docstring")


# -- fresh engines: the disk tier, Redis (its first load damaged) --------------------------------

def test_disk_tier_read_by_fresh_engine_is_exact_per_image(model, reference, tiers, stored, tmp_path):
    stats = tmp_path / "stats.json"
    llm = engine(model, tiers["disk"], {"hma_stats_file": str(stats)})  # new EngineCore and worker
    try:
        [toks] = generate(llm, TEXT)
        assert toks.cached == TEXT_HIT and same_greedy(reference["text"], toks), diff(reference["text"], toks)
        for name, hit in (("A", IMAGE_HIT), ("D", 0), ("B", IMAGE_HIT), ("C", IMAGE_HIT)):
            llm.reset_prefix_cache()  # each image hits its own chunks, D (never stored) none
            [toks] = generate(llm, image_prompt(name))
            assert toks.cached == hit and same_greedy(reference[name], toks), (name, diff(reference[name], toks))
        s = read_stats(stats)
        assert s["loads_ok"] == 4 and s["loaded_tokens_disk"] == TEXT_HIT + 3 * IMAGE_HIT
        assert s["loaded_bytes_recurrent_state"] == 4 * STATE_BYTES
    finally:
        shutdown(llm)


def test_redis_tier_read_by_fresh_engine_and_a_damaged_state_changes_tokens(model, reference, tiers, redis,
                                                                            stored, tmp_path):
    stats = tmp_path / "stats.json"
    llm = engine(model, tiers["redis"], {"hma_stats_file": str(stats),
                                        "hma_test_corrupt_loads": "recurrent_state"},
                 block_size=256)  # vLLM's scheduler then stops prefills on Mamba blocks (see above)
    try:
        [toks] = generate(llm, TEXT)  # the first load: noise in the loaded states only
        assert toks.cached == TEXT_HIT and not same_greedy(reference["text"], toks)
        print(f"corrupted recurrent_state: {diff(reference['text'], toks)}")
        llm.reset_prefix_cache()  # the stored objects were never damaged: exact again
        [toks] = generate(llm, TEXT)
        assert toks.cached == TEXT_HIT and same_greedy(reference["text"], toks), diff(reference["text"], toks)
        for name, hit in (("A", IMAGE_HIT), ("D", 0), ("B", IMAGE_HIT)):
            llm.reset_prefix_cache()
            [toks] = generate(llm, image_prompt(name))
            assert toks.cached == hit and same_greedy(reference[name], toks), (name, diff(reference[name], toks))
        s = read_stats(stats)
        assert s["loads_ok"] == 4 and s["loaded_tokens_redis"] == 2 * TEXT_HIT + 2 * IMAGE_HIT
        for expected in (0, 1280):  # stored by this engine, then hit: the state at 1280 exists
            llm.reset_prefix_cache()
            keys_before = redis.client().dbsize()
            [toks] = generate(llm, UNALIGNED)
            assert toks.cached == expected and same_greedy(reference["unaligned"], toks), \
                (expected, diff(reference["unaligned"], toks))
            if not expected:  # the hit is asked once the stores (Redis writes, asynchronous) landed
                wait_for(lambda: redis_grew_and_settled(redis, keys_before), timeout=30,
                         what="this engine's stores to land in Redis")
    finally:
        shutdown(llm)
