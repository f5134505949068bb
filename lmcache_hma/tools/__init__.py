"""The ``lmcache-hma`` command: ``serve``, ``repro``, ``build-model``."""
