"""One seeded schedule: the real connector halves in a model of vLLM's engine, checked after
every step against a KV oracle and the invariants of docs/testing.md.

``run(seed)`` draws everything from ``random.Random(seed)``: the configuration (tier sizes,
disk or not, Redis or not, tail admission, the vLLM release and runner whose call order the
connector derives through ``lmcache_hma.vllm_compat``), the trace families' requests, and
every event (arrivals, aborts, resets with and without running requests and with and without a
weight change, faults). It returns a ``Result`` whose ``history`` is every event in order; a
violation is raised as ``Violation`` with that history, and ``run(seed)`` again replays it
step for step (``steppable``: no thread decides an order).

Real parts: ``SchedulerHalf``, ``WorkerHalf`` (its ``ChunkStore``, admission, value policy,
LMCache's CPU and disk tiers, Redis through a real redis-server), vLLM's own
``KVCacheManager`` (block pool, hybrid prefix cache, sliding windows freeing blocks that left
the window) and ``Request``. Modelled: vLLM's scheduler loop (``vllm_side``) and the model
runner (``oracle``: the forward writes the oracle's KV).
"""

from __future__ import annotations

import contextlib
import gc
import random
import shutil
import signal
import threading
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from lmcache_hma import vllm_compat
from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import NULL_BLOCK_ID
from lmcache_hma.core.turn_ends import MARK_BYTES, decode_marks
from lmcache_hma.core.objects import payload_of
from lmcache_hma.scheduler.device_events import device_events
from lmcache_hma.scheduler.scheduler_half import SchedulerHalf
from lmcache_hma.store.lmcache_storage import flat, release
from lmcache_hma.worker.worker_half import WorkerHalf
from tests.engines import write_yaml
from tests.fakes import kv_caches, layout
from tests.sim.oracle import Expected
from tests.sim.steppable import LateAnswers, make_steppable, quiesce
from tests.sim.traces import Traces

CHUNK, BLOCK, WINDOW = 8, 4, 8

# Defects known and open, whose schedules the budget run leaves out (their seeds are in
# regression_seeds.txt, expected to fail until the fix lands; then remove the entry). None now:
# "cpu-fetch-room" (a Redis hit answered as no hit when the CPU tier had no room to fetch it into)
# is fixed, and Redis setups draw the smallest CPU tiers too.
KNOWN_OPEN: set = set()


# a step still running after this long waits with no end (a step takes milliseconds; every
# deadline of the connector is set at most 60 s): (g) liveness, reported with the history
STEP_LIMIT_S = 120.0


class StepHung(Exception):
    pass


@contextlib.contextmanager
def step_watchdog(limit_s: float | None = None):
    """Raise ``StepHung`` in the step when it runs past ``limit_s`` (a busy wait, a wait with no
    deadline): a hang is reported as a violation with its seed, not a test that never ends.
    Main thread only (signals); elsewhere no watchdog."""
    limit_s = STEP_LIMIT_S if limit_s is None else limit_s
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hung(signum, frame):
        raise StepHung(f"the step was still running after {limit_s:.0f} s")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Violation(AssertionError):
    """An invariant failed: ``seed``, ``step``, what, and the history up to it."""

    def __init__(self, seed: int, step: int, what: str, history: list[str]):
        self.seed, self.step, self.what, self.history = seed, step, what, history
        tail = "\n  ".join(history[-60:])
        super().__init__(f"seed {seed}, step {step}: {what}\n  history (last 60 of {len(history)}):\n  {tail}\n"
                         f"replay: tests.sim.simulator.run({seed})")


@dataclass
class Result:
    seed: int
    steps: int = 0
    events: int = 0
    requests: int = 0
    paths: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class SimRequest:
    req: object  # vllm.v1.request.Request
    draw: object  # traces.Draw
    arrived: int
    expected: Expected
    status: str = "waiting"  # waiting | remote | running | kept | done
    versions: dict = field(default_factory=dict)  # position -> weights version it was computed under
    admitted: int = 0  # the step it was last admitted
    waits: int = 0  # lookups in a row that answered "wait" (None)
    finished_no: int = 0  # the order in which it finished (0: not yet)
    landing: object = None  # an Expected for the objects its saves store (the current weights')


# -- configuration -----------------------------------------------------------------------------

ORDERS = {  # how each vLLM release and runner calls the connector; flags derived by vllm_compat
    "0.32-v1": ("0.32.0", False),
    "0.32-v2": ("0.32.0", True),
    "0.34": ("0.34.0", True),
}


@contextlib.contextmanager
def pinned_release(version: str):
    found = vllm_compat.vllm_version
    vllm_compat.vllm_version = lambda: version
    try:
        yield
    finally:
        vllm_compat.vllm_version = found


def derive_flags(order: str) -> tuple[bool, bool]:
    """(keep_blocks_for_turn_ends, defer_gathers) as ``connector.py`` derives them."""
    version, v2 = ORDERS[order]
    vllm_config = SimpleNamespace(use_v2_model_runner=v2, model_config=SimpleNamespace(enable_sleep_mode=False))
    kv_cache_config = SimpleNamespace(needs_kv_cache_zeroing=False)
    with pinned_release(version):
        keep = not vllm_compat.first_call_before_kv_writes(vllm_config)[0]
        defer = vllm_compat.gathers_may_defer(vllm_config, kv_cache_config)[0]
    return keep, defer


@dataclass
class Setup:
    order: str
    cpu_mb: float
    disk_mb: float  # 0: no disk tier
    admission: str
    num_blocks: int
    token_budget: int
    max_running: int
    steps: int
    redis: bool = False
    fail_loads: int = 0  # hma_test_fail_loads: hits loaded asynchronously until this many loads failed
    fail_sync_loads: int = 0  # hma_test_fail_sync_loads
    local_cpu: bool = True  # False: CPU memory only stages reads and writes of the disk tier or Redis

    @classmethod
    def draw(cls, rng: random.Random, steps: int, redis_url: str | None) -> "Setup":
        order, cpu_mb, disk_mb = rng.choice(list(ORDERS)), rng.choice([0.06, 0.1, 0.2, 1.0]), rng.choice([0, 0, 0.05, 0.3])
        admission, num_blocks, budget = rng.choice(["interval", "interval", "branch"]), rng.choice([64, 96, 128, 256]), \
            rng.choice([16, 32, 64, 128])
        while max_len(num_blocks, budget) < 150:  # a small pool (vLLM's cache forgets: loads) holds a request
            num_blocks += 32
        return cls(order=order, cpu_mb=cpu_mb, disk_mb=disk_mb, admission=admission, num_blocks=num_blocks,
                   token_budget=budget,
                   max_running=rng.choice([1, 2, 4, 6]),
                   steps=steps,
                   redis=bool(redis_url) and rng.random() < 0.7)


def _rows_equal(got, sr: SimRequest, version: int, layer: int, pos: int) -> bool:
    e = Expected(len(sr.expected.rows))
    e.ensure(sr.req.all_token_ids, version, pos + 1)
    return torch.equal(got, e.tensor(layer, pos + 1)[pos])


def max_len(num_blocks: int, budget: int) -> int:
    """The longest request (prompt and answer) a pool of ``num_blocks`` holds alone: its full
    group's blocks, and the sliding groups' window and one step's tokens each."""
    return min(400, BLOCK * (num_blocks - 2 * ((budget + WINDOW) // BLOCK + 3)))


def _kv_cache_manager(lay, num_blocks: int):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    def spec(g):
        if g.sliding_window:
            return SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1, head_size=4, dtype=torch.bfloat16,
                                     sliding_window=g.sliding_window)
        return FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=4, dtype=torch.bfloat16)

    groups = [KVCacheGroupSpec(list(g.layer_names), spec(g)) for g in lay.groups]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, enable_kv_cache_events=True)


# -- the engine --------------------------------------------------------------------------------

class Sim:
    def __init__(self, seed: int, steps: int = 60, redis=None, workdir: Path | None = None,
                 known_open=None):
        self.seed = seed
        self.known_open = KNOWN_OPEN if known_open is None else set(known_open)
        self.rng = random.Random(seed)
        self.setup = Setup.draw(self.rng, steps, redis.url if redis is not None else None)
        faults = random.Random(seed * 7919 + 1)  # a stream of its own: the other draws stay as they were
        if faults.random() < 0.3:
            self.setup.fail_loads = faults.choice([1, 2, 4])
            self.setup.fail_sync_loads = faults.choice([0, 1])  # twice stops the step (by design)
        # the store writer's and the lookup fetch's timing: a stream of its own too
        self.io = random.Random(seed * 104729 + 7)
        self.late_fetches = self.io.choice([0.0, 0.2, 0.5, 1.0])  # share of lookup fetches that come late
        self.backlog = self.io.choice([0.0, 0.3, 0.6])  # share of steps after which the writer lags
        self.late_answers = self.io.choice([0.0, 0.0, 0.05, 0.15])  # share of lookup answers past the deadline
        # how many of the resets drawn happen: rare resets leave turn ends and chunks to hit
        self.reset_rate = self.io.choice([0.2, 1.0])
        self.setup.local_cpu = not (self.setup.disk_mb or self.setup.redis) or self.io.random() < 0.75
        self.redis = redis if self.setup.redis else None
        self.redis_url = redis.url if self.redis is not None else None
        if self.redis is not None:
            self.redis.client().flushall()  # what earlier schedules stored is gone
        self.history: list[str] = []
        self.result = Result(seed)
        self.step_no = 0
        self.version = 0  # the model's weights
        self.resets = 0  # the connector's resets so far
        self.instance_resets = 0  # ... of this instance (its weights generation)
        self.generations_used = 0  # the highest generation an earlier instance used (restarts)
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="hma-sim-"))
        # vLLM refuses a request it could never hold (max_model_len)
        self.traces = Traces(random.Random(self.rng.random()),
                             max_len=max_len(self.setup.num_blocks, self.setup.token_budget))
        self.lay = layout("SSF", block=BLOCK, window=WINDOW, chunk=CHUNK)
        self.layers = len(self.lay.layer_names)
        self._build_connector()
        self.kvm = _kv_cache_manager(self.lay, self.setup.num_blocks)
        self.sched.bind_kv_cache_manager(self.kvm)
        self._bind_device_events()
        self.requests: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.remote: dict[str, SimRequest] = {}
        self.kept: dict[str, SimRequest] = {}
        self.loaded: set[str] = set()
        self.failed: set[str] = set()
        self.finished_ids: set[str] = set()
        self.preempted_ids: set[str] = set()
        # digest of tokens[:end] -> (end, turn ref, marker ref, weights version, request id)
        self.turn_ends: dict[bytes, tuple] = {}
        self.n_finished = 0  # requests finished so far (their order)
        self.restart_pending = False  # an engine restart waits for the engine to go idle
        # restarts on the tiers left (disk, Redis) in a third of the setups that have one: a
        # stream of its own, so that the other setups' schedules stay as they were
        self.restarts = bool(self.setup.disk_mb or self.redis is not None) and \
            random.Random(seed * 15485863 + 11).random() < 0.3
        self.saved: dict[tuple, str] = {}  # (kind, digest) of each object a save named -> its request
        self._refs: dict[tuple, object] = {}  # (kind, digest) -> the ObjectRef a save named it by
        self._names_of = (None, {}, 0)  # (generation, tier key -> (kind, digest), saves named so far)
        self._checked: dict = {}  # tier key -> the object last checked under it
        self._mark_on_tail: dict[bytes, bool] = {}  # marker digest -> on_tail of its last save
        self.bad_landings: list[str] = []  # (a) at the store: objects put with KV other than the oracle's
        self.answered: list[tuple] = []  # this step's first lookups: (request, hit, requests finished before it)
        self.n_req = 0
        self.last_progress = 0
        self.just_finished = False
        quiet()
        self.note(f"setup {self.setup} keep_blocks={self.keep} defer_gathers={self.defer} redis={bool(self.redis_url)} "
                  f"late_fetches={self.late_fetches} writer_backlog={self.backlog} late_answers={self.late_answers} "
                  f"reset_rate={self.reset_rate}")

    def note(self, line: str) -> None:
        self.history.append(f"[{self.step_no}] {line}")

    def path(self, name: str) -> None:
        self.result.paths[name] = self.result.paths.get(name, 0) + 1

    # building the connector exactly as the connector builds its halves
    def _build_connector(self) -> None:
        s = self.setup
        # deadlines run on the machine's clock: long enough that none fires on a loaded machine
        # (a hold that expired under load made a replay differ from its history)
        extra = {"hma_lookup_timeout_s": 60.0, "hma_tail_admission": s.admission}
        if s.fail_loads or s.fail_sync_loads:  # the product's TEST ONLY fault sites (worker.faults)
            extra.update(hma_test_fail_loads=s.fail_loads, hma_test_fail_sync_loads=s.fail_sync_loads)
        keys = dict(chunk_size=CHUNK, local_cpu=s.local_cpu, max_local_cpu_size=s.cpu_mb / 1024, extra_config=extra)
        if s.disk_mb:
            (self.dir / "disk").mkdir(exist_ok=True)
            keys.update(local_disk=f"file://{self.dir}/disk/", max_local_disk_size=s.disk_mb / 1024)
        if self.redis_url:
            keys.update(remote_url=self.redis_url, remote_serde="naive")
            extra["hma_remote_timeout_s"] = 30.0
        path = write_yaml(self.dir / "lmcache.yaml", **keys)
        self.keep, self.defer = derive_flags(s.order)
        engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        model = f"sim-{self.seed}"  # keys are a function of the seed (Redis is emptied per schedule)
        ns = Namespace(model=model, kv_dtype=torch.bfloat16, layout=self.lay, kv_layout="LBHNC/sim",
                       world_size=1, rank=0)
        self.ns = ns
        self.hasher = ChunkHasher(ns)
        self.worker = WorkerHalf(load_config({"lmcache_config_file": str(path)}), self.lay, ns, engine_id,
                                 s.num_blocks, serves_lookups=True, defer_gathers=self.defer)
        self.caches = kv_caches(self.lay, num_blocks=s.num_blocks)
        for t in self.caches.values():
            t.zero_()
        self.worker.register_kv_caches(self.caches)
        self.gather_thread, self.fetcher, self.writer = make_steppable(self.worker)
        self.writer.on_land = self.check_landing
        self.sched = SchedulerHalf(load_config({"lmcache_config_file": str(path)}), self.lay, ns, engine_id)
        self.sched.keep_blocks_for_turn_ends = self.keep
        self.answers = LateAnswers(self.sched.client)

    def close(self) -> None:
        try:
            self.sched.shutdown()
        finally:
            self.worker.shutdown()
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)

    # -- events ---------------------------------------------------------------------------------
    def arrive(self) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        draw = self.traces.draw()
        self.n_req += 1
        rid = f"r{self.n_req}"
        req = Request(rid, list(draw.prompt), SamplingParams(max_tokens=len(draw.answer)), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        sr = SimRequest(req, draw, self.step_no, Expected(self.layers))
        self.requests[rid] = sr
        self.waiting.append(sr)
        self.result.requests += 1
        self.path(f"trace:{draw.family}:{draw.kind}")
        if draw.kind != "new" and self.io.random() < 0.5:
            # what a next turn, a regenerate or a shared document would find in vLLM's own cache
            # is gone half the time: the connector's hits (turn ends above all) are what it meets
            self.vllm_cache_forgets()
        self.note(f"arrive {rid} {draw.family}/{draw.kind} prompt={len(draw.prompt)} answer={len(draw.answer)}")

    def abort(self) -> None:
        live = self.running + [r for r in self.waiting if r.req.num_computed_tokens]
        if not live:
            return
        sr = self.rng.choice(live)
        self.note(f"abort {sr.req.request_id} at {sr.req.num_computed_tokens}")
        self.path("abort")
        from vllm.v1.request import RequestStatus

        sr.req.status = RequestStatus.FINISHED_ABORTED
        if sr in self.waiting:
            self.waiting.remove(sr)
        self._finish(sr)

    def reset(self, weights: bool, running: bool) -> None:
        """vLLM's ``Scheduler.reset_prefix_cache(reset_running_requests, reset_connector=True)``;
        a weight update is one with every running request preempted first."""
        if self.remote:
            self.note("reset postponed: requests wait for remote KV (vLLM refuses that)")
            return
        weights = self._weights_allowed(weights)
        running = running or weights
        if weights:
            self.version += 1
            self.note(f"weights updated: version {self.version}")
        if running:
            for sr in list(reversed(self.running)):
                self._preempt(sr, "reset")
        self.path(f"reset:{'weights' if weights else 'plain'}:{'running' if running else 'idle'}")
        ok_kvm, ok = self.reset_prefix_cache(running, reset_connector=True)
        self.resets += 1
        self.instance_resets += 1
        self.note(f"reset weights={weights} running={running}: kvm={ok_kvm} connector={ok}")
        if not ok:
            raise Violation(self.seed, self.step_no, "the connector's reset failed", self.history)

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool = True):
        """vLLM's ``Scheduler.reset_prefix_cache`` from the manager's reset on: named and called as
        vLLM's is, since the connector's wrap of the manager's reset reads its caller
        (``scheduler/kept_blocks.py``: blocks kept for turn ends go back only where the connector
        is reset too). Returns (vLLM's reset, the connector's)."""
        ok_kvm = self.kvm.reset_prefix_cache()
        if reset_running_requests and not ok_kvm:
            raise Violation(self.seed, self.step_no, "vLLM's reset failed with every running request preempted "
                            "(blocks still in use: kept blocks not given back?)", self.history)
        if not reset_connector:
            return ok_kvm, True
        if self.gather_thread.pending:  # the worker's reset waits for them: the thread runs them
            self.gather_thread.run_pending()
        return ok_kvm, self.sched.reset()

    def _weights_allowed(self, weights: bool) -> bool:
        """A weight update is drawn as a plain reset where it would move this instance to a
        weights generation an earlier instance on the same tiers used with other weights (its
        resets are counted from its start: docs/design.md, a fleet that resets apart names the
        weights itself, with ``cache_salt``, which the simulator does not draw)."""
        if weights and self.instance_resets + 1 <= self.generations_used:
            self.note("a weight update would reuse a generation an earlier instance used: a plain reset")
            return False
        return weights

    def _reset_in_flight(self, weights: bool) -> None:
        """The connector's reset reaches the scheduler and, through the lookup server, rank 0,
        after the step's metadata was built and before the workers run it. The step computes with
        the weights it was built for (the update is applied after it), so its KV is the older
        weights' and nothing of it may be stored after the reset."""
        weights = self._weights_allowed(weights)
        self.path(f"reset:in-flight:{'weights' if weights else 'plain'}")
        if self.gather_thread.pending:
            self.gather_thread.run_pending()
        ok = self.sched.reset()
        self.resets += 1
        self.instance_resets += 1
        self.note(f"reset in flight weights={weights}: connector={ok}")
        if not ok:
            self.violate("the connector's reset failed")
        self.pending_version = weights

    def corrupt_disk_file(self) -> None:
        """A disk fault: bytes in the middle of one stored file flipped, or the file cut short."""
        files = sorted(p for p in (self.dir / "disk").rglob("*") if p.is_file())
        if not files:
            return
        f = self.rng.choice(files)
        data = bytearray(f.read_bytes())
        if not data:
            return
        if self.rng.random() < 0.5:
            at = self.rng.randrange(len(data))
            data[at] ^= 0x5A
            how = f"byte {at} flipped"
        else:
            data = data[:self.rng.randrange(len(data))]
            how = f"cut to {len(data)} bytes"
        f.write_bytes(bytes(data))
        self.path("fault:disk-corrupt")
        self.note(f"disk file {f.name[:24]} {how}")

    def corrupt_redis_value(self) -> None:
        """A hostile or broken writer on the shared Redis: one stored value (data or metadata key)
        overwritten with other bytes, cut short, or replaced by another key's value."""
        client = self.redis.client()
        keys = sorted(client.keys("*"))
        if not keys:
            return
        key = self.rng.choice(keys)
        value = client.get(key)
        if value is None:
            return
        how = self.rng.choice(["flip", "cut", "swap"])
        if how == "flip" and value:
            at = self.rng.randrange(len(value))
            value = value[:at] + bytes([value[at] ^ 0x5A]) + value[at + 1:]
        elif how == "cut":
            value = value[:self.rng.randrange(len(value) + 1)]
        else:
            other = client.get(self.rng.choice(keys))
            value = other if other is not None else b""
        ttl = client.pttl(key)
        client.set(key, value, px=ttl if ttl and ttl > 0 else None)
        self.path(f"fault:redis-{how}")
        self.note(f"redis value {key[:40]!r} {how}")

    # -- vLLM's scheduler ----------------------------------------------------------------------
    def _preempt(self, sr: SimRequest, why: str) -> None:
        self.kvm.free(sr.req)
        sr.req.num_computed_tokens = 0
        sr.versions.clear()
        from vllm.v1.request import RequestStatus

        sr.req.status = RequestStatus.PREEMPTED
        sr.req.num_preemptions += 1
        if sr in self.running:
            self.running.remove(sr)
        sr.status = "waiting"
        self.waiting.insert(0, sr)
        self.preempted_ids.add(sr.req.request_id)
        self.path(f"preempt:{why}")
        self.note(f"preempt {sr.req.request_id} ({why})")

    def _finish(self, sr: SimRequest) -> None:
        rid = sr.req.request_id
        if sr in self.running:
            self.running.remove(sr)
        block_ids = self.kvm.get_block_ids(rid) if sr.req.num_computed_tokens else None
        kept, _ = self.sched.request_finished(sr.req, block_ids)  # request_finished_all_groups
        self.finished_ids.add(rid)
        self.n_finished += 1
        sr.finished_no = self.n_finished
        self.just_finished = True
        self.traces.finished(sr.draw, list(sr.req.output_token_ids))
        if kept:
            sr.status = "kept"
            self.kept[rid] = sr
            self.path("finish:kept")
        else:
            sr.status = "done"
            self.kvm.free(sr.req)
            self.path("finish:freed")
        self.note(f"finish {rid} computed={sr.req.num_computed_tokens} kept={kept}")

    def schedule(self):
        budget = self.setup.token_budget
        scheduled: dict[str, int] = {}
        new_tables, new_ids = [], []
        fresh: set[int] = set()  # blocks allocated in this step (vLLM zeroes or copies into them)
        for rid in sorted(self.loaded | self.failed):
            sr = self.remote.pop(rid, None)
            if sr is None:
                continue
            if rid in self.failed:
                self.path("load:failed")
                self.kvm.free(sr.req)
                sr.req.num_computed_tokens = 0
                sr.status = "waiting"
                self.waiting.insert(0, sr)
                self.note(f"{rid}: load failed, recomputes")
            else:
                self.kvm.cache_blocks(sr.req, sr.req.num_computed_tokens)
                if sr.req.num_computed_tokens == sr.req.num_tokens:
                    sr.req.num_computed_tokens -= 1
                sr.status = "running"
                self.running.append(sr)
                for p in range(sr.req.num_computed_tokens):
                    sr.versions[p] = self.version
                self.note(f"{rid}: load done, computed={sr.req.num_computed_tokens}")
        self.loaded.clear()
        self.failed.clear()
        for sr in list(self.running):
            if sr not in self.running:
                continue
            n = min(sr.req.num_tokens - sr.req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while True:
                blocks = self.kvm.allocate_slots(sr.req, n)
                if blocks is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim, "no blocks")
                if victim is sr:
                    break
            if sr not in self.running:
                continue
            scheduled[sr.req.request_id] = n
            new_ids.append([list(ids) for ids in blocks.get_block_ids()])
            fresh.update(b for ids in blocks.get_block_ids() for b in ids)
            budget -= n
        for sr in list(self.waiting):
            if budget <= 0 or len(self.running) + len(self.remote) >= self.setup.max_running:
                break
            req = sr.req
            computed_blocks, local, *_ = self.kvm.get_computed_blocks(req)
            floor = self._hit_floor(sr)
            known = self.sched.requests.get(req.request_id)  # a failed load recomputes: no hit by design
            first = not (req.num_computed_tokens or req.num_output_tokens or req.num_preemptions
                         or (known is not None and known.load_failed))
            ceiling = self._hit_ceiling(sr, local)
            own = self._own_queued(req)
            self.writer.own_hashes = set(self.hasher.chunk_hashes(req.all_token_ids, req.num_tokens // CHUNK))
            waits = len(self.writer.waits)
            if self.late_fetches and self.io.random() < self.late_fetches:
                self.fetcher.late_next = True
                self.fetcher.read_first = self.io.random() < 0.5
            if self.late_answers and self.io.random() < self.late_answers:
                self.answers.late_next = True
            fired, fetches_late = self.answers.fired, self.fetcher.fired
            unread = self._reads_short()
            ext, load_async = self.sched.get_num_new_matched_tokens(req, local)
            if self._reads_short() != unread:  # no memory to read into, or damage: a miss by design
                first, floor = False, None
                self.path("lookup:not-read")
            self.answers.late_next = False  # (when nothing was asked)
            if self.answers.fired != fired:
                first = False
                self.answers.passed()
                self.path("lookup:answer-late")
                self.note(f"{req.request_id}: the lookup's answer came after its deadline: a miss")
                floor = None  # a miss by design
            self.fetcher.late_next = False  # (when no fetch was made)
            fetch_late = self.fetcher.fired != fetches_late
            if fetch_late:
                first = False
                self.fetcher.late[-1].resets = self.resets
                self.fetcher.late[-1].version = self.version
                self.path(f"fetch:late{':read-first' if self.fetcher.late[-1].__class__.__name__ == 'ReadFirstFuture' else ''}")
            self._check_waits(req.request_id, own, self.writer.waits[waits:])
            if ext and ceiling is not None:
                ceiling = max(ceiling, self._hit_ceiling(sr, local))
                hold = self.worker.held._by_request.get(req.request_id) if self.worker.held else None
                if hold is not None:  # a hold answers for objects the tiers may have evicted since
                    ceiling = max(ceiling, hold.turn_end, (hold.first + len(hold.hashes)) * CHUNK)
                if local + ext > max(ceiling, local):
                    self.violate(f"hit ceiling: {req.request_id} hit {local}+{ext} tokens; the tiers hold no more "
                                 f"than {ceiling} of it for these weights")
                self.path("lookup:ceiling-checked")
            if floor:  # what the lookup made land may have evicted part of it: promised is what both see
                # (a marker read that came late is a miss of the turn end: its chunks still hit)
                after = self._hit_floor(sr, turn_ends=not fetch_late)
                floor = None if after is None else min(floor, after)
            if ext is None:
                self.path("lookup:wait")
                self.note(f"{req.request_id}: lookup says wait")
                sr.waits += 1
                if sr.waits > 6:  # the design: a wait costs one or two steps
                    self.violate(f"liveness: {req.request_id} was told to wait {sr.waits} lookups in a row")
                continue
            sr.waits = 0
            self.path(f"lookup:{'hit-sync' if ext and not load_async else 'hit-async' if ext else 'miss'}")
            state = self.sched.requests.get(req.request_id)
            if ext and state is not None and state.turn is not None:
                self.path(f"lookup:turn-end{':on-tail' if state.turn.on_tail else ''}")
            elif sr.draw.kind == "next" and not req.num_computed_tokens:
                self.path(f"next-turn:{'chunks' if ext else 'local-only' if local else 'miss'}")
            if floor:
                self.path("lookup:floor-checked")
            if floor and local + ext < floor[0] and not req.num_output_tokens:
                self.violate(f"hit floor: {req.request_id} hit {local}+{ext} tokens; the tiers hold {floor[1]} "
                             f"up to {floor[0]}")
            if first and sr.draw.kind != "new":  # checked at the step's end: turn ends on their way
                self.answered.append((sr, local + ext, self.n_finished,
                                      *self._chunks_held(req, req.num_prompt_tokens - 1)))
            num_new = 0 if (load_async and ext) else min(req.num_tokens - local - ext, budget)
            blocks = self.kvm.allocate_slots(req, num_new, num_new_computed_tokens=local,
                                             new_computed_blocks=computed_blocks,
                                             num_external_computed_tokens=ext, delay_cache_blocks=load_async)
            if blocks is None:
                self.note(f"{req.request_id}: no blocks to admit it")
                self.path("admit:no-blocks")
                break
            self.sched.update_state_after_alloc(req, self.kvm.get_blocks(req.request_id), ext)
            fresh.update(b for ids in blocks.get_block_ids() for b in ids)
            self.waiting.remove(sr)
            sr.admitted = self.step_no
            req.num_computed_tokens = local + ext
            self.note(f"admit {req.request_id} local={local} ext={ext} async={load_async} new={num_new}")
            if load_async and ext:
                sr.status = "remote"
                self.remote[req.request_id] = sr
                continue
            from vllm.v1.request import RequestStatus

            req.status = RequestStatus.RUNNING
            sr.status = "running"
            self.running.append(sr)
            for p in range(local + ext):
                sr.versions[p] = self.version
            new_tables.append([list(ids) for ids in self.kvm.get_block_ids(req.request_id)])
            if num_new:
                scheduled[req.request_id] = num_new
                budget -= num_new
        out = SimpleNamespace(
            num_scheduled_tokens=scheduled,
            scheduled_new_reqs=[SimpleNamespace(block_ids=t) for t in new_tables],
            scheduled_cached_reqs=SimpleNamespace(new_block_ids=new_ids),
            finished_req_ids=set(self.finished_ids), preempted_req_ids=set(self.preempted_ids),
            kv_connector_block_state=None)
        self.fresh = fresh - {NULL_BLOCK_ID}
        self.finished_ids.clear()
        self.preempted_ids.clear()
        return out

    # -- one engine step ------------------------------------------------------------------------
    def step(self) -> None:
        out = self.schedule()
        meta = self.sched.build_connector_meta(out)
        before = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid].req
            before[rid] = req.num_computed_tokens
            req.num_computed_tokens += n
        if meta.saves or meta.loads:
            self.note(f"meta saves={[(s.req_id, [(r.kind.name, r.chunk, r.end) for r in s.objects], s.finished) for s in meta.saves]} "
                      f"loads={[(l.req_id, l.start, l.end, l.sync) for l in meta.loads]} reset={meta.reset} epoch={meta.epoch}")
        self._remember_turn_ends(meta)
        for spec in meta.saves:
            for ref in spec.objects:
                if ref.kind is ObjectKind.TURNMARK:  # a marker rewritten with the other on_tail
                    if self._mark_on_tail.get(ref.chunk_hash, ref.on_tail) != ref.on_tail:
                        self.path("marker:on-tail-flips")
                    self._mark_on_tail[ref.chunk_hash] = ref.on_tail
                if ref.kind in (ObjectKind.FULL, ObjectKind.TAIL, ObjectKind.TURN):
                    self.saved[(ref.kind, ref.chunk_hash)] = spec.req_id
                    self._refs[(ref.kind, ref.chunk_hash)] = ref
        inflight = getattr(self, "inflight_reset", None)
        if inflight is not None and self.remote:  # vLLM refuses a reset while loads are under way
            inflight = None
        if inflight is not None:
            self._reset_in_flight(inflight)
        w = self.worker
        if not self.defer and self.keep and out.num_scheduled_tokens:
            # V2 runner: vLLM writes new blocks (zeroing, copies) before the connector's barrier
            self._poison(self.fresh)
        w.before_step(meta)
        w.start_load_kv(meta)
        self._forward(before, out.num_scheduled_tokens)
        w.wait_for_save(meta)
        if getattr(self, "pending_version", False):
            self.version += 1
            self.note(f"weights updated after the step in flight: version {self.version}")
        self.pending_version = False
        if self.gather_thread.pending and self.rng.random() < 0.5:
            self.gather_thread.run_pending()  # the gather thread got the CPU during the step
            self.path("gather:beside-step")
        elif self.gather_thread.pending:
            self.path("gather:at-barrier")
        self._writer_runs()
        quiesce(w)
        # objects freed by the garbage collector (LMCache's memory objects among them) are freed
        # here, not wherever a collection happens to start: a replay frees them at the same point
        gc.collect()
        sending = w.take_finished_sending()
        done, failed = w.take_transfer_results()
        self.loaded |= done
        self.failed |= failed
        if failed:
            self.sched.on_failed_loads(failed)
        if inflight is not None:  # vLLM drops the in-flight step's output (drop_stale_output)
            for sr in list(reversed(self.running)):
                self._preempt(sr, "reset in flight")
            # the manager's part of vLLM's ``Scheduler.reset_prefix_cache`` whose connector part ran
            # in flight: called from a frame named as vLLM's, with its ``reset_connector`` (the
            # connector's wrap of the manager's reset reads it: scheduler/kept_blocks.py)
            def reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                return self.kvm.reset_prefix_cache()
            if not reset_prefix_cache():
                self.violate("vLLM's prefix cache could not be reset after the step in flight")
        else:
            self._sample(out.num_scheduled_tokens)
        if sending:
            self.sched.on_finished_sending(sending)
            for rid in sorted(sending):
                sr = self.kept.pop(rid, None)
                if sr is not None:
                    self.kvm.free(sr.req)
                    sr.status = "done"
            self.note(f"finished_sending {sorted(sending)}")
        self.check_kv()
        self.check_stored()
        self.check_tiers()
        self.check_device_index()
        self.check_turn_ends_landed()
        self.check_liveness(bool(out.num_scheduled_tokens) or bool(sending) or bool(done or failed)
                            or not (self.waiting or self.running or self.remote or self.kept))

    def _writer_runs(self) -> None:
        """What the store writer's thread and a slow lookup fetch got done by the step's end,
        drawn: the whole queue, one batch or nothing (a backlog the next lookups meet); a late
        fetch ends now or later (after a reset that may come meanwhile)."""
        if self.writer.queued():
            x = self.io.random()
            if x >= self.backlog:
                self.writer.land_all()
            elif x >= self.backlog / 2:
                self.writer.land_batch()
                self.path("writer:one-batch")
            else:
                self.path("writer:lags")
            if self.writer.queued():
                self.note(f"writer backlog: {len(self.writer.queued())} objects")
        if self.fetcher.late and self.io.random() < 0.25:
            if any(f.resets != self.resets for f in self.fetcher.late):
                self.path("fetch:late-after-reset")
            if any(f.resets != self.resets and getattr(f, "_kept", None) for f in self.fetcher.late):
                self.path("fetch:read-kept-after-reset")  # a disk or Redis read put back after a reset
            if any(f.version != self.version and getattr(f, "_kept", None) for f in self.fetcher.late):
                self.path("fetch:read-kept-after-weights")  # ... after a weight update
            n = self.fetcher.run_late()
            self.path("fetch:late-landed")
            self.note(f"{n} late lookup fetches end")

    def _sample(self, scheduled) -> None:
        for rid in scheduled:
            sr = self.requests[rid]
            req = sr.req
            if sr.status != "running" or req.num_computed_tokens < req.num_tokens:
                continue
            req.append_output_token_ids(sr.draw.answer[req.num_output_tokens])
            if req.num_output_tokens >= len(sr.draw.answer):
                from vllm.v1.request import RequestStatus

                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._finish(sr)

    # -- the model runner's forward: the oracle's KV -------------------------------------------
    def _forward(self, before: dict, scheduled: dict) -> None:
        for rid, n in scheduled.items():
            sr = self.requests[rid]
            start = before[rid]
            tokens = sr.req.all_token_ids
            sr.expected.ensure(tokens, self.version, start + n)
            table = self.kvm.get_block_ids(rid)
            for g in self.lay.groups:
                ids = table[g.index]
                for layer_name in g.layer_names:
                    layer = self.lay.layer_names.index(layer_name)
                    exp = sr.expected.tensor(layer, start + n)
                    cache = self.caches[layer_name]
                    for p in range(start, start + n):
                        block = ids[p // BLOCK]
                        cache[block, 0, p % BLOCK, :] = exp[p]
            for p in range(start, start + n):
                sr.versions[p] = self.version

    def _poison(self, blocks) -> None:
        for name in self.lay.layer_names:
            for b in blocks:
                self.caches[name][b].fill_(99)

    # -- invariants ----------------------------------------------------------------------------
    def violate(self, what: str) -> None:
        raise Violation(self.seed, self.step_no, what, self.history)

    def check_landing(self, items) -> None:
        """(a) at the store: each object the store writer is about to put under the current
        generation's names (gathered after the last reset: ``clears``) holds the oracle's KV of
        the current weights at every position a hit of it reads (a full object's chunk; a tail's
        window before its boundary; a turn object's chunk up to its end and the window before its
        end), whether or not any request ever hits it. Runs wherever the writer lands (a
        lookup's wait too): what it finds is raised at the step's end (``check_stored``)."""
        now = self.worker.store.clears
        for item in items:
            ref = item.ref
            if item.clears != now or ref is None or ref.kind not in (ObjectKind.FULL, ObjectKind.TAIL, ObjectKind.TURN):
                continue
            rid = self.saved.get((ref.kind, ref.chunk_hash))
            if rid is None:
                self.path("landing:unknown")
                continue
            bad = self._object_mismatch(self.requests[rid], ref, payload_of(flat(item.obj)))
            self.path("landing:checked")
            if bad:
                self.bad_landings.append(f"{ref.kind.name} object of chunk {ref.chunk}{f' (end {ref.end})' if ref.end else ''} "
                                         f"of {rid}, stored under the current names: {bad}")

    def _object_mismatch(self, sr: SimRequest, ref, payload) -> str:
        """Where ``payload`` (object ``ref``'s, gathered from ``sr``'s blocks) differs from the
        oracle of the current weights, or ""."""
        kind, chunk = ref.kind, ref.chunk
        boundary = ref.end if kind is ObjectKind.TURN else (chunk + 1) * CHUNK
        expected = sr.landing if sr.landing is not None else Expected(self.layers)
        sr.landing = expected
        expected.ensure(sr.req.all_token_ids, self.version, boundary)
        page = next(iter(self.caches.values()))[0]
        row = 0
        covered = {g.index: set() for g in self.lay.groups}
        for seg in self.lay.segments(kind, chunk, ref.end, ref.on_tail):
            g = self.lay.groups[seg.group]
            lo = chunk * CHUNK if g.kind is GroupKind.FULL else g.first_token_needed(boundary)
            if kind is ObjectKind.TURN and ref.on_tail and g.kind is not GroupKind.FULL:
                lo = max(lo, chunk * CHUNK)
            for name in g.layer_names:
                layer = self.lay.layer_names.index(name)
                exp = expected.tensor(layer, boundary)
                for j in range(seg.first_block, seg.first_block + seg.num_blocks):
                    got = payload[row * page.numel():(row + 1) * page.numel()].view(page.shape)
                    row += 1
                    for p in range(max(lo, j * BLOCK), min(boundary, (j + 1) * BLOCK)):
                        covered[g.index].add(p)
                        if not torch.equal(got[0, p % BLOCK], exp[p]):
                            stale = any(_rows_equal(got[0, p % BLOCK], sr, v, layer, p) for v in range(self.version))
                            return (f"group {g.index} layer {name} position {p}"
                                    f"{' holds an older weights version' if stale else ''}")
        # what a hit of it must find there, by the model's own window (not the layout's segments)
        for g in self.lay.groups:
            if g.kind is GroupKind.FULL and kind is not ObjectKind.TAIL:
                needed = range(chunk * CHUNK, boundary)
            elif g.kind is GroupKind.SLIDING and kind is not ObjectKind.FULL:
                first = max(0, boundary - WINDOW + 1)
                needed = range(max(first, chunk * CHUNK) if kind is ObjectKind.TURN and ref.on_tail else first, boundary)
            else:
                continue
            missing = [p for p in needed if p not in covered[g.index]]
            if missing:
                return f"group {g.index} positions {missing[0]}..{missing[-1]} are not in it (a hit there needs them)"
        return ""

    def check_stored(self) -> None:
        """(a) at the store, after every step: what the writer put (``check_landing``), and every
        object in CPU memory under the current generation's names (reads put back there, objects
        kept across a reset) holds the oracle's KV of the current weights."""
        if self.bad_landings:
            self.violate(f"KV mismatch at the store: {self.bad_landings[0]}")
        from lmcache_hma.store import lmcache_compat

        store = self.worker.store
        if self._names_of[0] != (store.clears, id(store.keys)):
            self._names_of = ((store.clears, id(store.keys)), {}, 0)
        _, names, known = self._names_of
        saved = list(self.saved.items())
        for (kind, digest), rid in saved[known:]:
            names[store.key(kind, digest)] = (kind, digest)
        self._names_of = (self._names_of[0], names, len(saved))
        for tier in store.tiers:
            backend = getattr(tier, "backend", None)
            if not tier.local or not hasattr(backend, "hot_cache"):
                continue
            with lmcache_compat.backend_lock(backend):
                held = [(key, obj) for key, obj in lmcache_compat.backend_index(backend).items() if key in names]
            for key, obj in held:
                if self._checked.get(key) is obj:
                    continue
                self._checked[key] = obj
                kind, digest = names[key]
                ref = self._refs.get((kind, digest))
                if ref is None:
                    continue
                bad = self._object_mismatch(self.requests[self.saved[(kind, digest)]], ref, payload_of(flat(obj)))
                self.path("stored:checked")
                if bad:
                    self.violate(f"KV mismatch in CPU memory: {kind.name} object of chunk {ref.chunk} held under the "
                                 f"current names: {bad}")

    def check_tiers(self) -> None:
        """(d) each local tier's value policy knows exactly the objects the tier holds (the bytes
        the disk tier counts are the bytes of its files' entries), and every child it records of
        an object is an object of the tier hanging off that parent (a stale child keeps its parent
        from ever being a leaf: pinned)."""
        from lmcache_hma.store import lmcache_compat
        from lmcache_hma.store.value_policy import ValuePolicy

        for tier in self.worker.store.tiers:
            room = getattr(tier, "_room", None)  # a Redis tier's: what this instance knows is there
            if room is not None:
                with room._lock:
                    self._check_kids(tier.label, room.policy, set(room.policy._uses))
                self.path("check:redis-room")
            policy = getattr(getattr(tier, "backend", None), "cache_policy", None)
            if not tier.local or not isinstance(policy, ValuePolicy):
                continue
            index = lmcache_compat.backend_index(tier.backend)
            with lmcache_compat.backend_lock(tier.backend):
                held = set(index)
                counted = getattr(tier.backend, "current_cache_size", None)
                sizes = sum(e.size for e in index.values()) if counted is not None else None
            known = set(policy._uses)
            if held != known:
                self.violate(f"tier {tier.label}: the policy knows {len(known - held)} objects the tier does not "
                             f"hold and not {len(held - known)} it holds")
            if counted is not None and counted != sizes:
                self.violate(f"tier {tier.label}: counts {counted} bytes, holds {sizes}")
            self._check_kids(tier.label, policy, known)
            self.path("check:tiers")

    def _check_kids(self, label: str, policy, known: set) -> None:
        """(d) every child ``policy`` records of an object is one it knows (``known``), hung off
        that parent (a stale child keeps its parent from ever being a leaf: pinned)."""
        for parent, kids in policy._kids.items():
            for kid in kids:
                line = policy._lines.get(kid)
                if kid not in known or line is None or line.parent != parent:
                    self.violate(f"tier {label}: a recorded child of {parent.chunk_hash.hex()[:12]} is "
                                 f"{'not in the tier' if kid not in known else 'hung off another parent'} "
                                 f"(its parent can never be a leaf: pinned)")

    def check_drained(self) -> None:
        """(e) after the run drained: every kept block given back, no hold left, and (d) no object
        pinned: each local tier's value eviction alone (leaves only, no fallback) empties it."""
        if self.kept or self.sched.turn_saves_pending:
            self.violate(f"drained: blocks still kept for {sorted(self.kept) or self.sched.turn_saves_pending}")
        held = self.worker.held
        if held is not None and (held.held_bytes or held._by_request):
            self.violate(f"drained: holds left {sorted(held._by_request)} ({held.held_bytes} bytes)")
        from collections import OrderedDict

        from lmcache_hma.store import lmcache_compat
        from lmcache_hma.store.value_policy import ValuePolicy

        for tier in self.worker.store.tiers:
            policy = getattr(getattr(tier, "backend", None), "cache_policy", None)
            if not tier.local or not isinstance(policy, ValuePolicy):
                continue
            with lmcache_compat.backend_lock(tier.backend):
                index = OrderedDict(lmcache_compat.backend_index(tier.backend))
            # past the grace (counted in puts): what a request was still storing is not any more
            policy._puts += policy.GRACE + 1
            fallback, policy.fallback = policy.fallback, False
            try:
                while index:
                    (key,) = policy.get_evict_candidates(index, 1) or (None,)
                    if key is None:
                        break
                    index.pop(key, None)
            finally:
                policy.fallback = fallback
            if index:
                self.violate(f"drained: tier {tier.label}'s eviction cannot drop {len(index)} objects by value "
                             "(pinned: a child recorded that no longer needs them)")
            self.path("check:drained")

    def check_kv(self) -> None:
        """(a) every block a running request's next token reads, and every block kept for a turn
        end, holds the oracle's KV for the weights it was computed under (the current ones for
        running requests: a weight update preempts them)."""
        for sr in list(self.running) + list(self.kept.values()):
            computed = sr.req.num_computed_tokens
            if not computed:
                continue
            rid = sr.req.request_id
            version = self.version if sr.status == "running" else max(sr.versions.values(), default=self.version)
            sr.expected.ensure(sr.req.all_token_ids, version, computed)
            table = self.kvm.get_block_ids(rid)
            for g in self.lay.groups:
                lo = 0 if g.kind is GroupKind.FULL else max(0, computed - WINDOW + 1)
                if sr.status == "kept" and g.kind is not GroupKind.FULL:
                    lo = max(0, computed - WINDOW)
                ids = table[g.index]
                positions = [p for p in range(lo, computed) if ids[p // BLOCK] != NULL_BLOCK_ID]
                if not positions:
                    continue
                blocks = torch.tensor([ids[p // BLOCK] for p in positions])
                slots = torch.tensor([p % BLOCK for p in positions])
                for layer_name in g.layer_names:
                    layer = self.lay.layer_names.index(layer_name)
                    got = self.caches[layer_name][blocks, 0, slots, :]
                    exp = sr.expected.tensor(layer, computed)[torch.tensor(positions)]
                    bad = (got != exp).any(dim=1)
                    if bool(bad.any()):
                        i = int(bad.nonzero()[0])
                        p = positions[i]
                        stale = next((f" (it is weights version {v}'s KV: stale)" for v in range(self.version)
                                      if _rows_equal(got[i], sr, v, layer, p)), "")
                        self.violate(f"KV mismatch: {rid} ({sr.status}) group {g.index} layer {layer_name} "
                                     f"position {p} of {computed} computed, block {ids[p // BLOCK]}; "
                                     f"{int(bad.sum())} positions wrong{stale}")

    def check_device_index(self) -> None:
        """(h) an index fed vLLM's device events of the full-attention groups (a set of hashes
        per group) holds exactly the blocks vLLM's own lookup serves some prompt through: on
        every prompt seen, ``find_longest_cache_hit`` of vLLM's coordinator (the window of the
        sliding groups cached before the hit's end), not merely the blocks its cache holds."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for e in self.kvm.take_events():
            if isinstance(e, AllBlocksCleared):
                self.device_index.clear()
            elif isinstance(e, (BlockStored, BlockRemoved)) and e.group_idx in self.device_groups:
                keys = {(e.group_idx, h) for h in e.block_hashes}
                if isinstance(e, BlockStored):
                    if e.parent_block_hash is not None and (e.group_idx, e.parent_block_hash) not in self.device_index:
                        self.violate("a device store whose parent the index does not hold (an index refuses it)")
                    self.device_index |= keys
                else:
                    self.device_index -= keys
        held = set()
        for sr in self.requests.values():
            hashes = sr.req.block_hashes
            hit = self.kvm.coordinator.find_longest_cache_hit(hashes, len(hashes) * BLOCK)[1]
            held.update((g, maybe_convert_block_hash(h)) for h in hashes[:hit // BLOCK] for g in self.device_groups)
        if held != self.device_index:
            self.violate(f"the device index (vLLM's events) holds {len(self.device_index - held)} hashes vLLM's "
                         f"lookup serves no prompt through and lacks {len(held - self.device_index)} it serves")
        gate = self.device_dedup.gate
        if gate is not None and gate.counters["withdrawn"] > self.device_withdrawn:
            self.device_withdrawn = gate.counters["withdrawn"]
            self.path("device-blocks-withdrawn")  # cached, but past where vLLM's hit can reach
        copies = sum(self.device_dedup.left_out.values())
        if copies > self.device_copies:  # vLLM cached or evicted a copy of a held hash this step
            self.device_copies = copies
            self.path("device-copies-left-out")
        self.path("check:device-index")

    def check_liveness(self, progressed: bool) -> None:
        """(g) a request once admitted finishes within a bound of steps (restarted by a
        preemption), and the engine never stalls while it has work."""
        if progressed:
            self.last_progress = self.step_no
        elif self.step_no - self.last_progress > 20:
            self.violate(f"liveness: no token computed and no request finished for 20 steps "
                         f"(waiting {len(self.waiting)}, remote {len(self.remote)}, kept {len(self.kept)})")
        for sr in self.running + list(self.remote.values()):
            need = sr.req.num_tokens + len(sr.draw.answer)
            bound = 50 + 2 * (need * self.setup.max_running // max(1, self.setup.token_budget) + len(sr.draw.answer))
            if self.step_no - sr.admitted > bound:
                self.violate(f"liveness: {sr.req.request_id} ({sr.status}) not finished {self.step_no - sr.admitted} "
                             f"steps after it was admitted")

    def _remember_turn_ends(self, meta) -> None:
        for spec in meta.saves:
            if not spec.finished or not spec.objects:
                continue
            sr = self.requests.get(spec.req_id)
            turn = spec.objects[0]
            if sr is None or turn.kind is not ObjectKind.TURN:
                continue
            tokens = sr.req.all_token_ids
            sr.expected.ensure(tokens, self.version, turn.end)
            self.turn_ends[sr.expected.digests[turn.end - 1]] = (turn.end, turn, spec.objects[-1], self.version,
                                                                  spec.req_id)

    def _hit_floor(self, sr: SimRequest, turn_ends: bool = True):
        """(f) the hit the tiers promise this request: (tokens, what) or None. A repeat of a
        prompt: the longest run of full objects ending at a stored tail (the hit rule), up to
        the prompt's limit; a next turn: a turn end stored (its object, its marker naming it, the
        chunks before it and, on_tail, the tail there) by a turn of this weights version."""
        req = sr.req
        if req.num_computed_tokens or req.num_output_tokens or self.sched.requests.get(req.request_id, None) \
                and self.sched.requests[req.request_id].load_failed:
            return None
        limit = min(req.num_prompt_tokens, req.num_tokens - 1)
        full, tails = self._chunks_held(req, limit)
        best, what = 0, ""
        for c in range(len(full)):
            if not full[c]:
                break
            if tails[c]:
                best, what = (c + 1) * CHUNK, f"chunks 0..{c} and the tail at {c}"
        sr.expected.ensure(req.all_token_ids, self.version, limit)
        if turn_ends:
            turn = self._stored_turn_end(sr, full, tails, best, limit)
            if turn is not None:
                best, what = turn
        return (best, what) if best else None

    def _reads_short(self) -> tuple[int, int]:
        """What makes a lookup answer less than the tiers held, by design: objects on disk it
        found no CPU memory to read into (a miss), and damaged objects it dropped (it looks again
        once, and a hit of its second look is the shorter one, no turn end read at its end)."""
        store = self.worker.store
        return store.counters().get("objects_not_read_no_memory", 0), store.integrity_failures

    def _chunks_held(self, req, limit: int):
        """Per chunk of ``req`` up to ``limit``: whether its full object, and its tail, are
        stored or queued for the writer under the current generation (a lookup lets its own
        queued objects land first)."""
        store = self.worker.store
        hashes = self.hasher.chunk_hashes(req.all_token_ids, limit // CHUNK)
        full = [a or b for a, b in zip(store.present(ObjectKind.FULL, hashes), self._queued_current(ObjectKind.FULL, hashes))]
        tails = [a or b for a, b in zip(store.present(ObjectKind.TAIL, hashes), self._queued_current(ObjectKind.TAIL, hashes))]
        return full, tails

    def _stored_turn_end(self, sr: SimRequest, full, tails, lo: int, limit: int, finished_before: int = 0):
        """The longest turn end in ``(lo, limit]`` of ``sr``'s tokens that a turn of these weights
        left and the tiers hold whole (its object, its marker naming it, the chunks before it
        (``full``) and, on_tail, the tail there (``tails``)): (end, what), or None.
        ``finished_before``: only those of requests among the first that many to finish."""
        store = self.worker.store
        for end in range(limit, lo, -1):
            hit = self.turn_ends.get(sr.expected.digests[end - 1])
            if hit is None or hit[3] != self.version:
                continue
            _, turn, mark, _, rid = hit
            if finished_before and not 0 < self.requests[rid].finished_no <= finished_before:
                continue
            c = turn.chunk
            if not all(full[:c]) or not store.has(ObjectKind.TURN, turn.chunk_hash):
                continue
            if c < len(full) and full[c]:  # the lookup reads the marker where its run of chunks ends
                continue
            if turn.on_tail and not (c and tails[c - 1]):
                continue
            marks = self._marks(mark.chunk_hash)  # offsets in the turn object's chunk
            offset = end - c * CHUNK
            if (-offset if turn.on_tail else offset) not in marks and offset not in marks:
                continue
            return end, f"the turn end at {end}{' on_tail' if turn.on_tail else ''} (of {rid})"
        return None

    def check_turn_ends_landed(self) -> None:
        """(f) for turn ends on their way: a request's first lookup answered in this step (on
        time, its marker read) must have reached every turn end whose request finished before
        the lookup and that the tiers hold whole by the step's end: the design waits for a turn
        end on its way (``TurnEndLanding``) rather than answering the chunk boundary before it."""
        answered, self.answered = self.answered, []
        for sr, hit, finished_before, full, tails in answered:
            req = sr.req
            limit = req.num_prompt_tokens - 1  # a first lookup's: vLLM computes the prompt's last token
            if limit <= hit:
                continue
            # the chunks before it as the lookup saw them (the request's own saves store them since)
            sr.expected.ensure(req.all_token_ids, self.version, limit)
            turn = self._stored_turn_end(sr, full, tails, hit, limit, finished_before)
            self.path("lookup:landed-checked")
            if turn is not None:
                self.violate(f"hit floor: {req.request_id} hit {hit} tokens; {turn[1]}, on its way when the "
                             f"lookup answered, is stored by the step's end (the lookup did not wait for it)")

    def _hit_ceiling(self, sr: SimRequest, local: int):
        """(b) the most a hit of this request may reach past vLLM's own ``local`` tokens: the run
        of chunks from there whose full objects are stored (or queued under this generation) and
        the turn ends of these weights whose objects are; None where the simulator cannot tell
        (a request asked again after computing)."""
        req = sr.req
        if req.num_computed_tokens or req.num_output_tokens:
            return None
        limit = min(req.num_prompt_tokens, req.num_tokens - 1)
        full, _ = self._chunks_held(req, limit)
        n = len(full)
        first = local // CHUNK
        run = next((c for c in range(first, n) if not full[c]), n)
        best = run * CHUNK
        sr.expected.ensure(req.all_token_ids, self.version, limit)
        for end in range(limit, best, -1):
            hit = self.turn_ends.get(sr.expected.digests[end - 1])
            if hit is not None and hit[3] == self.version and hit[1].chunk <= run \
                    and self.worker.store.has(ObjectKind.TURN, hit[1].chunk_hash):
                return end
        return best

    def _own_queued(self, req) -> int:
        """The highest number among the store writer's queued objects this request's lookup may
        wait for (keyed by one of its chunks' digests: chunks, tails, states, markers), 0: none."""
        hashes = set(self.hasher.chunk_hashes(req.all_token_ids, req.num_tokens // CHUNK))
        return max((q.number for q in self.writer.queued() if q.chunk_hash in hashes), default=0)

    def _check_waits(self, rid: str, own: int, waits: list) -> None:
        """(c) a lookup's waits for the store writer are for its own objects (and what was queued
        ahead of them), never for the backlog queued behind them. Its own are those queued when
        it was asked, and those its own gathers queued (``Gathers.gather_for_lookup``)."""
        for wanted, _, own_then in waits:
            if wanted > max(own, own_then):
                self.violate(f"wait: the lookup of {rid} waited for the store writer's object {wanted}; "
                             f"its own queued objects end at {own or 'none'} (a wait on the backlog)")
            if wanted:
                self.path("wait:own-objects")

    def _queued_current(self, kind, hashes) -> list[bool]:
        """Per digest, whether an object of ``kind`` is queued for the writer under the store's
        current generation (a reset since it was gathered drops it), or planned in a deferred
        gather round the gather thread has not started (a lookup gathers those first:
        ``Gathers.gather_for_lookup``; one that finds no room is a miss, which the floor taken
        after the lookup sees)."""
        now = self.worker.store.clears
        queued = {q.chunk_hash for q in self.writer.queued() if q.kind is kind and q.clears == now}
        if self.worker.gathers_under_way():
            queued |= {job.ref.chunk_hash for job in list(self.worker._gathering_jobs)
                       if job.ref.kind is kind and job.clears == now}
        return [h in queued for h in hashes]

    def _marks(self, key: bytes) -> list[int]:
        got = self.worker.store.get_many([(ObjectKind.TURNMARK, key, MARK_BYTES)])
        obj = got[0][0] if got else None
        if obj is None:
            return []
        try:
            return decode_marks(payload_of(flat(obj)), CHUNK)
        finally:
            release(obj)

    # -- the run ---------------------------------------------------------------------------------
    def events(self) -> None:
        r = self.rng
        busy = len(self.waiting) + len(self.running) + len(self.remote)
        if self.restart_pending and self.version:  # weights updated meanwhile: a restart would load
            self.restart_pending = False             # other weights under a generation used (no cache_salt)
            self.note("the restart asked for is called off: the weights were updated meanwhile")
        if self.restart_pending:
            if not (busy or self.kept or self.writer.queued() or self.fetcher.late or self.sched.turn_saves_due):
                self.restart()
        elif self.step_no < self.setup.steps and busy < 8 and r.random() < 0.55:
            self.arrive()
            if r.random() < 0.2:
                self.arrive()
        x = r.random()
        self.inflight_reset = None
        # resets are drawn more often right after a request finished (a turn end on its way):
        # the rare interleavings are where the defects were (FoundationDB's BUGGIFY idea)
        if self.just_finished and r.random() < 0.1:
            x = 0.015 + r.random() * 0.025
        self.just_finished = False
        if self.fetcher.late and not self.remote and self.io.random() < 0.4:  # a reset while a fetch is late
            x = 0.022 + self.io.random() * 0.013
        elif 0.015 <= x < 0.035 and self.io.random() >= self.reset_rate:
            x = 1.0  # this reset does not happen
        if x < 0.015:
            self.abort()
        elif x < 0.022 and not self.remote:
            # a reset arriving while a step is in flight (asynchronous scheduling: the engine
            # core handles it between building a step and the workers running it)
            weights = r.random() < 0.6
            self.inflight_reset = weights
        elif x < 0.035:
            # a weight update is the reset a late read must not outlive (its KV is the older weights')
            weights, running = r.random() < (0.8 if self.fetcher.late else 0.4), r.random() < 0.5
            self.reset(weights=weights, running=running)
        elif x < 0.04:
            self.vllm_cache_forgets()
        elif x < 0.045 and self.setup.disk_mb:
            self.corrupt_disk_file()
        elif x < 0.05 and self.redis is not None:
            self.note("redis restarts (empty)")
            self.path("fault:redis-restart")
            self.redis.restart()
        elif x < 0.06 and self.redis is not None:
            self.corrupt_redis_value()
        elif x < 0.07 and self.restarts and self.version == 0:
            # a restart loads the weights the engine started with: only before a weight update
            if not self.restart_pending:
                self.restart_pending = True
                self.note("an engine restart is asked for: no new requests until the engine is idle")

    def restart(self) -> None:
        """The engine restarts on the tiers it leaves (a rolling restart, a crashed instance
        replaced): a fresh connector with nothing in memory (no marker it read, no hold, no turn
        end on its way), vLLM's cache empty, the disk directory and Redis as they were."""
        self.restart_pending = False
        self.generations_used = max(self.generations_used, self.instance_resets)
        self.instance_resets = 0  # a restart is generation 0: the weights of its model files
        self.path("restart")
        self.note("the engine restarts on the same disk directory and Redis")
        self.sched.shutdown()
        self.worker.shutdown()
        self._build_connector()
        self.kvm = _kv_cache_manager(self.lay, self.setup.num_blocks)
        self.sched.bind_kv_cache_manager(self.kvm)
        self._bind_device_events()
        self._checked.clear()

    def _bind_device_events(self) -> None:
        """vLLM's own device events made one per block hash, and gated by where its hit can
        reach, as the connector binds them (with ``--kv-events-config``), and an index fed them:
        a set of hashes per group, as Dynamo's and llm-d's keep (``check_device_index``)."""
        full = [g.index for g in self.lay.groups if g.kind is GroupKind.FULL]
        self.device_dedup = device_events(self.lay)
        self.device_dedup.bind(self.kvm.block_pool)
        self.device_copies = self.device_withdrawn = 0
        self.device_index: set = set()
        self.device_groups = frozenset(full)

    def vllm_cache_forgets(self) -> None:
        """vLLM's own cache forgets the blocks no request uses (memory pressure; another engine on
        the same tiers): what comes next is served by the connector's loads."""
        free = {b.block_id for b in self.kvm.block_pool.blocks
                if b.ref_cnt == 0 and b.block_hash is not None and b.block_id != NULL_BLOCK_ID}
        self.kvm.evict_blocks(free)
        self.path("vllm-cache-forgets")
        self.note(f"vLLM's prefix cache forgets {len(free)} free blocks")

    def run(self) -> Result:
        t0 = time.perf_counter()
        idle = 0
        while True:
            self.step_no += 1
            self.events()
            busy = self.waiting or self.running or self.remote or self.kept or self.sched.turn_saves_due \
                or self.writer.queued() or self.fetcher.late
            if not busy:
                idle += 1
                if self.step_no >= self.setup.steps and idle > 2:
                    break
            try:
                with step_watchdog():
                    self.step()
            except Violation:
                raise
            except Exception as exc:  # (g): no step raises
                raise Violation(self.seed, self.step_no, f"liveness: the step raised {type(exc).__name__}: {exc}",
                                self.history) from exc
            if self.step_no > self.setup.steps * 20:
                self.violate("liveness: the run did not drain")
        self.fetcher.run_late()
        self.writer.land_all()
        quiesce(self.worker)
        self.check_drained()
        self.result.steps = self.step_no
        self.result.events = len(self.history)
        self.result.history = self.history
        self.result.seconds = time.perf_counter() - t0
        return self.result


def run(seed: int, steps: int = 60, redis=None, known_open=None) -> Result:
    """One schedule; ``redis``: a ``tests.redis_server.RedisServer`` the setups may draw."""
    # what earlier schedules (and vLLM, torch) left out of every collection: the collection at
    # each step's end then walks this schedule's objects only
    gc.collect()
    gc.freeze()
    sim = Sim(seed, steps, redis, known_open=known_open)
    try:
        return sim.run()
    finally:
        try:
            with step_watchdog():
                sim.close()
        except StepHung:  # what hung the step holds the close too: its threads are left
            pass


def quiet():
    """LMCache's and the connector's logs off (a schedule logs thousands of lines); returns a
    function that puts the levels back (a test process goes on with other tests' log checks)."""
    import logging

    names = {"lmcache", "LMCache", "lmcache_hma", "LMCacheHMA", "vllm"}
    names |= {n for n in list(logging.root.manager.loggerDict) if n.startswith(("lmcache", "vllm"))}
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)

    def restore() -> None:  # loggers made since (quieted by later calls) go back to the default
        later = {n for n in list(logging.root.manager.loggerDict) if n.startswith(("lmcache", "vllm"))}
        for name in names | later:
            logging.getLogger(name).setLevel(levels.get(name, logging.NOTSET))
    return restore
