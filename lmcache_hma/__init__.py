"""lmcache_hma: LMCache KV offload for vLLM's hybrid KV cache manager.

vLLM loads ``LMCacheHMAConnector`` from here (``kv_connector_module_path``).
Imported lazily so that tools and tests that do not need vLLM stay light.
"""

__all__ = ["LMCacheHMAConnector"]


def __getattr__(name):
    if name == "LMCacheHMAConnector":
        from lmcache_hma.connector import LMCacheHMAConnector

        return LMCacheHMAConnector
    raise AttributeError(f"module 'lmcache_hma' has no attribute {name!r}")
