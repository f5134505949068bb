"""Shared pytest fixtures, the gate on the greedy comparisons' tie statistics, and the count
of engine starts.

``redis_server`` (a real, empty redis-server on a free loopback port) and
``redis_yaml`` (a copy of configs/redis.yaml with a given URL), ``module_redis`` (one Redis for a module): see tests/redis_server.py.

At the end of a run the comparisons of ``tests.engines.same_greedy`` are counted: how many
ended at a reference near-tie instead of comparing every token (and in which tests). A run
where too many did fails (``tests.engines.tie_verdict``), whatever its tests said.

Engines. Starting one costs 20-35 s, most of the suite's time; each start and stop is recorded
(``tests.engines.record_engine``: engines of this process, servers, engines of child processes)
in the file ``$LMCACHE_HMA_ENGINE_LOG`` (one per run unless set) and the run ends with starts
and seconds per module.

Two test processes. ``make test`` runs the suite in two pytest-xdist workers (``-n 2 --dist
loadfile``: a module's tests stay in one worker, so its module-scoped engine is started once).
Most of an engine start is two fresh Python processes importing vLLM, one core's work, so two
workers on two cores take about half the time. Each worker binds its engines' compute threads to
CPUs of its own (``VLLM_CPU_OMP_THREADS_BIND``, the same for both sides of every comparison),
and the heaviest modules are handed out first (``MODULE_SECONDS``). Each worker's comparisons are
written to the engine log when it ends, and the tie gate judges the whole run. The rules for
engines hold within each worker (tests/engines.py has the details):

1. A reference (greedy tokens of an engine without the connector) is a module-level
   ``tests.engines.Reference``. All references of one engine configuration (model, dtype, engine
   arguments) that the selected modules declare are computed by ONE engine, at the first
   ``.get()`` of the session, from an empty prefix cache each, and that engine stops right
   after: a module that declares references of an existing configuration starts no engine.
2. A module's shared connector engine is a module-scoped fixture that depends on the module's
   reference fixture (the references' engine is gone before it starts) and registers the engine
   with ``tests.engines.hold``: ``make_llm`` shuts a held engine down before starting any other
   one, so never two engines are alive at once (each reserves its KV cache; 3-4 GB in all),
   except in a test about several engines together (two sharing Redis: engines that are not
   held are never shut down for another). Its tests come first in the module, empty vLLM's
   prefix cache (``reset_prefix_cache``) before a run that must hit, and read the stats file as
   deltas where an earlier test may have counted.
3. A fresh-process check (a new engine reading what another stored on disk or in Redis) starts a
   fresh engine; one fresh engine serves every check of that tier; the writer may be an engine
   the module starts anyway (test_e2e_exact and test_e2e_recurrent: the corrupted-loads engine
   writes the disk tier, then closes so that the fresh reader reads what it flushed).
4. ``tests.engines.shutdown`` stops an engine as soon as its processes finished their shutdown
   (the connector closed), not 5 s later.

A new test module (KV events, speculative decoding, ...)::

    from tests.engines import Reference, generate, hold, make_llm, read_stats, same_greedy, shutdown

    PROMPTS = [LONG_PROMPT, OTHER]
    REFERENCES = {p: Reference("tiny-gemma3", p) for p in PROMPTS}  # shares the session's engine

    @pytest.fixture(scope="module")
    def reference():
        return {p: ref.get() for p, ref in REFERENCES.items()}

    @pytest.fixture(scope="module")
    def engine(reference, tmp_path_factory):  # after the reference: one engine at a time
        llm = hold(make_llm(build_tiny_model("tiny-gemma3"), yaml, {...}, kv_events_config=...))
        yield llm
        shutdown(llm)

``Reference`` takes the same engine arguments as ``make_llm`` (``dtype="bfloat16"``,
``kv_cache_memory_bytes=...``); a batch is one reference (``Reference(model, [p1, p2])``), as
is vLLM's own prefix-cache hit of a prompt (``hit=True``). A model built by another builder
is given as the builder (``Reference(build_tiny_qwen35, prompt, ...)``).
"""

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pytest

from tests.redis_server import module_redis, redis_server, redis_yaml  # noqa: F401  (pytest fixtures)

_OWN_ENGINE_LOG = []  # the log file this session created, removed at its end


# Seconds a module took in one worker of ``make test`` (2 cores; its engine starts, references
# included: the "in all" of the run's summary). Only the order matters: with ``--dist loadfile``
# a worker takes the next module when it runs out, so the longest go first and the short ones
# fill the gaps. Unlisted: quick.
MODULE_SECONDS = {
    "test_e2e_shared_shapes": 276, "test_e2e_pd": 260, "test_e2e_exact": 166, "test_e2e_capacity": 150, "test_e2e_recurrent": 147, "test_e2e_qwen35": 123, "test_redis_cluster": 100,
    "test_redis": 82, "test_e2e_eagle": 79, "test_faults": 69, "test_e2e_kv_events": 61,
    "test_identity_lora": 45, "test_identity_multimodal": 43, "test_repro": 40, "test_redis_untrusted": 39,
    "test_e2e_speculative": 33, "test_metrics": 26, "test_config": 22, "test_speculative": 20,
}


def _worker_id(config) -> Optional[str]:
    """``gw0``, ``gw1``, ... in a pytest-xdist worker; None in a plain run (or the controller)."""
    return getattr(config, "workerinput", {}).get("workerid")


def pytest_configure(config):
    from tests.engines import ENGINE_LOG, ENGINE_LOG_OWNER

    if not os.environ.get(ENGINE_LOG):
        fd, path = tempfile.mkstemp(prefix="lmcache_hma_engines_", suffix=".jsonl")
        os.close(fd)
        os.environ[ENGINE_LOG] = path
        os.environ[ENGINE_LOG_OWNER] = str(os.getpid())
        _OWN_ENGINE_LOG.append(path)
    worker = _worker_id(config)
    if worker is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # Each worker's engines compute on CPUs of their own: with vLLM's default binding both
        # workers' forwards would share the first cores. Engines of one worker (a reference and
        # the connector engine it is compared with) get the same binding.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = worker_cpus(
            sorted(os.sched_getaffinity(0)), int(worker.lstrip("gw")), config.workerinput["workercount"])


def worker_cpus(cpus: list[int], index: int, workers: int) -> str:
    """The CPUs (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` list) of worker ``index``'s engines: an
    equal share of ``cpus``, less one for the connector's threads and the engine core when the
    share has two or more (vLLM's ``VLLM_CPU_NUM_OF_RESERVED_CPU``); one CPU on 2 cores."""
    share = max(1, len(cpus) // workers)
    mine = cpus[(index * share) % len(cpus):][:share]
    return ",".join(map(str, mine[:-1] if len(mine) > 1 else mine))


def pytest_collection_modifyitems(config, items):
    """The heaviest modules first (``MODULE_SECONDS``); tests keep their order within a module."""
    def weight(item) -> int:
        return MODULE_SECONDS.get(Path(str(item.fspath)).stem, 0)

    items.sort(key=lambda item: -weight(item))  # stable: modules stay contiguous and ordered


def pytest_collection_finish(session):
    """References are computed only for the modules this run selected."""
    from tests.engines import Reference

    Reference.selected_modules = {item.module.__name__ for item in session.items
                                  if getattr(item, "module", None) is not None}


_MODULE_RUN_SECONDS: dict = defaultdict(float)  # module -> seconds of its tests (setup and teardown included)


def pytest_runtest_logreport(report):
    """Each test's time, by module (under xdist the controller gets every worker's reports)."""
    _MODULE_RUN_SECONDS[report.nodeid.split("::")[0]] += report.duration


def engine_summary(path, module_seconds: Optional[dict] = None) -> list[str]:
    """Lines: engine starts and their seconds per module (from the engine log), with each
    module's seconds in all (``module_seconds``)."""
    try:
        entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return []
    entries = [e for e in entries if e["event"] in ("start", "failed_start", "stop")]
    module_seconds = module_seconds or {}
    starts = defaultdict(lambda: [0, 0.0, 0.0])  # module -> [starts, start seconds, stop seconds]
    for e in entries:
        module = e["test"].split("::")[0] or "(outside a test)"
        if e["event"] in ("start", "failed_start"):
            starts[module][0] += 1
            starts[module][1] += e["seconds"]
        elif e["event"] == "stop":
            starts[module][2] += e["seconds"]
    if not starts:
        return []
    total = [sum(v[i] for v in starts.values()) for i in range(3)]
    most_alive = max((e["alive"] for e in entries if e["event"] == "start"), default=0)
    lines = [f"engine starts: {total[0]} ({total[1]:.0f} s starting, {total[2]:.0f} s stopping; "
             f"at most {most_alive} alive at once in one process)"]
    lines += [f"  {module}: {n} starts, {s:.0f} s + {stop:.0f} s stopping"
              + (f"; {module_seconds[module]:.0f} s in all" if module in module_seconds else "")
              for module, (n, s, stop) in sorted(starts.items())]
    return lines


def _judges_the_run() -> bool:
    """This session reports on the whole run: it made the engine log (a plain run, or xdist's
    controller), or the user named one; not a worker, nor a nested run (test_tie_gate)."""
    from tests.engines import ENGINE_LOG_OWNER

    return bool(_OWN_ENGINE_LOG) or not os.environ.get(ENGINE_LOG_OWNER)


def run_tie_stats() -> tuple[dict, list]:
    """The run's comparisons: this process's, plus those the workers wrote to the engine log."""
    from tests.engines import ENGINE_LOG, TIE_STATS, TIE_TESTS

    stats, tests = dict(TIE_STATS), list(TIE_TESTS)
    path = os.environ.get(ENGINE_LOG)
    if _judges_the_run() and path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            lines = []
        for entry in (json.loads(line) for line in lines if line.strip()):
            if entry["event"] == "tie_stats":
                stats = {k: stats[k] + entry["stats"][k] for k in stats}
                tests += entry["tests"]
    return stats, tests


def pytest_terminal_summary(terminalreporter):
    from tests.engines import ENGINE_LOG, tie_verdict

    stats, tests = run_tie_stats()
    if stats["comparisons"]:
        terminalreporter.write_line(
            f"greedy comparisons: {stats['comparisons']}, ended at a reference near-tie: "
            f"{stats['ended_at_a_tie']}")
        for test in sorted(set(tests)):
            terminalreporter.write_line(f"  ended at a near-tie: {tests.count(test)} in {test}")
    if _judges_the_run():
        for line in engine_summary(os.environ.get(ENGINE_LOG, ""), _MODULE_RUN_SECONDS):
            terminalreporter.write_line(line)
    verdict = tie_verdict(stats)
    if verdict:
        terminalreporter.write_line(f"FAILED (tie statistics): {verdict}", red=True, bold=True)


def pytest_sessionfinish(session):
    from tests.engines import ENGINE_LOG, TIE_STATS, TIE_TESTS, tie_verdict

    if _worker_id(session.config) is not None:  # the controller judges the whole run
        path = os.environ.get(ENGINE_LOG)
        if path and TIE_STATS["comparisons"]:
            with open(path, "a") as f:
                f.write(json.dumps({"event": "tie_stats", "stats": TIE_STATS, "tests": TIE_TESTS}) + "\n")
        return
    if tie_verdict(run_tie_stats()[0]) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    for path in _OWN_ENGINE_LOG:
        try:
            os.unlink(path)
        except OSError:
            pass
