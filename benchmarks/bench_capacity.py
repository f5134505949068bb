"""Capacity under a full tier: what a bounded CPU, disk or Redis tier serves with today's policy
(``hma_tail_admission: interval``, ``hma_eviction: lru``) and the new one (``branch``, ``value``),
beside an offline oracle with perfect knowledge of the future at the same byte budget.

Model: a tiny Gemma-3-shaped model built here (``capacity-gemma3-5to1-w512``: 5 sliding-window
layers of window 512 : 1 full-attention layer, 1 KV head of 64, float32; random weights), so that
a sliding-window tail is 10x a chunk's full-attention object as on Gemma-3 1B. Chunks of 256.

Traces (``_capacity_traces.py``, seeded): RAG (a shared 512-token system prompt, 12 documents of
1536 tokens by Zipf popularity, a question of its own, a 16-token answer), chat (conversations on a
shared system prompt, each turn = the previous prompt + answer + a new message, six conversations
interleaved) and agent (a 2048-token tool prefix, short branches, some extended again). Prompts
are token ids (``/v1/completions``); answers are greedy (``min_tokens`` = ``max_tokens``,
``ignore_eos``), and a prompt that extends an earlier request carries that request's answer as the
first server that ran it generated it (every server gets the same prompts; a server whose answer
differs is counted: apart where the two part at a near tie, the top two logprobs of either within
``TIE``, where the same model computing in other splits may go either way).

Servers (``lmcache-hma serve``, float32, eager, ``--max-num-batched-tokens 2048``, hybrid manager
on, ``--enable-prompt-tokens-details``, ``VLLM_SERVER_DEV_MODE=1``): one per configuration, each
alone by default (started after the previous one stopped: on 2 cores two servers side by side
made every request 3.4x slower, idle engines polling; ``--batch N`` runs N side by side, taking
turns request by request, fewer if memory is short: each takes ~2 GB); one request at a time.
Every configuration runs every trace, its connector's tiers emptied between traces
(``/reset_prefix_cache?reset_external=true``; a Redis is flushed). vLLM's own prefix cache is
emptied before every request (``/reset_prefix_cache``), so every cached token is the connector's;
its KV cache is small (``--num-gpu-blocks-override 256``).

Configurations, each with today's policy and the new one:

* CPU tier (``local_cpu``) at the sizes of the run: a third of the RAG trace's chunks+tails bytes
  under today's policy (the goal's size), 0.2, 0.33, 0.5 and 1.0 of the RAG trace's working set
  (every byte today's policy stores for it, turn ends included), and unbounded (1 GiB);
* a disk tier (``local_cpu: false``) and a Redis under ``--maxmemory`` (``local_cpu: false``;
  ``allkeys-lru`` for today's policy, ``allkeys-lfu`` and ``maxmemory-samples 10`` for the new one
  as docs/redis.md says, turn ends with their TTL, ``hma_redis_turn_end_ttl_s``) at the goal's
  size and at 0.2 of the working set (``maxmemory`` = that plus what the empty Redis uses). Redis
  counts its allocator's rounding in ``used_memory`` (the connector fits its values to the size
  classes, ``wire.value_bytes``: an object takes about its bytes) and its clients' buffers. One
  more Redis runs the new policy under ``allkeys-lru`` (which suits it?), and where a third of
  what the RAG trace's chunks and tails take in Redis (``RedisFootprint``) differs from the goal
  by over 5%, two more (today's policy, the new one) get that, the goal's third in Redis's own
  bytes.

Sizes are planned from the traces before the run (``_capacity_oracle.admit`` of today's policy
on the traces with stand-in answers) and the tables give each as a fraction of the working set
the unbounded server of today's policy measured (``stored_bytes_*`` in its stats file). The
traces are sized so that their working sets are close to the RAG trace's.

Per configuration and trace: hit tokens (``usage.prompt_tokens_details.cached_tokens``: vLLM's
own cache was emptied, so all of them the connector's; checked against ``loaded_tokens`` in the
stats file), stored bytes per token against an all-layers connector (every stored byte over every
layer's KV of each distinct token the trace computed, once: 3072 B/token here), mean TTFT (client
side). The oracle (``_capacity_oracle.oracle``) gets the same trace and the same budget in tier
bytes: objects with their trailer, rounded to LMCache's 4 KiB allocations for the CPU and disk
tiers; for Redis what each object's two keys take there, measured on a redis-server at the
start (``RedisFootprint``: ``MEMORY USAGE``).

    python benchmarks/bench_capacity.py [--quick] [--batch N] [--tiers cpu,disk,redis]

``--quick``: shorter traces, the CPU tier at the goal's size and unbounded only (4 servers); with
``--tiers`` naming disk or Redis, also each at the goal's size, new policy (one server each; what
``make bench`` runs: ``--quick --tiers cpu,redis``, 5 servers).
Every figure: ``benchmarks/out/capacity.json``; per-request hits of every configuration:
``benchmarks/out/capacity_requests.json``; server logs:
``benchmarks/out/capacity_<config>.log``.
Prints one table per trace and tier and a last line ``CAPACITY {json}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _capacity_oracle import (TRAILER, Realized, Sizes, admit, format_floor, gemma_layout, ideal_paths,  # noqa: E402
                              oracle)
from _capacity_traces import Trace, stand_in_answers, traces  # noqa: E402
from _common import (OUT_DIR, ServerProcess, bench_main, bind_beside_worker, cached_tokens, free_port,  # noqa: E402
                     lmcache_yaml, machine_info, ratio, read_json, say, streamed_chunks, table)

CHUNK = 256
MAX_MODEL_LEN = 4096
BATCHED_TOKENS = 2048
KV_BLOCKS = 256  # vLLM's own KV cache: a 4096-token request fits (6 groups of one layer, 128-token blocks)
UNBOUNDED_GB = 1.0
STAGING_GB = 0.1  # local_cpu: false: LMCache's staging buffer (held hits live there)
GIB = 1024 ** 3
SERVER_GB = 2.2  # what one server takes, tier aside (API server, engine core, worker)
POLICIES = {"today": {"hma_tail_admission": "interval", "hma_eviction": "lru"},
            "new": {"hma_tail_admission": "branch", "hma_eviction": "value"}}
# Redis's eviction (docs/redis.md, "Eviction policy"): before the new policy the docs said allkeys-lru;
# for the new one allkeys-lfu with maxmemory-samples 10 (and hma_redis_turn_end_ttl_s, its default)
REDIS_POLICY = {"today": ("allkeys-lru",), "new": ("allkeys-lfu", "10")}
LADDER = (0.2, 1 / 3, 0.5, 1.0)  # CPU sizes, fractions of the RAG trace's working set (besides the goal's)


def model_spec():
    from lmcache_hma.testing.tiny_model import F, S, TinyModelSpec

    return TinyModelSpec("capacity-gemma3-5to1-w512", "gemma3", (S,) * 5 + (F,), sliding_window=512)


@dataclass
class Config:
    name: str  # e.g. "cpu-0.33-new"
    policy: str  # "today" | "new"
    tier: str  # "cpu" | "disk" | "redis"
    budget: Optional[int]  # tier bytes; None: unbounded
    rung: str  # "goal", "0.2", ..., "unbounded"
    redis_policy: tuple = ()  # Redis's maxmemory-policy and -samples (REDIS_POLICY[policy] unless set)


# --------------------------------------------------------------------------
# planning: sizes from the traces, before any server runs
# --------------------------------------------------------------------------


def predicted(trace: Trace, sizes: Sizes) -> dict:
    prompts, answers = trace.realize(stand_in_answers(trace))
    real = Realized(prompts, answers, CHUNK)
    today, new = admit(real, sizes, "interval"), admit(real, sizes, "branch")
    return {"W": today.payload_bytes, "CT": today.stored_payload["F"] + today.stored_payload["T"],
            "W_new": new.payload_bytes, "hits_today": today.hit_tokens, "hits_new": new.hit_tokens}


def chunks_and_tails(outcome) -> int:
    """Tier bytes of an admission's chunks and tails."""
    return outcome.stored_tier["F"] + outcome.stored_tier["T"]


def plan(trs: list[Trace], sizes: Sizes, quick: bool, tiers: list[str],
         redis_sizes: Optional[Sizes] = None) -> tuple[list[Config], dict]:
    pred = {t.name: predicted(t, sizes) for t in trs}
    rag = pred["rag"]
    goal = int(rag["CT"] / 3) // 4096 * 4096
    if redis_sizes is not None:  # a third of the RAG trace's chunks and tails as Redis holds them
        rag_trace = next(t for t in trs if t.name == "rag")
        real = Realized(*rag_trace.realize(stand_in_answers(rag_trace)), CHUNK)
        rag["CT_redis"] = chunks_and_tails(admit(real, redis_sizes, "interval"))
    rungs = [("goal", goal)] + ([] if quick else [(f"{f:.2g}", int(f * rag["W"]) // 4096 * 4096) for f in LADDER])
    configs: list[Config] = []
    for policy in POLICIES:
        configs.append(Config(f"cpu-unbounded-{policy}", policy, "cpu", None, "unbounded"))
    for rung, budget in rungs:
        for policy in POLICIES:
            configs.append(Config(f"cpu-{rung}-{policy}", policy, "cpu", budget, rung))
    for tier in ("disk", "redis"):
        if tier in tiers:
            for rung, budget in rungs[:2]:  # the goal's size and 0.2 of W (quick: the goal's, new policy)
                for policy in (("new",) if quick else POLICIES):
                    configs.append(Config(f"{tier}-{rung}-{policy}", policy, tier, budget, rung))
    if "redis" in tiers and not quick:  # the new policy under Redis's other eviction: which suits it
        configs.append(Config("redis-goal-new-lru", "new", "redis", goal, "goal, allkeys-lru", ("allkeys-lru",)))
        goal_redis = int(rag["CT_redis"] / 3) // 4096 * 4096 if redis_sizes is not None else goal
        if abs(goal_redis - goal) > goal / 20:  # the goal's third in Redis's own bytes, where they differ
            for policy in POLICIES:
                configs.append(Config(f"redis-goalr-{policy}", policy, "redis", goal_redis, "goal in Redis bytes"))
    return configs, pred


class RedisFootprint:
    """What an object takes in Redis, measured on a real redis-server: ``MEMORY USAGE`` of the two
    keys of an object of ``n`` bytes (payload and trailer) written as the connector writes it
    (``<key>kv_bytes``, then ``<key>metadata``, keys as long as the connector's), what evicting
    it frees: the allocator's rounding, string headers and key entries included. The oracle of a
    Redis configuration gets its budget in these bytes."""

    SAMPLES = 16  # objects per size measured

    def __init__(self, sizes: Iterable[int]):
        import torch
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info

        from lmcache_hma.store.redis.wire import value_bytes

        init_remote_metadata_info(1)  # the connector's objects have one shape (one group)
        self.cost: dict[int, int] = {}
        key = "x" * len(self._key_string())
        with CappedRedis("footprint", 1 << 34, ("noeviction",)) as r:
            client = r.client()
            for n in sorted(set(sizes)):
                meta = RemoteMetadata(n, [torch.Size([1, 1, n // 4])], [torch.float32], MemoryFormat.KV_2LTD).serialize()
                value = value_bytes(n)  # the rest rides in the metadata (wire.set_commands)
                total = 0
                for i in range(self.SAMPLES):
                    k = f"{i:04d}{key[4:]}"
                    client.set(k + "kv_bytes", os.urandom(value))
                    client.set(k + "metadata", meta + os.urandom(n - value))
                    total += sum(int(client.memory_usage(k + part, samples=0)) for part in ("kv_bytes", "metadata"))
                self.cost[n] = -(-total // self.SAMPLES)
                client.flushall()

    @staticmethod
    def _key_string() -> str:
        """A key as the connector writes it (``core.keys.Namespace``: ``<model>.<fingerprint>.<kind>``)."""
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(f"{model_spec().name}.{'0' * 16}.full", 1, 0, bytes(32), torch.float32).to_string()

    def __call__(self, n: int) -> int:
        return self.cost[n]


# --------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------


class CappedRedis(ServerProcess):
    """A throw-away redis-server whose ``maxmemory`` is ``budget`` bytes over what it uses empty."""

    def __init__(self, name: str, budget: int, policy: tuple):
        """``policy``: ``(maxmemory-policy, [maxmemory-samples, [more redis-server arguments]])``."""
        self.port = free_port()
        samples = ["--maxmemory-samples", policy[1], *policy[2:]] if len(policy) > 1 else []
        self._start([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--maxmemory-policy", policy[0], *samples],
                    OUT_DIR / f"capacity_{name}_redis.log", lambda: self.client().ping(), timeout=10)
        self.baseline = int(self.client().info("memory")["used_memory"])
        self.maxmemory = self.baseline + budget
        self.client().config_set("maxmemory", self.maxmemory)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def info(self) -> dict:
        i = self.client().info()
        return {k: i.get(k) for k in ("used_memory", "evicted_keys", "keyspace_hits", "keyspace_misses")} | {
            "keys": int(self.client().dbsize())}


class CapacityServer(ServerProcess):
    """``lmcache-hma serve`` of the model with the connector in configuration ``cfg``; started
    without waiting (``wait`` waits), so that a batch starts side by side."""

    group = True

    def __init__(self, cfg: Config, model: Path, work: Path, redis: Optional[CappedRedis]):
        import subprocess

        self.cfg, self.port = cfg, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.stats = work / f"{cfg.name}-stats.json"
        self.redis = redis
        keys: dict = {"chunk_size": CHUNK}
        gb = (cfg.budget / GIB) if cfg.budget is not None else UNBOUNDED_GB
        if cfg.tier == "cpu":
            keys.update(local_cpu=True, max_local_cpu_size=gb)
        elif cfg.tier == "disk":
            keys.update(local_cpu=False, max_local_cpu_size=STAGING_GB, local_disk=f"file://{work}/{cfg.name}-disk/",
                        max_local_disk_size=gb)
        else:
            keys.update(local_cpu=False, max_local_cpu_size=STAGING_GB, remote_url=redis.url, remote_serde="naive")
        keys["extra_config"] = {**POLICIES[cfg.policy], "hma_stats_file": str(self.stats)}
        yaml = lmcache_yaml(work / f"{cfg.name}.yaml", **keys)
        transfer = {"kv_connector": "LMCacheHMAConnector", "kv_connector_module_path": "lmcache_hma",
                    "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache_config_file": str(yaml)}}
        cmd = [sys.executable, "-m", "lmcache_hma.tools.serve", str(model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--seed", "0",
               "--enforce-eager", "--no-disable-hybrid-kv-cache-manager", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", str(BATCHED_TOKENS), "--num-gpu-blocks-override", str(KV_BLOCKS),
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)]
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(PYTHONUNBUFFERED="1", VLLM_SERVER_DEV_MODE="1")
        self.log_path = OUT_DIR / f"capacity_{cfg.name}.log"
        self.log = open(self.log_path, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, timeout: float = 900) -> None:
        import requests

        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cfg.name}: server exited with {self.proc.returncode} (log {self.log_path})")
            with contextlib.suppress(Exception):
                if requests.get(f"{self.base}/health", timeout=5).status_code == 200:
                    self.start_s = time.time() - self.t0
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.cfg.name}: not ready after {timeout} s (log {self.log_path})")

    def reset(self, external: bool = False) -> None:
        """Empty vLLM's prefix cache (``external``: and the connector's CPU and disk tiers)."""
        import requests

        url = f"{self.base}/reset_prefix_cache" + ("?reset_external=true" if external else "")
        for _ in range(200):  # refused while blocks are held (a turn end's, for a step)
            r = requests.post(url, timeout=60)
            r.raise_for_status()
            if r.json().get("success", True):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.cfg.name}: vLLM refused reset_prefix_cache")

    def complete(self, prompt: list[int], n: int) -> dict:
        """One streamed greedy request: ``ttft``, ``end`` (seconds), ``cached``, ``tokens``, and
        ``margins``: per token, how far the chosen token's logprob was ahead of the next best."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                "logprobs": 2, "return_tokens_as_token_ids": True}  # (top logprobs by id: no two tokens share a key)
        out = {"tokens": [], "cached": 0, "margins": []}
        first = None
        t0 = time.perf_counter()
        for chunk in streamed_chunks(f"{self.base}/v1/completions", body):
            if chunk.get("usage"):
                out["cached"] = cached_tokens(chunk["usage"])
            for choice in chunk.get("choices", []):
                if first is None and (choice.get("token_ids") or choice.get("text")):
                    first = time.perf_counter()
                out["tokens"] += choice.get("token_ids") or []
                for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                    best = sorted((top or {}).values(), reverse=True)
                    out["margins"].append(best[0] - best[1] if len(best) > 1 else float("inf"))
        end = time.perf_counter()
        return {**out, "ttft": (first or end) - t0, "end": end - t0}

    def settled_stats(self, quiet_s: float = 1.0, timeout: float = 20.0) -> dict:
        """The stats file once it stopped changing for ``quiet_s`` (stores land on a thread)."""
        t0, last, since = time.time(), None, time.time()
        while time.time() - t0 < timeout:
            s = read_json(self.stats)
            if s != last:
                last, since = s, time.time()
            elif time.time() - since >= quiet_s:
                break
            time.sleep(0.1)
        return last or {}


TIE = 1e-3  # float32: a greedy choice closer than this (logprob gap) may go either way between runs


def near_tie(rec: dict, answer: list[int], margins: list[float]) -> Optional[bool]:
    """None where ``rec``'s tokens are the first server's ``answer``; else whether they part
    where either server's choice was a near tie (the top two logprobs within ``TIE``): the same
    model computing the same tokens in other splits (a hit here, a recompute there) can choose
    either at such a point, a float32 rounding apart. Any other difference is a wrong answer."""
    if rec["tokens"] == answer:
        return None
    at = next((j for j, (a, b) in enumerate(zip(rec["tokens"], answer)) if a != b), min(len(rec["tokens"]), len(answer)))
    gaps = [m[at] for m in (rec["margins"], margins) if at < len(m)]
    return bool(gaps) and min(gaps) < TIE


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float)) and v != before.get(k, 0)}


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------


def mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0.0


def run_batch(batch: list[Config], model: Path, work: Path, trs: list[Trace], realized: dict, raw: dict,
              realized_margins: dict) -> None:
    """Start ``batch``'s servers side by side, run every trace on each, record into ``raw``.
    The first batch's first server realizes the traces (its answers define later prompts)."""
    with contextlib.ExitStack() as stack:
        servers: list[CapacityServer] = []
        for cfg in batch:
            redis = None
            if cfg.tier == "redis":
                redis = stack.enter_context(CappedRedis(cfg.name, cfg.budget,
                                                        cfg.redis_policy or REDIS_POLICY[cfg.policy]))
            servers.append(stack.enter_context(CapacityServer(cfg, model, work, redis)))
        alive = []
        for s in servers:
            try:
                s.wait()
                say(f"[capacity] {s.cfg.name}: ready in {s.start_s:.0f} s")
                alive.append(s)
            except RuntimeError as exc:
                say(f"[capacity] {exc}")
                raw[s.cfg.name] = {"error": str(exc)}
        stack.callback(bind_beside_worker(os.getpid()))
        for s in alive:  # an untimed first request: one-time costs
            s.complete(list(range(100, 400)), 2)
            s.reset(external=True)
        for trace in trs:
            t0 = time.perf_counter()
            defines = trace.name not in realized
            prompts, answers = ([], []) if defines else realized[trace.name]
            margins = realized_margins.setdefault(trace.name, [])  # the first server's, per answer
            before = {s.cfg.name: s.settled_stats() for s in alive}
            recs: dict[str, list] = {s.cfg.name: [] for s in alive}
            for i, r in enumerate(trace.requests):
                if defines:
                    prompts.append(trace.prompt(i, prompts, answers))
                order = alive if defines else alive[i % len(alive):] + alive[:i % len(alive)]
                for s in order:
                    s.reset()
                    rec = s.complete(prompts[i], r.answer)
                    if defines and len(answers) == i:
                        answers.append(rec["tokens"])
                        margins.append(rec["margins"])
                    recs[s.cfg.name].append({"ttft": rec["ttft"], "cached": rec["cached"],
                                             "same_answer": rec["tokens"] == answers[i],
                                             "near_tie": near_tie(rec, answers[i], margins[i])})
            realized[trace.name] = (prompts, answers)
            for s in alive:
                after = s.settled_stats()
                entry = {"requests": recs[s.cfg.name], "stats": _delta(after, before[s.cfg.name])}
                if s.redis is not None:
                    entry["redis"] = s.redis.info() | {"maxmemory": s.redis.maxmemory, "baseline": s.redis.baseline}
                raw.setdefault(s.cfg.name, {})[trace.name] = entry
                s.reset(external=True)
                if s.redis is not None:
                    s.redis.client().flushall()
            say(f"[capacity] {trace.name}: {len(trace.requests)} requests on {len(alive)} servers in "
                f"{time.perf_counter() - t0:.0f} s")


def run(quick: bool = False, batch: int = 1, tiers: Optional[str] = None) -> dict:
    """``tiers``: comma-separated, the CPU tier always (default cpu,disk,redis; cpu with ``quick``)."""
    from lmcache_hma.testing.tiny_model import build_tiny_model

    t_all = time.perf_counter()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tiers = tiers or ("cpu" if quick else "cpu,disk,redis")
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    notes = []
    if "redis" in tier_list and shutil.which("redis-server") is None:
        tier_list.remove("redis")
        notes.append("redis-server is not installed: no Redis configuration")
    sizes = Sizes(gemma_layout())
    redis_sizes = None
    if "redis" in tier_list:
        redis_sizes = Sizes(sizes.layout, footprint=RedisFootprint(sizes.object_bytes(MAX_MODEL_LEN)))
    trs = traces(quick)
    configs, pred = plan(trs, sizes, quick, tier_list, redis_sizes)
    model = build_tiny_model(model_spec())
    res: dict = {"quick": quick, "model": model_spec().name, "chunk": CHUNK, "machine": machine_info(),
                 "all_layers_bytes_per_token": sizes.all_layers_per_token(),
                 "configs": {c.name: {"policy": c.policy, "tier": c.tier, "budget": c.budget, "rung": c.rung}
                             for c in configs},
                 "predicted": pred, "traces": {}, "notes": notes}
    raw: dict = {}
    realized: dict = {}
    realized_margins: dict = {}  # trace -> the first server's margins per answer (near_tie)
    todo = list(configs)
    with tempfile.TemporaryDirectory(prefix="bench_capacity_") as d:
        while todo:
            room = int((mem_available() - 3 * GIB) // (SERVER_GB * GIB))
            n = max(1, min(batch, room))
            if n < batch:
                say(f"[capacity] {mem_available() / GIB:.1f} GiB available: {n} servers at a time")
            group, todo = todo[:n], todo[n:]
            say(f"[capacity] starting {', '.join(c.name for c in group)}")
            try:
                run_batch(group, model, Path(d), trs, realized, raw, realized_margins)
            except Exception as exc:  # noqa: BLE001  one configuration failing must not hide the others
                import traceback

                traceback.print_exc()
                for c in group:
                    raw.setdefault(c.name, {})["error"] = f"{type(exc).__name__}: {exc}"
    res["wall_s"] = time.perf_counter() - t_all
    summarize(res, trs, realized, raw, configs, sizes, redis_sizes)
    alone = "each alone" if batch == 1 else f"up to {batch} side by side"
    res["notes"].append(f"commit {res['machine'].get('git_commit')}; {len(configs)} servers, {alone}; whole run "
                        f"{res['wall_s'] / 60:.1f} min")
    OUT_DIR.joinpath("capacity.json").write_text(json.dumps(res, indent=1, default=str))  # every figure of the run
    return res


# --------------------------------------------------------------------------
# figures and tables
# --------------------------------------------------------------------------


def summarize(res: dict, trs: list[Trace], realized: dict, raw: dict, configs: list[Config], sizes: Sizes,
              redis_sizes: Optional[Sizes] = None) -> None:
    all_layers = sizes.all_layers_per_token()
    tables = []
    for name, e in raw.items():
        if e.get("error"):
            res["notes"].append(f"{name} failed: {e['error']}")
    for trace in trs:
        if trace.name not in realized:
            continue
        prompts, answers = realized[trace.name]
        real = Realized(prompts, answers, CHUNK)
        ideal, _ = ideal_paths(real)
        distinct = real.distinct_tokens()
        t = res["traces"][trace.name] = {
            "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "distinct_tokens": distinct,
            "ideal_hit_tokens": sum(ideal), "predicted": res["predicted"][trace.name], "params": trace.params,
            "configs": {}, "oracle": {}}
        sim_today, sim_new = admit(real, sizes, "interval"), admit(real, sizes, "branch")
        t["model_today"] = {"hit_tokens": sim_today.hit_tokens, "stored": sim_today.stored_payload}
        t["model_new"] = {"hit_tokens": sim_new.hit_tokens, "stored": sim_new.stored_payload}
        for cfg in configs:
            e = (raw.get(cfg.name) or {}).get(trace.name)
            if not e:
                continue
            st = e["stats"]
            stored = sum(v for k, v in st.items() if k.startswith("stored_bytes_"))
            recs = e["requests"]
            t["configs"][cfg.name] = c = {
                "hit_tokens": sum(r["cached"] for r in recs),
                "loaded_tokens": st.get("loaded_tokens", 0),
                "stored_bytes": stored,
                "stored_by_kind": {k[len("stored_bytes_"):]: v for k, v in st.items() if k.startswith("stored_bytes_")},
                "bytes_vs_all_layers": stored / (distinct * all_layers),
                "ttft_mean_s": sum(r["ttft"] for r in recs) / len(recs),
                "answers_differ": sum(not r["same_answer"] and not r.get("near_tie") for r in recs),
                "answers_at_near_tie": sum(bool(r.get("near_tie")) for r in recs),
                "stats": st}
            if e.get("redis"):
                c["redis"] = e["redis"]
        w_meas = (t["configs"].get("cpu-unbounded-today") or {}).get("stored_bytes")
        t["W"] = w_meas or t["predicted"]["W"]
        t["W_measured"] = w_meas
        t["CT"] = None
        u = t["configs"].get("cpu-unbounded-today")
        if u:
            k = u["stored_by_kind"]
            t["CT"] = k.get("full_attention", 0) + k.get("sliding_window", 0)
        for budget in sorted({c.budget for c in configs if c.budget is not None and c.tier != "redis"}):
            t["oracle"][str(budget)] = oracle(real, sizes, budget).hit_tokens
        if redis_sizes is not None:  # a Redis's budget is in Redis's bytes (RedisFootprint)
            for budget in sorted({c.budget for c in configs if c.budget is not None and c.tier == "redis"}):
                t["oracle"][f"redis:{budget}"] = oracle(real, redis_sizes, budget).hit_tokens
            t["CT_redis"] = chunks_and_tails(admit(real, redis_sizes, "interval"))
            t["redis_footprint"] = {n: redis_sizes.footprint(n) for n in sorted({
                sizes.payload(k, at) + TRAILER for k, at in (("F", 0), ("T", 4))})}
        unbounded_oracle = oracle(real, sizes, None)
        t["oracle"]["unbounded"] = unbounded_oracle.hit_tokens
        # what perfect admission stores (every object a later hit reads, once): a floor for any policy
        t["oracle_bytes_vs_all_layers"] = unbounded_oracle.payload_bytes / (distinct * all_layers)
        # and what any exact format needs at the least (each token's KV once, windows not stored twice)
        t["format_floor_vs_all_layers"] = format_floor(real, sizes)
        t["oracle_stored"] = unbounded_oracle.stored_payload
        for cfg in configs:
            c = t["configs"].get(cfg.name)
            if not c:
                continue
            unb = (t["configs"].get(f"cpu-unbounded-{cfg.policy}") or {}).get("hit_tokens")
            orc = t["oracle"][_oracle_key(cfg.tier, cfg.budget)]
            c["vs_unbounded"] = ratio(c["hit_tokens"], unb)
            c["vs_oracle"] = ratio(c["hit_tokens"], orc)
            c["oracle_hit_tokens"] = orc
            c["of_W"] = cfg.budget / t["W"] if cfg.budget is not None else None
        notes = res["notes"]
        pw, mw = t["predicted"]["W"], t["W_measured"]
        notes.append(f"{trace.name}: {len(prompts)} requests, {t['prompt_tokens']} prompt tokens, {distinct} distinct "
                     f"tokens computed; working set W (today, unbounded) {_mb(mw)} measured, {_mb(pw)} planned; "
                     f"chunks+tails {_mb(t['CT'])}; ideal (every object any earlier request computed) "
                     f"{sum(ideal)} hit tokens; the oracle's admission (every object a later hit reads, "
                     f"once) stores {t['oracle_bytes_vs_all_layers']:.3f}x an all-layers connector, any exact "
                     f"format at least {t['format_floor_vs_all_layers']:.3f}x (_capacity_oracle.format_floor)")
        for pol, sim in (("today", sim_today), ("new", sim_new)):  # the admission model against the server
            name = f"cpu-unbounded-{pol}"
            e = (raw.get(name) or {}).get(trace.name)
            if not e:
                continue
            got = [r["cached"] for r in e["requests"]]
            short = [(i, g, h) for i, (g, h) in enumerate(zip(got, sim.hits)) if g < h]
            over = sum(g > h for g, h in zip(got, sim.hits))
            t["configs"][name]["short_of_model"] = {"requests": len(short), "tokens": sum(h - g for _, g, h in short),
                                                    "first": short[:8]}
            kinds = t["configs"][name]["stored_by_kind"]
            per = {k: v / (distinct * all_layers) for k, v in kinds.items()}
            t["configs"][name]["bytes_vs_all_layers_by_kind"] = per
            notes.append(f"{trace.name}, {name}: stored / all-layers {t['configs'][name]['bytes_vs_all_layers']:.3f} = "
                         + " + ".join(f"{v:.3f} {k}" for k, v in sorted(per.items())))
            notes.append(f"{trace.name}, {name}: {sum(got)} hit tokens, the admission model "
                         f"(_capacity_oracle.admit) {sim.hit_tokens}; {len(short)} requests hit less than the "
                         f"model ({sum(h - g for _, g, h in short)} tokens), {over} more; stored "
                         f"{_mb(t['configs'][name]['stored_bytes'])}, the model {_mb(sim.payload_bytes)}")
        for name, c in t["configs"].items():
            if c["hit_tokens"] != c["loaded_tokens"]:
                notes.append(f"{trace.name}, {name}: cached_tokens {c['hit_tokens']} != the stats file's "
                             f"loaded_tokens {c['loaded_tokens']}")
            if c["answers_differ"]:
                notes.append(f"{trace.name}, {name}: {c['answers_differ']} answers differ from the first server's "
                             f"(not at a near tie)")
            if c["answers_at_near_tie"]:
                notes.append(f"{trace.name}, {name}: {c['answers_at_near_tie']} answers part from the first server's "
                             f"at a near tie (top two logprobs within {TIE})")
            if c.get("redis"):
                r, st = c["redis"], c["stats"]
                notes.append(f"{trace.name}, {name}: Redis maxmemory {_mb(r['maxmemory'])} (empty: "
                             f"{_mb(r['baseline'])}), used at the end {_mb(r['used_memory'])}, {r['keys']} keys, "
                             f"{r['evicted_keys']} evicted; integrity failures {st.get('integrity_failures', 0)}, "
                             f"objects not shared {st.get('objects_not_shared', 0)}")
        for tier in ("cpu", "disk", "redis"):
            rows = _rows(t, configs, tier)
            if rows:
                tables.append((f"{trace.name}, {tier} tier", _table(rows)))
    per_request = {}
    for trace in trs:
        if trace.name not in realized:
            continue
        prompts, answers = realized[trace.name]
        real = Realized(prompts, answers, CHUNK)
        per_request[trace.name] = {
            "prompt_tokens": [len(p) for p in prompts], "parent": [r.parent for r in trace.requests],
            "group": [r.group for r in trace.requests], "ideal": ideal_paths(real)[0],
            "configs": {name: [r["cached"] for r in e[trace.name]["requests"]]
                        for name, e in raw.items() if trace.name in e}}
    OUT_DIR.joinpath("capacity_requests.json").write_text(json.dumps(per_request))  # per request, to look into
    res["tables"] = [{"title": a, "table": b} for a, b in tables]
    res["table"] = "\n\n".join(f"{a}\n\n{b}" for a, b in tables)
    _headline(res)


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 1e6:.1f} MB"


def _rows(t: dict, configs: list[Config], tier: str) -> list[dict]:
    rungs: dict = {}
    for cfg in configs:
        if cfg.tier == tier and cfg.name in t["configs"]:
            rungs.setdefault((cfg.budget is None, cfg.budget or 0, cfg.rung), {})[cfg.policy] = t["configs"][cfg.name]
    out = []
    for (unbounded, budget, rung), by in sorted(rungs.items()):
        today, new = by.get("today", {}), by.get("new", {})
        orc = t["oracle"][_oracle_key(tier, None if unbounded else budget)]
        ct = t.get("CT_redis") if tier == "redis" else t.get("CT")  # chunks and tails in the tier's bytes
        out.append({"rung": rung, "budget": None if unbounded else budget, "of_W": None if unbounded else budget / t["W"],
                    "of_CT": (budget / ct) if (ct and not unbounded) else None,
                    "today": today, "new": new, "oracle": orc})
    return out


def _oracle_key(tier: str, budget: Optional[int]) -> str:
    if budget is None:
        return "unbounded"
    return f"redis:{budget}" if tier == "redis" else str(budget)


def _table(rows: list[dict]) -> str:
    def g(d, k):
        return d.get(k) if d else None
    return table(
        ["size", "MB", "of W", "of chunks+tails", "hit tokens today", "new", "oracle", "today/unbounded",
         "new/unbounded", "new/oracle", "today/oracle", "stored/all-layers today", "new", "TTFT ms today", "new",
         "answers differ"],
        [[r["rung"], "unbounded" if r["budget"] is None else r["budget"] / 1e6, r["of_W"], r["of_CT"],
          g(r["today"], "hit_tokens"), g(r["new"], "hit_tokens"), r["oracle"], g(r["today"], "vs_unbounded"),
          g(r["new"], "vs_unbounded"), g(r["new"], "vs_oracle"), g(r["today"], "vs_oracle"),
          g(r["today"], "bytes_vs_all_layers"), g(r["new"], "bytes_vs_all_layers"),
          (1e3 * r["today"]["ttft_mean_s"]) if r["today"] else None,
          (1e3 * r["new"]["ttft_mean_s"]) if r["new"] else None,
          "/".join(_differ(r[p]) for p in ("today", "new"))] for r in rows])


def _differ(c: dict) -> str:
    """Answers unlike the first server's, and (apart) those parting from it at a near tie."""
    if not c or c.get("answers_differ") is None:
        return "n/a"
    ties = c.get("answers_at_near_tie") or 0
    return f"{c['answers_differ']}" + (f" (+{ties} at a tie)" if ties else "")


def _headline(res: dict) -> None:
    tr = res["traces"]

    def cfg(trace, name, key):
        return ((tr.get(trace) or {}).get("configs", {}).get(name) or {}).get(key)

    res["capacity_rag_new_vs_unbounded"] = cfg("rag", "cpu-goal-new", "vs_unbounded")
    res["capacity_rag_today_vs_unbounded"] = cfg("rag", "cpu-goal-today", "vs_unbounded")
    res["capacity_rag_redis_new_vs_unbounded"] = cfg("rag", "redis-goal-new", "vs_unbounded")
    res["capacity_rag_redis_today_vs_unbounded"] = cfg("rag", "redis-goal-today", "vs_unbounded")
    res["capacity_rag_disk_new_vs_unbounded"] = cfg("rag", "disk-goal-new", "vs_unbounded")
    res["capacity_rag_redis_own_bytes_new_vs_unbounded"] = (cfg("rag", "redis-goalr-new", "vs_unbounded")  # or the same
                                                            or cfg("rag", "redis-goal-new", "vs_unbounded"))
    res["capacity_bytes_vs_all_layers_rag"] = cfg("rag", "cpu-unbounded-new", "bytes_vs_all_layers")
    res["capacity_bytes_vs_all_layers_chat"] = cfg("chat", "cpu-unbounded-new", "bytes_vs_all_layers")
    vs = [c["vs_oracle"] for t in tr.values() for name, c in t["configs"].items()
          if name.endswith("-new") and c.get("vs_oracle") is not None]
    res["capacity_new_vs_oracle_min"] = min(vs) if vs else None


KEYS = ("capacity_rag_new_vs_unbounded", "capacity_rag_today_vs_unbounded", "capacity_rag_redis_new_vs_unbounded",
        "capacity_rag_redis_today_vs_unbounded", "capacity_rag_disk_new_vs_unbounded",
        "capacity_rag_redis_own_bytes_new_vs_unbounded",
        "capacity_bytes_vs_all_layers_rag", "capacity_bytes_vs_all_layers_chat", "capacity_new_vs_oracle_min")


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, "CAPACITY", quick="shorter traces; the CPU tier at the goal's size and "
                        "unbounded only",
                        options=[("--batch", dict(type=int, default=1,
                                                  help="servers side by side (default 1: each alone)")),
                                 ("--tiers", dict(default=None,
                                                  help="tiers measured (the CPU tier always; default cpu,disk,redis, "
                                                       "cpu with --quick)"))],
                        keys=list(KEYS)))
