"""Routing a fleet by an existing router's index: hit tokens, TTFT and the index's credit error
per policy (round-robin, least-loaded, KV-aware), against one instance with all the memory.

    python benchmarks/bench_fleet_route.py [--quick] [--traces rag,chat,agents]

Three ``lmcache-hma serve`` instances of the tiny Gemma-3 shape (sliding windows beside full
attention), CPU tiers only, vLLM device caches small enough that vLLM evicts
(``--num-gpu-blocks-override``), each publishing KV cache events to NVIDIA Dynamo's standalone
indexer (the ``[fleet]`` extra, installed by ``tests/dynamo_indexer.py``); the policies of
``examples/fleet/proxy.py`` choose the instance. Requests go one at a time. Per trace and policy
(the fleet reset in between: ``reset_prefix_cache?reset_external=true``):

* hit tokens by source (vLLM's ``prompt_tokens_cached_by_source``: device, host), their ratio to
  the reference (one instance with three times the device blocks and CPU memory) and to
  round-robin;
* TTFT median, mean and p90 (streamed, first token), requests/s;
* the index's credit for the chosen instance against what it served
  (``prompt_tokens_details.cached_tokens``): tokens credited past what was served (``over``),
  served past the credit (``under``), and the requests outside [served - one block, served +
  the rest of the chunk the prompt diverges in] (``outside``).

Traces: ``rag`` (shared documents, a question each, one-off prompts between), ``chat``
(conversations whose turns interleave in any order across conversations, one-off prompts
between), ``agents`` (agents on one long shared system prompt, each history growing). Not
measured here: a shared Redis (docs/fleet.md: Dynamo's index ignores REMOTE events).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "fleet"))

from benchmarks._common import OUT_DIR, bench_main, fmt, free_port, lmcache_yaml, say, table  # noqa: E402

CHUNK, BLOCK = 256, 128
GPU_BLOCKS = 64
CPU_GB = 0.02
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega river stone cloud field light shadow music paper").split()


def text(rng: random.Random, n_words: int, tag: str) -> str:
    return tag + " " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def make_trace(kind: str, rng: random.Random, quick: bool) -> list[str]:
    """Prompts (text) in arrival order."""
    out = []
    if kind == "rag":
        docs = [text(rng, 700, f"Document {d}:") for d in range(6)]
        for q in range(24 if quick else 48):
            if q % 4 == 3:
                out.append(text(rng, 700, f"One-off {q}:"))
            d = min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)
            out.append(docs[d] + text(rng, 25, f" Question {q}:"))
    elif kind == "chat":
        system = text(rng, 150, "System:")
        convs = [[system] for _ in range(5)]
        pending = [c for c in range(5) for _ in range(4)]
        rng.shuffle(pending)
        for n, c in enumerate(pending[: 16 if quick else 20]):
            convs[c].append(text(rng, 150, f" Turn {len(convs[c])} of {c}:"))
            out.append("".join(convs[c]))
            if n % 4 == 3:
                out.append(text(rng, 700, f"One-off {n}:"))
    elif kind == "agents":
        system = text(rng, 500, "Tools and rules:")
        hist = [[system, text(rng, 60, f" Task {a}:")] for a in range(4)]
        for step in range(4 if quick else 6):
            for a in range(4):
                hist[a].append(text(rng, 80, f" Step {step} observation {a}:"))
                out.append("".join(hist[a]))
    else:
        raise ValueError(kind)
    return out


def metrics(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        body = r.read().decode()
    out = {}
    for m in re.finditer(r'^vllm:prompt_tokens_cached_by_source_total\{([^}]*)\} ([0-9.e+]+)$', body, re.M):
        src = re.search(r'source="([^"]+)"', m.group(1))
        if src:
            out[src.group(1)] = out.get(src.group(1), 0.0) + float(m.group(2))
    return out


def streamed(base: str, tokens: list[int]) -> tuple[float, int]:
    """(TTFT s, cached tokens) of one request."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0, ttft, cached = time.monotonic(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - t0
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft if ttft is not None else time.monotonic() - t0, cached


def query(indexer: str, tokens: list[int]) -> dict:
    body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
    req = urllib.request.Request(f"{indexer}/query", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read()).get("instances", {})
    except OSError:
        return {}


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


def run_policy(fleet, policy: str, prompts: list[list[int]]) -> dict:
    import proxy

    front = proxy.Fleet(fleet.instances, fleet.indexer, policy)
    for base in fleet.instances.values():
        reset(base)
    time.sleep(3)  # the resets' events reach the index
    before = {i: metrics(b) for i, b in fleet.instances.items()}
    seen: dict[int, list[list[int]]] = {i: [] for i in fleet.instances}
    ttfts, over, under, outside, served_total, credited_total = [], 0, 0, 0, 0, 0
    t0 = time.monotonic()
    for tokens in prompts:
        i = front.choose("/v1/completions", {"prompt": tokens})
        scores = front.last_scores if policy == "kv" else query(fleet.indexer, tokens)  # the error columns
        credit = (scores.get(str(i)) or {}).get("longest_matched", 0)
        ttft, served = streamed(fleet.instances[i], tokens)
        ttfts.append(ttft)
        served_total += served
        credited_total += credit
        over += max(0, credit - served)
        under += max(0, served - credit)
        # allowed: one block below; above, the rest of the chunk where it parts from what it saw
        diverge = max((shared_prefix(tokens, p) for p in seen[i]), default=0)
        slack = (-(-diverge // CHUNK) * CHUNK - diverge) if diverge % CHUNK else 0
        if credit < served - BLOCK or credit > served + max(slack, 0) + BLOCK - 1:
            outside += 1
        seen[i].append(tokens)
        time.sleep(0.5)  # the stores' events land before the next decision
    wall = time.monotonic() - t0
    after = {i: metrics(b) for i, b in fleet.instances.items()}
    by_source: dict[str, float] = {}
    for i in fleet.instances:
        for src, v in after[i].items():
            by_source[src] = by_source.get(src, 0.0) + v - before[i].get(src, 0.0)
    ttfts.sort()
    return {"policy": policy, "hit_tokens": served_total, "credited": credited_total,
            "device": int(by_source.get("device", 0)), "host": int(by_source.get("host", 0)),
            "other": int(sum(v for k, v in by_source.items() if k not in ("device", "host"))),
            "ttft_median": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
            "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "req_s": len(prompts) / wall,
            "over": over, "under": under, "outside": outside, "requests": len(prompts)}


def start(n: int, work: Path, scale: int, site: Path):
    from run_fleet import LocalFleet

    from lmcache_hma.testing.tiny_model import build_tiny_model

    model = build_tiny_model("tiny-gemma3")
    yaml = lmcache_yaml(work / f"lmcache-{n}.yaml", local_cpu=True, max_local_cpu_size=CPU_GB * scale)
    transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache_config_file": str(yaml)}}
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--seed", "0", "--enforce-eager",
            "--no-disable-hybrid-kv-cache-manager", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
            "--num-gpu-blocks-override", str(GPU_BLOCKS * scale), "--kv-transfer-config", json.dumps(transfer)]
    return LocalFleet(str(model), n, str(yaml), indexer_path=str(site), base_port=0,
                      indexer_port=free_port(), block_size=BLOCK,
                      serve_args=args, logdir=work / f"fleet-{n}",
                      env_extra={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})


def run(quick: bool = False, traces: str = "rag,chat,agents") -> dict:
    from tests import dynamo_indexer

    site = dynamo_indexer.install()
    if site is None:
        raise SystemExit(f"Dynamo's indexer cannot be installed: {dynamo_indexer.INSTALL_ERROR}")
    work = OUT_DIR / "fleet_route"
    work.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in traces.split(",") if k]
    rows, results = [], {}
    ref = start(1, work, 3, site)  # the reference first: one instance with all the memory
    try:
        first = next(iter(ref.instances.values()))

        def tok(s: str) -> list[int]:
            body = json.dumps({"model": "tiny", "prompt": s}).encode()
            req = urllib.request.Request(f"{first}/tokenize", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["tokens"][:2000]

        prompts = {k: [tok(p) for p in make_trace(k, random.Random(7), quick)] for k in kinds}
        for k in kinds:
            say(f"{k}: reference ...")
            results[(k, "one instance x3")] = run_policy(ref, "round-robin", prompts[k])
            say(json.dumps({k: results[(k, "one instance x3")]}))
    finally:
        ref.stop()
    fleet = start(3, work, 1, site)
    try:
        for k in kinds:
            for policy in ("round-robin", "least-loaded", "kv"):
                say(f"{k}: {policy} ...")
                results[(k, policy)] = run_policy(fleet, policy, prompts[k])
                say(json.dumps({f"{k} {policy}": results[(k, policy)]}))
    finally:
        fleet.stop()
    out = {"notes": ["requests one at a time; 2 shared CPU cores loaded by other work: TTFTs are disturbed"]}
    for k in kinds:
        rr, refr = results[(k, "round-robin")], results[(k, "one instance x3")]
        for policy in ("round-robin", "least-loaded", "kv", "one instance x3"):
            r = results[(k, policy)]
            rows.append([k, policy, r["hit_tokens"], r["device"], r["host"],
                         fmt(r["hit_tokens"] / max(1, refr["hit_tokens"])), fmt(r["hit_tokens"] / max(1, rr["hit_tokens"])),
                         fmt(r["ttft_median"]), fmt(r["ttft_mean"]), fmt(r["ttft_p90"]), fmt(r["req_s"]),
                         r["over"], r["under"], f"{r['outside']}/{r['requests']}"])
            tag = f"{k}_{policy.replace(' ', '_').replace('-', '_')}"
            out[f"{tag}_hit_tokens"] = r["hit_tokens"]
            out[f"{tag}_ttft_median"] = round(r["ttft_median"], 4)
            out[f"{tag}_credit_over"] = r["over"]
            out[f"{tag}_credit_under"] = r["under"]
        kv = results[(k, "kv")]
        out[f"{k}_kv_vs_reference"] = round(kv["hit_tokens"] / max(1, refr["hit_tokens"]), 3)
        out[f"{k}_kv_vs_round_robin"] = round(kv["hit_tokens"] / max(1, rr["hit_tokens"]), 3)
        out[f"{k}_kv_ttft_median_vs_round_robin"] = round(kv["ttft_median"] / rr["ttft_median"], 3)
    out["table"] = table(["trace", "policy", "hit tok", "device", "host", "x ref", "x rr", "TTFT med", "mean", "p90",
                          "req/s", "credit over", "under", "outside"], rows)
    return out


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__, run, "BENCH_FLEET_ROUTE", options=(
        ("--traces", {"default": "rag,chat,agents", "help": "comma-separated: rag, chat, agents"}),)))
