"""``lmcache-hma check``: is this configuration ready to serve? One line per check.

Reads the LMCache YAML as the connector will (``load_config``, with ``--extra-config`` as
vLLM's ``kv_connector_extra_config`` and LMCache's ``LMCACHE_<KEY>`` variables over the file's
values), says where the values came from and, when no tier is named, what LMCache's defaults give
(in the OK line), then reaches each tier it names:

* CPU: ``max_local_cpu_size`` against this machine's memory (LMCache 0.5.6 allocates it in full,
  in every vLLM worker);
* disk: the directory prepared as the worker prepares it (``prepare_disk_dir``: created with mode
  0700, refused when others can write it), a probe file written and removed, its mode and the
  free space;
* Redis / Redis Cluster: PING through the connector's own Redis code (``store.redis``: the same
  client, handshake and deadline, ``hma_remote_timeout_s``), the credentials, and ``maxmemory`` /
  ``maxmemory-policy`` read back (``CONFIG GET``; ``INFO memory`` when CONFIG is disabled).

With ``--model`` (a model directory, or a Hugging Face id whose config.json is already in the
local Hugging Face cache: nothing is downloaded, no weights are read) it also estimates what one
stored token costs for that model, by layer kind, against an all-layers connector, and how many
tokens each tier holds.

Each line is ``OK``, ``WARN`` or ``FAIL`` with the reason and, when something is wrong, the
fix. The exit status is 1 when any line is ``FAIL``, 2 for a usage error, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

from lmcache_hma.tools.check_lines import FAIL, OK, WARN, Line, captured_warnings
from lmcache_hma.tools.model_costs import DTYPE_BYTES, PREFILL_STEP, ModelError, model_lines, read_model
from lmcache_hma.tools.tier_probes import tier_checks

# Not used here: tests/test_check.py reads them as check.FULL, check.costs, ... (their home is model_costs).
from lmcache_hma.tools.model_costs import FULL, GDN, SLIDING, costs  # noqa: F401

CONFIG_ENV = "LMCACHE_CONFIG_FILE"


class UsageError(Exception):
    """A bad command line (exit status 2)."""


# -- the configuration -------------------------------------------------------------------------
def load(config: Optional[str], extra: Optional[dict] = None):
    """``(HMAConfig or None, [Line])``: the configuration read as the connector reads it."""
    from lmcache_hma.config.errors import ConfigError
    from lmcache_hma.config.settings import load_config

    given = dict(extra or {})
    if config:
        given.setdefault("lmcache_config_file", str(config))
    source = given.get("lmcache_config_file") or os.environ.get(CONFIG_ENV)
    warnings: list = []
    try:
        with captured_warnings(warnings):
            cfg = load_config(given)
    except ConfigError as exc:
        return None, [Line(FAIL, "config", str(exc))]
    except Exception as exc:  # LMCache's own parser, an unreadable file, ...
        return None, [Line(FAIL, "config", f"{source or 'LMCache defaults'}: {type(exc).__name__}: {exc}",
                           "fix the YAML")]
    lines = []
    env = ", ".join(cfg.environment)
    if source is None and not env:
        lines.append(Line(WARN, "config", "no YAML given (--config, or the environment variable "
                                          f"{CONFIG_ENV}) and no LMCACHE_<KEY> variable: the connector would "
                                          "run on LMCache's defaults",
                          f"pass --config PATH or set {CONFIG_ENV}"))
    lm = cfg.lmcache
    if source:
        read = f"{source} with {env} from the environment" if env else source
    else:
        read = f"{env} from the environment (no YAML)" if env else "LMCache defaults"
    tiers = ", ".join(_tier_names(lm)) or "none"
    if cfg.tier_defaults:  # said here, not again as a warning line
        tiers = f"{tiers} (no tier named: {cfg.tier_defaults})"
    lines.append(Line(OK, "config", f"{read} is valid (chunk_size {lm.chunk_size}; tiers: {tiers})"))
    lines += [Line(WARN, "config", w) for w in warnings if not (cfg.tier_defaults and cfg.tier_defaults in w)]
    return cfg, lines


def _tier_names(lm) -> list:
    names = ["cpu"] if lm.local_cpu else []
    if lm.local_disk:
        names.append("disk")
    if lm.remote_url:
        names.append("redis-cluster" if lm.remote_url.startswith("redis-cluster://") else "redis")
    return names


# -- the command ---------------------------------------------------------------------------------
def run(config: Optional[str], extra: Optional[dict] = None, model: Optional[str] = None,
        kv_dtype: Optional[str] = None, out: Callable[[str], None] = print,
        prefill_step: int = PREFILL_STEP) -> int:
    """Every check, each line printed by ``out`` as it is found; 1 when any FAIL, else 0."""
    lines: list = []

    def say(new: list) -> None:
        for line in new:
            lines.append(line)
            out(str(line))

    cfg, found = load(config, extra)
    say(found)
    remote = None
    if cfg is not None:
        tiers, remote = tier_checks(cfg)
        say(tiers)
    if model:
        try:
            shape = read_model(model, kv_dtype)
        except ModelError as exc:
            say([Line(FAIL, "model", str(exc))])
        else:
            say(model_lines(shape, cfg, remote, prefill_step))
    fails = sum(1 for line in lines if line.verdict == FAIL)
    warns = sum(1 for line in lines if line.verdict == WARN)
    out(f"{fails} FAIL, {warns} WARN")
    return 1 if fails else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-hma check",
        description="Check a configuration before serving: the YAML as the connector reads it, each tier it "
                    "names (CPU memory, the disk directory, Redis or Redis Cluster), and with --model an "
                    "estimate of the bytes one stored token costs. One line per check: OK, WARN or FAIL with "
                    "the reason and the fix.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when no check FAILs, 1 when one does, 2 for a usage error.\n"
               f"environment: {CONFIG_ENV}: the YAML when --config is not given (as the connector reads it);\n"
               "  LMCACHE_<KEY> (e.g. LMCACHE_CHUNK_SIZE): LMCache's variables, over the YAML's values;\n"
               "  HF_HUB_CACHE / HF_HOME: where --model looks up a Hugging Face id's config.json.")
    parser.add_argument("--config", metavar="YAML", default=None,
                        help=f"the LMCache YAML (default: ${CONFIG_ENV})")
    parser.add_argument("--extra-config", metavar="JSON", default=None,
                        help="vLLM's kv_connector_extra_config as JSON, e.g. '{\"hma_remote_timeout_s\": 1.0}'")
    parser.add_argument("--model", metavar="DIR_OR_HF_ID", default=None,
                        help="estimate bytes per stored token and tokens per tier for this model: a model "
                             "directory, or a Hugging Face id whose config.json is in the local cache "
                             "(nothing is downloaded, no weights are read)")
    parser.add_argument("--kv-dtype", metavar="DTYPE", default=None, choices=sorted(DTYPE_BYTES),
                        help="the KV cache's dtype for the estimate (vLLM's --kv-cache-dtype; default: the "
                             "model's, float32 counted as bfloat16)")
    parser.add_argument("--max-num-batched-tokens", metavar="N", type=int, default=PREFILL_STEP,
                        help="vLLM's --max-num-batched-tokens, for the estimate of a gated-delta-net model: vLLM "
                             f"hands recurrent states over only where a prefill step ends (default {PREFILL_STEP})")
    return parser


def parse_extra(text: Optional[str]) -> dict:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-config is not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise UsageError(f"--extra-config must be a JSON object (kv_connector_extra_config), got {text!r}")
    return extra


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = parse_extra(args.extra_config)
    except UsageError as exc:
        print(f"lmcache-hma check: {exc}", file=sys.stderr)
        return 2
    if args.max_num_batched_tokens <= 0:
        print("lmcache-hma check: --max-num-batched-tokens must be > 0", file=sys.stderr)
        return 2
    return run(args.config, extra, args.model, args.kv_dtype, out=lambda s: print(s, flush=True),
               prefill_step=args.max_num_batched_tokens)


if __name__ == "__main__":
    sys.exit(main())
