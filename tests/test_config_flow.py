"""Configuration flows one way: ``lmcache_hma/config`` decides values and knows nothing of the
parts that use them (``store``, ``worker``, ``scheduler``, the connector, the tools).

Checked twice: every ``import`` statement of every module under ``config/`` (including those
inside functions), and a fresh interpreter that imports every config module and loads a
configuration naming all three tiers, after which none of those packages may be loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import lmcache_hma.config

CONFIG_DIR = Path(lmcache_hma.config.__file__).parent
ROOT = CONFIG_DIR.parents[1]
UPSTREAM = ("lmcache_hma.store", "lmcache_hma.worker", "lmcache_hma.scheduler", "lmcache_hma.connector",
            "lmcache_hma.tools", "lmcache_hma.kv_copy")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_no_config_module_imports_store_worker_or_scheduler():
    bad = [f"{path.name}:{line}: {module}" for path in sorted(CONFIG_DIR.glob("*.py"))
           for line, module in imported_modules(path)
           if module.startswith(UPSTREAM) or module.startswith(".")]
    assert bad == [], bad


def test_loading_a_configuration_loads_nothing_upstream(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.1\n"
                      f"local_disk: {tmp_path}/disk/\nmax_local_disk_size: 0.1\n"
                      f"remote_url: redis://127.0.0.1:6379\nremote_serde: naive\n"
                      f"extra_config:\n  hma_redis_turn_end_ttl_s: 60\n  hma_test_fail_loads: 1\n")
    modules = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
    code = (f"import sys, json\n"
            f"for m in {modules!r}: __import__('lmcache_hma.config.' + m)\n"
            f"from lmcache_hma.config.settings import load_config\n"
            f"c = load_config({{'lmcache_config_file': {str(config)!r}}})\n"
            f"assert c.redis_turn_end_ttl_s == 60.0 and c.faults.fail_loads == 1\n"
            f"print(json.dumps(sorted(k for k in sys.modules if k.startswith({UPSTREAM!r}))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
