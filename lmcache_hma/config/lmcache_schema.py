"""LMCache's YAML schema, as LMCache 0.5.6 defines it: every key's name, aliases, type, default and
how LMCache parses it from an ``LMCACHE_<KEY>`` environment variable.

Read from ``lmcache.v1.config`` (its ``_CONFIG_DEFINITIONS`` and ``_CONFIG_ALIASES``, private
names of the one LMCache release ``store.lmcache_compat`` checks for) and from
``lmcache.v1.config_base`` (``_parse_quoted_string``, the unquoting LMCache applies to every
environment value). Nothing else of LMCache is touched here; nothing of lmcache_hma is imported.
"""

from __future__ import annotations

from typing import Any, Callable


def config_keys() -> set[str]:
    """Every key an LMCache YAML file may hold (names and their aliases)."""
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS

    return set(_CONFIG_DEFINITIONS) | set(_CONFIG_ALIASES)


def config_definitions() -> tuple[dict, dict]:
    """``({key: (type, default)}, {alias: key})`` of LMCache's YAML keys (``config.lmcache_keys``
    checks each value's type against them and tells a default from a setting)."""
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS

    return ({k: (d["type"], d["default"]) for k, d in _CONFIG_DEFINITIONS.items()}, dict(_CONFIG_ALIASES))


def env_converter(key: str) -> Callable[[str], Any]:
    """How LMCache turns the text of ``LMCACHE_<KEY>`` into ``key``'s value (an alias: as the key
    it stands for): its ``env_converter``, after its unquoting of the text."""
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS
    from lmcache.v1.config_base import _parse_quoted_string

    convert = _CONFIG_DEFINITIONS[_CONFIG_ALIASES.get(key, key)].get("env_converter") or (lambda text: text)
    return lambda text: convert(_parse_quoted_string(text))
