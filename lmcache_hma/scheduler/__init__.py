"""The scheduler half (vLLM's EngineCore process): hashing, lookups (``lookup_client``), load and save plans."""
