"""The chunk store over its tiers (``tier.Tier``): LMCache's CPU and disk tiers, and Redis (``redis/``)."""
