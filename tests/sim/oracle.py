"""The KV oracle: the KV of a token is a pure function of (weights version, the tokens up to and
including it, layer, position).

The simulated forward (``vllm_side.Runner``) writes exactly these bytes into the pages vLLM gave
the request; a load writes whatever the store holds. After every step the simulator compares
every block a request's next token reads with the oracle for the current weights: a stale
object (older weights, another prefix), a block a load left unwritten or a block another
request's load overwrote all show as a mismatch at a named (request, group, layer, position).

Values are small integers (|v| <= 127), exact in bf16, so a byte-exact copy compares equal.
"""

from __future__ import annotations

import hashlib

import torch

ROW = 8  # elements per token and layer in tests.fakes' pages: (1 head, block, 8)


def prefix_digests(tokens, start_digest: bytes = b"", start: int = 0, out=None) -> list[bytes]:
    """``out[p]``: the digest of ``tokens[:p + 1]`` (extends ``out`` from ``start``)."""
    out = [] if out is None else out
    h = start_digest
    for t in tokens[start:]:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=16).digest()
        out.append(h)
    return out


def kv_row(version: int, digest: bytes, layer: int, pos: int) -> list[int]:
    """The KV row (``ROW`` small integers) at ``pos`` of layer ``layer``."""
    b = hashlib.blake2b(digest + bytes((layer, version & 0xFF)) + pos.to_bytes(4, "little"),
                        digest_size=ROW).digest()
    return [x - 128 for x in b]


class Expected:
    """Per request: the oracle's rows for each layer, extended as its tokens grow, for one
    weights version (rebuilt when the version changes)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.digests: list[bytes] = []
        self.version = -1
        self.rows: list[list[list[int]]] = [[] for _ in range(num_layers)]
        self._tensor: dict[int, torch.Tensor] = {}

    def ensure(self, tokens, version: int, upto: int) -> None:
        if version != self.version:
            self.version, self.rows, self._tensor = version, [[] for _ in range(self.num_layers)], {}
        if len(self.digests) < upto:
            prefix_digests(tokens[:upto], self.digests[-1] if self.digests else b"", len(self.digests), self.digests)
        for layer in range(self.num_layers):
            rows = self.rows[layer]
            while len(rows) < upto:
                rows.append(kv_row(version, self.digests[len(rows)], layer, len(rows)))

    def tensor(self, layer: int, upto: int) -> torch.Tensor:
        t = self._tensor.get(layer)
        if t is None or t.shape[0] < upto:
            t = torch.tensor(self.rows[layer][:upto], dtype=torch.bfloat16)
            self._tensor[layer] = t
        return t[:upto]
