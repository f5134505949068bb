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
and seconds per module. The rules (tests/engines.py has the details):

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

import pytest

from tests.redis_server import module_redis, redis_server, redis_yaml  # noqa: F401  (pytest fixtures)

_OWN_ENGINE_LOG = []  # the log file this session created, removed at its end
_CREATED_BY = "LMCACHE_HMA_ENGINE_LOG_PID"  # a nested pytest run (test_tie_gate) reuses its parent's


def pytest_configure(config):
    from tests.engines import ENGINE_LOG

    if not os.environ.get(ENGINE_LOG):
        fd, path = tempfile.mkstemp(prefix="lmcache_hma_engines_", suffix=".jsonl")
        os.close(fd)
        os.environ[ENGINE_LOG] = path
        os.environ[_CREATED_BY] = str(os.getpid())
        _OWN_ENGINE_LOG.append(path)


def pytest_collection_finish(session):
    """References are computed only for the modules this run selected."""
    from tests.engines import Reference

    Reference.selected_modules = {item.module.__name__ for item in session.items
                                  if getattr(item, "module", None) is not None}


def engine_summary(path) -> list[str]:
    """Lines: engine starts and their seconds per module (from the engine log)."""
    try:
        entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return []
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
              for module, (n, s, stop) in sorted(starts.items())]
    return lines


def pytest_terminal_summary(terminalreporter):
    from tests.engines import ENGINE_LOG, TIE_STATS, TIE_TESTS, tie_verdict

    if TIE_STATS["comparisons"]:
        terminalreporter.write_line(
            f"greedy comparisons: {TIE_STATS['comparisons']}, ended at a reference near-tie: "
            f"{TIE_STATS['ended_at_a_tie']}")
        for test in sorted(set(TIE_TESTS)):
            terminalreporter.write_line(f"  ended at a near-tie: {TIE_TESTS.count(test)} in {test}")
    if _OWN_ENGINE_LOG or not os.environ.get(_CREATED_BY):  # this run's log, or one the user named
        for line in engine_summary(os.environ.get(ENGINE_LOG, "")):
            terminalreporter.write_line(line)
    verdict = tie_verdict()
    if verdict:
        terminalreporter.write_line(f"FAILED (tie statistics): {verdict}", red=True, bold=True)


def pytest_sessionfinish(session):
    from tests.engines import tie_verdict

    if tie_verdict() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    for path in _OWN_ENGINE_LOG:
        try:
            os.unlink(path)
        except OSError:
            pass
