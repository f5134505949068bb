"""An existing router's index keeps true credit for an instance (issue 66 item 4).

A real NVIDIA Dynamo standalone indexer (``tests.dynamo_indexer``: installed from PyPI by the
``[fleet]`` extra, skipped with the reason only when it cannot be installed) subscribes to one
``lmcache-hma serve`` of the tiny Gemma-3 (sliding windows beside full attention) publishing
vLLM's KV cache events (``--kv-events-config``, bound ZMQ endpoint). vLLM's own cache is small
(``--num-gpu-blocks-override``): it evicts. The CPU tier of the connector is the only one.

The case compares the index's ``longest_matched`` for the instance with what the engine then
serves (``prompt_tokens_details.cached_tokens``): equal after vLLM evicted the prompt's device
blocks, and again after the connector's own tier evicted the prompt's tail (the chunks past the
last boundary left are withdrawn; the event stream itself is tested in tests/test_kv_events.py),
where the request then routed to it hits exactly the credit, its tokens those it computed cold.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.engines import write_yaml
from tests.redis_server import free_port
from tests.servers import ServeProcess

CHUNK = 256
BLOCK = 128  # vLLM CPU's block size (the indexer's --block-size must equal the events')
HELLO = "Hello, how are you?"
PROMPT_TOKENS = 1100


class Server(ServeProcess):
    def __init__(self, name, model, yaml_path: Path, work: Path, events_port: int, replay_port: int,
                 gpu_blocks: int):
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                  "replay_endpoint": f"tcp://*:{replay_port}"}
        super().__init__(name, model, yaml_path, work, [
            "--served-model-name", "tiny", "--kv-events-config", json.dumps(events),
            "--prefix-caching-hash-algo", "sha256_cbor", "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", "2048"])

    def tokenize(self, text: str) -> list[int]:
        import requests

        r = requests.post(f"{self.base}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, tokens: list[int]) -> int:
        return self.generate(tokens, 1)[0]

    def generate(self, tokens: list[int], max_tokens: int) -> tuple[int, str]:
        """(the prompt tokens served from cache, the greedy completion)."""
        import requests

        r = requests.post(f"{self.base}/v1/completions", timeout=180,
                          json={"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        got = r.json()
        return ((got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                got["choices"][0]["text"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from lmcache_hma.testing.tiny_model import build_tiny_model
    from tests import dynamo_indexer

    site = dynamo_indexer.install()
    if site is None:
        pytest.skip(f"Dynamo's indexer (the [fleet] extra) cannot be installed: {dynamo_indexer.INSTALL_ERROR}")
    work = tmp_path_factory.mktemp("fleet_index")
    model = build_tiny_model("tiny-gemma3")
    events_port, replay_port = free_port(), free_port()
    indexer = dynamo_indexer.Indexer(site, free_port(), work / "indexer.log")
    server = None
    try:
        indexer.wait_ready()
        yaml = write_yaml(work / "a.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.02,
                          extra_config={"hma_tail_admission": "interval"})
        server = Server("a", model, yaml, work, events_port, replay_port, gpu_blocks=64)
        indexer.register(1, f"tcp://127.0.0.1:{events_port}", BLOCK, f"tcp://127.0.0.1:{replay_port}")
        server.wait_ready(time.monotonic() + 600)
        subscribed(server, indexer)
        yield {"server": server, "indexer": indexer}
    finally:
        if server is not None:
            server.stop()
        indexer.stop()


def subscribed(server, indexer, timeout: float = 120.0) -> None:
    """Until the index holds what a request stored: ZMQ drops what is published before the
    subscription is live (and a replay is asked for only when a later batch shows the gap), so
    short prompts are sent until one shows."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        tokens = server.tokenize(f"warm-up {n}: " + HELLO * 20)[:300]
        server.complete(tokens)
        until = time.monotonic() + 5
        while time.monotonic() < until:
            if indexer.score(tokens, 1)["longest_matched"] > 0:
                return
            time.sleep(0.25)
        n += 1
        assert time.monotonic() < deadline, f"the indexer never received the engine's events: {indexer.text()[-2000:]}"


def settle(indexer, tokens, quiet_s=2.0, timeout=30.0) -> dict:
    """The instance's score for ``tokens`` once it stopped changing for ``quiet_s``."""
    deadline = time.monotonic() + timeout
    last, since = indexer.score(tokens, 1), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        got = indexer.score(tokens, 1)
        if got != last:
            last, since = got, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def test_the_index_credits_the_cpu_tier_after_vllm_evicted_the_prompt(fleet):
    """vLLM's device cache evicts P's blocks (its BlockRemoved, medium GPU); the connector's CPU
    tier still holds P: the index goes on crediting what the instance then serves."""
    a, idx = fleet["server"], fleet["indexer"]
    p = a.tokenize("P: " + HELLO * 200)[:PROMPT_TOKENS]
    assert a.complete(p) == 0
    first = settle(idx, p)
    assert first["gpu"] == 1024 and first["longest_matched"] == 1024, first
    for i in range(10):  # one-off prompts until vLLM's 64 blocks no longer hold P's
        a.complete(a.tokenize(f"filler {i}: " + HELLO * 200)[:PROMPT_TOKENS])
        score = settle(idx, p)
        if score["gpu"] == 0:
            break
    else:
        pytest.fail(f"vLLM never evicted P's device blocks: {score}")
    served = a.complete(p)
    assert served == 1024  # 4 chunks, from the connector's CPU tier
    assert score["longest_matched"] == served, (score, served)
    assert score["cpu"] == served and score["gpu"] == 0
    assert "ParentBlockNotFound" not in idx.text() and "Failed to find parent" not in idx.text()


def test_the_index_follows_the_connector_when_its_tier_evicts_the_prompts_tail(fleet):
    """Q is stored (tails at every chunk: interval admission) and evicted from vLLM's device; R,
    sharing Q's first 512 tokens, then reads Q's first two chunks and the tail at 512 from the
    connector (two uses each against one for the rest of Q). One-off prompts then fill the 20 MB
    tier: the value policy drops Q's least-used leaves first, its later tails, and with its last
    tail the chunks no hit can end at any more. At the first drop of the index's credit for Q,
    the instance serves exactly the credit, with the tokens Q got cold."""
    a, idx = fleet["server"], fleet["indexer"]
    q = a.tokenize("Q: " + "The quick brown fox jumps over the lazy dog. " * 120)[:PROMPT_TOKENS]
    cold, reference = a.generate(q, 8)
    assert cold == 0
    first = settle(idx, q)
    assert first["longest_matched"] == 1024, first

    def one_offs_until(done, what: str, n: int = 60) -> dict:
        for i in range(n):
            a.complete(a.tokenize(f"one-off {what} {i}: " + HELLO * 200)[:PROMPT_TOKENS])
            score = settle(idx, q)
            if done(score):
                return score
        pytest.fail(f"{what} never happened: {score}")

    one_offs_until(lambda s: s["gpu"] == 0, "vLLM evicting Q")
    r = q[:512] + a.tokenize(" and then something else entirely, " * 40)[:400]
    assert a.complete(r) == 512  # Q's chunks 0-1 and its tail at 512, from the connector's tier
    # judged with none of Q's blocks left on vLLM's device, nor R's (Q's first 512 tokens): the
    # credit and what is served then come from the connector's tier alone
    score = one_offs_until(lambda s: s["gpu"] == 0 and s["longest_matched"] < first["longest_matched"],
                           "the tier evicting Q")
    served, text = a.generate(q, 8)
    assert served == score["longest_matched"], (score, served)
    assert 0 < served < 1024 and served % CHUNK == 0, (score, served)  # a tail Q still has
    assert text == reference, (text, reference)
    assert "ParentBlockNotFound" not in idx.text() and "Failed to find parent" not in idx.text()
