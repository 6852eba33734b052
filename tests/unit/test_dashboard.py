"""The Grafana dashboard (ops/grafana/lastevent.json) against the metrics the processes
define: a renamed or dropped metric, or a label it no longer has, fails here rather than
as an empty panel in production; a new metric with no panel fails too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from service.api import metrics as api_metrics
from workers import metrics as worker_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "lastevent.json"
NAME = re.compile(r"\blastevent_[a-z0-9_]+")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
TARGET_LABELS = {"le", "instance", "job"}  # the histogram's buckets; what Prometheus adds
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}


def defined() -> dict[str, MetricWrapperBase]:
    """Every metric of the API's and the workers' (and recorders') processes."""
    found = {}
    for module in (api_metrics, worker_metrics):
        for metric in vars(module).values():
            if isinstance(metric, MetricWrapperBase):
                (family,) = metric.describe()
                found[family.name] = metric
    return found


def series(metrics: dict[str, MetricWrapperBase]) -> dict[str, MetricWrapperBase]:
    """The sample names a scrape shows for each metric (a counter's ``_total``...)."""
    out = {}
    for name, metric in metrics.items():
        (family,) = metric.describe()
        for suffix in SUFFIXES[family.type]:
            out[name + suffix] = metric
    return out


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def test_the_dashboard_names_only_metrics_that_exist_with_their_labels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = series(defined())
    exprs = expressions(dashboard)
    assert exprs
    for expr in exprs:
        names = NAME.findall(expr)
        assert names, expr
        missing = [n for n in names if n not in known]
        assert not missing, f"{expr}: no such metric {missing}"
        labels = TARGET_LABELS.union(*(known[n]._labelnames for n in names))
        for group in GROUPING.findall(expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= labels, f"{expr}: no such label {sorted(used - labels)}"


def test_every_metric_has_a_panel() -> None:
    referenced = set()
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        referenced.update(NAME.findall(expr))
    known = series(defined())
    shown = {known[n].describe()[0].name for n in referenced}
    assert sorted(set(defined()) - shown) == []


def test_every_panel_queries_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    source = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    shown = [p for p in panels(dashboard["panels"]) if p["type"] != "row"]
    assert shown
    for panel in shown:
        assert panel["datasource"] == source, panel["title"]
        assert all(t["datasource"] == source for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
