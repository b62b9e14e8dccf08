"""Prometheus metrics, served at ``GET /metrics``.

The figures a job produces are recorded by the Celery worker that drives it, while ``/metrics`` is
served by the web process, and a deployment runs several of each. So the job figures are not
counted in process memory where events happen: ``DatabaseCollector`` derives them from the
database at scrape time, which makes every web replica report the same, complete numbers.

- From the job event log (``JobEvent``), read incrementally: each scrape reads only the events
  appended since the last one (by id). An id below the cursor that was missing when read (a
  transaction still open then) is looked for again at later scrapes, for the ``GAP_WINDOW`` ids
  below the newest, so events committed out of id order are counted once they commit.
  ``step.finished`` gives steps and step latency by stage, ``control.transition`` transitions and
  their predicted and actual cost, ``control.trigger`` triggers by kind.
- From the rows, fresh at each scrape: jobs by state, proposals by state, approval wait time (the
  time from a proposal to a person's decision).
- In process: API latency by route and method (``RequestLatencyMiddleware``), per web process.

Counters restart from the whole history whenever a web process starts, which Prometheus sees as a
counter that kept rising: ``rate()`` and ``increase()`` stay right. Every web replica exports the
same database-derived series; aggregate them with ``max by (...)``, not ``sum``.

``NEREUS_METRICS_TOKEN``: when set, ``/metrics`` requires ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

from django.db.models import Count, Q
from django.http import HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TRANSITION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
APPROVAL_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

EVENT_KINDS = ("step.finished", "control.transition", "control.trigger")
GAP_WINDOW = 1000
"""How far below the newest event id a missing id is still expected to commit."""
CHUNK = 5000

REGISTRY = CollectorRegistry(auto_describe=False)

HTTP_LATENCY = Histogram(
    "nereus_http_request_duration_seconds",
    "Time to answer an HTTP request, by URL route and method (this web process).",
    ["route", "method"],
    buckets=HTTP_BUCKETS,
    registry=REGISTRY,
)
HTTP_RESPONSES = Counter(
    "nereus_http_responses",
    "HTTP responses by URL route, method and status class (this web process).",
    ["route", "method", "status"],
    registry=REGISTRY,
)
ProcessCollector(namespace="nereus_web", registry=REGISTRY)


class _Hist:
    """A histogram's cumulative state: counts per bucket (non-cumulative), sum, count."""

    def __init__(self, buckets: Sequence[float]):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


class _EventTotals:
    """Everything derived from the event log, accumulated as events are read."""

    def __init__(self):
        self.steps: dict[tuple[str, str], int] = defaultdict(int)
        self.step_seconds: dict[str, _Hist] = defaultdict(lambda: _Hist(STEP_BUCKETS))
        self.stage_seconds: dict[tuple[str, str], _Hist] = defaultdict(lambda: _Hist(STEP_BUCKETS))
        self.transitions: dict[tuple[str, str], int] = defaultdict(int)
        self.transition_predicted: dict[str, _Hist] = defaultdict(lambda: _Hist(TRANSITION_BUCKETS))
        self.transition_actual: dict[str, _Hist] = defaultdict(lambda: _Hist(TRANSITION_BUCKETS))
        self.triggers: dict[str, int] = defaultdict(int)

    def add(self, kind: str, data) -> None:
        if not isinstance(data, dict):
            return
        mode = "simulated" if data.get("simulated") else "real"
        if kind == "step.finished":
            self.steps[(mode, "true" if data.get("ok", True) else "false")] += 1
            total = _number(data.get("step_s"))
            if total is not None:
                self.step_seconds[mode].observe(total)
            stages = data.get("stage_s")
            if isinstance(stages, dict):
                for stage, seconds in stages.items():
                    seconds = _number(seconds)
                    if seconds is not None:
                        self.stage_seconds[(mode, str(stage)[:64])].observe(seconds)
        elif kind == "control.transition":
            self.transitions[(mode, "done" if data.get("ok") else "failed")] += 1
            predicted = _number(data.get("predicted_s"))
            if predicted is not None:
                self.transition_predicted[mode].observe(predicted)
            actual = _number(data.get("actual_s"))
            if actual is not None:
                self.transition_actual[mode].observe(actual)
        elif kind == "control.trigger":
            self.triggers[str(data.get("kind") or "unknown")[:64]] += 1


class DatabaseCollector:
    """Reads the job figures from the database at scrape time (see the module's docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cursor = 0
        self._gaps: set[int] = set()
        self._totals = _EventTotals()

    def describe(self) -> Iterable:
        return []  # nothing to check at registration; collect() queries the database

    def _read_events(self) -> None:
        from webapp.jobs.models import JobEvent

        newest = JobEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        if newest < self._cursor:
            # The log lost events (a database restored from an older backup, a test's flush):
            # count again from the start rather than stay blind below the old cursor.
            self._cursor, self._gaps, self._totals = 0, set(), _EventTotals()
        if self._gaps:
            filled = list(
                JobEvent.objects.filter(pk__in=self._gaps).values_list("pk", "kind", "data")
            )
            for pk, kind, data in filled:
                self._gaps.discard(pk)
                if kind in EVENT_KINDS:
                    self._totals.add(kind, data)
        while True:
            rows = list(
                JobEvent.objects.filter(pk__gt=self._cursor)
                .order_by("pk")
                .values_list("pk", "kind")[:CHUNK]
            )
            if not rows:
                break
            wanted = [pk for pk, kind in rows if kind in EVENT_KINDS]
            data = dict(JobEvent.objects.filter(pk__in=wanted).values_list("pk", "data"))
            expected = self._cursor + 1
            for pk, kind in rows:
                self._gaps.update(range(max(expected, pk - GAP_WINDOW), pk))
                expected = pk + 1
                if kind in EVENT_KINDS:
                    self._totals.add(kind, data.get(pk))
            self._cursor = rows[-1][0]
            if len(rows) < CHUNK:
                break
        self._gaps = {gap for gap in self._gaps if gap > self._cursor - GAP_WINDOW}

    def collect(self):
        from webapp.jobs.models import Job, JobState
        from webapp.plans.models import Proposal, ProposalState

        with self._lock:
            self._read_events()
            totals = self._totals

            jobs = GaugeMetricFamily("nereus_jobs", "Jobs by state.", labels=["state"])
            counts = dict(Job.objects.order_by().values_list("state").annotate(n=Count("id")))
            for state in JobState.values:
                jobs.add_metric([state], counts.get(state, 0))
            yield jobs

            steps = CounterMetricFamily(
                "nereus_steps",
                "Training steps finished (step.finished events), real or simulated, by outcome.",
                labels=["mode", "ok"],
            )
            for (mode, ok), n in sorted(totals.steps.items()):
                steps.add_metric([mode, ok], n)
            yield steps

            step_s = HistogramMetricFamily(
                "nereus_step_duration_seconds",
                "Wall time of a training step.",
                labels=["mode"],
            )
            for mode, hist in sorted(totals.step_seconds.items()):
                step_s.add_metric([mode], hist.buckets(), hist.sum)
            yield step_s

            stage_s = HistogramMetricFamily(
                "nereus_step_stage_duration_seconds",
                "Wall time of a stage of a training step (generate, score, train, ...).",
                labels=["mode", "stage"],
            )
            for (mode, stage), hist in sorted(totals.stage_seconds.items()):
                stage_s.add_metric([mode, stage], hist.buckets(), hist.sum)
            yield stage_s

            transitions = CounterMetricFamily(
                "nereus_transitions",
                "Transitions between parallel layouts (control.transition events), by outcome.",
                labels=["mode", "outcome"],
            )
            for (mode, outcome), n in sorted(totals.transitions.items()):
                transitions.add_metric([mode, outcome], n)
            yield transitions

            for name, source, doc in (
                (
                    "nereus_transition_predicted_seconds",
                    totals.transition_predicted,
                    "The planner's predicted cost of a transition.",
                ),
                (
                    "nereus_transition_actual_seconds",
                    totals.transition_actual,
                    "The measured cost of a transition.",
                ),
            ):
                family = HistogramMetricFamily(name, doc, labels=["mode"])
                for mode, hist in sorted(source.items()):
                    family.add_metric([mode], hist.buckets(), hist.sum)
                yield family

            triggers = CounterMetricFamily(
                "nereus_triggers",
                "Controller triggers (control.trigger events), by kind.",
                labels=["kind"],
            )
            for kind, n in sorted(totals.triggers.items()):
                triggers.add_metric([kind], n)
            yield triggers

        proposals = GaugeMetricFamily("nereus_proposals", "Proposals by state.", labels=["state"])
        counts = dict(Proposal.objects.order_by().values_list("state").annotate(n=Count("id")))
        for state in ProposalState.values:
            proposals.add_metric([state], counts.get(state, 0))
        yield proposals

        waits: dict[str, _Hist] = defaultdict(lambda: _Hist(APPROVAL_BUCKETS))
        decided = Proposal.objects.filter(
            Q(state=ProposalState.APPROVED) | Q(state=ProposalState.REJECTED),
            decided_at__isnull=False,
        ).values_list("state", "created_at", "decided_at")
        for state, created, decided_at in decided:
            waits[state].observe(max(0.0, (decided_at - created).total_seconds()))
        approval = HistogramMetricFamily(
            "nereus_approval_wait_seconds",
            "Time from a proposal to a person's decision, by decision.",
            labels=["decision"],
        )
        for state, hist in sorted(waits.items()):
            approval.add_metric([state], hist.buckets(), hist.sum)
        yield approval

        up = GaugeMetricFamily(
            "nereus_metrics_scrape_timestamp_seconds", "When this scrape read the database."
        )
        up.add_metric([], time.time())
        yield up


COLLECTOR = DatabaseCollector()
REGISTRY.register(COLLECTOR)


def metrics_view(request):
    """The Prometheus text exposition of ``REGISTRY``."""
    token = os.environ.get("NEREUS_METRICS_TOKEN", "")
    if token:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            response = HttpResponse("metrics need a bearer token\n", status=401)
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
