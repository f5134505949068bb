"""The package logger: ``lmcache_hma`` at INFO on stderr, in every vLLM process.

vLLM configures only its own ``vllm.*`` loggers, so without this the per-request
lines would be lost in the engine and worker processes.
"""

import logging
import os

LEVEL_ENV = "LMCACHE_HMA_LOG_LEVEL"
_FORMAT = "[%(asctime)s] LMCacheHMA %(levelname)s: %(message)s"


def get_logger(name: str = "lmcache_hma") -> logging.Logger:
    root = logging.getLogger("lmcache_hma")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        level = os.environ.get(LEVEL_ENV, "INFO").upper()
        root.propagate = False
        try:
            root.setLevel(level)
        except ValueError:
            root.setLevel("INFO")
            root.warning("%s=%r is not a log level (DEBUG, INFO, WARNING, ERROR); using INFO",
                         LEVEL_ENV, level)
    return logging.getLogger(name)
