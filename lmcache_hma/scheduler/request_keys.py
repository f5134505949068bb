"""A request's chunk keys, extended as its tokens grow.

Contract:

* ``RequestKeys.digests[c]`` is chunk c's key: the prefix-chained digest (``core.keys``) of
  tokens ``[0, (c + 1) * chunk_size)`` of ``request.all_token_ids`` with their extra keys
  (``core.identity``: LoRA, multimodal inputs, ``cache_salt``). It equals the digest of the same
  tokens hashed as one prompt, so a next turn whose prompt is this request's prompt and answer
  gets the same keys and hits what this request stored.
* ``ensure(n)`` extends the digests to ``n`` chunks, or as far as ``keyable()`` allows, hashing
  only the chunks not hashed yet, and returns how many of the first ``n`` chunks have one. Nothing is hashed before it is
  asked for: a prompt wholly in vLLM's own prefix cache needs no keys.
* ``keyable()``: with ``answers`` (``hma_store_answers``), every whole chunk of
  ``all_token_ids`` (prompt and output); without, the prompt's whole chunks only. Under
  speculative decoding with a draft model's KV (``lookahead`` > 0) a chunk also needs the
  ``lookahead`` tokens after it (each digest covers them, see ``config.speculative``): an
  answer's chunk gets its key once those tokens are accepted, i.e. in a step after the one that
  computed its last position. By then its KV, the draft's included, is final: a step's target
  and draft forwards write only positions from that step's first token on, and a rejection
  rewrites only positions past the accepted ones.
* The digests never go past the tokens they cover: vLLM's streaming-input sessions grow the
  prompt after it was hashed (keys then extend over the new tokens) and drop the last sampled,
  never computed, token; should ``all_token_ids`` ever be shorter than what was hashed, the
  digests start over.
* ``turn_digest(end)``: the key of a turn end at ``end`` (``core.turn_ends``): tokens
  ``[k*C, end)`` of ``all_token_ids`` with their extra keys, chained on chunk ``k - 1``'s
  digest (``k = end // C`` >= 1, ``end`` not a chunk boundary), and the ``lookahead`` tokens
  after ``end``; None where there is none (too few tokens, uncacheable).
* An uncacheable request (``core.identity.UncacheableRequest``: unreadable LoRA files) has no
  keys; that is logged once.
"""

from __future__ import annotations

from typing import Any, Optional

from lmcache_hma.core.identity import UncacheableRequest, chunk_extra_keys_from, range_extra_keys, request_lora_key
from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_UNREAD = object()  # the LoRA key not read yet


class RequestKeys:
    def __init__(self, request: Any, hasher: ChunkHasher, lookahead: int = 0, answers: bool = True):
        self.request = request
        self.hasher = hasher
        self.chunk_size = hasher.chunk_size
        self.lookahead = lookahead
        self.answers = answers
        self.digests: list[bytes] = []
        self._mm_index = 0  # multimodal index to continue the extra keys from
        self._lora: Any = _UNREAD
        self.uncacheable = False

    def keyable(self) -> int:
        """Chunks that can have keys now (see the module docstring)."""
        req = self.request
        if self.answers:
            return max(0, len(req.all_token_ids) - self.lookahead) // self.chunk_size
        return max(0, min(req.num_prompt_tokens, len(req.all_token_ids)) - self.lookahead) // self.chunk_size

    def ensure(self, num_chunks: int) -> int:
        """Extend the digests to ``num_chunks`` chunks where ``keyable`` allows; how many of the
        first ``num_chunks`` chunks have digests now."""
        have = len(self.digests)
        if num_chunks <= have or self.uncacheable:
            return min(num_chunks, have)
        tokens = self.request.all_token_ids
        if len(tokens) < have * self.chunk_size + self.lookahead:  # tokens hashed are gone
            self.digests, self._mm_index, have = [], 0, 0
        end = min(num_chunks, self.keyable())
        if end <= have:
            return have
        try:
            if self._lora is _UNREAD:
                self._lora = request_lora_key(self.request)
            extra, mm_index = chunk_extra_keys_from(self.request, have, end, self.chunk_size, self._lora,
                                                    self._mm_index)
        except UncacheableRequest as exc:
            logger.warning("LMCacheHMA: %s is not cached: %s", self.request.request_id, exc)
            self.uncacheable, self.digests = True, []
            return 0
        previous: Optional[bytes] = self.digests[-1] if have else None
        self.digests += self.hasher.continue_hashes(previous, tokens, have, end, extra, self.lookahead)
        self._mm_index = mm_index
        return end

    def turn_digest(self, end: int, on_tail: bool = False) -> Optional[bytes]:
        """The key of a turn end at token ``end`` (see the module docstring; ``on_tail``:
        ``ObjectRef.on_tail``), or None."""
        chunk = end // self.chunk_size
        if (chunk < 1 or not end % self.chunk_size or len(self.request.all_token_ids) < end + self.lookahead
                or self.ensure(chunk) < chunk):
            return None
        start = chunk * self.chunk_size
        try:
            extra, _ = range_extra_keys(self.request, start, end, self._lora)
        except UncacheableRequest:  # pragma: no cover - ensure() read the LoRA already
            return None
        return self.hasher.turn_digest(self.digests[chunk - 1], self.request.all_token_ids, start, end, extra,
                                       self.lookahead, on_tail)
