"""The health check of a Redis tier: a ping at start and every ``PERIOD_S``.

While Redis does not answer, the tier is bypassed (LMCache's
``StorageManager.set_backend_bypass``): lookups miss and writes are skipped at once,
with one warning; the tier is used again when Redis answers. redis-py fails a call at
once while nothing listens, but waits its timeout per call while Redis hangs: without
the bypass every lookup would pay that.
"""

from __future__ import annotations

from lmcache_hma.log import get_logger

logger = get_logger(__name__)


class HealthChecked:
    """Mixed into a Redis tier, which gives ``_probe() -> (ok, why)``, ``_manager``, ``_stop``,
    ``up``, ``health_errors``, ``NAME``, ``WHAT``, ``url`` and ``PERIOD_S``."""

    def _watch(self) -> None:
        """Health checks every ``PERIOD_S`` until ``close``. A check that raises is logged and
        counted, and the next one runs; should the thread end anyway, the tier is bypassed
        for good (misses, no writes), said once."""
        try:
            while not self._stop.wait(self.PERIOD_S):
                try:
                    self._check()
                except Exception:
                    self.health_errors += 1
                    logger.exception("LMCacheHMA: a health check of the %s %s failed (%d so far); the next "
                                     "one runs in %g s", self.WHAT, self.url, self.health_errors, self.PERIOD_S)
        finally:
            if not self._stop.is_set():
                self._give_up()

    def _give_up(self) -> None:
        """The health thread ended: nothing checks Redis any more, so it is never used again."""
        self.up = False
        logger.error("LMCacheHMA: the %s %s health thread stopped; the tier is bypassed until the engine "
                     "restarts (lookups miss, writes are skipped)", self.WHAT, self.url)
        try:
            self._manager.set_backend_bypass(self.NAME, True)
        except Exception:  # the tier's own calls already skip Redis (``up`` is False)
            logger.exception("LMCacheHMA: bypassing the %s", self.WHAT)

    def _check(self, at_start: bool = False) -> None:
        ok, why = self._probe()
        if ok == self.up and not (at_start and not ok):
            return
        self.up = ok
        self._manager.set_backend_bypass(self.NAME, not ok)
        if not ok:
            logger.warning(
                "LMCacheHMA: %s %s %s (%s); serving continues without it: lookups miss "
                "and writes are skipped until it answers again",
                self.WHAT, self.url, "is unreachable at start" if at_start else "stopped answering", why,
            )
        else:
            logger.warning("LMCacheHMA: %s %s answers again; sharing resumes", self.WHAT, self.url)
