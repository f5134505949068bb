"""Real vLLM engines (CPU build) for end-to-end tests, with or without the connector.

An engine start costs 20-35 s on a quiet 2-core machine, most of the suite's time. The rules
(tests/conftest.py has them in short, and how a new module follows them):

- References (greedy outputs of an engine WITHOUT the connector) are declared at module level
  with ``Reference(model, prompts, ...)`` and read with ``.get()``: every reference of one
  engine configuration that the session's selected modules declared is computed in ONE engine,
  started at the first ``.get()`` and shut down right after, each request from an empty prefix
  cache. (test_identity_lora keeps its own reference engine: its adapters are built at run time.)
- A module's connector engine is a module-scoped fixture (shared by the module's tests, which
  use ``reset_prefix_cache()`` and deltas of the stats file); a fresh-process check (a new
  engine reading the disk or Redis tier) starts a fresh engine, and one fresh engine serves
  several such checks.
- One engine alive at a time (each reserves its KV cache, ``KV_CACHE_BYTES``, and takes 3-4 GB
  in all): a module's shared engine is registered with ``hold(llm)`` and ``make_llm`` shuts it
  down before it starts any other engine (so a module orders its tests: those of its shared
  engine first); a connector engine's fixture depends on the module's reference fixture, so the
  references are computed (and their engine gone) before it starts. Only tests about several
  engines at once (two sharing Redis) keep two alive: engines that are not held are never shut
  down for another.
- ``shutdown`` stops an engine once its processes finished their shutdown (see ``SHUT_DOWN``).
- Every start and stop is recorded (``record_engine``) in the file named by ``ENGINE_LOG``;
  conftest.py prints starts per module at the end of the run.

Both sides of every comparison run with the same thread settings (``VLLM_CPU_NUM_OF_RESERVED_CPU``):
vLLM's CPU build reserves one more core when a KV connector is configured (docs/design.md,
"Where the threads run").
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

# The legacy VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes on CPU.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
KV_CACHE_BYTES = 2**30

LONG_PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"  # 6007 tokens
MAX_TOKENS = 10


# Greedy tokens are compared with a run without the connector. The exactness tests run the
# tiny models in float32 (``DTYPE``): two runs that split the same prompt differently (a hit
# computes only the tail; a batch-mate changes the matmul shapes) then differ in the last
# bits of a logit, far below a nat. Where the reference's top-2 log-probabilities are closer
# than ``TIE_TOL``, the next token is decided by rounding: the comparison stops there. A
# wrong KV block moves logits by far more.
DTYPE = "float32"
TIE_TOL = 1e-3
# The recurrent-state (gated delta net) models run only in bf16 on vLLM's CPU build: their
# comparisons against a recompute (another compute split) keep this tolerance, about three
# bf16 steps of a logit near 10 (bf16 noise that depends on batch composition alone flips
# such ties, with or without a connector). Where the split is the same they compare
# exactly (``same_logprobs``).
BF16_TIE_TOL = 0.2
# A tie is never accepted before this many tokens agreed: a comparison must compare ...
MIN_COMPARED = 2
# ... except an exact tie (the reference's top-2 log-probabilities equal: its own pick was
# the lower token id) after the first token: nothing can agree or disagree with it. Seen at
# the second token on an Intel Xeon (AMX) machine, test_faults' batch with preemption.
# How often the tie rule decided a comparison: printed at the end of the run, and a run
# where it decided too many fails (conftest.py, ``tie_verdict``).
TIE_STATS = {"comparisons": 0, "ended_at_a_tie": 0}
TIE_TESTS: list[str] = []  # the test of each comparison that ended at a near-tie (printed at the end)
# A run is judged once it made this many comparisons; it fails when more than this share
# of them ended at a near-tie (an exactness test that mostly stops early decides nothing).
TIE_JUDGED_FROM, TIE_MAX_SHARE = 20, 0.05


def tie_verdict(stats: dict = TIE_STATS) -> Optional[str]:
    """Why the run's comparisons are not trustworthy (too many ended at a tie), or None."""
    n, ties = stats["comparisons"], stats["ended_at_a_tie"]
    if n < TIE_JUDGED_FROM or ties <= TIE_MAX_SHARE * n:
        return None
    return (f"{ties} of {n} greedy comparisons ({ties / n:.0%}) ended at a reference near-tie, more "
            f"than {TIE_MAX_SHARE:.0%}: these exactness tests compared too little to decide")


@dataclass
class Gen:
    tokens: list[int]
    cached: int  # num_cached_tokens: local prefix hit plus connector hit
    margins: list[float]  # top-1 minus top-2 log-probability at each position
    logprobs: list[float] = field(default_factory=list)  # of the chosen token at each position
    # speculative decoding with per_request_spec_decode_metrics="detailed": draft tokens accepted
    # at each verify step
    accepted: list[int] = field(default_factory=list)


def same_greedy(ref: Gen, out: Gen, tol: float = TIE_TOL) -> bool:
    """True if ``out`` follows ``ref`` up to the first position ``ref`` leaves to a near-tie.

    At least ``MIN_COMPARED`` tokens must agree before a tie may end the comparison (one
    before an exact tie).
    """
    TIE_STATS["comparisons"] += 1
    for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
        if a != b:
            tie = ref.margins[i] < tol and (i >= MIN_COMPARED or (i >= 1 and ref.margins[i] == 0.0))
            TIE_STATS["ended_at_a_tie"] += tie
            if tie:
                TIE_TESTS.append(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0])
            return tie
    return len(ref.tokens) == len(out.tokens)


def same_logprobs(ref: Gen, out: Gen) -> bool:
    """Bit-identical output: the same tokens with the same log-probabilities (both runs
    computed the same positions in the same steps from the same KV and state bytes)."""
    TIE_STATS["comparisons"] += 1
    return ref.tokens == out.tokens and ref.logprobs == out.logprobs and ref.margins == out.margins


def same_answer(ref: tuple, out: tuple, tol: float = TIE_TOL) -> bool:
    """A server's answer ``out`` = (text, token ids) against a reference answer ``ref`` = (text,
    token ids, margins) computed with another split (cold, or another hit boundary):
    ``same_greedy`` on the tokens, and the same text where every token agrees. The servers
    (tests/servers.py) run the tiny model in float32 like the engines, hence the tolerance."""
    ref_text, ref_ids, ref_margins = ref
    text, ids = out
    return same_greedy(Gen(ref_ids, 0, ref_margins), Gen(ids, 0, []), tol) and (ids != ref_ids or text == ref_text)


def diff(ref: Gen, out: Gen) -> str:
    """Where and how ``out`` leaves ``ref`` (for assertion messages)."""
    for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
        if a != b:
            return (f"position {i}: {a} vs {b}, ref margin {ref.margins[i]:.4g}, "
                    f"out margin {out.margins[i]:.4g}, cached {ref.cached} vs {out.cached}")
    for i, (a, b) in enumerate(zip(ref.logprobs, out.logprobs)):
        if a != b:
            return f"same tokens; position {i}: log-probability {a!r} vs {b!r}"
    return "same"


def greedy(max_tokens: int = MAX_TOKENS, kv_transfer_params: Optional[dict] = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0, top_p=0.95, max_tokens=max_tokens, logprobs=2, extra_args=extra)


# -- counting engine starts ----------------------------------------------------------------

ENGINE_LOG = "LMCACHE_HMA_ENGINE_LOG"  # a JSON-lines file; conftest.py names one per run
ENGINE_LOG_OWNER = "LMCACHE_HMA_ENGINE_LOG_PID"  # the run that made it (a nested run reuses its parent's)
LIVE = {"engines": 0}  # engines of this process started by make_llm and not shut down


def record_engine(event: str, seconds: float, what: str = "") -> None:
    """One engine event ("start", "failed_start", "stop"; a server's "start" is its time to
    ready) with the test that caused it, appended to ``$LMCACHE_HMA_ENGINE_LOG`` (if set).
    Child processes inherit the variable and ``PYTEST_CURRENT_TEST``: their starts count too."""
    path = os.environ.get(ENGINE_LOG)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    entry = {"event": event, "test": test, "what": what, "seconds": round(seconds, 2),
             "pid": os.getpid(), "alive": LIVE["engines"]}
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


HELD: list = []  # a module's shared engine (at most one), shut down when another engine starts


def hold(llm):
    """``llm``, a module's shared engine, to be shut down when this process starts another engine
    (one engine at a time). Its fixture still shuts it down at the end (``shutdown`` is idempotent);
    a test that uses it after another engine started gets a clear error from ``generate``."""
    release_held()
    HELD.append(llm)
    return llm


def release_held() -> None:
    """Shut down the held engine, if any (``make_llm`` does before each start)."""
    while HELD:
        shutdown(HELD.pop())


def counting_repro_starts(monkeypatch) -> None:
    """The engines ``lmcache_hma.tools.repro.run_repro`` builds (its own ``_llm``) started and
    stopped as ``make_llm`` and ``shutdown`` do here: a held engine shut down first, each start
    and stop recorded, each stop as quick as ``shutdown``'s (run_repro reads nothing from an
    engine once it stops it)."""
    from lmcache_hma.tools import repro

    build = repro._llm

    def timed(model, config, *args, **kwargs):
        release_held()
        t0 = time.monotonic()
        llm = build(model, config, *args, **kwargs)
        LIVE["engines"] += 1
        record_engine("start", time.monotonic() - t0, f"repro {Path(model).name} "
                      f"{'connector' if config is not None else 'no connector'}")
        if config is None:
            setattr(llm, NO_CONNECTOR, True)
        return llm

    monkeypatch.setattr(repro, "_llm", timed)
    monkeypatch.setattr(repro, "_shutdown", shutdown)


def _describe(model_dir, lmcache_yaml, dtype, kwargs) -> str:
    keys = ",".join(sorted(k for k in kwargs if k != "kv_cache_memory_bytes"))
    return (f"{Path(model_dir).name} {'connector' if lmcache_yaml is not None else 'no connector'} {dtype}"
            + (f" {keys}" if keys else ""))


def make_llm(model_dir, lmcache_yaml: Optional[Path] = None, extra: Optional[dict] = None,
             max_num_batched_tokens: int = 2048, dtype: str = DTYPE, keep_held: bool = False, **kwargs):
    """An ``LLM`` with the hybrid manager on; with the connector when a YAML is given.

    ``dtype`` is the compute (and KV cache) dtype; the tiny models' weights are stored in
    bf16 and are exact in float32. For a reference without the connector use ``Reference``.
    A held engine (``hold``) is shut down first, unless ``keep_held`` (a test about two engines
    alive together, one of them the module's shared engine).
    """
    if not keep_held:
        release_held()
    what = _describe(model_dir, lmcache_yaml, dtype, kwargs)
    t0 = time.monotonic()
    try:
        llm = _make_llm(model_dir, lmcache_yaml, extra, max_num_batched_tokens, dtype, **kwargs)
    except BaseException:
        record_engine("failed_start", time.monotonic() - t0, what)
        raise
    LIVE["engines"] += 1
    record_engine("start", time.monotonic() - t0, what)
    if lmcache_yaml is None:
        setattr(llm, NO_CONNECTOR, True)
    return llm


def _make_llm(model_dir, lmcache_yaml, extra, max_num_batched_tokens, dtype, **kwargs):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if lmcache_yaml is not None:
        transfer = KVTransferConfig(
            kv_connector="LMCacheHMAConnector",
            kv_connector_module_path="lmcache_hma",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache_config_file": str(lmcache_yaml), **(extra or {})},
        )
    return LLM(
        model=str(model_dir), dtype=dtype, max_model_len=kwargs.pop("max_model_len", 8192),
        enforce_eager=True, disable_hybrid_kv_cache_manager=False,
        max_num_batched_tokens=max_num_batched_tokens, kv_transfer_config=transfer, seed=0,
        kv_cache_memory_bytes=kwargs.pop("kv_cache_memory_bytes", KV_CACHE_BYTES), **kwargs,
    )


def cached_by_source(llm) -> dict[str, int]:
    """vLLM's own ``vllm:prompt_tokens_cached_by_source`` of this process, by source (the engine
    must run with ``disable_log_stats=False``). Counters add up over the engines a process ran:
    compare before and after."""
    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source":
            source = metric.labels.get("source", "")
            out[source] = out.get(source, 0) + int(metric.value)
    return out


def source_delta(before: dict, after: dict) -> dict:
    """The tokens each source gained between two ``cached_by_source`` snapshots (non-zero ones)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


SHUT_DOWN = "_lmcache_hma_shut_down"  # set on an LLM once ``shutdown`` stopped it
# vLLM's shutdown: SIGTERM to the engine core, which stops its worker process (the worker closes
# the connector, whose worker half closes its store: pending disk and Redis writes end there;
# then vLLM tears down its distributed state) and then tears itself down; 5 s after the SIGTERM
# whatever is left is killed. Here both processes then spend seconds in the interpreter's exit
# (a cyclic garbage collection of their whole heap), so every stop cost the full 5 s. Once a
# process is down to its main thread (the gloo threads end after the connector closed) or gone,
# nothing it still does matters to the tests: it is killed then, workers first, the engine core
# once its workers are gone (``CORE_GRACE_S`` later at most). An engine without the connector
# has nothing to close: it is killed at once.
CORE_GRACE_S = 0.5
NO_CONNECTOR = "_lmcache_hma_no_connector"  # set on an LLM that make_llm started without the connector


def _kill_once_finished(core_client) -> Optional[threading.Event]:
    """A watcher that kills the engine's processes once they finished their shutdown (see above);
    returns an event that stops it, or None (vLLM's own timeout then applies)."""
    try:
        import psutil

        cores = [psutil.Process(p.pid) for p in core_client.resources.engine_manager.processes if p.is_alive()]
        workers = [c for core in cores for c in core.children(recursive=True)
                   if "VLLM::Worker" in " ".join(c.cmdline())]
    except Exception:  # another client or vLLM release
        return None
    if not cores or not workers or any(w.num_threads() < 2 for w in workers):
        return None
    done = threading.Event()

    def finished(proc) -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE or proc.num_threads() == 1
        except psutil.Error:  # gone
            return True

    def kill(procs) -> None:
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass

    def watch() -> None:
        deadline, workers_done = time.monotonic() + 60, None
        while not done.wait(0.05) and time.monotonic() < deadline:
            if workers_done is None and all(finished(w) for w in workers):
                kill(workers)
                workers_done = time.monotonic()
            if workers_done is not None and (all(finished(c) for c in cores)
                                             or time.monotonic() > workers_done + CORE_GRACE_S):
                kill(cores)
                return

    threading.Thread(target=watch, daemon=True, name="kill-engine-once-finished").start()
    return done


def shutdown(llm) -> None:
    """Stop an engine's processes now (the connector closes its store); again: nothing."""
    if getattr(llm, SHUT_DOWN, False):
        return
    setattr(llm, SHUT_DOWN, True)
    if any(held is llm for held in HELD):
        HELD[:] = [held for held in HELD if held is not llm]
    t0 = time.monotonic()
    core = llm.llm_engine.engine_core
    if getattr(llm, NO_CONNECTOR, False):
        watcher, timeout = None, 0.0  # SIGTERM, then SIGKILL to the engine core and its workers
    else:
        watcher, timeout = _kill_once_finished(core), None  # vLLM's default (5 s)
    try:
        core.shutdown(timeout=timeout)
    finally:
        if watcher is not None:
            watcher.set()
        del llm, core
        gc.collect()
        LIVE["engines"] -= 1
        record_engine("stop", time.monotonic() - t0)


class Writer:
    """An engine that stores what a fresh engine then reads: its tests use ``llm`` (and any other
    attribute given, e.g. ``stats``, ``disk``), a fixture ``close``s it (idempotent; its stores
    are flushed then) before the fresh engine starts. ``alive``: not closed, nor shut down for
    another engine (``hold``)."""

    def __init__(self, llm, **attributes) -> None:
        self.llm = llm
        self.__dict__.update(attributes)

    @property
    def alive(self) -> bool:
        return self.llm is not None and not getattr(self.llm, SHUT_DOWN, False)

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            shutdown(llm)

    def flushed(self, prompt: str) -> "Writer":
        """``prompt`` stored (already, unless the module's test runs alone), then the engine shut
        down: fresh engines read what it flushed, nothing is in flight."""
        if self.alive:
            generate(self.llm, prompt)
        self.close()
        return self


def generate(llm, prompts, max_tokens: int = MAX_TOKENS, kv_transfer_params: Optional[dict] = None) -> list[Gen]:
    """Greedy generation of each prompt, with the margins ``same_greedy`` needs."""
    if getattr(llm, SHUT_DOWN, False) or getattr(getattr(llm, "_llm", None), SHUT_DOWN, False):
        raise RuntimeError("this engine was shut down: a module's shared engine (tests.engines.hold) stops "
                           "when another engine starts; run the tests that use it before the others")
    outs = llm.generate(prompts if isinstance(prompts, list) else [prompts], greedy(max_tokens, kv_transfer_params),
                        use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        margins, chosen = [], []
        for token, lp in zip(c.token_ids, c.logprobs):
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            chosen.append(lp[token].logprob)
        spec = getattr(c, "spec_decode_metrics", None)
        accepted = list(spec.per_step_accepted) if spec is not None else []
        result.append(Gen(list(c.token_ids), o.num_cached_tokens, margins, chosen, accepted))
    return result


def write_yaml(path: Path, **keys) -> Path:
    """An LMCache YAML with ``keys`` (nested dicts allowed)."""
    import yaml

    path.write_text(yaml.safe_dump(keys))
    return path


def read_stats(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def settled_stats(path: Path, quiet_s: float = 0.5, timeout: float = 10.0) -> dict:
    """The stats file once it stopped changing for ``quiet_s``: the stores of earlier requests
    (a finished request's turn end goes with the engine's next step, then the store writer
    commits it) are counted, so a delta from here is this test's own."""
    import time

    last, since, deadline = read_stats(path), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read_stats(path)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def turn_end_stored(path: Path, before: dict, what: str = "the turn end", timeout: float = 30.0) -> dict:
    """The stats file once a turn end was stored after ``before`` (a ``settled_stats``). A finished
    request's turn end goes with the engine's next step; a ``reset_prefix_cache`` that reaches
    the engine first drops it where it resets the connector, and where it does not, is refused
    while vLLM keeps blocks for it (``scheduler.kept_blocks``), so a test whose next turn must hit
    it waits for it before resetting."""
    from tests.waiting import wait_for

    grew = lambda: read_stats(path).get("stored_bytes_turn_end", 0) > before.get("stored_bytes_turn_end", 0)  # noqa: E731
    wait_for(grew, timeout=timeout, what=what)
    return read_stats(path)


# -- references: engines without the connector, one per configuration and session -------------

Model = Union[str, Callable[[], Path]]  # a tiny model preset (build_tiny_model) or a builder


def _freeze(value):
    """A hashable stand-in for a prompt, prompt list or engine argument (images by content)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):  # a PIL image
        return ("image", value.mode, tuple(value.size), hashlib.sha256(value.tobytes()).hexdigest())
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


class Reference:
    """Greedy outputs of one batch of prompts from an engine WITHOUT the connector.

    Declare it at module level (pytest imports every module at collection, before any test
    runs)::

        LONG = Reference("tiny-gemma3", LONG_PROMPT)                     # .get() -> Gen
        BATCH = Reference("tiny-gemma3", PROMPTS, max_tokens=32)         # .get() -> list[Gen]
        HIT = Reference("tiny-qwen3next", LONG_PROMPT, hit=True, dtype="bfloat16")

    ``prompts``: one prompt (str or vLLM prompt dict) or a list, run as ONE batch (a batch's
    composition changes the matmul shapes, so declare it as the test runs it). ``hit=True``: the
    outputs of running it a second time right after the cold run, i.e. vLLM's own prefix-cache
    hit. ``engine_kwargs`` go to ``make_llm`` (dtype, kv_cache_memory_bytes, speculative_config, ...).

    The first ``.get()`` of a configuration (model + engine_kwargs) starts one engine, computes
    every reference of that configuration declared by the modules this session selected, each
    from an empty prefix cache, and shuts the engine down: a configuration costs one start per
    session however many modules use it (each pytest-xdist worker is a session: a configuration
    that modules in both workers declare costs one start in each). Call ``.get()`` before the
    module starts its own engine (one engine at a time: make the connector engine's fixture
    depend on the reference fixture).
    A reference declared late (inside a test) still works: it costs another start.
    """

    declared: list["Reference"] = []
    results: dict = {}  # request key -> list[Gen]
    selected_modules: Optional[set] = None  # set by conftest.py once collection is done

    def __init__(self, model: Model, prompts, max_tokens: int = MAX_TOKENS, *, hit: bool = False,
                 **engine_kwargs) -> None:
        self.model, self.engine_kwargs = model, engine_kwargs
        self.single = not isinstance(prompts, list)
        self.prompts = [prompts] if self.single else list(prompts)
        self.max_tokens, self.hit = max_tokens, hit
        self.module = sys._getframe(1).f_globals.get("__name__", "?")
        self.config = (_freeze(model), _freeze(engine_kwargs))
        self.key = (self.config, _freeze(self.prompts), max_tokens, hit)
        Reference.declared.append(self)

    def get(self):
        if self.key not in Reference.results:
            self._compute_configuration()
        outs = Reference.results[self.key]
        return outs[0] if self.single else list(outs)

    def _compute_configuration(self) -> None:
        selected = Reference.selected_modules
        todo, seen = [], set()
        for ref in [self] + Reference.declared:
            if (ref.config == self.config and ref.key not in seen and ref.key not in Reference.results
                    and (ref is self or selected is None or ref.module in selected)):
                seen.add(ref.key)
                todo.append(ref)
        todo.sort(key=lambda r: not r.hit)  # a hit's cold run also answers the cold request
        if callable(self.model):
            model_dir = self.model()
        else:
            from lmcache_hma.testing.tiny_model import build_tiny_model

            model_dir = build_tiny_model(self.model)
        llm = make_llm(model_dir, **self.engine_kwargs)
        try:
            for ref in todo:
                cold_key = (ref.config, _freeze(ref.prompts), ref.max_tokens, False)
                if not ref.hit and cold_key in Reference.results:
                    continue
                llm.reset_prefix_cache()
                cold = generate(llm, ref.prompts, ref.max_tokens)
                Reference.results[cold_key] = cold
                if ref.hit:
                    Reference.results[ref.key] = generate(llm, ref.prompts, ref.max_tokens)
        finally:
            shutdown(llm)
