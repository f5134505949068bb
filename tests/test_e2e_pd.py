"""Disaggregated prefill through Redis: a ``kv_producer`` computes each prompt (``max_tokens`` 1),
a ``kv_consumer`` generates from its KV, through ``examples/pd_proxy.py`` as a client would.

Two ``lmcache-hma serve`` processes on the tiny Gemma-3 (sliding window and full attention) share
one Redis. The decode instance loads every token of the prompt but the one vLLM must compute
(``L - 1``: the producer stores a turn end there), its tokens equal its own cold run (a
``cache_salt``) within the float32 tie gate, and vLLM's own metric counts the hit under
``source="p2p"``. The consumer writes nothing to Redis; the producer reads nothing from it (it
sends no lookups): Redis's own command counters say so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.engines import same_answer
from tests.redis_server import REPO
from tests.servers import serve_fleet
from tests.test_redis import HIT, wait_until

HELLO = "Hello, how are you?"
CHUNK = 256
READS = ("exists", "get", "getrange", "strlen")  # what the connector's Redis tier reads with
WRITES = ("set", "setrange", "del")
ROLES = {"prefill": {"kv_role": "kv_producer"}, "decode": {"kv_role": "kv_consumer"}}


@pytest.fixture(scope="class")
def pd(tmp_path_factory):
    """Redis, a prefill and a decode server, and the proxy in front of them."""
    for fleet in serve_fleet(tmp_path_factory.mktemp("pd"), "tiny-gemma3", {}, ROLES):
        proxy = subprocess.Popen([sys.executable, str(REPO / "examples" / "pd_proxy.py"), "--port", "0",
                                  "--prefill", fleet["prefill"].base, "--decode", fleet["decode"].base],
                                 stdout=subprocess.PIPE, text=True)
        try:
            port = int(re.search(r":(\d+):", proxy.stdout.readline()).group(1))
            yield {**fleet, "proxy": f"http://127.0.0.1:{port}"}
        finally:
            proxy.kill()


def command_calls(redis, names) -> int:
    stats = redis.client().info("commandstats")
    return sum(stats.get(f"cmdstat_{n}", {}).get("calls", 0) for n in names)


def settled_keys(redis) -> int:
    """Redis's key count once writes stopped landing."""
    last = None

    def still():
        nonlocal last
        now = redis.client().dbsize()
        done, last = now == last, now
        return done

    wait_until(still, timeout=20, step=0.5)
    return last


def body(server, prompt: str, **extra) -> dict:
    """What ``Server.complete`` asks, as JSON (10 greedy tokens with their top-2 log-probabilities)."""
    return {"model": server.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True, **extra}


def post(url: str, payload: dict) -> dict:
    import requests

    r = requests.post(f"{url}/v1/completions", json=payload, timeout=300)
    r.raise_for_status()
    return r.json()


def ids_of(answer: dict) -> list[int]:
    return [int(t.split(":")[-1]) for t in answer["choices"][0]["logprobs"]["tokens"]]


def logged_hit(server, mark: int) -> tuple[int, int]:
    """(total tokens, hit tokens) of the last request ``server`` logged after ``mark``."""
    hits = [(int(total), int(hit)) for _, total, hit, _ in HIT.findall(server.text()[mark:])]
    assert hits, f"{server.name}: no 'LMCache hit tokens' line"
    return hits[-1]


def p2p_hit_tokens(server) -> float:
    import requests

    text = requests.get(f"{server.base}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(
        r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="p2p"[^}]*\} ([0-9.e+]+)$', text, re.M))


def expected_hit(total: int) -> int:
    return total - 1  # L - 1: a turn end inside a chunk, or a chunk boundary with its tail


# -- gated delta net ---------------------------------------------------------------------------

@pytest.fixture(scope="class")
def gdn_pd(tmp_path_factory):
    """The same pair on the tiny Qwen3-Next (gated delta net and full attention; bf16, the only
    dtype vLLM's CPU build runs it in)."""
    bf16 = {name: {**kwargs, "extra_args": ["--dtype", "bfloat16"]} for name, kwargs in ROLES.items()}
    yield from serve_fleet(tmp_path_factory.mktemp("pd_gdn"), "tiny-qwen3next", {}, bf16)


class TestSlidingWindow:
    """Tiny Gemma-3: the pair's servers stop after this class (never four at once)."""

    @pytest.mark.parametrize("repeats", [300, 384, 128], ids=["turn-end", "near-boundary", "short"])
    def test_the_decode_instance_loads_every_token_but_one_through_the_proxy(self, pd, repeats):
        prefill, decode, redis = pd["prefill"], pd["decode"], pd["redis"]
        prompt = f"proxy {repeats}: " + HELLO * repeats
        cold = decode.complete(prompt, salt="cold")  # a single instance computing everything
        assert cold[2] == 0
        p2p, mark = p2p_hit_tokens(decode), len(decode.text())
        answer = post(pd["proxy"], body(decode, prompt))
        total, hit = logged_hit(decode, mark)
        assert hit == expected_hit(total), decode.text()[-3000:]
        assert same_answer((cold[0], cold[1], decode.last_margins), (answer["choices"][0]["text"], ids_of(answer)))
        assert p2p_hit_tokens(decode) - p2p == hit
        assert logged_hit(prefill, 0)[1] == 0  # the producer never loads

    def test_the_consumer_writes_nothing_and_the_producer_reads_nothing(self, pd):
        prefill, decode, redis = pd["prefill"], pd["decode"], pd["redis"]
        prompt = "roles: " + HELLO * 250
        reads = command_calls(redis, READS)
        first = post(prefill.base, body(prefill, prompt, max_tokens=1))  # what the proxy sends the producer
        keys = settled_keys(redis)
        assert keys > 0 and command_calls(redis, READS) == reads  # stored, and never looked anything up
        params = first.get("kv_transfer_params")
        assert params and params["lmcache_hma"]["loadable_tokens"] > 0
        writes, mark = command_calls(redis, WRITES), len(decode.text())
        answer = post(decode.base, body(decode, prompt, kv_transfer_params=params))
        assert logged_hit(decode, mark)[1] == params["lmcache_hma"]["loadable_tokens"]
        assert len(ids_of(answer)) == 10
        time.sleep(1.0)  # anything it stored would be on its way by now
        assert settled_keys(redis) == keys and command_calls(redis, WRITES) == writes
        assert decode.counters().get("objects_stored", 0) == 0


class TestRecurrentState:
    """Tiny Qwen3-Next."""

    def test_a_recurrent_state_model_decodes_from_the_last_state_its_producer_stored(self, gdn_pd):
        """vLLM keeps a running request's state after its last computed token only, so the producer
        stores no turn end at L - 1 and promises nothing; the decode instance loads up to the last
        chunk boundary where vLLM handed a state over (2048: where its first prefill step of 2048
        tokens ended) and computes the rest, with its own cold run's tokens (bf16 tie gate)."""
        from tests.engines import BF16_TIE_TOL

        prefill, decode, redis = gdn_pd["prefill"], gdn_pd["decode"], gdn_pd["redis"]
        prompt = "gdn: " + HELLO * 500
        first = post(prefill.base, body(prefill, prompt, max_tokens=1))
        assert not first.get("kv_transfer_params")  # no promise: nothing to wait for
        settled_keys(redis)
        cold = decode.complete(prompt, salt="cold")
        mark = len(decode.text())
        answer = post(decode.base, body(decode, prompt))
        total, hit = logged_hit(decode, mark)
        assert 2048 <= hit < total - 1, decode.text()[-3000:]
        assert same_answer((cold[0], cold[1], decode.last_margins), (answer["choices"][0]["text"], ids_of(answer)),
                           BF16_TIE_TOL)
