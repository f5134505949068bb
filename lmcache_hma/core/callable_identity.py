"""What a callable ``hf_overrides`` does, named the same in every process that runs the same code.

Runs in both halves at start (``identity.model_identity``).

A config-to-config function changes the model, hence its KV, through its code and through
every value that code reads. The key therefore covers, for a function: its module, qualified
name and code (nested functions' code included), its default and keyword-only default
arguments, the values in its closure cells and the globals its code reads (and, recursively,
the same for every function among those values, with a guard against cycles); for a
``functools.partial``: its function and what it binds; for a bound method: its function and
its object. Two closures over another ``rope_theta``, or two functions that differ only in a
default, get two keys; the same definition in two processes or two places gets one.

Values are described by what they are: numbers, strings, bytes, containers (sets in sorted
order, so ``PYTHONHASHSEED`` does not matter), enum members, dataclass instances (all fields),
torch dtypes, loggers (by name: logging changes no config). Modules and importable classes are
named, not read: their contents are the installed code, like vLLM's model code, which no key
names either.

Any other value (an object whose repr holds an address, a class defined inside a function, a
lock, ...) has no description that another process would share. The key is then per process:
a random nonce of this process goes into it, with the object's identity, so it is never shared
with a deployment whose function may behave otherwise. Never a shared key for differing
behaviour; the price is that such a deployment shares nothing, not even with itself after a
restart, and a warning says once why. (A deployment still works: the scheduler only hashes
prompts with the seed and each worker only names and verifies its objects with the fingerprint,
so neither needs the other's key to agree.)
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import logging
import secrets
import sys
import types

from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_PROCESS_NONCE = secrets.token_hex(16)  # only in keys whose callable reads an undescribable value
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType,
                types.ClassMethodDescriptorType)
_LRU_CACHE_WRAPPER = type(functools.lru_cache()(len))  # behaves as the function it wraps
_warned: set[str] = set()


def callable_key(fn) -> str:
    """``fn``'s name and a digest of what it does, or a per-process key (see the module doc)."""
    walk = _Walk()
    text = walk.describe(fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if walk.unstable:
        reason = f"{name} reads {walk.unstable[0]}"
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("LMCacheHMA: hf_overrides %s, which has no description that another "
                           "process would share: this process's keys are its own (nothing "
                           "stored by another process or before a restart is loaded)", reason)
        text = f"per-process:{_PROCESS_NONCE}:{text}"
    return f"{name}#{hashlib.sha256(text.encode()).hexdigest()[:32]}"


class _Walk:
    """One description: objects on the path (cycle guard), finished ones (shared references)."""

    def __init__(self):
        self.unstable: list[str] = []  # what has no stable description, in the order met
        self._path: list[int] = []
        self._done: dict[int, str] = {}
        self._alive: list = []  # what ``_done`` names by id stays alive while the walk runs

    def describe(self, value) -> str:
        if isinstance(value, _SCALARS):
            return repr(value)  # float's repr is exact and the same everywhere
        key = id(value)
        if key in self._done:
            return self._done[key]
        if key in self._path:  # a cycle: named by how far up it points, the same in every process
            return f"<cycle {len(self._path) - self._path.index(key)}>"
        self._path.append(key)
        try:
            text = self._describe(value)
        finally:
            self._path.pop()
        self._done[key] = text
        self._alive.append(value)
        return text

    def _describe(self, value) -> str:
        d = self.describe
        if isinstance(value, (tuple, list)):
            return f"{type(value).__name__}[{','.join(d(v) for v in value)}]"
        if isinstance(value, (set, frozenset)):
            return f"{type(value).__name__}{{{','.join(sorted(d(v) for v in value))}}}"
        if isinstance(value, dict):
            items = sorted(f"{d(k)}:{d(v)}" for k, v in value.items())
            return f"{type(value).__name__}{{{','.join(items)}}}"
        if isinstance(value, types.FunctionType):
            return self._function(value)
        if isinstance(value, functools.partial):
            kw = sorted(f"{k}={d(v)}" for k, v in value.keywords.items())
            return f"partial({d(value.func)};{','.join(d(a) for a in value.args)};{','.join(kw)})"
        if isinstance(value, types.MethodType):
            return f"method({d(value.__func__)};{d(value.__self__)})"
        if isinstance(value, _LRU_CACHE_WRAPPER):
            return f"lru_cache({d(value.__wrapped__)})"
        if isinstance(value, (staticmethod, classmethod)):
            return f"{type(value).__name__}({d(value.__func__)})"
        if isinstance(value, types.BuiltinFunctionType):  # len, math.sqrt, or a C object's method
            owner = value.__self__
            bound = "" if owner is None or isinstance(owner, types.ModuleType) else f";{d(owner)}"
            return f"builtin({getattr(owner, '__name__', '')}.{value.__qualname__}{bound})"
        if isinstance(value, _DESCRIPTORS):  # str.upper, dict.get, object.__init__
            return f"descriptor({self._named(value.__objclass__, 'class')}.{value.__name__})"
        if isinstance(value, types.MethodWrapperType):  # (1).__add__
            return f"method-wrapper({value.__name__};{d(value.__self__)})"
        if isinstance(value, types.ModuleType):
            return f"module({value.__name__})"
        if isinstance(value, type):
            return self._named(value, "class")
        if isinstance(value, enum.Enum):
            return f"enum({self._named(type(value), 'class')}.{value.name})"
        if dataclasses.is_dataclass(value):
            fields = ",".join(f"{f.name}={d(getattr(value, f.name))}" for f in dataclasses.fields(value))
            call = type(value).__call__ if callable(value) else None  # a callable dataclass: its code
            body = f";{d(call)}" if isinstance(call, types.FunctionType) else ""
            return f"{self._named(type(value), 'dataclass')}({fields}){body}"
        if isinstance(value, logging.Logger):  # a module's logger: what it logs changes no config
            return f"logger({value.name})"
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.dtype):
            return f"dtype({value})"
        return self._per_process(value, f"a {type(value).__qualname__}")

    def _function(self, fn: types.FunctionType) -> str:
        d = self.describe
        code = fn.__code__
        parts = [f"{fn.__module__}.{fn.__qualname__}#{_code_digest(code)}",
                 f"defaults={d(fn.__defaults__)}", f"kwdefaults={d(fn.__kwdefaults__)}"]
        if fn.__dict__:  # attributes set on the function, which its code may read
            parts.append(f"attributes={d(fn.__dict__)}")
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                parts.append(f"cell {name}={d(cell.cell_contents)}")
            except ValueError:  # a cell not yet filled
                parts.append(f"cell {name} empty")
        builtins = fn.__builtins__ if isinstance(fn.__builtins__, dict) else vars(fn.__builtins__)
        for name in sorted(_globals_read(code)):
            if name in fn.__globals__:
                parts.append(f"global {name}={d(fn.__globals__[name])}")
            elif name in builtins:
                parts.append(f"global {name}=builtin {d(builtins[name])}")
            else:
                parts.append(f"global {name} unbound")
        return "function(" + ";".join(parts) + ")"

    def _named(self, cls: type, kind: str) -> str:
        """A class by where it is imported from; one that is not importable has no stable name."""
        module = sys.modules.get(cls.__module__)
        found = module
        for part in cls.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is not cls:
            return self._per_process(cls, f"the class {cls.__qualname__} (not importable by its name)")
        return f"{kind}({cls.__module__}.{cls.__qualname__})"

    def _per_process(self, value, what: str) -> str:
        self.unstable.append(what)
        return f"<{what} {id(value)}>"  # kept apart from other objects in this process too


@functools.lru_cache(maxsize=1024)
def _globals_read(code: types.CodeType) -> frozenset:
    """Names the code (and the code of functions defined in it) reads or writes as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_read(const)
    return frozenset(names)


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(_const_key(const).encode() + b"\0")
    return h.hexdigest()[:32]


def _const_key(const) -> str:
    if isinstance(const, types.CodeType):  # a nested function (its repr holds an address)
        return _code_digest(const)
    if isinstance(const, frozenset):  # ``x in {...}``: its order depends on PYTHONHASHSEED
        return "frozenset(" + ",".join(sorted(_const_key(c) for c in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_key(c) for c in const) + ")"
    return repr(const)
