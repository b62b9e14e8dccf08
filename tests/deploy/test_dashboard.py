"""The Grafana dashboard aggregates each metric the way it is exported.

Every web replica exports the same database-derived series (``webapp/observability/metrics.py``),
so a query over one takes the ``max`` across replicas, grouped by all of the metric's own labels;
a ``sum`` would count each figure once per replica. The HTTP metrics are each web process's own
and add up with ``sum``."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "nereus.json"

# The database-derived metrics as exposed, with their labels (webapp/observability/metrics.py).
DATABASE_METRICS = {
    "nereus_jobs": {"state"},
    "nereus_steps_total": {"mode", "ok"},
    "nereus_step_duration_seconds": {"mode"},
    "nereus_step_stage_duration_seconds": {"mode", "stage"},
    "nereus_transitions_total": {"mode", "outcome"},
    "nereus_transition_predicted_seconds": {"mode"},
    "nereus_transition_actual_seconds": {"mode"},
    "nereus_triggers_total": {"kind"},
    "nereus_proposals": {"state"},
    "nereus_approval_wait_seconds": {"decision"},
}
PROCESS_METRICS = {
    "nereus_http_request_duration_seconds": {"route", "method"},
    "nereus_http_responses_total": {"route", "method", "status"},
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

METRIC = re.compile(r"\bnereus_[a-z_]+")
MAX = re.compile(r"\bmax\s*(?:by\s*\(([^)]*)\))?\s*\(")
SUM = re.compile(r"\bsum\b")
EQUALITY_MATCHER = re.compile(r"(\w+)\s*=\s*\"")


def _family(name: str) -> tuple[str, bool]:
    """The metric a series name belongs to, and whether it is a histogram's buckets."""
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and (base in DATABASE_METRICS or base in PROCESS_METRICS):
            return base, suffix == "_bucket"
    return name, False


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_query_names_metrics_the_service_exports():
    for expr in _queries():
        for name in METRIC.findall(expr):
            family, _ = _family(name)
            assert family in DATABASE_METRICS or family in PROCESS_METRICS, (family, expr)


def test_database_derived_metrics_take_the_max_across_replicas_never_the_sum():
    checked = set()
    for expr in _queries():
        families = {_family(n) for n in METRIC.findall(expr)}
        database = {(f, bucket) for f, bucket in families if f in DATABASE_METRICS}
        if not database:
            continue
        assert not SUM.search(expr), f"sums a series every replica exports: {expr}"
        groupings = [m.group(1) for m in MAX.finditer(expr)]
        assert groupings, f"no max across replicas: {expr}"
        fixed = set(EQUALITY_MATCHER.findall(expr))
        labels = set().union(*(DATABASE_METRICS[f] for f, _ in database))
        if any(bucket for _, bucket in database):
            labels.add("le")
        for grouping in groupings:
            by = {label.strip() for label in (grouping or "").split(",") if label.strip()}
            # Every label the metric has (unless a matcher fixes it), so that max only picks
            # between replicas' copies of one series; and none besides (an instance label would
            # keep the copies apart).
            assert labels - fixed <= by, f"max merges distinct series ({labels - by}): {expr}"
            assert by <= labels, f"max by a label the metric lacks ({by - labels}): {expr}"
        checked |= {f for f, _ in database}
    assert checked, "the dashboard shows no database-derived metric"


def test_per_process_http_metrics_add_up_across_web_processes():
    seen = False
    for expr in _queries():
        families = {_family(n)[0] for n in METRIC.findall(expr)}
        if families & PROCESS_METRICS.keys():
            seen = True
            assert SUM.search(expr) and not MAX.search(expr), expr
    assert seen
