"""An engine with the connector starts in a process that imported ``lmcache_hma`` and LMCache
first (LMCache's own offline examples import it to close the engine at the end).

LMCache imports numba, numba loads llvmlite, and vLLM's CPU worker start-up walks every loaded
module; without the connector's vLLM plugin (``lmcache_hma/vllm_plugin.py``, registered as an
entry point by ``pip install``) that walk fails on llvmlite's library handle and the engine does
not start. The script is a file run by a fresh interpreter, as a user's: vLLM's CPU platform
starts its engine process with ``spawn``, which imports the script's top-level imports (LMCache's
among them) into that process again before the worker starts; ``python -c`` would hide it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lmcache_hma.testing.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 600  # one engine start (30-90 s on a loaded 2-core machine) and three requests

SCRIPT = r"""
import json
import sys
from pathlib import Path

import lmcache_hma
import lmcache
import lmcache.v1.platform.torch_ops  # what the connector's worker loads: numba, and llvmlite

from tests.engines import LONG_PROMPT, generate, make_llm, read_stats, shutdown, write_yaml

if __name__ == "__main__":
    assert "llvmlite.binding.ffi" in sys.modules, "LMCache no longer loads llvmlite: nothing to test"
    model, work = sys.argv[1], Path(sys.argv[2])
    yaml = write_yaml(work / "cpu.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.5)
    stats = work / "stats.json"
    llm = make_llm(model, yaml, {"hma_stats_file": str(stats)})
    [cold] = generate(llm, LONG_PROMPT)
    llm.reset_prefix_cache()
    [hit] = generate(llm, LONG_PROMPT)
    print("RESULT " + json.dumps({"cold": cold.tokens, "hit": hit.tokens, "cached": hit.cached,
                                 "loaded_tokens": read_stats(stats).get("loaded_tokens", 0)}), flush=True)
    shutdown(llm)
"""


def test_engine_starts_and_hits_after_lmcache_was_imported(tmp_path):
    model = build_tiny_model("tiny-gemma3")
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(model), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    errors = "\n".join(ln for ln in (done.stdout + done.stderr).splitlines() if "Error" in ln)  # vLLM logs to stdout
    assert done.returncode == 0 and lines, f"exit {done.returncode}; errors:\n{errors[-3000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert len(r["cold"]) == 10 and r["hit"] == r["cold"]
    assert r["cached"] == r["loaded_tokens"] == 5888  # 23 chunks of 256, loaded by the connector


WALK = r"""
import lmcache.v1.platform.torch_ops  # numba, and llvmlite
from vllm.triton_utils.dispatcher import _rebind_kernels  # the walk over every loaded module

def kernel():
    pass

try:
    _rebind_kernels([(kernel, kernel)])
    print("BEFORE ok")
except AttributeError as exc:
    print("BEFORE", exc)
from lmcache_hma.vllm_plugin import register
register()
_rebind_kernels([(kernel, kernel)])
print("AFTER ok")
"""


def test_the_plugin_is_installed_and_lets_vllms_kernel_walk_pass_llvmlite():
    """The engine-free half of the test above (seconds, not a minute): vLLM finds the plugin, and
    after it ran, the walk vLLM CPU's worker makes at start passes a process that loaded numba."""
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("lmcache_hma") == "lmcache_hma.vllm_plugin:register", \
        "the vLLM plugin is not registered: reinstall the package (make setup, or pip install -e .)"
    done = subprocess.run([sys.executable, "-c", WALK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "AFTER ok" in done.stdout, done.stderr[-3000:]
    # what it guards against, while vLLM 0.32 and llvmlite 0.47 are installed (constraints.txt)
    print(next(ln for ln in done.stdout.splitlines() if ln.startswith("BEFORE")))
