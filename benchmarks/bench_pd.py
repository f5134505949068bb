"""Disaggregated prefill through Redis: what a decode instance loads and how long its first token
takes, with ``kv_role`` honoured (producer / consumer) and, as the baseline in the same run, two
``kv_both`` instances used the same way (what a user got before: the decode instance loaded the
prompt's whole chunks and prefilled the rest itself).

Servers: ``lmcache-hma serve`` of the tiny Gemma-3 (float32, block 16 on vLLM CPU's default),
Redis the only tier. Per prompt length (1k to 16k tokens; ``--quick``: 1k and 4k), each setting:

* the producer (or first ``kv_both``) instance prefills the prompt, ``max_tokens`` 1;
* once the prefill's stores landed (Redis's key count stopped changing: on two cores two engines
  computing at once would time each other), the decode (or second ``kv_both``) instance is sent it
  with the prefill's ``kv_transfer_params``:
  its TTFT (one token asked, so its whole time) and the prompt tokens it computed itself (its
  ``LMCache hit tokens`` log line: ``L - hit``);
* the decode instance's own cold prefill of the prompt (a ``cache_salt`` nothing was stored under).

    python benchmarks/bench_pd.py [--quick]

Prints the table and a last line ``PD {json}``: ``pd_prefilled_tokens_max`` (the most prompt
tokens a decode instance computed, over all lengths; goal 1), ``pd_prefilled_tokens_max_both``
(the baseline's), ``pd_ttft_vs_cold`` (decode TTFT over its cold prefill, largest prompt) and
``pd_ttft_vs_both`` (over the baseline decode's TTFT, largest prompt).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (OUT_DIR, RedisServer, ServerProcess, bench_main, fmt, free_port, lmcache_yaml,  # noqa: E402
                     median, ratio, say, serve_command, table)

HELLO = "Hello, how are you?"  # 6 tokens of the tiny model's tokenizer
LENGTHS = (1000, 2000, 4000, 8000, 16000)
QUICK_LENGTHS = (1000, 4000)
REPEATS = 3  # timed runs per prompt length (a new prompt each)


def prompt(tokens: int, tag: str) -> str:
    return f"{tag}: " + HELLO * max(1, (tokens - 8) // 6)


class PDServer(ServerProcess):
    """``lmcache-hma serve`` with the connector in ``kv_role``; ``complete`` returns (seconds, prompt
    tokens, hit tokens, the answer's kv_transfer_params)."""

    group = True

    def __init__(self, name: str, model: Path, yaml: Path, kv_role: str):
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = OUT_DIR / f"pd_{name}.log"
        cmd = serve_command(model, self.port, yaml, kv_role, max_model_len=17000)
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        import requests

        self._start(cmd, self.log_path, lambda: requests.get(f"{self.base}/health", timeout=5).status_code == 200,
                    timeout=300, env=env)

    def complete(self, text: str, **extra) -> tuple[float, int, int, dict]:
        import requests

        mark = self.log_path.stat().st_size
        t0 = time.perf_counter()
        r = requests.post(f"{self.base}/v1/completions", timeout=600,
                          json={"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0, **extra})
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        time.sleep(0.2)
        with open(self.log_path, errors="replace") as f:
            f.seek(mark)
            lines = re.findall(r"Total tokens (\d+), LMCache hit tokens: (\d+)", f.read())
        total, hit = (int(x) for x in lines[-1]) if lines else (0, 0)
        return seconds, total, hit, r.json().get("kv_transfer_params") or {}


def settle(redis, quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
    """Until Redis's key count stopped changing for ``quiet_s`` (the producer's stores landed)."""
    client, last, since, t0 = redis.client(), None, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = client.dbsize()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def run_setting(model: Path, redis, work: Path, roles: tuple[str, str], lengths, tag: str) -> dict:
    """One pair of servers on an emptied Redis: per length, the prefill's and the decode's figures."""
    redis.client().flushall()
    yaml = lmcache_yaml(work / f"pd_{tag}.yaml", local_cpu=False, max_local_cpu_size=1.0,
                        remote_url=redis.url, remote_serde="naive")
    out = {}
    with PDServer(f"{tag}_prefill", model, yaml, roles[0]) as prefill, \
            PDServer(f"{tag}_decode", model, yaml, roles[1]) as decode:
        for n in (600, 1200):  # first-request costs (of prefill, load and cold paths) out of the figures
            warm = prompt(n, f"{tag} warm-up")
            params = prefill.complete(warm)[3]
            decode.complete(warm, **({"kv_transfer_params": params} if params else {}))
            decode.complete(warm, cache_salt="warm-up")
        for n in lengths:
            rows = []
            for rep in range(-1, REPEATS):  # rep -1 untimed: the first run at a new length pays for its shapes
                text = prompt(n, f"{tag} {n} {rep}")
                p_s, total, _, params = prefill.complete(text)
                settle(redis)  # the producer idle: two engines on two cores would time each other
                d_s, d_total, hit, _ = decode.complete(text, **({"kv_transfer_params": params} if params else {}))
                cold_s = decode.complete(text, cache_salt=f"cold {rep}")[0]
                if rep < 0:
                    continue
                rows.append({"tokens": total, "prefill_s": p_s, "decode_s": d_s, "cold_s": cold_s,
                             "computed": d_total - hit, "hit": hit})
            out[n] = {k: median(r[k] for r in rows) for k in ("prefill_s", "decode_s", "cold_s")}
            out[n].update(tokens=rows[0]["tokens"], computed_max=max(r["computed"] for r in rows))
            say(f"pd {tag} {n}: {out[n]}")
    return out


def run(quick: bool = False) -> dict:
    from lmcache_hma.testing.tiny_model import build_tiny_model

    work = OUT_DIR / "pd"
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model("tiny-gemma3")
    lengths = QUICK_LENGTHS if quick else LENGTHS
    with RedisServer(OUT_DIR / "pd_redis.log") as redis:
        pd = run_setting(model, redis, work, ("kv_producer", "kv_consumer"), lengths, "pd")
        both = run_setting(model, redis, work, ("kv_both", "kv_both"), lengths, "both")
    rows = []
    for n in lengths:
        a, b = pd[n], both[n]
        rows.append([a["tokens"], fmt(a["prefill_s"] * 1e3, 1), fmt(a["cold_s"] * 1e3, 1),
                     fmt(a["decode_s"] * 1e3, 1), a["computed_max"], fmt(b["decode_s"] * 1e3, 1), b["computed_max"],
                     fmt(ratio(a["decode_s"], a["cold_s"])), fmt(ratio(a["decode_s"], b["decode_s"]))])
    last = lengths[-1]
    return {
        "table": table(["prompt tokens", "prefill ms (producer)", "decode cold ms", "decode ms (kv_consumer)",
                        "tokens it computed", "decode ms (kv_both)", "tokens it computed (kv_both)",
                        "decode / cold", "kv_consumer / kv_both"], rows),
        "pd_prefilled_tokens_max": max(pd[n]["computed_max"] for n in lengths),
        "pd_prefilled_tokens_max_both": max(both[n]["computed_max"] for n in lengths),
        "pd_ttft_vs_cold": ratio(pd[last]["decode_s"], pd[last]["cold_s"]),
        "pd_ttft_vs_both": ratio(pd[last]["decode_s"], both[last]["decode_s"]),
        "lengths": list(lengths),
        "raw": {"pd": pd, "both": both},
    }


if __name__ == "__main__":
    bench_main(__doc__, run, "PD", keys=["pd_prefilled_tokens_max", "pd_prefilled_tokens_max_both",
                                         "pd_ttft_vs_cold", "pd_ttft_vs_both"])
