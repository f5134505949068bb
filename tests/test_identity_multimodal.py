"""Same text, different image: the connector must not hand one image's KV to the other.

An image's tokens in the prompt are placeholders (the same ids for every image), so chunk
keys made from token ids alone give two requests with equal text and different images the
same keys, and the second would load the first's KV (issue 10). Real vLLM engine (CPU
build), the tiny Gemma-3 VLM (``lmcache_hma.testing.tiny_vlm``), two engine starts: a reference
without the connector (``tests.engines.Reference``), then one with the connector on the CPU tier.
"""

from __future__ import annotations


import numpy as np
import pytest
from PIL import Image

from lmcache_hma.testing.tiny_vlm import IMAGE_SIZE, build_tiny_vlm, shim_everywhere
from tests.engines import (TIE_TOL, Reference, diff, generate, hold, make_llm, read_stats, same_greedy, shutdown,
                           write_yaml)

CHUNK = 256
# The image right after BOS, then 1200 text tokens: 1222 tokens, a hit of 1024 (4 chunks)
# would cover the image's 16 tokens (positions 4-19).
TEXT = "Hello<start_of_image>" + "Hello, how are you?" * 200
HIT = 1024

IMAGE_A = Image.fromarray(np.random.default_rng(0).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3),
                                                            dtype=np.uint8))  # seeded noise
IMAGE_B = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 120, 40))  # a plain canvas


def prompt(image):
    return {"prompt": TEXT, "multi_modal_data": {"image": image}}


@pytest.fixture(scope="module")
def vlm():
    """The model, with the torchvision shim here and in vLLM's child processes."""
    with shim_everywhere():
        yield build_tiny_vlm()


# Greedy outputs for image A and image B from an engine with no connector (tests.engines.Reference).
REFERENCES = {name: Reference(build_tiny_vlm, prompt(img)) for name, img in (("A", IMAGE_A), ("B", IMAGE_B))}


@pytest.fixture(scope="module")
def reference(vlm):  # the vlm fixture puts the shim on vLLM's path
    return {name: ref.get() for name, ref in REFERENCES.items()}


@pytest.fixture(scope="module")
def cpu_engine(vlm, reference, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("cpu")
    yaml = write_yaml(d / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)
    stats = d / "stats.json"
    llm = hold(make_llm(vlm, yaml, {"hma_stats_file": str(stats)}))
    yield llm, stats
    shutdown(llm)


def loaded_tokens(stats) -> int:
    return read_stats(stats).get("loaded_tokens", 0)


def test_output_depends_on_the_image(reference):
    """Otherwise the checks below could not fail."""
    a, b = reference["A"], reference["B"]
    i = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    assert i is not None, f"same tokens for both images: {a.tokens}"
    assert max(a.margins[i], b.margins[i]) >= TIE_TOL  # decisively, not by rounding


def test_other_image_gets_no_hit(cpu_engine, reference):
    llm, stats = cpu_engine
    [a] = generate(llm, prompt(IMAGE_A))  # stores image A's chunks
    assert a.cached == 0 and same_greedy(reference["A"], a), diff(reference["A"], a)
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    [b] = generate(llm, prompt(IMAGE_B))
    loaded = loaded_tokens(stats) - before
    assert same_greedy(reference["B"], b), (
        f"image B differs from the reference ({diff(reference['B'], b)}); "
        f"cached {b.cached}, connector loaded {loaded} tokens")
    assert b.cached == 0 and loaded == 0, (
        f"image B hit image A's KV: cached {b.cached}, loaded {loaded}")


def test_same_image_hits(cpu_engine, reference):
    llm, stats = cpu_engine
    generate(llm, prompt(IMAGE_A))  # stored already unless run alone
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    [a] = generate(llm, prompt(IMAGE_A))
    assert a.cached == HIT and loaded_tokens(stats) - before == HIT
    assert same_greedy(reference["A"], a), diff(reference["A"], a)
