"""Lets vLLM's Gemma-3 vision code import without torchvision (for the tiny VLM tests).

vLLM's ``gemma3_mm`` imports ``transformers.models.gemma3.image_processing_gemma3``,
whose module body imports torchvision; CPU torchvision wheels are not on PyPI, so that
import fails. When torchvision is missing, this maps that one module to a stand-in whose
``Gemma3ImageProcessor`` is transformers' PIL implementation (``Gemma3ImageProcessorPil``).

As ``sitecustomize.py`` on ``PYTHONPATH`` (see ``lmcache_hma.testing.tiny_vlm.vlm_pythonpath``)
it runs at start-up of every Python process, vLLM's spawned ones included. It only adds a
finder to ``sys.meta_path``: nothing is imported until that module is asked for.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

TARGET = "transformers.models.gemma3.image_processing_gemma3"


class _PilGemma3ImageProcessorModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        from transformers.models.gemma3 import image_processing_pil_gemma3 as pil

        module.Gemma3ImageProcessor = pil.Gemma3ImageProcessorPil
        module.Gemma3ImageProcessorKwargs = pil.Gemma3ImageProcessorKwargs


def install() -> None:
    """Add the finder once (idempotent)."""
    if not any(type(f).__name__ == _PilGemma3ImageProcessorModule.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _PilGemma3ImageProcessorModule())


install()
