"""A thin OpenAI-compatible proxy in front of a fleet: it asks an existing router's index which
instance can restore the most of a prompt and sends the request there.

    python examples/fleet/proxy.py --instances 1=http://127.0.0.1:8001,2=http://127.0.0.1:8002 \
        --indexer http://127.0.0.1:8090 --policy kv --port 8000

The index is the router's (Dynamo's standalone indexer, subscribed to each instance's KV cache
events: docs/fleet.md); this is glue. Per ``POST /v1/completions`` or ``/v1/chat/completions``:

* ``kv``: the prompt's token ids (the request's own, or the instance's ``/tokenize``), the
  index's ``/query``, and per instance a score: restorable tokens weighed by tier (device 1,
  CPU 0.75, disk 0.25: Dynamo's defaults) minus ``--load-tokens`` per request it is serving;
  the highest wins (ties: the least loaded, then round-robin). A prompt whose best score is
  under ``--cache-threshold`` of its tokens counts as new (as SGLang's router's
  ``cache_threshold``): it goes to the least loaded instance that computed the fewest tokens
  through this proxy, so that new prefixes spread the fleet's memory instead of following a
  short shared head (a system prompt) to one instance;
* ``least-loaded``: the instance serving the fewest requests through this proxy (ties: in turn);
* ``round-robin``.

The answer, streamed or not, is passed through; the chosen instance is in the ``x-fleet-instance``
response header. Standard library only; a sketch for trials and benchmarks, not a production
router (no retries, health checks or authentication).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

ROUTED = ("/v1/completions", "/v1/chat/completions")
WEIGHTS = {"gpu": 1.0, "cpu": 0.75, "disk": 0.25}
POLICIES = ("kv", "least-loaded", "round-robin")


def _call(url: str, body: Optional[dict], timeout: float):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def tier_weighted(score: dict) -> float:
    """Restorable tokens weighed by tier; the index's counts are cumulative (cpu includes gpu)."""
    gpu, cpu, disk = score.get("gpu", 0), score.get("cpu", 0), score.get("disk", 0)
    return WEIGHTS["gpu"] * gpu + WEIGHTS["cpu"] * max(0, cpu - gpu) + WEIGHTS["disk"] * max(0, disk - cpu)


class Fleet:
    """The instances (id -> base URL), their load, and the policy."""

    def __init__(self, instances: dict[int, str], indexer: Optional[str], policy: str,
                 load_tokens: float = 512.0, timeout: float = 600.0, cache_threshold: float = 0.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if policy == "kv" and not indexer:
            raise ValueError("the kv policy needs --indexer")
        self.instances, self.indexer, self.policy = dict(instances), indexer, policy
        self.load_tokens, self.timeout = load_tokens, timeout
        self.cache_threshold = cache_threshold
        self.inflight = {i: 0 for i in instances}
        self.computed = {i: 0 for i in instances}  # prompt tokens sent to each beyond its credit
        self._lock = threading.Lock()
        self._rr = itertools.cycle(sorted(instances))
        self.last_scores: dict = {}  # the last /query answer (benchmarks read it)

    def tokens(self, path: str, body: dict) -> Optional[list[int]]:
        """The prompt's token ids: given, or from an instance's ``/tokenize``."""
        prompt = body.get("prompt")
        if path == "/v1/completions" and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        ask = {"model": body.get("model")}
        if path == "/v1/completions" and isinstance(prompt, str):
            ask["prompt"] = prompt
        elif path == "/v1/chat/completions" and "messages" in body:
            ask["messages"] = body["messages"]
        else:
            return None
        base = next(iter(self.instances.values()))
        try:
            with _call(f"{base}/tokenize", ask, 30) as r:
                return json.loads(r.read())["tokens"]
        except (OSError, ValueError, KeyError):
            return None

    def choose(self, path: str, body: dict) -> int:
        with self._lock:
            load = dict(self.inflight)
        if self.policy == "round-robin":
            with self._lock:
                return next(self._rr)
        order = self._in_turn(load)  # ties go in turn (the first of equals every time piled them on one)
        if self.policy == "least-loaded":
            return min(order, key=lambda i: load[i])
        tokens = self.tokens(path, body)
        scores = self.query(tokens) if tokens else {}
        self.last_scores = scores
        with self._lock:
            computed = dict(self.computed)
        weighted = {i: tier_weighted(scores.get(str(i), {})) for i in order}
        if not tokens or max(weighted.values()) < self.cache_threshold * len(tokens):
            chosen = min(order, key=lambda i: (load[i], computed[i]))  # new: where the least was put
        else:
            chosen = max(order, key=lambda i: (weighted[i] - self.load_tokens * load[i], -load[i]))
        if tokens:
            credit = (scores.get(str(chosen)) or {}).get("longest_matched", 0)
            with self._lock:
                self.computed[chosen] += max(0, len(tokens) - credit)
        return chosen

    def _in_turn(self, load: dict) -> list[int]:
        """The instances, starting from the next one in turn."""
        with self._lock:
            start = next(self._rr)
        return sorted(load, key=lambda i: (i - start) % (max(load) + 1))

    def query(self, tokens: list[int]) -> dict:
        """The index's answer for ``tokens``: instance id (a string) -> its counts; {} if it fails."""
        try:
            with _call(f"{self.indexer}/query", {"token_ids": tokens, "model_name": "default"}, 10) as r:
                return json.loads(r.read()).get("instances", {})
        except (OSError, ValueError):
            return {}

    def begin(self, i: int) -> None:
        with self._lock:
            self.inflight[i] += 1

    def end(self, i: int) -> None:
        with self._lock:
            self.inflight[i] -= 1


def make_handler(fleet: Fleet):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _reply(self, status: int, payload: bytes, ctype: str = "application/json", extra=()) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            base = next(iter(fleet.instances.values()))
            try:
                with urllib.request.urlopen(base + self.path, timeout=30) as r:
                    self._reply(r.status, r.read(), r.headers.get("Content-Type", "application/json"))
            except urllib.error.HTTPError as e:
                self._reply(e.code, e.read())
            except OSError as e:
                self._reply(502, json.dumps({"error": str(e)}).encode())

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                self._reply(400, b'{"error": "the body is not JSON"}')
                return
            i = fleet.choose(self.path, body) if self.path in ROUTED else next(iter(fleet.instances))
            fleet.begin(i)
            try:
                self._forward(i, raw)
            finally:
                fleet.end(i)

        def _forward(self, i: int, raw: bytes) -> None:
            req = urllib.request.Request(fleet.instances[i] + self.path, data=raw,
                                         headers={"Content-Type": "application/json"})
            try:
                r = urllib.request.urlopen(req, timeout=fleet.timeout)
            except urllib.error.HTTPError as e:
                self._reply(e.code, e.read(), extra=(("x-fleet-instance", str(i)),))
                return
            except OSError as e:
                self._reply(502, json.dumps({"error": f"instance {i}: {e}"}).encode())
                return
            with r:
                self.send_response(r.status)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("x-fleet-instance", str(i))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := r.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

    return Handler


def parse_instances(spec: str) -> dict[int, str]:
    out = {}
    for part in filter(None, spec.split(",")):
        key, _, url = part.partition("=")
        out[int(key)] = url.rstrip("/")
    if not out:
        raise ValueError("no instances")
    return out


def serve(fleet: Fleet, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(fleet))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", required=True, help="id=URL,... (ids as registered with the indexer)")
    ap.add_argument("--indexer", help="the indexer's base URL (policy kv)")
    ap.add_argument("--policy", choices=POLICIES, default="kv")
    ap.add_argument("--load-tokens", type=float, default=512.0,
                    help="restorable tokens one request in flight on an instance is worth against it")
    ap.add_argument("--cache-threshold", type=float, default=0.5,
                    help="a prompt whose best tier-weighted restorable share is under this counts as new")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    fleet = Fleet(parse_instances(args.instances), args.indexer, args.policy, args.load_tokens,
                  cache_threshold=args.cache_threshold)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(fleet))
    server.daemon_threads = True
    print(f"fleet proxy ({args.policy}) on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
