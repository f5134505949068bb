"""A router's side of vLLM's KV cache events, for tests: subscribe, decode, track, predict.

What an external router does with ``--kv-events-config`` publishers: plain ``zmq`` SUB
sockets, msgspec's decoder for vLLM's ``KVEventBatch``, a set of (group, block hash) per
instance and medium, and vLLM's hybrid hit rule over the prompt's block hashes computed
with vLLM's ``hash_block_tokens``.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Router:
    """A router's view of the fleet, from KV cache events alone.

    Per instance: ``gpu`` (vLLM's own prefix cache) and ``local[tier]`` (CPU memory and disk,
    LOCAL), sets of (group, block hash); ``redis``: the shared REMOTE tier, whoever announced it.
    ``AllBlocksCleared`` (vLLM's own prefix cache was reset; the connector never sends it)
    empties an instance's GPU set only: the connector announces what left its tiers one by one.
    """

    def __init__(self, ports: dict[str, int]) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._socks = {}
        for name, port in ports.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.bind(f"tcp://127.0.0.1:{port}")
            self._socks[sock] = name
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.lock = threading.Lock()
        self.log: dict[str, list] = defaultdict(list)  # instance -> every event, in order
        self.seqs: dict[str, list[int]] = defaultdict(list)
        self.topics: dict[str, set] = defaultdict(set)
        self.gpu: dict[str, set] = defaultdict(set)
        self.local: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        self.redis: set = set()
        self.groups: dict[int, tuple] = {}  # group -> (kind, block size, sliding window)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                topic, seq, payload = sock.recv_multipart()
                name = self._socks[sock]
                batch = self._decode(payload)
                with self.lock:
                    self.topics[name].add(topic.decode())
                    self.seqs[name].append(int.from_bytes(seq, "big"))
                    for event in batch.events:
                        self.log[name].append(event)
                        self._apply(name, event)

    def _apply(self, name: str, e) -> None:
        kind = type(e).__name__
        if kind == "AllBlocksCleared":
            self.gpu[name].clear()
            return
        where = self._where(name, e)
        entries = {(e.group_idx, h) for h in e.block_hashes}
        if kind == "BlockStored":
            self.groups.setdefault(e.group_idx, (e.kv_cache_spec_kind, e.block_size, e.kv_cache_spec_sliding_window))
            where |= entries
        else:
            where -= entries

    def _where(self, name: str, e) -> set:
        if e.medium == "GPU":
            return self.gpu[name]
        if e.locality == "REMOTE":
            return self.redis
        return self.local[name][{"CPU": "cpu", "STORAGE": "disk"}[e.medium]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()

    # what a router computes --------------------------------------------------------
    def tier_sets(self, name: str) -> list[tuple[str, set]]:
        return [("cpu", self.local[name]["cpu"]), ("disk", self.local[name]["disk"]), ("redis", self.redis)]

    def predict(self, tokens: list[int], tiers: list[tuple[str, set]]) -> tuple[int, str | None]:
        """(hit tokens, the slowest tier a hit reads) of ``tokens`` over ``tiers`` [(name, set)],
        each block read from the fastest tier that holds it."""
        with self.lock:
            groups = dict(self.groups)
            tiers = [(t, set(s)) for t, s in tiers]
        hashes = {size: vllm_block_hashes(tokens, size) for _, size, _ in groups.values()}
        step = max(size for _, size, _ in groups.values())  # all sizes divide it here
        for b in range((len(tokens) - 1) // step * step, 0, -step):
            worst, ok = -1, True
            for g, (kind, size, window) in groups.items():
                first = 0 if kind == "full_attention" else max(0, b - window + 1) // size
                for j in range(first, b // size):
                    found = [i for i, (_, s) in enumerate(tiers) if (g, hashes[size][j]) in s]
                    if not found:
                        ok = False
                        break
                    worst = max(worst, found[0])
                if not ok:
                    break
            if ok:
                return b, tiers[worst][0]
        return 0, None


def vllm_block_hashes(tokens: list[int], block_size: int) -> list:
    """The prompt's block hashes as vLLM computes and announces them (``sha256_cbor``, the
    engines' ``--prefix-caching-hash-algo``, chained from ``NONE_HASH``; events carry the
    last 8 bytes as an int unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

    init_none_hash(sha256_cbor)
    out, parent = [], None
    for j in range(len(tokens) // block_size):
        parent = hash_block_tokens(sha256_cbor, parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(maybe_convert_block_hash(parent))
    return out
