"""Exact hits from full tiers: branch points learned then served, hits after evictions in CPU
memory, on disk and in a Redis under ``maxmemory`` (scheduler.admission, store.value_policy).

A RAG-shaped sequence on tiny-gemma3 (chunk 256, window 128): a 512-token system prompt (two
chunks), documents of 512 tokens, 40-token questions, token ids drawn from a seeded generator.
Each tier holds about two documents' objects; six unique documents pass through it, two between
each read of the popular one (as a Zipf-popular document is read). Every run that must hit empties vLLM's own prefix cache first, and
its greedy tokens are compared with an engine without the connector (float32).

Then a conversation of three turns through the full CPU tier, a unique document before each next
turn: each turn hits what the one before stored, exactly.

Engines: the session's tiny-gemma3 references; a CPU-tier engine; an engine with a small disk
tier and a Redis under ``maxmemory`` (allkeys-lfu, docs/redis.md; the writer makes room there,
store.redis.room), then a fresh engine that reads that Redis alone.
"""

from __future__ import annotations

import random

import pytest

from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import Gen, Reference, generate, hold, make_llm, read_stats, same_greedy, settled_stats, shutdown, write_yaml
from tests.redis_server import RedisServer, redis_server_binary

CHUNK, VOCAB = 256, 790
# tiny-gemma3's tails are small (window 128 < chunk): by default one at every chunk (its
# tail_interval); a Gemma-3 shape's are five windows apart. As there, none between these prompts'
# ends: the tails are the prompt ends' and the branch points' (scheduler.admission).
SPARSE = {"hma_checkpoint_interval": 4096}
_rng = random.Random(46)
SYSTEM = [_rng.randrange(10, VOCAB) for _ in range(512)]
DOCS = [[_rng.randrange(10, VOCAB) for _ in range(512)] for _ in range(9)]
QUESTIONS = {q: [_rng.randrange(10, VOCAB) for _ in range(40)] for q in "abcdefg"}


def prompt(doc: int, question: str) -> dict:
    return {"prompt_token_ids": SYSTEM + DOCS[doc] + QUESTIONS[question]}


CHECKED = [(0, "a"), (1, "a"), (2, "a"), (0, "b"), (0, "c"), (0, "d"), (0, "e"), (0, "f")]
REFERENCES = {pq: Reference("tiny-gemma3", prompt(*pq)) for pq in CHECKED}
# A conversation of three turns, each turn's prompt the previous prompt and its answer: its
# reference is one generation of three answers' length. A first chunk of its own (its own
# turn-end counts, scheduler.admission), a unique document before each next turn.
_conversation = random.Random(4646)
CONVERSATION = [_conversation.randrange(10, VOCAB) for _ in range(1064)]
FILLERS = [[_conversation.randrange(10, VOCAB) for _ in range(512)] for _ in range(2)]
ANSWER = 16
REFERENCES["conversation"] = Reference("tiny-gemma3", {"prompt_token_ids": CONVERSATION}, max_tokens=3 * ANSWER)
# unique documents, and the reads of document 0 between them
PLAYED = [(3, "a"), (4, "a"), (0, "c"), (5, "a"), (6, "a"), (0, "d"), (7, "a"), (8, "a")]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-gemma3")


@pytest.fixture(scope="module")
def references():
    return {pq: ref.get() for pq, ref in REFERENCES.items()}


def run(llm, doc: int, question: str, stats=None):
    """One request after vLLM's prefix cache was emptied; with ``stats``, once what the requests
    before stored has landed (a lookup waits for nothing but the turn ends it could hit: a tail
    the request before stored, still in the writer's queue under load, would be a miss)."""
    if stats is not None:
        settled_stats(stats)
    llm.reset_prefix_cache()
    [out] = generate(llm, prompt(doc, question))
    return out


def play_until_evicted(llm, references, stats) -> None:
    """The sequence every tier sees: a branch point learned, then served; document 0 read between
    unique documents that overflow the tier (each read exact)."""
    assert run(llm, 0, "a", stats).cached == 0
    assert run(llm, 1, "a", stats).cached == 0  # the system prompt's chunks are stored, no tail at their end
    hit = run(llm, 2, "a", stats)  # the branch point document 1's request stored
    assert hit.cached == 512 and same_greedy(references[(2, "a")], hit)
    for doc, question in [(0, "b")] + PLAYED:
        out = run(llm, doc, question, stats)
        if doc:
            assert out.cached == 512  # the system prompt: the branch point
        else:
            assert out.cached == 1024 and same_greedy(references[(0, question)], out), question


@pytest.fixture(scope="module")
def cpu_engine(model, references, tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu")
    # ~4 MB: the system prompt and its tail (768 KB) and about two documents with their turn ends
    # (a document's two chunks 512 KB, its tail 256 KB, a turn end ~384 KB)
    yaml = write_yaml(d / "cpu.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.004, extra_config=SPARSE)
    stats = d / "stats.json"
    llm = hold(make_llm(model, yaml, {"hma_stats_file": str(stats)}))
    yield llm, stats
    shutdown(llm)


def test_a_branch_point_is_learned_then_served_and_a_read_document_survives_a_full_cpu_tier(cpu_engine, references):
    llm, stats = cpu_engine
    play_until_evicted(llm, references, stats)
    s = read_stats(stats)
    stored = sum(n for k, n in s.items() if k.startswith("stored_bytes_"))
    assert stored > 2 * 4.3e6, "the trace must overflow the tier (else nothing was evicted)"
    hit = run(llm, 0, "e", stats)  # read again and again: the unique documents went first
    assert hit.cached == 1024 and same_greedy(references[(0, "e")], hit)


def test_a_conversation_hits_each_turn_end_through_a_full_cpu_tier(cpu_engine, references):
    """Three turns, each after a unique document (stored, never read again) and the tier full
    from the test before: every turn after the first hits what the one before stored, its turn end
    (every token it computed) or, where that went first, the chunk boundary before it, and each
    answer equals the reference's continuation. (A turn end that restores a few dozen tokens
    beyond a tail, for a whole block of every layer, is worth least per byte of what the tier
    holds, store.value_policy: under this much pressure it goes before any document's tail.)"""
    llm, stats = cpu_engine
    ref = references["conversation"]
    before = read_stats(stats)
    prompt = list(CONVERSATION)
    fillers = iter(FILLERS)
    for turn in range(3):
        llm.reset_prefix_cache()
        [out] = generate(llm, {"prompt_token_ids": prompt}, max_tokens=ANSWER)
        part = slice(turn * ANSWER, (turn + 1) * ANSWER)
        assert same_greedy(Gen(ref.tokens[part], 0, ref.margins[part]), out), f"turn {turn + 1}"
        if out.tokens != ref.tokens[part]:
            break  # parted from the reference at a near tie: the next turns' prompts are not its
        assert out.cached in ((len(prompt) - 1, (len(prompt) - 1) // CHUNK * CHUNK) if turn else (0,)), \
            f"turn {turn + 1}: {out.cached} of {len(prompt)}"
        prompt += out.tokens
        if turn < 2:
            llm.reset_prefix_cache()
            generate(llm, {"prompt_token_ids": SYSTEM + next(fillers) + QUESTIONS["g"]})
    stored = {when: sum(n for k, n in s.items() if k.startswith("stored_bytes_")) for when, s in
              (("before", before), ("after", read_stats(stats)))}
    # the test before filled the tier (4 MB), and the turns and documents stored ~3.7 MB more
    assert stored["before"] > 4.3e6 and stored["after"] - stored["before"] > 2e6, \
        f"the tier must be full and overflow while the turns run (else nothing was evicted): {stored}"


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    if redis_server_binary() is None:
        pytest.fail("redis-server is not installed (make test-setup installs it)")
    server = RedisServer(workdir=tmp_path_factory.mktemp("redis"),
                         extra_args=["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lfu",
                                     "--maxmemory-samples", "10"]).start()  # docs/redis.md
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiers_engine(model, references, redis, tmp_path_factory, cpu_engine):  # after the CPU engine's tests
    d = tmp_path_factory.mktemp("tiers")
    # no CPU tier (its memory only stages reads and writes): hits come from the disk tier (about
    # two documents) or Redis, which is told of the disk's hits (it evicts by what is read least)
    yaml = write_yaml(d / "tiers.yaml", chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                      local_disk=f"file://{d}/disk/", max_local_disk_size=0.004, remote_url=redis.url,
                      remote_serde="naive", extra_config=SPARSE)
    stats = d / "stats.json"
    llm = hold(make_llm(model, yaml, {"hma_stats_file": str(stats)}))
    yield llm, stats
    shutdown(llm)


def test_hits_after_evictions_from_disk_and_from_a_redis_under_maxmemory(tiers_engine, redis, references,
                                                                        tmp_path_factory, model):
    llm, stats = tiers_engine
    play_until_evicted(llm, references, stats)
    hit = run(llm, 0, "e", stats)
    assert hit.cached == 1024 and same_greedy(references[(0, "e")], hit)
    # Redis was full: the writer made room for its writes (hma_eviction: value, store.redis.room),
    # deleting what is worth least; Redis itself evicts only for what that estimate missed
    deleted = read_stats(stats).get("redis_room_deletes", 0)
    assert deleted > 0, f"no room was made in Redis (evicted_keys {redis.client().info()['evicted_keys']}): " \
                        "this proves nothing about maxmemory"
    shutdown(llm)
    # a fresh instance with Redis alone: what Redis kept under maxmemory serves it, exactly
    d = tmp_path_factory.mktemp("reader")
    yaml = write_yaml(d / "reader.yaml", chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                      remote_url=redis.url, remote_serde="naive", extra_config=SPARSE)
    reader = make_llm(model, yaml, {"hma_stats_file": str(d / "stats.json")})
    try:
        hit = run(reader, 0, "f")
        assert hit.cached == 1024 and same_greedy(references[(0, "f")], hit)
        assert read_stats(d / "stats.json").get("loaded_tokens_redis", 0) >= 1024
    finally:
        shutdown(reader)
