"""The Grafana dashboard's PromQL (k8s/monitoring/grafana-dashboard.json) and the metric names
it reads, parsed with promql-parser (a port of Prometheus' own parser). The unit tests check the
queries offline; the integration tests check that the running service exports every name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser

DASHBOARD = Path(__file__).resolve().parents[1] / "k8s" / "monitoring" / "grafana-dashboard.json"
# Grafana's own variables, with a value each so that a query parses as Prometheus would see it.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<expr>.+),\s*)?(?P<label>\w+)\)$")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables' label_values()
    selectors, Grafana variables still in them."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = _LABEL_VALUES.match(query.strip())
            assert match, f"variable {variable['name']}: only label_values() is supported"
            if match["expr"]:
                exprs.append(match["expr"])
    return exprs


def variables_used(expr: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(expr)}


def substitute(expr: str, dashboard: dict) -> str:
    """expr with each Grafana variable replaced by its current value (or a placeholder)."""
    values = dict(GRAFANA_BUILTINS)
    for variable in dashboard.get("templating", {}).get("list", []):
        values[variable["name"]] = str(variable.get("current", {}).get("value") or "x")
    return _VARIABLE.sub(lambda m: values[m[1] or m[2]], expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (every vector and range selector).

    Raises:
        ValueError: the expression is not valid PromQL, or selects by something else than a
            metric name.
    """
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if not node.name:
                raise ValueError(f"a selector without a metric name in {expr!r}")
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def dashboard_metric_names(dashboard: dict | None = None) -> set[str]:
    """Every metric name the dashboard's queries read, as Prometheus stores them."""
    dashboard = dashboard or load()
    return {n for expr in queries(dashboard) for n in metric_names(substitute(expr, dashboard))}
