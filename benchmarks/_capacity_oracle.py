"""Offline models of what a tier stores and serves on a trace (``bench_capacity.py``).

Objects are those of the connector (docs/design.md): ``FULL`` of chunk ``c`` (the full-attention
KV of tokens ``[cC, (c+1)C)``), ``TAIL`` at boundary ``b`` (every sliding layer's blocks a hit at
``b`` reads), ``TURN`` at a finished request's end ``L`` (its last partial chunk and the tail at
``L``: "U"; or ``on_tail``, "V": only the blocks from ``L``'s chunk start, the window before it
being the ``TAIL`` there, which a hit through it reads too: ``ObjectRef.on_tail``). Each is named by a digest of every token before its end, as the connector's keys are,
and sized by ``lmcache_hma.core.layout.HybridLayout.payload_bytes`` for the model's layout (plus
the 128-byte trailer; in a tier rounded up to LMCache's 4 KiB allocation).

The hit rule (``core/hit_rule``): a prompt of ``P`` tokens hits at ``b`` (a multiple of ``C``,
``b <= P - 1``) when the ``FULL`` objects of every chunk before ``b`` and the ``TAIL`` at ``b`` are
stored, or at a turn end ``L <= P - 1`` when the chunks before ``L``'s chunk and the ``TURN`` over
the prompt's first ``L`` tokens are (one ``on_tail``: and the ``TAIL`` at that chunk's start); the
longest such hit is served.

Three models, all on a realized trace (prompts and answers, ``_capacity_traces.Trace.realize``):

* ``admit``: the connector's admission, ``interval`` (today: a tail every checkpoint interval, at
  the prompt's last whole chunk and the chunk before its last token, at every chunk of an answer;
  a turn end for every request) or ``branch`` (tails at those two prompt boundaries, at branch
  points lookups found, every ``HybridLayout.tail_interval`` tokens, at an answer ending on a
  boundary; turn ends probed under a first chunk once 8 were stored and fewer than one in 8 hit:
  one in 8 requests, the gap doubling up to 64; a turn end after a tail its request stored or
  read ``on_tail``), with an unbounded tier: what each stores
  (the working set) and the hits it then serves. Used to size the tiers before a run and to
  check the servers' counts.
* ``ideal``: every object any earlier request computed is available (an unbounded tier that
  stored everything): the most any cache can serve; each request's *path* (the objects its hit
  reads) gives every object's future uses.
* ``oracle``: perfect knowledge of the future at a byte budget. A request offers every object it
  computed that a later request's ideal path reads (a ``TAIL`` only where a later request hits,
  a ``TURN`` only if a later request extends it, a chunk only if a later hit passes it), none
  other; then, while over the budget, drops a leaf (an object no stored object depends on: a
  chunk's next chunk, the tail or turn end it ends) whose next use is farthest (never used again
  first): Belady, prefix-closed. It serves the longest hit the stored objects allow.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout

TRAILER = 128  # core/objects.py: every stored object carries it
ALIGN = 4096  # LMCache's CPU allocator rounds each allocation up to this
TURN_PROBE = 2  # scheduler.admission.Admission.TURN_PROBE
TURN_PROBE_MAX = 64  # scheduler.admission.Admission.TURN_PROBE_MAX
TURN_JUDGED_AFTER = 8  # scheduler.admission.Admission.TURN_JUDGED_AFTER


# --------------------------------------------------------------------------
# the model's layout and object sizes
# --------------------------------------------------------------------------


def gemma_layout(*, sliding_layers: int = 5, full_layers: int = 1, window: int = 512, block_size: int = 128,
                 kv_heads: int = 1, head_dim: int = 64, dtype_bytes: int = 4, chunk: int = 256) -> HybridLayout:
    """The layout vLLM gives a Gemma-3-shaped model with the hybrid manager: one group per layer
    (5 sliding : 1 full has groups of one layer), a page = K and V of ``block_size`` tokens."""
    page = 2 * block_size * kv_heads * head_dim * dtype_bytes
    groups = [GroupLayout(i, GroupKind.SLIDING, (f"model.layers.{i}.self_attn.attn",), block_size, page,
                          sliding_window=window) for i in range(sliding_layers)]
    groups += [GroupLayout(sliding_layers + j, GroupKind.FULL, (f"model.layers.{sliding_layers + j}.self_attn.attn",),
                           block_size, page) for j in range(full_layers)]
    return HybridLayout(tuple(groups), chunk)


@dataclass(frozen=True)
class Sizes:
    """Object sizes of a layout: ``payload`` as the connector counts stored bytes
    (``stored_bytes_*``), ``tier`` as one takes room in a tier: with its trailer, rounded to
    LMCache's 4 KiB allocations, or ``footprint(bytes with the trailer)`` where given (Redis:
    what ``used_memory`` grows by, measured)."""

    layout: HybridLayout
    footprint: Optional[Callable[[int], int]] = None

    @property
    def chunk(self) -> int:
        return self.layout.chunk_size

    def page(self, g: GroupLayout) -> int:
        return g.page_bytes

    def payload(self, kind: str, at: int) -> int:
        """``kind`` "F" (``at``: chunk index), "T" (``at``: boundary in chunks), "U" and "V" (``at``:
        the turn end in tokens; "V": ``on_tail``)."""
        page = self.layout.groups[0].page_bytes  # every group of these models has the same page
        if kind == "F":
            return self.layout.payload_bytes(ObjectKind.FULL, at, page)
        if kind == "T":
            return self.layout.payload_bytes(ObjectKind.TAIL, at - 1, page)
        if kind in ("U", "V"):
            return self.layout.payload_bytes(ObjectKind.TURN, at // self.chunk, page, end=at, on_tail=kind == "V")
        raise ValueError(kind)

    def tier(self, kind: str, at: int) -> int:
        n = self.payload(kind, at) + TRAILER
        return self.footprint(n) if self.footprint is not None else -(-n // ALIGN) * ALIGN

    def object_bytes(self, max_tokens: int) -> set[int]:
        """Every size (payload and trailer) an object of a request of up to ``max_tokens`` can have."""
        C = self.chunk
        out = {self.payload("F", c) for c in range(max_tokens // C)}
        out |= {self.payload("T", b) for b in range(1, max_tokens // C + 1)}
        out |= {self.payload(k, end) for k in "UV" for end in range(C + 1, max_tokens) if end % C}
        return {n + TRAILER for n in out}

    def all_layers_per_token(self) -> float:
        """Bytes of every layer's KV of one token (what an all-layers connector stores per token)."""
        return sum(len(g.layer_names) * g.page_bytes / g.block_size for g in self.layout.paged_groups)


# --------------------------------------------------------------------------
# object names: digests chained over chunks, as the connector's keys are
# --------------------------------------------------------------------------


def _digest(prev: bytes, tokens: Sequence[int], tag: bytes = b"") -> bytes:
    return hashlib.blake2b(prev + tag + array("i", tokens).tobytes(), digest_size=16).digest()


class Tokens:
    """A token sequence's chunk digests (``d[c]``: every token up to chunk ``c``'s end)."""

    def __init__(self, tokens: Sequence[int], chunk: int):
        self.tokens, self.chunk = list(tokens), chunk
        self.d: list[bytes] = []
        prev = b""
        for c in range(len(self.tokens) // chunk):
            prev = _digest(prev, self.tokens[c * chunk:(c + 1) * chunk])
            self.d.append(prev)

    def full(self, c: int) -> tuple:
        return ("F", c, self.d[c])

    def tail(self, b: int) -> tuple:
        """The tail at boundary ``b`` chunks (``b >= 1``)."""
        return ("T", b, self.d[b - 1])

    def turn(self, end: int, on_tail: bool = False) -> tuple:
        k = end // self.chunk
        if on_tail:
            return ("V", end, _digest(self.d[k - 1], self.tokens[k * self.chunk:end], b"turn-on-tail"))
        return ("U", end, _digest(self.d[k - 1], self.tokens[k * self.chunk:end], b"turn"))


# --------------------------------------------------------------------------
# the hit rule
# --------------------------------------------------------------------------


def objects_of(seq: Tokens, upto: int, start: int = 0,
               layout: Optional[HybridLayout] = None) -> list[tuple[tuple, Optional[tuple]]]:
    """``(key, parent)`` of every object a request that computed tokens ``[start, upto)`` of
    ``seq`` could store: the chunks it completed, the tails at their ends, the turn end at
    ``upto`` (``on_tail`` where ``layout`` says its window needs the tail before it and the request
    computed that tail; its parent is then that tail). Chunks in order, then tails, then the turn
    end (parents first)."""
    C = seq.chunk
    out = []
    first = start // C
    last = upto // C  # chunks [first, last) are complete
    for c in range(first, last):
        out.append((seq.full(c), seq.full(c - 1) if c else None))
    for c in range(first, last):
        out.append((seq.tail(c + 1), seq.full(c)))
    if upto % C and upto >= C:
        k = upto // C
        if layout is not None and first < k and layout.turn_needs_tail(k, upto):
            out.append((seq.turn(upto, on_tail=True), seq.tail(k)))
        else:
            out.append((seq.turn(upto), seq.full(k - 1)))
    return out


def best_hit(store_has, turns_after, seq: Tokens, P: int) -> tuple[int, list[tuple]]:
    """The longest hit of a prompt (``seq``'s first ``P`` tokens) on the objects ``store_has``
    (a container of keys) holds; ``turns_after(digest)``: the turn ends stored after a chunk.
    Returns ``(tokens, the objects read)``."""
    C = seq.chunk
    limit = (P - 1) // C  # a hit leaves the prompt's last token to compute
    run = 0
    while run < min(len(seq.d), P // C) and seq.full(run) in store_has:
        run += 1
    best, path_end = 0, None
    for b in range(min(run, limit), 0, -1):
        if seq.tail(b) in store_has:
            best, path_end = b * C, [seq.tail(b)]
            break
    for j in range(1, run + 1):  # a turn end in chunk j (after the chunks [0, j))
        for end in turns_after(seq.d[j - 1]):
            if end // C == j and best < end <= P - 1 and end <= len(seq.tokens):
                if seq.turn(end) in store_has:
                    best, path_end = end, [seq.turn(end)]
                elif seq.turn(end, on_tail=True) in store_has and seq.tail(j) in store_has:
                    best, path_end = end, [seq.tail(j), seq.turn(end, on_tail=True)]
    if not best:
        return 0, []
    path = [seq.full(c) for c in range(best // C)] + path_end
    return best, path


# --------------------------------------------------------------------------
# a realized trace
# --------------------------------------------------------------------------


@dataclass
class Realized:
    """A trace's prompts and answers; ``computed[i]``: request ``i``'s prompt and its answer
    but the last token (its KV is never computed), as ``Tokens``."""

    prompts: list[list[int]]
    answers: list[list[int]]
    chunk: int = 256
    computed: list[Tokens] = field(init=False)

    def __post_init__(self):
        self.computed = [Tokens(p + a[:-1], self.chunk) for p, a in zip(self.prompts, self.answers)]

    def __len__(self) -> int:
        return len(self.prompts)

    def distinct_tokens(self) -> int:
        """Tokens of the trie of every request's computed tokens: what an all-layers connector
        stores once each."""
        seen: set = set()
        n = 0
        for t in self.computed:
            prev = b""
            toks = t.tokens
            # whole chunks by digest, then the partial rest token by token (a trie of prefixes)
            for c, d in enumerate(t.d):
                if d not in seen:
                    seen.add(d)
                    n += self.chunk
                prev = d
            rest = toks[len(t.d) * self.chunk:]
            for k in range(len(rest)):
                key = (prev, tuple(rest[:k + 1]))
                if key not in seen:
                    seen.add(key)
                    n += 1
        return n


class _Turns:
    """Turn ends by the digest of the chunk before them, for ``best_hit``."""

    def __init__(self):
        self.by: dict[bytes, set[int]] = {}

    def add(self, anchor: bytes, end: int) -> None:
        self.by.setdefault(anchor, set()).add(end)

    def discard(self, anchor: bytes, end: int) -> None:
        s = self.by.get(anchor)
        if s:
            s.discard(end)

    def __call__(self, anchor: bytes) -> Iterable[int]:
        return sorted(self.by.get(anchor, ()))


def _anchor(seq: Tokens, end: int) -> bytes:
    return seq.d[end // seq.chunk - 1]


@dataclass
class Outcome:
    """What a model served and stored on a trace."""

    hits: list[int]  # hit tokens per request
    stored_payload: dict  # bytes stored (payload, as stored_bytes_* count), by kind "F", "T", "U"
    stored_objects: int
    held_bytes: int = 0  # tier bytes held at the end
    peak_bytes: int = 0
    evictions: int = 0
    stored_tier: dict = field(default_factory=dict)  # stored_payload in tier bytes (Sizes.tier; admit)

    @property
    def hit_tokens(self) -> int:
        return sum(self.hits)

    @property
    def payload_bytes(self) -> int:
        return sum(self.stored_payload.values())


# --------------------------------------------------------------------------
# the connector's admission, unbounded
# --------------------------------------------------------------------------


def _admits_turn_end(counts: list) -> bool:
    """``Admission.admits_turn_end`` on ``[stored (judged), hit, skipped, gap, finished, pending]`` (updated)."""
    finished, pending = counts[4] + 1, counts[5]
    counts[4] = finished
    while pending and pending[0] <= finished - TURN_JUDGED_AFTER:
        pending.pop(0)
        counts[0] += 1
    stored, hit, skipped, gap = counts[:4]
    if stored < TURN_PROBE or hit * TURN_PROBE >= stored:
        counts[2:4] = [0, TURN_PROBE]
    elif skipped + 1 >= gap:
        counts[2:4] = [0, min(2 * gap, TURN_PROBE_MAX)]
    else:
        counts[2] = skipped + 1
        return False
    pending.append(finished)
    return True


def admit(real: Realized, sizes: Sizes, mode: str, interval: Optional[int] = None,
          tier: Optional["ValueTier"] = None, spare_fill: Optional[float] = None) -> Outcome:
    """The connector's admission (``interval`` or ``branch``, scheduler/admission.py) with an
    unbounded tier, or with ``tier`` (a bounded one that evicts): hits, and bytes stored (with an
    unbounded tier each object once: it keeps it). ``spare_fill`` (``branch``): also the tails
    ``interval`` would store at its interval boundaries, while the tier is below that fraction of
    its budget (an unbounded one always), each worth nothing until read (``Line.spare``)."""
    C = real.chunk
    sparse = interval or sizes.layout.tail_interval()  # branch's sparse interval
    interval = interval or sizes.layout.checkpoint_interval()
    turns = _Turns()
    held = tier if tier is not None else set()
    if tier is not None:
        tier.turns = turns
    branches: set[bytes] = set()
    counts: dict[bytes, list[int]] = {}  # first chunk -> [stored, hit, skipped]
    skipped: set = set()  # turn ends not stored (Admission.skipped_turn_end)
    skipped_turns = _Turns()

    class _HeldOrSkipped:
        def __contains__(self, key) -> bool:
            return key in held or key in skipped
    stored = {"F": 0, "T": 0, "U": 0, "V": 0}
    in_tier = dict(stored)
    n_obj = 0
    hits = []
    for i, (p, seq) in enumerate(zip(real.prompts, real.computed)):
        P, L = len(p), len(seq.tokens)
        pseq = Tokens(p, C)
        hit, path = best_hit(held, turns, pseq, P)
        hits.append(hit)
        if tier is not None:
            tier.read(path)
        first = pseq.d[0] if pseq.d else None
        if path and path[-1][0] in "UV" and first is not None and first in counts:
            counts[first][1] += 1
        elif first in counts and skipped:  # Admission.missed_turn_end: it extends one not stored
            would, would_path = best_hit(_HeldOrSkipped(), lambda a: sorted(set(turns(a)) | set(skipped_turns(a))),
                                         pseq, P)
            if would > hit and would_path and would_path[-1] in skipped:
                counts[first][1] += 1
                skipped.discard(would_path[-1])
        # the tails it stores or its hit reads (RequestState.tails): a turn end after one is on_tail
        tails = {key[1] for key in path if key[0] == "T"}
        # the lookup's run of stored chunks past its hit: a branch point (branch and interval alike)
        run = 0
        while run < len(pseq.d) and pseq.full(run) in held:
            run += 1
        if run > hit // C:
            branches.add(pseq.d[run - 1])
        repeat_hit, last_full = (P - 1) // C, P // C
        last_boundary = hit  # RequestState.last_boundary: what ObjectRef.gain counts from

        def wants(c: int):  # Admission.wants_boundary for chunk c's end ("spare": on speculation)
            b = (c + 1) * C
            if c + 1 in (repeat_hit, last_full) or seq.d[c] in branches:
                return True
            if mode == "branch":
                if b % sparse == 0:
                    return True
                if spare_fill is not None and b % interval == 0 and b <= P and (
                        tier is None or tier.total < spare_fill * tier.budget):
                    return "spare"
                return False
            return b > P or b % interval == 0

        def gain(end: int) -> int:  # save_plan.StepSaves.gain
            nonlocal last_boundary
            g, last_boundary = max(end - last_boundary, 1), max(last_boundary, end)
            return g

        def put(key, kind, at, parent=None, tokens=C, supersedes=(), spare=False) -> bool:
            nonlocal n_obj
            if key in held:
                return True
            if tier is None:
                held.add(key)
            elif not tier.put(key, parent, tokens, supersedes, spare):
                return False
            stored[kind] += sizes.payload(kind, at)
            in_tier[kind] += sizes.tier(kind, at)
            n_obj += 1
            return True

        for c in range(hit // C, L // C):
            put(seq.full(c), "F", c, seq.full(c - 1) if c else None)
        for c in range(hit // C, L // C):
            want = wants(c)
            if want:
                put(seq.tail(c + 1), "T", c + 1, seq.full(c), gain((c + 1) * C), spare=want == "spare")
                tails.add(c + 1)
        # a turn end names the one its hit read, that one's tail but not its own (turn_ends._superseded)
        read_turn = tuple(path[-2:] if path and path[-1][0] == "V" else path[-1:]) if path and path[-1][0] in "UV" \
            else ()
        if L % C and L >= C:
            ok = True
            if mode == "branch" and first is not None:
                ok = _admits_turn_end(counts.setdefault(first, [0, 0, 0, TURN_PROBE, 0, []]))
            on_tail = mode == "branch" and L // C in tails and sizes.layout.turn_needs_tail(L // C, L)
            key = seq.turn(L, on_tail)
            if ok:
                parent = seq.tail(L // C) if on_tail else seq.full(L // C - 1)
                if put(key, "V" if on_tail else "U", L, parent, gain(L),
                       tuple(k for k in read_turn if k != parent) if mode == "branch" else ()):
                    turns.add(_anchor(seq, L), L)
            else:
                skipped.add(key)
                skipped_turns.add(_anchor(seq, L), L)
        elif L % C == 0 and mode == "branch" and L > P:
            put(seq.tail(L // C), "T", L // C, seq.full(L // C - 1), gain(L), read_turn)  # an answer ending on a boundary
    return Outcome(hits, stored, n_obj, stored_tier=in_tier, evictions=tier.evictions if tier is not None else 0)


class ValueTier:
    """A tier of ``budget`` bytes (``Sizes.tier``) under the connector's value eviction: the real
    ``lmcache_hma.store.value_policy.ValuePolicy``, told of each put and read as LMCache's tiers
    tell it (its clock: the puts). ``admit(..., tier=ValueTier(...))`` then models a bounded tier
    in seconds, not a server run: what the policy keeps, beside the oracle (``sim_capacity.py``).
    Each request's stores land at once (the connector's land step by step, chunks before the
    tails that end them)."""

    def __init__(self, sizes: Sizes, budget: int):
        from lmcache_hma.store.value_policy import Line, Lineage, ValuePolicy

        kinds = {"F": ObjectKind.FULL, "T": ObjectKind.TAIL, "U": ObjectKind.TURN, "V": ObjectKind.TURN}
        self._line, self._kind = Line, kinds
        self.lineage = Lineage()
        self.policy = ValuePolicy(self.lineage, lambda key: kinds[key[0]], sizes.layout.has_sliding)
        self.sizes, self.budget = sizes, budget
        self.held: OrderedDict = OrderedDict()  # key -> tier bytes: the tier's index (``cache_dict``)
        self.total = self.evictions = 0
        self.turns: Optional[_Turns] = None  # admit's: a turn end evicted is found no more
        self._anchors: dict = {}  # turn end -> (_Turns anchor, end)

    def __contains__(self, key) -> bool:
        return key in self.held

    def read(self, path: list[tuple]) -> None:
        for key in path:
            self.policy.update_on_hit(key, self.held)

    def put(self, key, parent, tokens: int, supersedes=(), spare: bool = False) -> bool:
        size = self.sizes.tier(key[0], key[1])
        self.lineage.record(key, self._line(parent, tokens, self._kind[key[0]], size, tuple(supersedes), spare))
        self.policy.expect(key)  # its parent is no leaf while room is made for it
        while self.total + size > self.budget:
            victims = self.policy.get_evict_candidates(self.held, 1)
            if not victims:
                self.policy.unexpect(key)
                return False
            for victim in victims:
                self.total -= self.held.pop(victim)
                self.evictions += 1
                if victim[0] in "UV":
                    self.turns.discard(*self._anchors.pop(victim))
        self.held[key] = size
        self.total += size
        if key[0] in "UV":
            self._anchors[key] = (parent[2], key[1])  # its marker's chunk: the parent's digest (_anchor)
        self.policy.update_on_put(key)
        return True


# --------------------------------------------------------------------------
# the ideal and the oracle
# --------------------------------------------------------------------------


def ideal_paths(real: Realized, real_layout: Optional[HybridLayout] = None) -> tuple[list[int], list[list[tuple]]]:
    """Every request's longest hit when every object any earlier request computed is stored,
    and the objects that hit reads (``real_layout``: turn ends ``on_tail`` where it wants them,
    ``objects_of``; the hits are the same either way)."""
    C = real.chunk
    held: set = set()
    turns = _Turns()
    hits, paths = [], []
    for p, seq in zip(real.prompts, real.computed):
        hit, path = best_hit(held, turns, Tokens(p, C), len(p))
        hits.append(hit)
        paths.append(path)
        for key, _ in objects_of(seq, len(seq.tokens), layout=real_layout):
            held.add(key)
            if key[0] in "UV":
                turns.add(_anchor(seq, key[1]), key[1])
    return hits, paths


def oracle(real: Realized, sizes: Sizes, budget: Optional[int],
           on_step: Optional[Callable[[int, dict, dict], None]] = None) -> Outcome:
    """Belady, prefix-closed, with perfect admission, at ``budget`` tier bytes (None: unbounded).
    ``on_step(i, held, parent)`` after request ``i``'s stores and evictions (tests): ``held``
    maps each object to its tier bytes, ``parent`` each object to the one it depends on."""
    C = real.chunk
    _, paths = ideal_paths(real, sizes.layout)
    uses: dict[tuple, list[int]] = {}
    for i, path in enumerate(paths):
        for key in path:
            uses.setdefault(key, []).append(i)

    def next_use(key, now) -> float:
        u = uses.get(key)
        if not u:
            return float("inf")
        j = bisect.bisect_right(u, now)
        return u[j] if j < len(u) else float("inf")

    held: dict[tuple, int] = {}
    parent: dict[tuple, Optional[tuple]] = {}
    children: dict[tuple, int] = {}
    anchors: dict[tuple, bytes] = {}
    turns = _Turns()
    total = peak = evictions = n_obj = 0
    stored = {"F": 0, "T": 0, "U": 0, "V": 0}
    hits = []
    for i, (p, seq) in enumerate(zip(real.prompts, real.computed)):
        hit, _ = best_hit(held, turns, Tokens(p, C), len(p))
        hits.append(hit)
        for key, par in objects_of(seq, len(seq.tokens), start=0, layout=sizes.layout):
            if key in held or next_use(key, i) == float("inf"):
                continue
            if par is not None and par not in held:
                continue  # prefix-closed: never a child without its parent
            size = sizes.tier(key[0], key[1])
            held[key], parent[key] = size, par
            if par is not None:
                children[par] = children.get(par, 0) + 1
            if key[0] in "UV":
                anchors[key] = _anchor(seq, key[1])
                turns.add(anchors[key], key[1])
            total += size
            stored[key[0]] += sizes.payload(key[0], key[1])
            n_obj += 1
        peak = max(peak, total)
        while budget is not None and total > budget:
            victim = max((k for k in held if not children.get(k)), key=lambda k: (next_use(k, i), held[k]))
            total -= held.pop(victim)
            par = parent.pop(victim)
            if par is not None:
                children[par] -= 1
                if not children[par]:
                    del children[par]
            if victim[0] in "UV":
                turns.discard(anchors.pop(victim), victim[1])
            evictions += 1
        if on_step is not None:
            on_step(i, held, parent)
    return Outcome(hits, stored, n_obj, total, peak, evictions)


def format_floor(real: Realized, sizes: Sizes) -> float:
    """Stored bytes over an all-layers connector's for ANY exact format serving the ideal hits: each
    distinct token's (a node of the trie of computed tokens) full-attention KV once if some hit
    covers it, its sliding-window KV once if it lies within a window before some hit's end; no
    object boundaries, no overlap between windows stored twice. The connector's format stores
    windows whole per boundary and turn end; this is what no exact admission and format can beat."""
    C, layout = real.chunk, sizes.layout
    per_token = {kind: sum(len(g.layer_names) * g.page_bytes / g.block_size for g in layout.paged_groups
                           if g.kind is kind) for kind in (GroupKind.FULL, GroupKind.SLIDING)}
    sliding_groups = [g for g in layout.paged_groups if g.kind is GroupKind.SLIDING]
    hits, _ = ideal_paths(real, layout)
    full, sliding = set(), set()
    for p, hit in zip(real.prompts, hits):
        seq = Tokens(p, C)
        for q in range(hit):
            c = q // C
            node = (seq.d[c - 1] if c else b"", tuple(seq.tokens[c * C:q + 1]))
            full.add(node)
            if any(q >= g.first_token_needed(hit) for g in sliding_groups):  # the token at ``hit`` reads it
                sliding.add(node)
    stored = len(full) * per_token[GroupKind.FULL] + len(sliding) * per_token[GroupKind.SLIDING]
    return stored / (real.distinct_tokens() * sizes.all_layers_per_token())


def check_prefix_closed(held: Iterable[tuple], parent: dict) -> bool:
    """Every held object's parent is held (tests)."""
    s = set(held)
    return all(parent.get(k) is None or parent[k] in s for k in s)
