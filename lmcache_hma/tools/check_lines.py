"""What ``lmcache-hma check`` prints: one ``Line`` per check, and the text in it.

Contract: a ``Line`` is one verdict, ``OK``, ``WARN`` or ``FAIL``, on what was checked, with the
reason and, when it is not OK, the fix; ``str(line)`` is how the command prints it (details
indented under it). ``size_text`` / ``tokens_text`` / ``bytes_text`` write sizes and counts for
people; ``captured_warnings`` turns the ``lmcache_hma`` logger's warnings into text for lines
instead of stderr while a check runs. No checks here: they live in ``check`` (the configuration),
``tier_probes`` (CPU, disk), ``redis_probe`` (Redis) and ``model_costs`` (a model's bytes per token).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Line:
    """One check's verdict: ``what`` was checked, ``reason``, and ``fix`` when it is not OK."""

    verdict: str
    what: str
    reason: str
    fix: str = ""
    details: list = field(default_factory=list)  # indented lines printed under it

    @property
    def message(self) -> str:
        return f"{self.reason}: {self.fix}" if self.fix else self.reason

    def __str__(self) -> str:
        head = f"{self.verdict:<4} {self.what}: {self.message}"
        return "\n".join([head, *(f"     {d}" for d in self.details)])


# -- sizes -------------------------------------------------------------------------------------
def size_text(n: float) -> str:
    """``n`` bytes for people: 512 B, 1.5 KiB, 2 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B" if n == int(n) else f"{n:.1f} B"


def tokens_text(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def bytes_text(n: float) -> str:
    """Bytes with thousands separators (per-token figures)."""
    return f"{n:,.0f} B"


# -- warnings ----------------------------------------------------------------------------------
@contextmanager
def captured_warnings(into: list):
    """The ``lmcache_hma`` logger's warnings go into ``into`` (as text) instead of stderr, and
    nothing logs at INFO or below meanwhile (this command's output is its lines)."""
    root = logging.getLogger("lmcache_hma")
    from lmcache_hma.log import get_logger

    get_logger()  # its handler exists (so that restoring it below restores it)

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                text = record.getMessage()
                into.append(text[len("LMCacheHMA: "):] if text.startswith("LMCacheHMA: ") else text)

    saved, disabled = root.handlers[:], logging.root.manager.disable
    root.handlers = [_Keep()]
    logging.disable(max(disabled, logging.INFO))  # LMCache's info lines at import (its device, ...)
    try:
        yield into
    finally:
        logging.disable(disabled)
        root.handlers = saved
