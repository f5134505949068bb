"""A disaggregated-prefill proxy for two vLLM instances that share one store through this connector.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to the prefill instance
(``kv_role: kv_producer``) with ``max_tokens`` 1 and no streaming, as vLLM's disaggregated proxy
examples send it; that instance computes the prompt and stores its KV (every token a decode
instance can load, ``docs/redis.md``). Then the original request goes to the decode instance
(``kv_role: kv_consumer``) with the prefill's answer's ``kv_transfer_params``, which tell it how
many tokens the store will hold (it waits for them, within a lookup timeout, if the prefill's
writer is still putting them). The decode instance's answer, streamed or not, is the client's.
Any other path goes to the decode instance as it is.

Standard library only; a sketch of the flow for tests and trials, not a production router (no
load balancing, retries or authentication).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TWO_STEP = ("/v1/completions", "/v1/chat/completions")


def _post(url: str, body: bytes, timeout: float):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def prefill_body(request: dict) -> dict:
    """The prefill instance's request: the same prompt, one token, no streaming."""
    body = {**request, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    return body


def decode_body(request: dict, prefill_answer: dict) -> dict:
    """The decode instance's request: the client's, with the prefill's ``kv_transfer_params``."""
    params = prefill_answer.get("kv_transfer_params")
    return {**request, "kv_transfer_params": params} if params else dict(request)


class Proxy(BaseHTTPRequestHandler):
    prefill_url = decode_url = ""
    timeout_s = 600.0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path not in TWO_STEP:
            return self._relay(self.decode_url + self.path, body)
        try:
            request = json.loads(body)
            with _post(self.prefill_url + self.path, json.dumps(prefill_body(request)).encode(), self.timeout_s) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # the prefill instance's own error, as it said it
            return self._answer(exc.code, exc.read())
        except (OSError, ValueError) as exc:
            return self._answer(502, json.dumps({"error": f"prefill instance: {exc}"}).encode())
        self._relay(self.decode_url + self.path, json.dumps(decode_body(request, answer)).encode())

    def do_GET(self):  # noqa: N802
        try:
            with urllib.request.urlopen(self.decode_url + self.path, timeout=self.timeout_s) as r:
                self._answer(r.status, r.read(), r.headers.get("Content-Type"))
        except urllib.error.HTTPError as exc:
            self._answer(exc.code, exc.read())

    def _relay(self, url: str, body: bytes) -> None:
        """POST ``body`` to ``url`` and stream its answer back as it comes."""
        try:
            r = _post(url, body, self.timeout_s)
        except urllib.error.HTTPError as exc:
            return self._answer(exc.code, exc.read())
        except OSError as exc:
            return self._answer(502, json.dumps({"error": f"decode instance: {exc}"}).encode())
        with r:
            self.send_response(r.status)
            self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            self.send_header("Connection", "close")
            self.end_headers()
            while True:
                piece = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not piece:
                    break
                self.wfile.write(piece)
                self.wfile.flush()

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):  # quiet: one line per request on stderr only with --verbose
        if self.server.verbose:
            super().log_message(fmt, *args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the kv_producer instance's base URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer instance's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    Proxy.prefill_url, Proxy.decode_url = args.prefill.rstrip("/"), args.decode.rstrip("/")
    server = ThreadingHTTPServer((args.host, args.port), Proxy)
    server.verbose = args.verbose
    print(f"pd_proxy on {args.host}:{server.server_port}: prefill {Proxy.prefill_url}, decode {Proxy.decode_url}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
