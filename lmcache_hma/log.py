"""The package logger: ``lmcache_hma`` at INFO on stderr, in every vLLM process.

vLLM configures only its own ``vllm.*`` loggers, so without this the per-request
lines would be lost in the engine and worker processes.
"""

import logging
import os

_FORMAT = "[%(asctime)s] LMCacheHMA %(levelname)s: %(message)s"


def get_logger(name: str = "lmcache_hma") -> logging.Logger:
    root = logging.getLogger("lmcache_hma")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        root.setLevel(os.environ.get("LMCACHE_HMA_LOG_LEVEL", "INFO"))
        root.propagate = False
    return logging.getLogger(name)
