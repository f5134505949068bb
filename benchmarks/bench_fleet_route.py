"""Routing a fleet by an existing router's index: hit tokens, TTFT and the index's credit error
per policy (round-robin, least-loaded, KV-aware), against one instance with all the memory.

    python benchmarks/bench_fleet_route.py [--quick] [--traces rag,chat,agents] [--fleets local,redis]
        [--model gemma3-h512|tiny-gemma3|tiny-qwen3next]

Three ``lmcache-hma serve`` instances of a Gemma-3-shaped model (sliding windows beside full
attention: ``gemma3-h512``, the tiny Gemma-3's KV with eight times its compute, see
``model_dir``; ``--model tiny-gemma3``, ``tiny-qwen3next``: gated-delta-net layers, bf16),
vLLM device caches small enough that vLLM evicts (``--num-gpu-blocks-override``), each
publishing KV cache events to NVIDIA Dynamo's standalone indexer (the ``[fleet]`` extra,
installed by ``tests/dynamo_indexer.py``); the policies of ``examples/fleet/proxy.py`` choose the
instance. Two fleets: ``local`` (each instance's CPU tier only) and ``redis`` (the same plus one
shared Redis; round-robin and KV-aware: Dynamo's index ignores REMOTE events, so the KV-aware
proxy routes by the local tiers, and every instance reads Redis alike). Requests go one at a
time, or from ``--clients N`` clients at once (each sends the earliest request not yet sent
whose conversation's previous turn has its answer; the proxy weighs the requests in flight on
each instance). Per trace and policy (the fleet reset in between: ``reset_prefix_cache?reset_external=true``,
and Redis flushed):

* hit tokens by source (vLLM's ``prompt_tokens_cached_by_source``: device, host, p2p = Redis),
  their ratio to the reference (one instance with three times the device blocks and CPU memory)
  and to round-robin (of the same fleet);
* the MB Redis sent to clients (its ``INFO stats`` ``total_net_output_bytes``);
* TTFT median, mean and p90 (streamed, first token), requests/s;
* the index's credit for the chosen instance against what it served
  (``prompt_tokens_details.cached_tokens``): tokens credited past what was served (``over``),
  served past the credit (``under``), and the requests outside [served - one block, served +
  the rest of the chunk the prompt diverges in] (``outside``);
* answers that differ from the reference's (greedy, two tokens: none should).

Traces (``make_trace``: sized between one instance's memory and the fleet's): ``rag`` (shared
documents, a question each, one-off prompts between), ``chat`` (conversations whose turns
interleave in any order across conversations, one-off prompts between), ``agents`` (agents on
one shared system prompt, each history growing). A conversation's or agent's next prompt carries
the model's answers to the earlier ones, as a client sends them back (``prompts``: computed once,
on the reference instance, before any policy runs).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "fleet"))

from benchmarks._common import OUT_DIR, RedisServer, bench_main, fmt, free_port, lmcache_yaml, say, table  # noqa: E402
from benchmarks._fleet_traces import conversation_deps, make_trace, prompts  # noqa: E402

CHUNK = 256
ANSWER_TOKENS = 2  # per request: the prompt's prefill is what routing changes
DEVICE_TOKENS = 8192  # each instance's vLLM KV cache (--num-gpu-blocks-override: this / its block size)
# model -> (dtype it is served in, vLLM CPU's block size for it: the size its events carry, which
# the indexer must be registered with)
MODELS = {"gemma3-h512": ("float32", 128), "tiny-gemma3": ("float32", 128), "tiny-qwen3next": ("bfloat16", 256)}


def model_dir(name: str) -> Path:
    """``gemma3-h512``: the tiny Gemma-3's layers and KV (the same bytes per token, so the same
    tiers hold the same tokens) with eight times its compute (hidden 512, MLP 2048, 8 query heads),
    so that a prefill costs what it does on a real model against a request's fixed costs: on the
    tiny one, a 1,500-token prefill took 45 ms and a hit 25 ms, and the TTFTs of every policy
    were within 2x of each other whatever they hit. The others are the tiny presets."""
    from lmcache_hma.testing.tiny_model import F, S, TinyModelSpec, build_tiny_model

    if name == "gemma3-h512":
        return build_tiny_model(TinyModelSpec("bench-gemma3-h512-w128", "gemma3", (S, S, F, S, S, F),
                                              sliding_window=128, hidden_size=512, intermediate_size=2048,
                                              num_attention_heads=8, num_kv_heads=1, head_dim=64))
    return build_tiny_model(name)


BLOCK = 128  # of the model run (set by run())
CPU_GB = 0.02


def metrics(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        body = r.read().decode()
    out = {}
    for m in re.finditer(r'^vllm:prompt_tokens_cached_by_source_total\{([^}]*)\} ([0-9.e+]+)$', body, re.M):
        src = re.search(r'source="([^"]+)"', m.group(1))
        if src:
            out[src.group(1)] = out.get(src.group(1), 0.0) + float(m.group(2))
    return out


def streamed(base: str, tokens: list[int]) -> tuple[float, int, list[int]]:
    """(TTFT s, cached tokens, the answer's token ids) of one request."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": ANSWER_TOKENS, "temperature": 0,
                       "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0, ttft, cached, answer = time.monotonic(), None, 0, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - t0
            for choice in chunk.get("choices") or ():
                answer += choice.get("token_ids") or []
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft if ttft is not None else time.monotonic() - t0, cached, answer


def reset(base: str) -> None:
    req = urllib.request.Request(f"{base}/reset_prefix_cache?reset_external=true", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60):
        pass


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_policy(fleet, policy: str, prompts: list[list[int]], answers: list[list[int]], redis=None,
               log: Path | None = None, deps: list | None = None, clients: int = 1) -> dict:
    """One trace through the fleet under ``policy``; ``log``: a JSON line per request there.
    ``answers``: the reference's answer to each prompt; those that differ are counted (none
    should: a hit changes no token, whichever instance and tier served it). ``clients`` > 1:
    that many clients send requests at once, each the earliest not yet sent whose conversation's
    previous turn (``deps``) has its answer, and the proxy's load (requests in flight per
    instance) weighs in; the tokens served by source per request are then not logged (the
    instances' counters mix concurrent requests)."""
    import proxy

    front = proxy.Fleet(fleet.instances, fleet.indexer, policy)
    for base in fleet.instances.values():
        reset(base)
    if redis is not None:  # the shared tier starts empty for each policy too
        redis.client().flushall()
    time.sleep(3)  # the resets' events reach the index
    before = {i: metrics(b) for i, b in fleet.instances.items()}
    last = dict(before)
    redis_out = redis.stat("total_net_output_bytes") if redis is not None else 0
    seen: dict[int, list[list[int]]] = {i: [] for i in fleet.instances}
    acc = {"over": 0, "under": 0, "outside": 0, "served": 0, "credited": 0, "differ": 0}
    ttfts: list[float] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        tokens, expected = prompts[k], answers[k]
        with lock:  # a decision sees the index, and the load, as the requests before it left them
            i = front.choose("/v1/completions", {"prompt": tokens})
            scores = front.last_scores if policy == "kv" else front.query(tokens)  # the error columns
            front.begin(i)
            # allowed: one block below; above, the rest of the chunk where it parts from what it saw
            diverge = max((shared_prefix(tokens, p) for p in seen[i]), default=0)
            seen[i].append(tokens)
        credit = (scores.get(str(i)) or {}).get("longest_matched", 0)
        try:
            ttft, served, answer = streamed(fleet.instances[i], tokens)
        finally:
            front.end(i)
        slack = (-(-diverge // CHUNK) * CHUNK - diverge) if diverge % CHUNK else 0
        with lock:
            acc["differ"] += answer != expected
            ttfts.append(ttft)
            acc["served"] += served
            acc["credited"] += credit
            acc["over"] += max(0, credit - served)
            acc["under"] += max(0, served - credit)
            acc["outside"] += credit < served - BLOCK or credit > served + max(slack, 0) + BLOCK - 1
        time.sleep(GAP_S)
        if log is not None:  # (after the gap: the instance's counters have caught up)
            by_src = None
            if clients == 1:
                now = metrics(fleet.instances[i])
                by_src = {s: int(v - last[i].get(s, 0.0)) for s, v in now.items() if v != last[i].get(s, 0.0)}
                last[i] = now
            tiers = {t: n for t, n in (scores.get(str(i)) or {}).items() if t in ("gpu", "cpu", "disk")}
            with lock, open(log, "a") as f:
                f.write(json.dumps({"request": k, "instance": i, "tokens": len(tokens), "credit": credit,
                                    "credit_by_tier": tiers, "served": served, "served_by_source": by_src,
                                    "diverges": diverge, "ttft": round(ttft, 4),
                                    "answer_differs": answer != expected}) + "\n")

    t0 = time.monotonic()
    if clients == 1:
        for k in range(len(prompts)):
            one(k)
    else:
        deps = deps or [None] * len(prompts)
        state = {"next": [k for k in range(len(prompts))], "done": set(), "failed": []}
        ready = threading.Condition(lock)

        def client() -> None:
            while True:
                with ready:
                    while True:
                        if state["failed"] or not state["next"]:
                            return
                        k = next((k for k in state["next"] if deps[k] is None or deps[k] in state["done"]), None)
                        if k is not None:
                            state["next"].remove(k)
                            break
                        ready.wait()
                try:
                    one(k)
                except BaseException as e:  # noqa: BLE001 - reported by the main thread
                    with ready:
                        state["failed"].append(e)
                        ready.notify_all()
                    return
                with ready:
                    state["done"].add(k)
                    ready.notify_all()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if state["failed"]:
            raise state["failed"][0]
    wall = time.monotonic() - t0
    after = {i: metrics(b) for i, b in fleet.instances.items()}
    by_source: dict[str, float] = {}
    for i in fleet.instances:
        for src, v in after[i].items():
            by_source[src] = by_source.get(src, 0.0) + v - before[i].get(src, 0.0)
    ttfts.sort()
    return {"policy": policy, "hit_tokens": acc["served"], "credited": acc["credited"],
            "device": int(by_source.get("device", 0)), "host": int(by_source.get("host", 0)),
            "remote": int(by_source.get("p2p", 0)),  # Redis: KV another instance (or this one) wrote there
            "other": int(sum(v for k, v in by_source.items() if k not in ("device", "host", "p2p"))),
            "redis_MB_read": round(((redis.stat("total_net_output_bytes") - redis_out) / 1e6), 2)
            if redis is not None else 0.0,
            "ttft_median": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "req_s": len(prompts) / wall,
            "over": acc["over"], "under": acc["under"], "outside": acc["outside"], "requests": len(prompts),
            "answers_differ": acc["differ"]}


def start(n: int, work: Path, scale: int, site: Path, redis=None, model_name: str = "gemma3-h512",
          prefill_step: int = 0):
    from run_fleet import LocalFleet

    model = model_dir(model_name)
    dtype, block = MODELS[model_name]
    remote = {"remote_url": redis.url, "remote_serde": "naive"} if redis is not None else {}
    yaml = lmcache_yaml(work / f"lmcache-{n}{'-redis' if redis else ''}.yaml", local_cpu=True,
                        max_local_cpu_size=CPU_GB * scale, **remote)
    transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache_config_file": str(yaml)}}
    args = ["--served-model-name", "tiny", "--dtype", dtype, "--seed", "0", "--enforce-eager",
            "--no-disable-hybrid-kv-cache-manager", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
            "--num-gpu-blocks-override", str(DEVICE_TOKENS // block * scale), "--kv-transfer-config", json.dumps(transfer)]
    if prefill_step:  # a prompt prefilled in steps of this many tokens: a recurrent state kept at each step's end
        # (vLLM's --long-prefill-token-threshold does not cut a request that runs alone)
        args[args.index("--max-num-batched-tokens") + 1] = str(prefill_step)
    return LocalFleet(str(model), n, str(yaml), indexer_path=str(site), base_port=0,
                      indexer_port=free_port(), block_size=block,
                      serve_args=args, logdir=work / f"fleet-{n}{'-redis' if redis else ''}",
                      env_extra={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})


# Between requests: the stores' events land before the next decision, and every instance's vLLM
# worker has left its busy loop (it spins on sched_yield for 1 s after its last step:
# shm_broadcast's SpinCondition). With 0.5 s, the workers of the instances used just before spun
# on the 2 cores under the next request: 12-18 of 75 requests took ~0.5 s more, hit or miss.
GAP_S = 1.2
POLICIES = ("round-robin", "least-loaded", "kv")
REDIS_POLICIES = ("round-robin", "kv")  # with the shared tier: the goal's comparison


def run(quick: bool = False, traces: str = "rag,chat,agents", fleets: str = "local,redis",
        model: str = "gemma3-h512", prefill_step: int = 0, clients: int = 1) -> dict:
    global BLOCK
    from tests import dynamo_indexer

    BLOCK = MODELS[model][1]

    site = dynamo_indexer.install()
    if site is None:
        raise SystemExit(f"Dynamo's indexer cannot be installed: {dynamo_indexer.INSTALL_ERROR}")
    work = OUT_DIR / "fleet_route" / (model + (f"-step{prefill_step}" if prefill_step else "")
                                      + (f"-clients{clients}" if clients > 1 else ""))
    work.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in traces.split(",") if k]
    which = [f for f in fleets.split(",") if f]
    rows, results = [], {}
    ref = start(1, work, 3, site, model_name=model, prefill_step=prefill_step)  # the reference first: one instance with all the memory
    try:
        first = next(iter(ref.instances.values()))

        def tokenize(text: str, special: bool) -> list[int]:
            body = json.dumps({"model": "tiny", "prompt": text, "add_special_tokens": special}).encode()
            req = urllib.request.Request(f"{first}/tokenize", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["tokens"]

        def answer(tokens: list[int]) -> list[int]:
            return streamed(first, tokens)[2]

        raw = {k: make_trace(k, random.Random(7), quick) for k in kinds}
        traces = {k: prompts(raw[k], tokenize, answer) for k in kinds}
        deps = {k: conversation_deps(raw[k]) for k in kinds}
        if "local" in which:
            for k in kinds:
                say(f"{k}: reference ...")
                log = work / f"requests-{k}-reference.jsonl"
                log.unlink(missing_ok=True)
                results[(k, "one instance x3")] = run_policy(ref, "round-robin", *traces[k], log=log,
                                                             deps=deps[k], clients=clients)
                say(json.dumps({k: results[(k, "one instance x3")]}))
    finally:
        ref.stop()
    for kind_of_fleet in which:
        redis = RedisServer(work / "redis.log") if kind_of_fleet == "redis" else None
        try:
            fleet = start(3, work, 1, site, redis, model, prefill_step)
            try:
                for k in kinds:
                    for policy in (REDIS_POLICIES if redis is not None else POLICIES):
                        name = policy if redis is None else f"{policy} +redis"
                        say(f"{k}: {name} ...")
                        log = work / f"requests-{k}-{name.replace(' ', '').replace('+', '-')}.jsonl"
                        log.unlink(missing_ok=True)
                        results[(k, name)] = run_policy(fleet, policy, *traces[k], redis, log, deps[k], clients)
                        say(json.dumps({f"{k} {name}": results[(k, name)]}))
            finally:
                fleet.stop()
        finally:
            if redis is not None:
                redis.stop()
    out = {"notes": [("requests one at a time" if clients == 1 else f"{clients} clients at once")
                      + "; 2 shared CPU cores: TTFTs are disturbed by other work"]}
    for k in kinds:
        rr, refr = results.get((k, "round-robin")), results.get((k, "one instance x3"))
        for policy in (*POLICIES, "one instance x3", *(f"{p} +redis" for p in REDIS_POLICIES)):
            r = results.get((k, policy))
            if r is None:
                continue
            base = results[(k, "round-robin +redis")] if policy.endswith("+redis") else rr
            rows.append([k, policy, r["hit_tokens"], r["device"], r["host"], r["remote"], r["redis_MB_read"],
                         fmt(r["hit_tokens"] / max(1, refr["hit_tokens"])) if refr else "-",
                         fmt(r["hit_tokens"] / max(1, base["hit_tokens"])),
                         fmt(r["ttft_median"]), fmt(r["ttft_mean"]), fmt(r["ttft_p90"]), fmt(r["req_s"]),
                         r["over"], r["under"], f"{r['outside']}/{r['requests']}", r["answers_differ"]])
            tag = f"{k}_{policy.replace(' +redis', '_redis').replace(' ', '_').replace('-', '_')}"
            out[f"{tag}_hit_tokens"] = r["hit_tokens"]
            out[f"{tag}_ttft_median"] = round(r["ttft_median"], 4)
            out[f"{tag}_credit_over"] = r["over"]
            out[f"{tag}_credit_under"] = r["under"]
            out[f"{tag}_credit_outside"] = r["outside"]
            out[f"{tag}_answers_differ"] = r["answers_differ"]
            if policy.endswith("+redis"):
                out[f"{tag}_redis_MB_read"] = r["redis_MB_read"]
        kv = results.get((k, "kv"))
        if kv is not None:
            out[f"{k}_kv_vs_reference"] = round(kv["hit_tokens"] / max(1, refr["hit_tokens"]), 3)
            out[f"{k}_kv_vs_round_robin"] = round(kv["hit_tokens"] / max(1, rr["hit_tokens"]), 3)
            out[f"{k}_kv_ttft_median_vs_round_robin"] = round(kv["ttft_median"] / rr["ttft_median"], 3)
        kvr, rrr = results.get((k, "kv +redis")), results.get((k, "round-robin +redis"))
        if kvr is not None:
            out[f"{k}_redis_kv_vs_round_robin"] = round(kvr["hit_tokens"] / max(1, rrr["hit_tokens"]), 3)
            out[f"{k}_redis_kv_MB_read_vs_round_robin"] = round(kvr["redis_MB_read"] / max(1e-6, rrr["redis_MB_read"]), 3)
            out[f"{k}_redis_kv_ttft_median_vs_round_robin"] = round(kvr["ttft_median"] / rrr["ttft_median"], 3)
    out["table"] = table(["trace", "policy", "hit tok", "device", "host", "redis", "redis MB read", "x ref", "x rr",
                          "TTFT med", "mean", "p90", "req/s", "credit over", "under", "outside", "answers differ"], rows)
    return out


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__, run, "BENCH_FLEET_ROUTE", options=(
        ("--traces", {"default": "rag,chat,agents", "help": "comma-separated: rag, chat, agents"}),
        ("--fleets", {"default": "local,redis", "help": "comma-separated: local (CPU tiers), redis (+ one shared Redis)"}),
        ("--model", {"default": "gemma3-h512", "choices": sorted(MODELS),
                     "help": "tiny-qwen3next: the gated-delta-net shape (recurrent states beside full attention)"}),
        ("--prefill-step", {"type": int, "default": 0,
                            "help": "vLLM's --max-num-batched-tokens (default 2048): a prompt prefilled in steps of this "
                                    "many tokens (on a gated-delta-net model, a state kept at each step's end)"}),
        ("--clients", {"type": int, "default": 1,
                       "help": "clients sending at once (default 1: one request at a time); a conversation's next "
                               "turn waits for the answer to its previous one"}))))
