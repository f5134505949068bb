"""KV computed under one LoRA adapter or ``cache_salt`` is never served to another (issue 10).

The same prompt text gives different KV with LoRA adapter 1, adapter 2 and no adapter;
requests with different ``cache_salt`` must not share KV even though it is the same. The
connector's chunk keys therefore have to name the adapter and the salt, as vLLM's own
prefix-cache keys do. Real vLLM engines (CPU build), the tiny 3-group Gemma-3 model,
random LoRA adapters from :mod:`lmcache_hma.testing.tiny_lora`, LMCache's CPU tier.

Every check empties vLLM's own prefix cache (``reset_prefix_cache``) first, so a hit can
only come from the connector; the worker's ``loaded_tokens`` counter tells which did. The
LoRA checks and the salt checks use prompts that differ in their first chunk, so what
one part stored can never match a key of the other.
"""

from __future__ import annotations

import pytest

from lmcache_hma.testing.tiny_lora import build_lora_adapter
from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import TIE_TOL, diff, generate, hold, make_llm, read_stats, same_greedy, shutdown, write_yaml

CHUNK = 256
LORA_PROMPT = "Hello, how are you?" * 400 + "Tell me a story"  # 2405 tokens
SALT_PROMPT = "Tell me a very long story" * 450 + "Hello, how are you?"  # 2707 tokens
LORA_KWARGS = dict(enable_lora=True, max_lora_rank=8, max_loras=2)


def boundary(num_tokens: int) -> int:
    """The longest chunk boundary a prompt of ``num_tokens`` can hit."""
    return (num_tokens - 1) // CHUNK * CHUNK


LORA_HIT = boundary(2405)  # 2304
SALT_HIT = boundary(2707)  # 2560


class _WithLoRA:
    """An ``LLM`` whose ``generate`` passes a ``lora_request`` (for ``engines.generate``)."""

    def __init__(self, llm, lora):
        self._llm, self._lora = llm, lora

    def generate(self, prompts, params, **kwargs):
        return self._llm.generate(prompts, params, lora_request=self._lora, **kwargs)


def run(llm, prompt: str, lora=None, salt: str | None = None):
    """One greedy request, with an optional LoRA adapter and ``cache_salt``."""
    request = prompt if salt is None else {"prompt": prompt, "cache_salt": salt}
    [out] = generate(_WithLoRA(llm, lora) if lora is not None else llm, request)
    return out


def loaded_tokens(stats) -> int:
    return read_stats(stats).get("loaded_tokens", 0)


def assert_miss(what: str, ref, out, grew: int) -> None:
    """No connector hit and the reference's tokens; all that went wrong in one message."""
    problems = []
    if grew:
        problems.append(f"the connector loaded {grew} tokens")
    if out.cached:
        problems.append(f"num_cached_tokens {out.cached}")
    if not same_greedy(ref, out):
        problems.append(f"tokens differ from the reference ({diff(ref, out)})")
    assert not problems, f"{what}: " + "; ".join(problems)


def assert_hit(what: str, ref, out, grew: int, hit: int) -> None:
    assert (out.cached, grew) == (hit, hit), (
        f"{what}: expected a connector hit of {hit} tokens, got num_cached_tokens "
        f"{out.cached}, loaded {grew}")
    assert same_greedy(ref, out), f"{what}: tokens differ from the reference ({diff(ref, out)})"


def decisively_different(a, b) -> bool:
    """The two outputs part at a position neither leaves to a near-tie."""
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            return max(a.margins[i], b.margins[i]) >= TIE_TOL
    return False


# -- engines -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-gemma3")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """Adapter id -> ``LoRARequest``, or None for the base model."""
    from vllm.lora.request import LoRARequest

    d = tmp_path_factory.mktemp("lora")
    return {None: None, **{
        i: LoRARequest(f"adapter{i}", i, str(build_lora_adapter(model, d / f"adapter{i}", seed=i)))
        for i in (1, 2)
    }}


@pytest.fixture(scope="module")
def reference(model, adapters):
    """Cold outputs (no connector, empty prefix cache) of every request used below. (Its own
    engine, not a ``tests.engines.Reference``: the adapters are built at run time.)"""
    llm = make_llm(model, **LORA_KWARGS)
    try:
        refs = {}
        for i, lora in adapters.items():
            llm.reset_prefix_cache()
            refs["lora", i] = run(llm, LORA_PROMPT, lora)
        for salt in (None, "a", "b"):
            llm.reset_prefix_cache()
            refs["salt", salt] = run(llm, SALT_PROMPT, salt=salt)
    finally:
        shutdown(llm)
    return refs


@pytest.fixture(scope="module")
def engine(model, reference, tmp_path_factory):  # after the reference: one engine at a time
    d = tmp_path_factory.mktemp("cpu")
    yaml = write_yaml(d / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.5)
    stats = d / "stats.json"
    llm = hold(make_llm(model, yaml, {"hma_stats_file": str(stats)}, **LORA_KWARGS))
    yield llm, stats
    shutdown(llm)


# -- the references: these tests can fail --------------------------------------------

def test_adapters_change_the_output(reference):
    """Adapter 1, adapter 2 and the base model give three decisively different outputs."""
    outs = {i: reference["lora", i] for i in (None, 1, 2)}
    for a, b in [(None, 1), (None, 2), (1, 2)]:
        assert decisively_different(outs[a], outs[b]), f"adapter {a} vs {b}: {diff(outs[a], outs[b])}"


def test_salt_does_not_change_the_output(reference):
    """So the unsalted reference is the reference of every salt."""
    for salt in ("a", "b"):
        assert same_greedy(reference["salt", None], reference["salt", salt]), salt


# -- LoRA ------------------------------------------------------------------------------

def test_same_adapter_hits_and_is_exact(engine, reference, adapters):
    llm, stats = engine
    llm.reset_prefix_cache()
    cold = run(llm, LORA_PROMPT, adapters[1])  # stores adapter 1's KV
    assert cold.cached == 0 and same_greedy(reference["lora", 1], cold), diff(reference["lora", 1], cold)
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, LORA_PROMPT, adapters[1])
    assert_hit("adapter 1 after adapter 1", reference["lora", 1], out, loaded_tokens(stats) - before, LORA_HIT)


def test_other_adapter_gets_no_hit(engine, reference, adapters):
    llm, stats = engine
    llm.reset_prefix_cache()
    run(llm, LORA_PROMPT, adapters[1])  # adapter 1's KV is in the connector (stored or hit)
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, LORA_PROMPT, adapters[2])
    assert_miss("adapter 2 after adapter 1", reference["lora", 2], out, loaded_tokens(stats) - before)


def test_no_adapter_gets_no_hit(engine, reference, adapters):
    llm, stats = engine
    llm.reset_prefix_cache()
    run(llm, LORA_PROMPT, adapters[1])
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, LORA_PROMPT)
    assert_miss("no adapter after adapter 1", reference["lora", None], out, loaded_tokens(stats) - before)


# -- cache_salt --------------------------------------------------------------------------

def test_same_salt_hits_and_is_exact(engine, reference):
    llm, stats = engine
    llm.reset_prefix_cache()
    cold = run(llm, SALT_PROMPT, salt="a")  # stores salt a's KV
    assert cold.cached == 0 and same_greedy(reference["salt", "a"], cold), diff(reference["salt", "a"], cold)
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, SALT_PROMPT, salt="a")
    assert_hit('salt "a" after salt "a"', reference["salt", "a"], out, loaded_tokens(stats) - before, SALT_HIT)


def test_other_salt_gets_no_hit(engine, reference):
    llm, stats = engine
    llm.reset_prefix_cache()
    run(llm, SALT_PROMPT, salt="a")
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, SALT_PROMPT, salt="b")
    assert_miss('salt "b" after salt "a"', reference["salt", "b"], out, loaded_tokens(stats) - before)


def test_no_salt_gets_no_hit_of_salted_kv(engine, reference):
    llm, stats = engine
    llm.reset_prefix_cache()
    run(llm, SALT_PROMPT, salt="a")
    llm.reset_prefix_cache()
    before = loaded_tokens(stats)
    out = run(llm, SALT_PROMPT)
    assert_miss('no salt after salt "a"', reference["salt", None], out, loaded_tokens(stats) - before)
