"""Lets vLLM's Gemma-3 and Qwen3.5 vision code run without torchvision (tiny VLM tests).

CPU torchvision wheels are not on PyPI. When torchvision is missing:

* Image processors. vLLM's ``gemma3_mm`` imports ``transformers.models.gemma3.
  image_processing_gemma3`` and its ``qwen3_vl`` (imported by ``qwen3_5``) imports
  ``transformers.models.qwen2_vl.image_processing_qwen2_vl``; both modules' bodies import
  torchvision. Each is mapped to a stand-in whose image processor is transformers' PIL
  implementation of the same processor (``Gemma3ImageProcessorPil``, ``Qwen2VLImageProcessorPil``).
* The Qwen3.5 video processor. vLLM builds the model's ``Qwen3VLProcessor``, which has a video
  processor even when no video is ever sent. ``Qwen3VLVideoProcessor`` itself imports and runs
  without torchvision (it uses it only when present), but transformers then resolves it by name
  to its torchvision placeholder, and checks a processor's video processor against a class
  (``VideoProcessorMixin``) that it exports only with torchvision. Once
  ``transformers.models.auto.video_processing_auto`` is imported, the real class is registered
  for ``Qwen3_5Config`` and ``VideoProcessorMixin`` exported. Videos themselves are not tested.

As ``sitecustomize.py`` on ``PYTHONPATH`` (see ``lmcache_hma.testing.tiny_vlm.vlm_pythonpath``)
it runs at start-up of every Python process, vLLM's spawned ones included. It only adds a
finder to ``sys.meta_path``: nothing is imported until one of those modules is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# torchvision-based module -> (its PIL sibling, {name in the stand-in: name in the sibling})
STAND_INS = {
    "transformers.models.gemma3.image_processing_gemma3": (
        "transformers.models.gemma3.image_processing_pil_gemma3",
        {"Gemma3ImageProcessor": "Gemma3ImageProcessorPil",
         "Gemma3ImageProcessorKwargs": "Gemma3ImageProcessorKwargs"},
    ),
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil",
         "Qwen2VLImageProcessorKwargs": "Qwen2VLImageProcessorKwargs",
         "smart_resize": "smart_resize"},
    ),
}


VIDEO_AUTO = "transformers.models.auto.video_processing_auto"


class _PilImageProcessorModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in (*STAND_INS, VIDEO_AUTO) or importlib.util.find_spec("torchvision"):
            return None
        if fullname == VIDEO_AUTO:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None:
                spec.loader = _RegisteringVideoProcessors(spec.loader)
            return spec
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        sibling, names = STAND_INS[module.__name__]
        pil = importlib.import_module(sibling)
        for name, pil_name in names.items():
            setattr(module, name, getattr(pil, pil_name))
        module.__all__ = [next(iter(names))]


class _RegisteringVideoProcessors(importlib.abc.Loader):
    """Loads ``video_processing_auto`` as usual, then registers the Qwen3.5 video processor."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register_video_processors(module)


def _register_video_processors(auto) -> None:
    import transformers
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    auto.AutoVideoProcessor.register(
        Qwen3_5Config, video_processor_classes={"torchvision": Qwen3VLVideoProcessor}, exist_ok=True)
    transformers.VideoProcessorMixin = VideoProcessorMixin


def install() -> None:
    """Add the finder once (idempotent)."""
    if not any(type(f).__name__ == _PilImageProcessorModules.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _PilImageProcessorModules())
        if VIDEO_AUTO in sys.modules and importlib.util.find_spec("torchvision") is None:
            _register_video_processors(sys.modules[VIDEO_AUTO])  # imported before the finder


install()
