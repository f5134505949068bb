"""The Redis tiers: one Redis (``node_tier``) or a Redis Cluster (``cluster_tier``), spoken to
directly (``calls``, ``wire``, ``pipelined_reads``, ``resp``) in LMCache's stored format.

A tier reads its settings (credentials, call deadline, turn ends' TTL) from the LMCache config it
is handed, where ``config.remote_url`` keeps them; nothing here is imported by ``config``."""

from __future__ import annotations

from typing import Optional

# the settings the tier is built from, kept with LMCache's config by ``config.settings.load_config``
from lmcache_hma.config.remote_url import (CLUSTER_SCHEME, attach_turn_end_ttl, remote_auth,  # noqa: F401
                                           remote_timeout_s, turn_end_ttl_s)

REMOTE_BACKEND = "RemoteBackend"  # LMCache's name for its remote tier


def redis_tiers_for(manager, name: str, backend, lmcache_config) -> Optional[list]:
    """``[the Redis tier]`` over LMCache's remote backend (``remote_url``), None for another backend."""
    if name != REMOTE_BACKEND:
        return None
    url = lmcache_config.remote_url or ""
    if url.startswith(CLUSTER_SCHEME):
        from lmcache_hma.store.redis.cluster_tier import RedisClusterTier as tier
    else:  # config.remote_url lets only Redis URLs through
        from lmcache_hma.store.redis.node_tier import RedisTier as tier
    return [tier(manager, backend, url, remote_auth(lmcache_config), remote_timeout_s(lmcache_config),
                 turn_end_ttl_s=turn_end_ttl_s(lmcache_config))]
