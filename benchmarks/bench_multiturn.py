"""Multi-turn chat through ``lmcache-hma serve``: how much of each turn's prompt the earlier
turns computed, how much of it is served instead of recomputed, and what that does to TTFT.

Workload (the same for every configuration): ``N`` conversations x ``T`` turns (8 x 4;
``--quick`` 3 x 3) through the OpenAI chat API (``/v1/chat/completions``, streamed), one
request at a time, the conversations interleaved round-robin (turn 1 of every conversation,
then turn 2 of every one, ...). Every conversation starts with the same ~300-token system
prompt; each user message has 100-200 tokens of seeded random words; each answer is
``ANSWER_TOKENS`` tokens (``min_tokens`` = ``max_tokens``, ``ignore_eos``, temperature 0) and
goes back into the next turn's messages as text. The tiny model (``tiny-gemma3``, random
weights, float32 as the tests' servers so greedy tokens are comparable) has no chat template:
the server gets ``CHAT_TEMPLATE`` with ``--chat-template``. Answers are drawn from whole-word
tokens only (``allowed_token_ids``, see ``word_tokens``) so that their text re-tokenizes into
the tokens generated, as a real model's mostly does.

Configurations, four servers started one after another, then all running side by side and taking
turns request by request (``run_workload``) (``lmcache-hma serve``, ``--enforce-eager``,
``--max-model-len`` ``MAX_MODEL_LEN``, ``--max-num-batched-tokens`` ``BATCHED_TOKENS``, hybrid
manager on, ``--enable-prompt-tokens-details``, ``--logprobs-mode processed_logprobs``):

* ``no_connector``: vLLM alone with a KV cache of ``SMALL_BLOCKS`` blocks (``--num-gpu-blocks-override``),
  smaller than the conversations' working set, so a conversation's blocks are evicted before its
  next turn;
* ``prompt_only``: the same cache and LMCacheHMAConnector (CPU tier) with ``hma_store_answers: false``;
* ``answers``: the same with answers stored (the default);
* ``ideal``: vLLM alone with ``LARGE_BLOCKS`` blocks, enough to keep every conversation, and
  ``--prefix-cache-retention-interval`` 128 (the model's, ``MODELS``; see ``CONFIGS``: by default vLLM serves no answer
  blocks of a sliding-window model from its own cache).

Per configuration: mean TTFT (client side: request sent to the first streamed token) of turn 1
and of turns >= 2 (and their median: on a shared machine a few requests take 10x the others);
requests/s (requests over the sum of their latencies: the servers take turns); decode
throughput (output tokens after the first over the time from the first to the last streamed
token, summed over requests);
over turns >= 2, ``reusable`` tokens (the length of the common prefix of the turn's prompt and
the tokens the previous turn of the conversation computed: its prompt and answer but the last
answer token; below ``computed`` where the answer's text re-tokenizes differently) and
``served`` tokens (``usage.prompt_tokens_details.cached_tokens``: vLLM's own and the
connector's hits, capped at ``reusable``). Exactness: every request's output token ids
against ``no_connector``'s; a first divergence where either run's top-2 logprob margin is
below ``TIE_TOL`` is a near tie (float32 rounding decides it), anything else is a mismatch.

    python benchmarks/bench_multiturn.py [--quick] [--model tiny-qwen3next] [--alone]

``--alone``: each configuration's server runs the whole workload alone, started after the last
one stopped. Four servers side by side on a small machine disturb each other's TTFT (every idle
vLLM engine core polls); alone, each sees only its own work (the load's drift is not shared).

``--model tiny-qwen3next``: the same on the tiny gated-delta-net model (bf16, as vLLM's CPU build
runs it: near ties below ``BF16_TIE_TOL``; blocks of 256 tokens, the ideal's retention 256).

Prints the table and a last line ``MULTITURN {json}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (OUT_DIR, ServerProcess, bench_main, bind_beside_worker, cached_tokens, free_port,  # noqa: E402
                     lmcache_yaml, median, ratio, say, streamed_chunks, table)

ANSWER_TOKENS = 170
SYSTEM_TOKENS = 300
USER_TOKENS = (100, 200)
MAX_MODEL_LEN = 2048
SMALL_BLOCKS = 30   # blocks of vLLM's KV cache: the fewest it starts with (one max-length request)
LARGE_BLOCKS = 512  # every conversation of the full run at once, several times over
TIE_TOL = 1e-3      # tests.engines.TIE_TOL: float32 logprob margins below it are near ties
BF16_TIE_TOL = 0.2  # tests.engines.BF16_TIE_TOL: the same in bf16
# per model: the dtype it is served in, its near-tie margin, the ideal's retention interval (a
# multiple of its block size)
MODELS = {"tiny-gemma3": ("float32", TIE_TOL, 128), "tiny-qwen3next": ("bfloat16", BF16_TIE_TOL, 256)}
BATCHED_TOKENS = 512  # --max-num-batched-tokens: a smaller minimum KV cache (sliding groups hold a whole step)
# a newline before each message: the answer's first token starts a pre-token of its own, as in the turn it was generated
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}\n\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")
WORD_TOKEN = re.compile(r" [a-z]+")  # the tokens answers are made of (see word_tokens)
WORDS = ("the king and queen lived in a small house near forest every morning she walked to river "
         "fetch water for her mother brother quick brown fox jumps over lazy dog it was dark stormy "
         "night wind blowing through old trees what time is where do you live can help me with my "
         "homework of course weather nice today sun shining birds are singing computer program reads "
         "input computes answer prints result long ago land far away there man his wife").split()
# vLLM 0.32 keeps a sliding-window group's blocks cached only at a prompt's last block boundary
# (``prefix_cache_retention_interval`` 0, its default): its own cache never serves an answer's
# blocks on this model. The ideal keeps a tail at every block (``--prefix-cache-retention-interval``).
CONFIGS = (  # name, connector (None: no connector; else hma_store_answers), KV cache blocks, keeps every block
    ("no_connector", None, SMALL_BLOCKS, False), ("prompt_only", False, SMALL_BLOCKS, False),
    ("answers", True, SMALL_BLOCKS, False), ("ideal", None, LARGE_BLOCKS, True))


class ChatServer(ServerProcess):
    """``python -m lmcache_hma.tools.serve`` of the tiny model, served as ``tiny``; the connector
    (CPU tier, ``hma_store_answers`` = ``answers``) unless ``answers`` is None."""

    group = True

    def __init__(self, name: str, model: Path, work: Path, blocks: int, answers=None, allowed=(),
                 retention: int | None = None, dtype: str = "float32"):
        self.allowed = list(allowed)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        template = work / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        cmd = [sys.executable, "-m", "lmcache_hma.tools.serve", str(model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--seed", "0",
               "--enforce-eager", "--no-disable-hybrid-kv-cache-manager", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", str(BATCHED_TOKENS), "--num-gpu-blocks-override", str(blocks),
               "--enable-prompt-tokens-details", "--chat-template", str(template),
               "--logprobs-mode", "processed_logprobs"]  # margins among the allowed tokens
        if retention is not None:
            cmd += ["--prefix-cache-retention-interval", str(retention)]
        if answers is not None:
            yaml = lmcache_yaml(work / f"{name}.yaml", local_cpu=True, max_local_cpu_size=1.0)
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                "kv_role": "kv_both", "kv_connector_extra_config": {
                    "lmcache_config_file": str(yaml), "hma_store_answers": answers,
                    "hma_stats_file": str(work / f"{name}-stats.json")}})]
        # LMCache points PROMETHEUS_MULTIPROC_DIR at a shared directory in a process that opened a store
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["PYTHONUNBUFFERED"] = "1"
        import requests

        self._start(cmd, OUT_DIR / f"multiturn_{name}.log",
                    lambda: requests.get(f"{self.base}/health", timeout=5).status_code == 200,
                    timeout=300, env=env)

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        """One streamed greedy request: ``ttft``, ``decode_s`` (first to last token), ``end``
        (seconds since sent), ``prompt`` and ``tokens`` (ids), ``text``, ``margins`` (top-2
        logprob margin per output token), ``cached`` (prompt tokens not computed)."""
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "logprobs": True, "top_logprobs": 2}
        if self.allowed:
            body["allowed_token_ids"] = self.allowed
        out = {"prompt": [], "tokens": [], "text": "", "margins": [], "cached": 0}
        first = None
        t0 = time.perf_counter()
        for chunk in streamed_chunks(f"{self.base}/v1/chat/completions", body):
            out["prompt"] = chunk.get("prompt_token_ids") or out["prompt"]
            if chunk.get("usage"):
                out["cached"] = cached_tokens(chunk["usage"])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids") and first is None:
                    first = time.perf_counter()
                out["tokens"] += choice.get("token_ids") or []
                out["text"] += (choice.get("delta") or {}).get("content") or ""
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True) + [float("-inf")]
                    out["margins"].append(top[0] - top[1])
        end = time.perf_counter()
        return {**out, "ttft": first - t0, "decode_s": end - first, "end": end - t0}


def word_tokens(tokenizer) -> list[int]:
    """Ids of the tokens that are one space and lower-case letters. The random model's unconstrained
    answers are byte soup (partial UTF-8 characters, pieces a re-tokenization merges): their text,
    sent back by the client, re-tokenizes into other tokens and the next turn's prompt shares
    little with what the previous turn computed. Answers made of these re-tokenize exactly (each
    is a pre-token of its own, encoded as itself), as a real model's text mostly does."""
    ids = [i for i in range(len(tokenizer)) if WORD_TOKEN.fullmatch(tokenizer.decode([i]))]
    assert all(tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i] for i in ids)
    return ids


def words(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Random words from ``WORDS`` until the text has ``n_tokens`` tokens."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += rng.choice(WORDS) + " "
    return text.strip()


def user_messages(tokenizer, conversations: int, turns: int) -> tuple[str, list[list[str]]]:
    rng = random.Random(0)
    system = words(rng, tokenizer, SYSTEM_TOKENS)
    return system, [[words(rng, tokenizer, rng.randint(*USER_TOKENS)) for _ in range(turns)]
                    for _ in range(conversations)]


def run_workload(servers: dict[str, ChatServer], system: str, users: list[list[str]], warm_up: list[dict]
                 ) -> dict[str, list[dict]]:
    """Every turn of every conversation, round-robin, on every server, after an untimed ``warm_up``
    chat (a first prompt of a realistic length pays one-time costs); the records by server.

    The servers take turns request by request (the order among them rotating): each sees the
    workload in the same order as alone, and drift of a shared machine's load hits them alike."""
    histories = {name: [[{"role": "system", "content": system}] for _ in users] for name in servers}
    records: dict[str, list[dict]] = {name: [] for name in servers}
    for server in servers.values():
        server.chat(warm_up, 8)
    names = list(servers)
    for i, (turn, conv) in enumerate((t, c) for t in range(len(users[0])) for c in range(len(users))):
        for name in names[i % len(names):] + names[:i % len(names)]:
            history = histories[name][conv]
            history.append({"role": "user", "content": users[conv][turn]})
            rec = servers[name].chat(history, ANSWER_TOKENS)
            history.append({"role": "assistant", "content": rec["text"]})
            records[name].append({"conv": conv, "turn": turn, **rec})
    return records


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reuse(records: list[dict]) -> None:
    """Adds ``computed``, ``reusable`` and ``served`` to the records of turns >= 2."""
    prev = {}
    for r in records:
        p = prev.get(r["conv"])
        if p is not None:
            earlier = (p["prompt"] + p["tokens"])[:-1]  # the last answer token was sampled, never computed
            r["computed"] = len(earlier)
            r["reusable"] = common_prefix(r["prompt"], earlier)
            r["served"] = min(r["cached"], r["reusable"])
        prev[r["conv"]] = r


def exactness(ref: list[dict], records: list[dict], tie: float = TIE_TOL) -> dict:
    """Requests whose output ids equal the reference's; first divergences (conv, turn, index,
    the smaller margin of the two runs there) split into near ties and mismatches."""
    equal, ties, mismatches = 0, [], []
    diverged = set()
    for a, b in zip(ref, records):
        if a["tokens"] == b["tokens"]:
            equal += 1
            continue
        if a["conv"] in diverged:  # its later prompts differ: a consequence, not a new divergence
            continue
        diverged.add(a["conv"])
        k = common_prefix(a["tokens"], b["tokens"])
        margin = min(a["margins"][k], b["margins"][k]) if k < min(len(a["margins"]), len(b["margins"])) else None
        (ties if margin is not None and margin < tie else mismatches).append(
            {"conv": a["conv"], "turn": a["turn"], "index": k, "margin": margin})
    return {"equal": equal, "of": len(ref), "near_ties": ties, "mismatches": mismatches}


def summary(records: list[dict]) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    later = [r for r in records if r["turn"] > 0]
    return {
        "ttft_turn1_s": mean([r["ttft"] for r in records if r["turn"] == 0]),
        "ttft_later_s": mean([r["ttft"] for r in later]),
        "ttft_later_median_s": median(r["ttft"] for r in later),
        "requests_per_s": len(records) / sum(r["end"] for r in records),
        "decode_tokens_per_s": sum(len(r["tokens"]) - 1 for r in records) / sum(r["decode_s"] for r in records),
        "computed": sum(r["computed"] for r in later),
        "reusable": sum(r["reusable"] for r in later),
        "served": sum(r["served"] for r in later),
        "served_fraction": ratio(sum(r["served"] for r in later), sum(r["reusable"] for r in later)),
        "served_turn1": sum(r["cached"] for r in records if r["turn"] == 0),
    }


def run(quick: bool = False, model: str = "tiny-gemma3", alone: bool = False) -> dict:
    from transformers import AutoTokenizer

    from lmcache_hma.testing.tiny_model import build_tiny_model

    conversations, turns = (3, 3) if quick else (8, 4)
    name_of_model, (dtype, tie, ideal_retention) = model, MODELS[model]
    model = build_tiny_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    system, users = user_messages(tokenizer, conversations, turns)
    allowed = word_tokens(tokenizer)
    rng = random.Random(1)  # not the conversations' words: nothing of it is reused
    warm_up = [{"role": "system", "content": words(rng, tokenizer, SYSTEM_TOKENS)},
               {"role": "user", "content": words(rng, tokenizer, USER_TOKENS[1])}]
    res: dict = {"model": name_of_model, "conversations": conversations, "turns": turns, "answer_tokens": ANSWER_TOKENS,
                 "max_model_len": MAX_MODEL_LEN, "configs": {}}
    res["alone"] = alone
    with tempfile.TemporaryDirectory(prefix="bench_multiturn_") as d, contextlib.ExitStack() as stack:
        def start(name, answers, blocks, every_block):
            server = ChatServer(name, model, Path(d), blocks, answers, allowed,
                                ideal_retention if every_block else None, dtype)
            say(f"[multiturn] {name}: server ready in {server.start_s:.0f} s")
            return server

        t0 = time.perf_counter()
        if alone:  # one server at a time: no other engine polls beside the one measured
            raw = {}
            for config in CONFIGS:
                with start(*config) as server:
                    restore = bind_beside_worker(os.getpid())
                    try:
                        raw[config[0]] = run_workload({config[0]: server}, system, users, warm_up)[config[0]]
                    finally:
                        restore()
        else:
            servers = {config[0]: stack.enter_context(start(*config)) for config in CONFIGS}  # then all kept
            # as _common.Engine: everything but vLLM's workers (front ends, engine cores, this client) beside them
            stack.callback(bind_beside_worker(os.getpid()))
            raw = run_workload(servers, system, users, warm_up)
        res["wall_s"] = time.perf_counter() - t0
    for name, records in raw.items():
        reuse(records)
        s = res["configs"][name] = {"blocks": dict((c[0], c[2]) for c in CONFIGS)[name], **summary(records)}
        say(f"[multiturn] {name}: TTFT turn 1 {s['ttft_turn1_s']:.3f} s, turns>=2 {s['ttft_later_s']:.3f} s, "
            f"served {s['served']} of {s['reusable']} reusable ({s['computed']} computed)")
    for name in raw:
        res["configs"][name]["exact"] = exactness(raw["no_connector"], raw[name], tie)
    OUT_DIR.joinpath("multiturn_requests.json").write_text(json.dumps(  # per request, to look into
        {name: [{"conv": r["conv"], "turn": r["turn"], "prompt_tokens": len(r["prompt"]), "cached": r["cached"],
                 **{k: r[k] for k in ("computed", "reusable", "ttft", "decode_s", "end") if k in r}}
                for r in recs] for name, recs in raw.items()}, indent=1))
    c = res["configs"]
    res["multiturn_served_fraction"] = c["answers"]["served_fraction"]
    res["multiturn_served_fraction_prompt_only"] = c["prompt_only"]["served_fraction"]
    res["multiturn_served_fraction_no_connector"] = c["no_connector"]["served_fraction"]
    for name, key in (("answers", ""), ("prompt_only", "_prompt_only"), ("no_connector", "_no_connector")):
        res[f"multiturn_ttft_vs_ideal{key}"] = ratio(c[name]["ttft_later_s"], c["ideal"]["ttft_later_s"])
    res["multiturn_ttft_vs_ideal_median"] = ratio(c["answers"]["ttft_later_median_s"],
                                                  c["ideal"]["ttft_later_median_s"])
    res["multiturn_decode_vs_prompt_only"] = ratio(c["answers"]["decode_tokens_per_s"],
                                                   c["prompt_only"]["decode_tokens_per_s"])
    res["multiturn_exact"] = all(not v["exact"]["mismatches"] for v in c.values())
    res["prompt_tokens_last_turn"] = [len(r["prompt"]) for r in raw["no_connector"][-conversations:]]
    res["table"] = table(
        ["config", "KV blocks", "TTFT turn 1 (ms)", "TTFT turns>=2 (ms)", "median", "req/s", "decode tok/s",
         "computed", "reusable", "served", "served / reusable", "answers = no_connector's"],
        [[n, v["blocks"], 1e3 * v["ttft_turn1_s"], 1e3 * v["ttft_later_s"], 1e3 * v["ttft_later_median_s"],
          v["requests_per_s"],
          v["decode_tokens_per_s"], v["computed"], v["reusable"], v["served"], v["served_fraction"],
          f"{v['exact']['equal']}/{v['exact']['of']}" + (f" ({len(v['exact']['near_ties'])} near ties)"
                                                         if v["exact"]["near_ties"] else "")]
         for n, v in c.items()])
    res["notes"] = [
        f"{conversations} conversations x {turns} turns, round-robin, one request at a time; answers of "
        f"{ANSWER_TOKENS} tokens; last turns' prompts {res['prompt_tokens_last_turn']} tokens",
        "computed / reusable / served: sums over turns >= 2 (reusable: the prompt's common prefix with the "
        "previous turn's prompt + answer but its last token; served: cached_tokens, at most reusable)",
        "exact: output token ids against no_connector's per request (float32; after a first divergence a "
        "conversation's later turns are not compared again)",
    ]
    return res


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "MULTITURN", quick="3 conversations x 3 turns",
                        options=[("--model", dict(default="tiny-gemma3", choices=sorted(MODELS),
                                                  help="the tiny model served (default tiny-gemma3)")),
                                 ("--alone", dict(action="store_true",
                                                  help="run each configuration's server alone, one after "
                                                       "another, instead of four side by side"))],
                        keys=[k for k in ("multiturn_served_fraction", "multiturn_served_fraction_prompt_only",
                                          "multiturn_served_fraction_no_connector", "multiturn_ttft_vs_ideal",
                                          "multiturn_ttft_vs_ideal_prompt_only", "multiturn_ttft_vs_ideal_no_connector",
                                          "multiturn_ttft_vs_ideal_median",
                                          "multiturn_decode_vs_prompt_only", "multiturn_exact")]))
