"""LMCache's ``LMCACHE_<KEY>`` environment variables, read as LMCache 0.5.6's own loader reads them.

LMCache (``lmcache_get_or_create_config``) builds its config from these variables when no file
is named, and lets them override a file's values when one is (``update_config_from_env``); so
does ``settings.load_config``, whichever way the file was named. The same allow-list: one
variable per key and per alias of LMCache's YAML (``LMCACHE_CHUNK_SIZE`` for ``chunk_size``);
other ``LMCACHE_*`` names (``LMCACHE_CONFIG_FILE``, LMCache's logging and feature flags) are
not config keys. The same parsing: LMCache's unquoting, then its converter for the key
(``int``, ``float``, a comma list, JSON for ``extra_config``, ``file://`` stripped from
``local_disk``).

Stricter than LMCache in two ways, as the YAML is: a value LMCache cannot convert (it logs a
warning and keeps the default) is a ``ConfigError`` naming the variable; a boolean is
``true``/``false`` or ``1``/``0`` in any case (LMCache reads any other text as false). An empty
variable of a key whose value may be null is unset. The values then go through every check a
YAML value goes through, each message naming the variable (``source``).
"""

from __future__ import annotations

import json
import os
import typing
from typing import Any, Mapping, Optional

from lmcache_hma.config.errors import ConfigError
from lmcache_hma.config.lmcache_schema import config_definitions, env_converter

PREFIX = "LMCACHE_"
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def variable(key: str) -> str:
    """The environment variable LMCache reads for ``key``."""
    return f"{PREFIX}{key.upper()}"


def source(key: str) -> str:
    """Where a value read from ``key``'s variable is said to come from, in messages."""
    return f"the environment variable {variable(key)}"


def lmcache_variables(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """``{key: value}`` of every LMCache key whose variable is set, parsed and converted
    (``ConfigError`` naming the variable for a value that is not of the key's type)."""
    environ = os.environ if environ is None else environ
    defs, aliases = config_definitions()
    found = {}
    for key in [*defs, *aliases]:
        text = environ.get(variable(key))
        if text is not None:
            found[key] = _parse(key, text, defs[aliases.get(key, key)][0])
    return found


def _kind(typ: Any) -> tuple[Any, bool]:
    """(the type a value has, whether the key may be null)."""
    if typing.get_origin(typ) is typing.Union:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return typing.get_origin(args[0]) or args[0], True
    return typing.get_origin(typ) or typ, False


def _parse(key: str, text: str, typ: Any) -> Any:
    origin, nullable = _kind(typ)
    name = variable(key)
    # the value itself only where it cannot hold a secret (a URL's password, hma_shared_secret)
    shown = f"{name}={text!r}" if origin in (bool, int, float) else name
    if nullable and text.strip() == "":
        return None
    if origin is bool:
        word = text.strip().strip("'\"").lower()
        if word in _TRUE + _FALSE:
            return word in _TRUE
        raise ConfigError(f"the environment variable {shown}: {key} must be true or false (or 1 or 0); "
                          f"LMCache would read it as false")
    expected = {int: "an integer", float: "a number of GB, e.g. 5" if key.endswith("_size") else "a number",
                list: "a comma-separated list",
                dict: "a JSON object (e.g. '{\"hma_lookup_timeout_s\": 2}')"}.get(origin, "a string")
    try:
        value = env_converter(key)(text)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"the environment variable {shown}: {key} must be {expected} "
                          f"({' '.join(str(exc).split())})") from None
    if origin is dict and value is not None and not isinstance(value, dict):
        raise ConfigError(f"the environment variable {shown}: {key} must be {expected}")
    return value
