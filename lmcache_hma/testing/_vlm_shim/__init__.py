"""The ``sitecustomize`` that lets the tiny VLM load without torchvision (see ``tiny_vlm.py``).

This directory is put on ``PYTHONPATH`` for vLLM's child processes; importing
``lmcache_hma.testing._vlm_shim.sitecustomize`` installs the same shim in the current process.
"""
