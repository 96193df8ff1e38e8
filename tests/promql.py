"""What a Grafana dashboard's PromQL reads (metric names, labels, label values) and what a
metrics endpoint serves, for checking the one against the other."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Labels a Prometheus scrape adds to every series (not the endpoint's own).
SCRAPE_LABELS = frozenset({"job", "instance"})
#: Series Prometheus itself makes for every target (not the endpoint).
PROMETHEUS_SERIES = frozenset({"up"})
#: PromQL words that look like names but are not metrics.
KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
    }
)
#: Grafana's interval variables, as the durations they stand for in a check.
INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}

_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard, where it is, and its legend's labels."""

    where: str
    expr: str
    legend_labels: frozenset[str] = frozenset()


@dataclass
class Used:
    """What one expression reads: metric names, the labels matched on each named selector,
    the labels it groups or joins by (or a ``label_values`` asks for), and the values it
    matches each label against."""

    metrics: set[str] = field(default_factory=set)
    selector_labels: dict[str, set[str]] = field(default_factory=dict)
    other_labels: set[str] = field(default_factory=set)
    values: dict[str, set[str]] = field(default_factory=dict)


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """Every PromQL expression of the dashboard: each panel's targets (rows' panels too) and
    each query variable's query."""
    out: list[Query] = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            legend = frozenset(
                re.findall(r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}", target.get("legendFormat", ""))
            )
            out.append(Query(f"panel {panel.get('title')!r}", target["expr"], legend))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, Mapping) else query
            out.append(Query(f"variable {variable['name']!r}", text))
    return out


def _panels(panels: list[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Every panel, and the panels of each row, in order."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def without_variables(expr: str) -> str:
    """``expr`` as Prometheus would get it: interval variables as durations, any other
    variable (``$host``, ``${datasource}``) as ``.*`` (they are only used in regex matches)."""
    for variable, duration in INTERVALS.items():
        expr = expr.replace(variable, duration)
    return re.sub(r"\$\{?[a-zA-Z_]\w*\}?", ".*", expr)


def promql(expr: str) -> str:
    """The PromQL of a query: a variable's ``label_values(SELECTOR, LABEL)`` is Grafana's,
    reading SELECTOR's series."""
    match = _LABEL_VALUES.match(expr)
    return match[1] if match else expr


def used(expr: str) -> Used:
    """What ``expr`` (without Grafana variables) reads; ``label_values(SELECTOR, LABEL)``
    reads SELECTOR and asks for LABEL."""
    out = Used()
    match = _LABEL_VALUES.match(expr)
    if match:
        expr = match[1]
        out.other_labels.add(match[2])
    rest = expr
    for selector in _SELECTOR.finditer(expr):
        name, matchers = selector[1], selector[2]
        labels = set()
        for label, _, value in _MATCHER.findall(matchers):
            labels.add(label)
            out.values.setdefault(label, set()).add(value)
        if name:
            out.metrics.add(name)
            out.selector_labels.setdefault(name, set()).update(labels)
        else:
            out.other_labels.update(labels)
    rest = _SELECTOR.sub(lambda m: " " + (m[1] or "") + " ", rest)
    for grouping in _GROUPING.finditer(rest):
        out.other_labels.update(x.strip() for x in grouping[2].split(",") if x.strip())
    rest = _GROUPING.sub(" ", rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range durations
    rest = re.sub(r'"[^"]*"', " ", rest)
    for name in _NAME.finditer(rest):
        after = rest[name.end() :].lstrip()
        if after.startswith("(") or name[0].lower() in KEYWORDS:
            continue  # a function or an operator word
        out.metrics.add(name[0])
    return out


def served(exposition: str) -> dict[str, set[str]]:
    """Every sample name in a Prometheus text exposition, with its label names."""
    names: dict[str, set[str]] = {}
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        assert match, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match[2] or ""))
        names.setdefault(match[1], set()).update(labels)
    return names


def declared(exposition: str) -> set[str]:
    """The sample names the ``# TYPE`` lines of an exposition promise (a counter's with
    ``_total``, a histogram's ``_bucket``, ``_count`` and ``_sum``), samples or none."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "histogram":
                names |= {name + "_bucket", name + "_count", name + "_sum"}
            elif kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            else:
                names.add(name)
    return names
