"""examples/grafana_dashboard.json against the metrics the connector defines.

No engine, no vLLM import: ``METRICS`` is read from ``lmcache_hma/metrics.py``'s source
(it is a plain literal; importing the module would pull in vLLM, ~8 s). Every
``vllm:lmcache_hma_*`` series a panel queries must be one ``HMAPromMetrics`` exposes
(counter ``<name>_total``, histogram ``<name>_bucket|_sum|_count``, gauge ``<name>``), its
labels (``{label=...}`` matchers, ``by``/``without``/``on``/``ignoring`` lists, ``{{label}}``
legends) must exist on it, every query is filtered by ``$model_name``, and every metric has a
panel (so a new metric without one is noticed).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "examples" / "grafana_dashboard.json"
PREFIX = "vllm:lmcache_hma_"
BASE_LABELS = {"model_name", "engine"}  # vLLM's labels on every connector metric
DS_UID = "${DS_PROMETHEUS}"

# Metrics deliberately without a panel: name -> reason. Keep it empty unless a metric really
# has nothing to show on a dashboard.
NO_PANEL: dict[str, str] = {}

# (suffix, metric type) of the series prometheus_client exposes per metric.
_SERIES = (("_total", "counter"), ("_bucket", "histogram"), ("_sum", "histogram"),
           ("_count", "histogram"), ("", "gauge"))
_SELECTOR = re.compile(r"(vllm:lmcache_hma_[A-Za-z0-9_]+)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def load_metrics() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """``lmcache_hma.metrics.METRICS`` as it is in the source now."""
    path = REPO / "lmcache_hma" / "metrics.py"
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "METRICS":
            try:
                return ast.literal_eval(node.value)
            except ValueError:  # no longer a plain literal: import it (slow, pulls in vLLM)
                from lmcache_hma.metrics import METRICS
                return METRICS
    raise AssertionError(f"no METRICS assignment in {path}")


def resolve(series: str, metrics: dict) -> tuple[str, str]:
    """``vllm:lmcache_hma_<name><suffix>`` -> (name, suffix), or AssertionError."""
    assert series.startswith(PREFIX), series
    rest = series[len(PREFIX):]
    for suffix, kind in _SERIES:
        if rest.endswith(suffix):
            name = rest[:len(rest) - len(suffix)] if suffix else rest
            if name in metrics and metrics[name][0] == kind:
                return name, suffix
    raise AssertionError(f"{series}: not a series of any metric in METRICS "
                         f"(counters end in _total, histograms in _bucket/_sum/_count, gauges bare)")


def allowed_labels(series: str, metrics: dict) -> set[str]:
    name, suffix = resolve(series, metrics)
    return BASE_LABELS | set(metrics[name][2]) | ({"le"} if suffix == "_bucket" else set())


def _group_after(expr: str, i: int) -> str:
    """The balanced ``(...)`` starting at ``expr[i]`` (skipping blanks), or ''."""
    while i < len(expr) and expr[i].isspace():
        i += 1
    if i >= len(expr) or expr[i] != "(":
        return ""
    depth = 0
    for j in range(i, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[i:j + 1]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def _group_before(expr: str, i: int) -> str:
    """The balanced ``(...)`` ending just before ``expr[i]`` (skipping blanks), or ''."""
    i -= 1
    while i >= 0 and expr[i].isspace():
        i -= 1
    if i < 0 or expr[i] != ")":
        return ""
    depth = 0
    for j in range(i, -1, -1):
        depth += {")": 1, "(": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[j:i + 1]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def check_expr(expr: str, metrics: dict, legend: str = "") -> tuple[list[str], set[str]]:
    """Problems in one PromQL ``expr`` and the metric names it uses."""
    problems, used = [], set()
    where = f"expr {expr!r}"
    selectors = list(_SELECTOR.finditer(expr))
    if not selectors:
        problems.append(f"{where}: queries no {PREFIX}* metric")
    for m in selectors:
        series, block = m.group(1), m.group(2) or ""
        try:
            name, _ = resolve(series, metrics)
        except AssertionError as e:
            problems.append(f"{where}: {e}")
            continue
        used.add(name)
        matchers = {label: (op, value) for label, op, value in _MATCHER.findall(block)}
        if matchers.get("model_name") != ("=~", "$model_name"):
            problems.append(f'{where}: {series} is not filtered by model_name=~"$model_name"')
        for label in sorted(set(matchers) - allowed_labels(series, metrics)):
            problems.append(f"{where}: {series} has no label {label!r}")
    # Label lists: by/without apply to the aggregated argument (before or after the list);
    # on/ignoring/group_* are checked against every metric of the expression.
    by_labels: set[str] = set()
    for m in _LABEL_LIST.finditer(expr):
        keyword, labels = m.group(1), {s.strip() for s in m.group(2).split(",") if s.strip()}
        if keyword in ("by", "without"):
            scope = _group_after(expr, m.end()) or _group_before(expr, m.start())
            if not scope:
                problems.append(f"{where}: cannot find what {keyword} ({m.group(2)}) aggregates")
                continue
            if keyword == "by":
                by_labels |= labels
        else:
            scope = expr
        for s in _SELECTOR.finditer(scope):
            try:
                missing = labels - allowed_labels(s.group(1), metrics)
            except AssertionError:
                continue  # reported above
            for label in sorted(missing):
                problems.append(f"{where}: {keyword} ({m.group(2)}): {s.group(1)} has no label {label!r}")
    # {{label}} in the legend: must survive the aggregation (be in a by list), or with no
    # aggregation at all, be a label of every metric queried.
    for label in _LEGEND_LABEL.findall(legend):
        if by_labels:
            ok = label in by_labels
        else:
            try:
                ok = all(label in allowed_labels(s.group(1), metrics) for s in selectors)
            except AssertionError:
                ok = True  # reported above
        if not ok:
            problems.append(f"{where}: legend {legend!r} uses {{{{{label}}}}}, absent from the result")
    return problems, used


def _panels(panels: list) -> list:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))  # panels inside collapsed rows
    return out


def check_dashboard(dash: dict, metrics: dict) -> tuple[list[str], set[str]]:
    """Every problem found in the dashboard, and the metric names its panels use."""
    problems, used = [], set()
    panels = [p for p in _panels(dash.get("panels", [])) if p.get("type") != "row"]
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        problems.append(f"duplicate panel ids: {ids}")
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        title = p.get("title", "?")
        if p.get("type") not in ("timeseries", "stat"):
            problems.append(f"panel {title!r}: type {p.get('type')!r}, expected timeseries or stat")
        if (p.get("datasource") or {}).get("uid") != DS_UID:
            problems.append(f"panel {title!r}: datasource is not {DS_UID}")
        g = p.get("gridPos", {})
        if not (g.get("x", 0) >= 0 and g.get("w", 0) > 0 and g.get("h", 0) > 0 and g["x"] + g["w"] <= 24):
            problems.append(f"panel {title!r}: bad gridPos {g}")
        else:
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    if (x, y) in cells:
                        problems.append(f"panel {title!r} overlaps {cells[x, y]!r}")
                        break
                    cells[x, y] = title
                else:
                    continue
                break
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"panel {title!r}: no targets")
        for t in targets:
            if (t.get("datasource") or p.get("datasource") or {}).get("uid") != DS_UID:
                problems.append(f"panel {title!r} target {t.get('refId')}: datasource is not {DS_UID}")
            found, names = check_expr(t.get("expr", ""), metrics, t.get("legendFormat", ""))
            problems += [f"panel {title!r}: {f}" for f in found]
            used |= names
    # Template variables: the data source and the model_name query.
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("DS_PROMETHEUS", {})
    if (ds.get("type"), ds.get("query")) != ("datasource", "prometheus"):
        problems.append(f"no datasource variable DS_PROMETHEUS of type prometheus: {ds}")
    model = variables.get("model_name", {})
    query = model.get("query")
    query = query.get("query") if isinstance(query, dict) else query
    m = re.fullmatch(r"\s*label_values\(\s*([^,\s]+)\s*,\s*([A-Za-z_]\w*)\s*\)\s*", query or "")
    if model.get("type") != "query" or not m or m.group(2) != "model_name":
        problems.append(f"model_name variable is not a label_values(..., model_name) query: {query!r}")
    else:
        try:
            if "model_name" not in allowed_labels(m.group(1), metrics):
                problems.append(f"model_name variable: {m.group(1)} has no model_name label")
        except AssertionError as e:
            problems.append(f"model_name variable: {e}")
    return problems, used


def _load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_valid_json():
    dash = _load_dashboard()
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    panels = [p for p in _panels(dash["panels"]) if p.get("type") != "row"]
    assert 6 <= len(panels) <= 14, f"{len(panels)} panels: keep the dashboard small"


def test_dashboard_queries_match_metrics():
    problems, _ = check_dashboard(_load_dashboard(), load_metrics())
    assert not problems, "\n".join(problems)


def test_every_metric_has_a_panel():
    metrics = load_metrics()
    _, used = check_dashboard(_load_dashboard(), metrics)
    stale = {n for n in NO_PANEL if n not in metrics or n in used}
    assert not stale, f"NO_PANEL lists metrics that are gone or now have a panel: {sorted(stale)}"
    missing = set(metrics) - used - set(NO_PANEL)
    assert not missing, (f"metrics without a panel in {DASHBOARD.name}: {sorted(missing)} "
                         "(add a panel, or list them in NO_PANEL with the reason)")


def test_checker_catches_mistakes():
    """The checker itself: a misspelt metric, a wrong suffix, a foreign label, a missing filter."""
    metrics = load_metrics()
    f = 'model_name=~"$model_name"'
    bad = [
        f"sum(rate(vllm:lmcache_hma_hit_tokenz_total{{{f}}}[5m]))",        # no such metric
        f"sum(rate(vllm:lmcache_hma_load_seconds_total{{{f}}}[5m]))",      # histogram as counter
        f"sum by (kind) (rate(vllm:lmcache_hma_hit_tokens_total{{{f}}}[5m]))",  # hit_tokens has load
        f'sum(rate(vllm:lmcache_hma_loads_total{{{f}, tier="cpu"}}[5m]))',  # loads has no tier
        "sum(rate(vllm:lmcache_hma_lookups_total[5m]))",                    # not filtered
        f"sum(rate(vllm:lmcache_hma_lookups_total{{{f}}}[5m])) by (le)",     # le only on _bucket
    ]
    for expr in bad:
        assert check_expr(expr, metrics)[0], expr
    assert check_expr(f"sum(rate(vllm:lmcache_hma_lookups_total{{{f}}}[5m]))", metrics, "{{load}}")[0]
    good = f"histogram_quantile(0.99, sum by (le, load) (rate(vllm:lmcache_hma_load_seconds_bucket{{{f}}}[5m])))"
    assert check_expr(good, metrics, "p99 {{load}}") == ([], {"load_seconds"})
