"""The Redis tiers: one Redis (``node_tier``) or a Redis Cluster (``cluster_tier``), spoken to
directly (``calls``, ``wire``, ``pipelined_reads``, ``resp``) in LMCache's stored format."""

from __future__ import annotations

from typing import Optional

REMOTE_BACKEND = "RemoteBackend"  # LMCache's name for its remote tier

# hma_redis_turn_end_ttl_s, kept with LMCache's config as ``config.remote_url`` keeps the
# credentials and the timeout (``attach_turn_end_ttl``)
_TURN_END_TTL_ATTR = "_lmcache_hma_redis_turn_end_ttl_s"


def attach_turn_end_ttl(lmcache_config, seconds: float) -> None:
    """Keep ``hma_redis_turn_end_ttl_s`` with LMCache's config, where the Redis tier is built from
    (``redis_tiers_for``); ``config.settings.load_config`` calls it next to ``attach_remote_settings``."""
    setattr(lmcache_config, _TURN_END_TTL_ATTR, float(seconds))


def turn_end_ttl_s(lmcache_config) -> float:
    """``hma_redis_turn_end_ttl_s`` of the config (the key's default when none was attached)."""
    seconds = getattr(lmcache_config, _TURN_END_TTL_ATTR, None)
    if seconds is None:
        from lmcache_hma.config.settings import ADAPTER_KEYS

        seconds = ADAPTER_KEYS["hma_redis_turn_end_ttl_s"][1]
    return seconds


def redis_tiers_for(manager, name: str, backend, lmcache_config) -> Optional[list]:
    """``[the Redis tier]`` over LMCache's remote backend (``remote_url``), None for another backend."""
    if name != REMOTE_BACKEND:
        return None
    from lmcache_hma.config.remote_url import CLUSTER_SCHEME, remote_auth, remote_timeout_s

    url = lmcache_config.remote_url or ""
    if url.startswith(CLUSTER_SCHEME):
        from lmcache_hma.store.redis.cluster_tier import RedisClusterTier as tier
    else:  # config.remote_url lets only Redis URLs through
        from lmcache_hma.store.redis.node_tier import RedisTier as tier
    return [tier(manager, backend, url, remote_auth(lmcache_config), remote_timeout_s(lmcache_config),
                 turn_end_ttl_s=turn_end_ttl_s(lmcache_config))]
