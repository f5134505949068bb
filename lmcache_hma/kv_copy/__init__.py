"""Where bytes are copied between vLLM's KV cache and stored objects: torch on the CPU, CuPy kernels on a GPU."""
