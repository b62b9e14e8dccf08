"""Events: the one way the runtime tells the world what happened.

The runtime hands each event to an ``EventSink``; the web service's sink appends it to the job's
event log in the database and publishes it on the channel layer; a CLI sink prints it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any, Protocol


def finite(value: Any) -> Any:
    """``value`` as strict JSON holds it: NaN and infinities (an unreachable plan's cost, a
    payback that never comes) become null, which JSON has and PostgreSQL's jsonb and browsers'
    ``JSON.parse`` accept; mappings get string keys, tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class RepeatedKeyError(ValueError):
    """A JSON object giving one key twice (``json`` keeps the last without a word)."""

    def __init__(self, key: str):
        super().__init__(f"{key!r} is given twice in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: the object, raising ``RepeatedKeyError`` (a
    ValueError) on a key given twice, whatever its values, as the catalog loader does."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKeyError(key)
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeEvent:
    """Something that happened to a job, with JSON-serialisable data."""

    kind: str
    """Dotted event type, e.g. ``job.started``, ``step.finished``, ``job.finished``."""
    data: Mapping[str, Any]
    at: float = dataclasses.field(default_factory=time.time)
    """Wall-clock time (seconds since the epoch) when it happened."""

    def __post_init__(self) -> None:
        if not self.kind or not all(part.isidentifier() for part in self.kind.split(".")):
            raise ValueError(
                f"kind: expected a dotted name like 'step.finished', got {self.kind!r}"
            )


class EventSink(Protocol):
    """Receives the events of one job, in order."""

    def emit(self, event: RuntimeEvent) -> None: ...


class ListSink:
    """Keeps events in memory (tests, and the CLI's summary)."""

    def __init__(self) -> None:
        self.events: list[RuntimeEvent] = []

    def emit(self, event: RuntimeEvent) -> None:
        self.events.append(event)

    def of_kind(self, kind: str) -> list[RuntimeEvent]:
        return [e for e in self.events if e.kind == kind]
