"""Where built tiny models are kept, and building one into place atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

MARKER_FILE = ".lmcache_hma_complete"


def model_cache_dir() -> Path:
    """``$LMCACHE_HMA_HOME/models``, else ``~/.cache/lmcache_hma/models``."""
    home = os.environ.get("LMCACHE_HMA_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "lmcache_hma"
    return base / "models"


def is_built(model_dir: Path, digest: str) -> bool:
    """Whether ``model_dir`` holds a finished build whose marker names ``digest``."""
    marker = model_dir / MARKER_FILE
    return marker.is_file() and marker.read_text().strip() == digest


def build_into(final: Path, digest: str, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """``final``, built by ``write(directory)`` unless a complete build of ``digest`` is there.

    The build is written into a temporary directory beside ``final`` and renamed into place
    once complete, so an interrupted build never leaves a half-written model behind. Only an
    empty directory or an earlier build (one with a marker file) is replaced, never a
    directory of other files given as ``out_dir`` by mistake.
    """
    if not force and is_built(final, digest):
        return final
    _check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        (tmp / MARKER_FILE).write_text(digest + "\n")
        if final.exists():
            if is_built(final, digest) and not force:
                return final  # a concurrent builder finished first
            _check_replaceable(final)
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, stale / "model")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not is_built(final, digest):  # lost a race to a concurrent builder?
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _check_replaceable(final: Path) -> None:
    if final.is_dir() and not (final / MARKER_FILE).is_file() and any(final.iterdir()):
        raise FileExistsError(f"{final} exists and is not a tiny model build; not replacing it")
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final} exists and is not a directory")
