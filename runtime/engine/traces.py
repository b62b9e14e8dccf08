"""Traces of the world a job runs in: generated length over steps, slots over time, node failures.

A trace file is JSON Lines. The first line is the header, every other line one record:

    {"trace": "growth-16", "version": 1, "steps": 1000, "accelerator": "h100-sxm", "gpus": 16,
     "notice_s": 120}
    {"at_step": 0, "gen_len": 500}
    {"at_step": 1000, "gen_len": 8000}
    {"at_s": 3600, "gpus": 24}
    {"at_s": 7200, "fail_slot": 3}

``gen_len`` points are joined linearly (a held-out shape is any polyline); ``gpus`` sets the pool
size from that simulated time on; ``fail_slot`` kills one slot at that time (its state is lost; the
pool shrinks by one until a later ``gpus`` record). The header's optional ``notice_s`` (default 0)
is how long before a shrink of the pool the job is told of it, as clouds announce reclaiming a
spot instance (EC2 Spot: two minutes; GCP and Azure: 30 s): the slots to go stay usable, and
hold their state, until the shrink itself. Failures come unannounced. The header's optional
``len_sigma`` (default 0.6, 0 to 3) is the sigma of a lognormal spread of one response's length
around the step's ``gen_len``, its mean (0: every response has that length), and ``len_cap``
(default 4, 1 to 64) cuts a response at that many times the mean, as a max_tokens limit does;
``Trace.response_lengths`` draws them. ``generate`` makes seeded traces of the shapes the
experiments use; ``load`` reads a file and names the line and field of anything malformed.

Bounds: ``steps`` and ``at_step`` at most ``MAX_STEPS`` (a job's most), ``gen_len`` at most
``MAX_GEN_LEN`` tokens, ``gpus`` at most ``MAX_GPUS``, and the failures
since the last ``gpus`` record (or the start) must leave the pool at least one slot to run on.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
import reprlib
from pathlib import Path

from runtime.events import RepeatedKeyError, unique_keys

FORMAT_VERSION = 1
SPOT_NOTICE_S = 120.0
"""How long before reclaiming them a generated spot-like pool announces it: EC2 Spot's
interruption notice (the seed's availability traces are AWS's)."""
MAX_NOTICE_S = 3600.0
MAX_GPUS = 4096
"""The largest pool a trace gives: four times the seed's largest run. Planning and compiling
transitions over many more slots takes the simulated engine minutes a step (65,536 slots, the
planner's most, over a minute and a half for the first)."""
MAX_STEPS = 1_000_000
"""The most steps a trace runs (or places a ``gen_len`` point at): a job's most."""
MAX_GEN_LEN = 10_000_000
"""The most generated tokens a ``gen_len`` point gives (far above any model's context)."""
MAX_DIGITS = 100
"""Integers of more digits than this are not read as numbers (every bound above has far fewer);
a field holding one is refused by name, not by Python's limit on converting long integers."""
DEFAULT_LEN_SIGMA = 0.6
"""The sigma of a response's lognormal length around the step's mean, when the header gives none."""
MAX_LEN_SIGMA = 3
"""The widest spread a trace gives (at 3, the median response is 1% of the mean)."""
DEFAULT_LEN_CAP = 4.0
"""How many times the step's mean length a response is cut at, when the header gives none."""
MIN_LEN_CAP, MAX_LEN_CAP = 1, 64
"""The bounds of ``len_cap``: a cap below the mean would move the mean; 64 is far in the tail."""
HEADER_OPTIONS = ("notice_s", "len_sigma", "len_cap")
"""The header's optional fields."""
SHAPES = ("growth", "plateau", "step", "oscillate", "noisy", "shrink")


def min_steps(shape: str) -> int:
    """The fewest steps a generated ``shape`` has room for: its corners are distinct steps
    ('step' cuts three times, 'plateau' and 'shrink' bend once after a first stretch)."""
    return 4 if shape in ("plateau", "step", "shrink") else 1


class TraceError(ValueError):
    """A malformed trace: the message names the line and the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
    name: str
    steps: int
    accelerator: str
    gpus: int
    """Slots at time 0."""
    gen_len: tuple[tuple[int, float], ...]
    """(step, generated tokens) points, by step."""
    pool: tuple[tuple[float, int], ...] = ()
    """(simulated seconds, slots) changes, by time."""
    failures: tuple[tuple[float, int], ...] = ()
    """(simulated seconds, slot index) failures, by time."""
    notice_s: float = 0.0
    """How long before a shrink of the pool it is announced (0: unannounced)."""
    len_sigma: float = DEFAULT_LEN_SIGMA
    """The sigma of one response's lognormal length around the step's mean (0: the mean)."""
    len_cap: float = DEFAULT_LEN_CAP
    """A response is cut at this many times the step's mean length."""

    def response_lengths(self, step: int, count: int, rng: random.Random) -> list[int]:
        """``count`` responses' lengths at ``step``: the step's mean (``gen_len_at``) times a
        lognormal of mean 1 (mu = -sigma²/2), cut to 1 to ``len_cap`` times the mean, in whole
        tokens. One standard normal is drawn per response whatever the sigma, so one rng state
        gives the same quantiles at every sigma (at 0, every length is the mean). The cap takes
        a little off the mean: 0.4% at the defaults."""
        _int(count, "count")
        mean = self.gen_len_at(step)
        top = max(1, math.floor(self.len_cap * mean))  # rounding up would pass the cap
        mu = -(self.len_sigma**2) / 2
        return [
            min(top, max(1, round(mean * math.exp(mu + self.len_sigma * rng.gauss(0.0, 1.0)))))
            for _ in range(count)
        ]

    def gen_len_at(self, step: int) -> int:
        steps = [s for s, _ in self.gen_len]
        i = bisect.bisect_right(steps, step)
        if i == 0:
            return max(1, round(self.gen_len[0][1]))
        if i == len(steps):
            return max(1, round(self.gen_len[-1][1]))
        (s0, v0), (s1, v1) = self.gen_len[i - 1], self.gen_len[i]
        return max(1, round(v0 + (v1 - v0) * (step - s0) / (s1 - s0)))

    def gpus_at(self, seconds: float) -> int:
        count = self.gpus
        for at, value in self.pool:
            if at <= seconds:
                count = value
        return count

    def announced_gpus_at(self, seconds: float) -> int:
        """The pool the job is told it has at ``seconds``: the pool then, less the slots of any
        shrink announced by then (``notice_s``) that has not happened yet. Growth is not
        announced: slots join when they come."""
        later = (n for at, n in self.pool if seconds < at <= seconds + self.notice_s)
        return min([self.gpus_at(seconds), *later])

    def fewest_gpus_between(self, start: float, end: float) -> int:
        """The smallest pool in ``(start, end]``, counting the pool at ``start``: a revocation
        and its return inside the interval still took the revoked slots' state."""
        return min([self.gpus_at(start), *(n for at, n in self.pool if start < at <= end)])

    def failures_between(self, start: float, end: float) -> list[int]:
        return [slot for at, slot in self.failures if start < at <= end]

    def first_loss(self, start: float, end: float, slots) -> float | None:
        """The first instant in ``(start, end]`` at which one of ``slots`` is revoked (the pool
        shrinks to it or below) or fails; None when none is."""
        wanted = set(slots)
        top = max(wanted, default=-1)
        times = [at for at, n in self.pool if start < at <= end and n <= top]
        times += [at for at, slot in self.failures if start < at <= end and slot in wanted]
        return min(times, default=None)

    def pool_changes(self) -> int:
        return len(self.pool)

    def to_lines(self) -> list[str]:
        lines = [
            json.dumps(
                {
                    "trace": self.name,
                    "version": FORMAT_VERSION,
                    "steps": self.steps,
                    "accelerator": self.accelerator,
                    "gpus": self.gpus,
                    **({"notice_s": self.notice_s} if self.notice_s else {}),
                    **(
                        {"len_sigma": self.len_sigma} if self.len_sigma != DEFAULT_LEN_SIGMA else {}
                    ),
                    **({"len_cap": self.len_cap} if self.len_cap != DEFAULT_LEN_CAP else {}),
                }
            )
        ]
        lines += [json.dumps({"at_step": s, "gen_len": v}) for s, v in self.gen_len]
        lines += [json.dumps({"at_s": t, "gpus": g}) for t, g in self.pool]
        lines += [json.dumps({"at_s": t, "fail_slot": s}) for t, s in self.failures]
        return lines

    def save(self, path: str | Path) -> None:
        Path(path).write_text("\n".join(self.to_lines()) + "\n")


class _LongInteger:
    """A JSON integer of more than ``MAX_DIGITS`` digits: kept unconverted, refused by field."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"

    __str__ = __repr__


def _read_int(text: str) -> int | _LongInteger:
    return int(text) if len(text) <= MAX_DIGITS else _LongInteger(text)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 60, 60, 30


def _shown(value) -> str:
    """A value for a message: short, whatever the file held."""
    return repr(value) if isinstance(value, _LongInteger) else _SHOWN.repr(value)


def _int(value, where: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = (
            f"from {minimum} to {maximum:,}" if maximum is not None else f"of at least {minimum}"
        )
        raise TraceError(f"{where}: must be an integer {bound}, got {_shown(value)}")
    return value


def _number(value, where: str, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = (
            f"from {minimum:g} to {maximum:,}" if maximum is not None else f"of at least {minimum}"
        )
        raise TraceError(f"{where}: must be a finite number {bound}, got {_shown(value)}")
    return float(value)


def parse(lines: list[str], *, source: str = "trace", gpus: int | None = None) -> Trace:
    """The trace the lines give; ``gpus`` replaces the header's slots at time 0 (a run on
    another pool: its failures must still leave a slot; the file is otherwise read as written)."""
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_int=_read_int, object_pairs_hook=unique_keys)
        except RepeatedKeyError as exc:  # json would keep the last one without a word
            raise TraceError(
                f"{source}:{number}: field {_shown(exc.key)}: given twice in one object"
            ) from None
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}:{number}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise TraceError(f"{source}:{number}: not JSON (nested too deeply)") from None
        except ValueError as exc:  # what the decoder raises besides (none known: a safeguard)
            raise TraceError(f"{source}:{number}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{source}:{number}: expected an object, got {type(record).__name__}")
        records.append((number, record))
    if not records:
        raise TraceError(f"{source}: empty; the first line must be the header")
    number, header = records[0]
    where = f"{source}:{number}"
    if "trace" not in header:
        raise TraceError(f"{where}: field 'trace': the first line must be the header")
    if type(header.get("version")) is not int or header["version"] != FORMAT_VERSION:
        raise TraceError(
            f"{where}: field 'version': expected {FORMAT_VERSION}, "
            f"got {_shown(header.get('version'))}"
        )
    for field in ("steps", "accelerator", "gpus"):
        if field not in header:
            raise TraceError(f"{where}: field '{field}': missing from the header")
    if not isinstance(header["accelerator"], str):
        raise TraceError(f"{where}: field 'accelerator': must be a name")
    if not isinstance(header["trace"], str):
        raise TraceError(f"{where}: field 'trace': must be a name")
    unknown = set(header) - {"trace", "version", "steps", "accelerator", "gpus", *HEADER_OPTIONS}
    if unknown:
        raise TraceError(f"{where}: field '{sorted(unknown)[0]}': unknown in the header")
    notice_s = _number(
        header.get("notice_s", 0.0), f"{where}: field 'notice_s'", maximum=MAX_NOTICE_S
    )
    len_sigma = _number(
        header.get("len_sigma", DEFAULT_LEN_SIGMA),
        f"{where}: field 'len_sigma'",
        maximum=MAX_LEN_SIGMA,
    )
    len_cap = _number(
        header.get("len_cap", DEFAULT_LEN_CAP),
        f"{where}: field 'len_cap'",
        minimum=MIN_LEN_CAP,
        maximum=MAX_LEN_CAP,
    )
    steps = _int(header["steps"], f"{where}: field 'steps'", minimum=1, maximum=MAX_STEPS)
    written = _int(header["gpus"], f"{where}: field 'gpus'", minimum=1, maximum=MAX_GPUS)
    if gpus is None:
        gpus = written
    else:
        _int(gpus, "gpus", minimum=1, maximum=MAX_GPUS)
    gen_len, pool, failures = [], [], []
    for number, record in records[1:]:
        where = f"{source}:{number}"
        misplaced = [k for k in ("len_sigma", "len_cap") if k in record]
        if misplaced:  # a trace-wide setting, not one that changes over steps or time
            raise TraceError(
                f"{where}: field '{misplaced[0]}': belongs in the header (line {records[0][0]})"
            )
        kinds = [k for k in ("gen_len", "gpus", "fail_slot") if k in record]
        if len(kinds) != 1:
            raise TraceError(
                f"{where}: expected exactly one of 'gen_len', 'gpus', 'fail_slot', got "
                f"{sorted(record)}"
            )
        kind = kinds[0]
        unknown = set(record) - {kind, "at_step", "at_s"}
        if unknown:
            raise TraceError(f"{where}: field '{sorted(unknown)[0]}': unknown")
        if kind == "gen_len":
            if "at_step" not in record:
                raise TraceError(f"{where}: field 'at_step': a gen_len point needs it")
            at = _int(record["at_step"], f"{where}: field 'at_step'", maximum=MAX_STEPS)
            value = _number(
                record["gen_len"], f"{where}: field 'gen_len'", minimum=1, maximum=MAX_GEN_LEN
            )
            gen_len.append((at, value, number))
            continue
        if "at_s" not in record:
            raise TraceError(f"{where}: field 'at_s': a {kind} record needs it")
        at_s = _number(record["at_s"], f"{where}: field 'at_s'")
        if kind == "gpus":
            size = _int(record["gpus"], f"{where}: field 'gpus'", minimum=1, maximum=MAX_GPUS)
            pool.append((at_s, size, number))
            continue
        if not at_s > 0:
            # The job starts at 0 s on the header's pool: a slot lost by then is a smaller pool.
            raise TraceError(f"{where}: field 'at_s': a failure must come after 0 s, got {at_s}")
        failures.append((at_s, _int(record["fail_slot"], f"{where}: field 'fail_slot'"), number))
    if not gen_len:
        raise TraceError(f"{source}: field 'gen_len': at least one point is needed")
    _refuse_repeats(gen_len, source, "at_step", "gen_len points")
    _refuse_repeats(pool, source, "at_s", "pool sizes")
    most = max([written, *(g for _, g, _ in pool)])
    for _, slot, number in failures:
        if slot >= most:
            raise TraceError(
                f"{source}:{number}: field 'fail_slot': slot {slot} never exists "
                f"(the pool holds at most {most} slots, numbered from 0)"
            )
    _, emptying = _failures_leaving_a_slot(gpus, [(at, g) for at, g, _ in pool], failures)
    if emptying:
        (at, slot, number), size, failed = emptying[0]
        raise TraceError(
            f"{source}:{number}: field 'fail_slot': slot {slot} failing at {at:g} s leaves no slot "
            f"to run on (the pool holds {size} then, and failures since its last size took "
            f"slots {sorted(failed)})"
        )
    return Trace(
        name=header["trace"],
        steps=steps,
        accelerator=header["accelerator"].lower(),  # the catalog's names ignore case
        gpus=gpus,
        gen_len=tuple((at, value) for at, value, _ in sorted(gen_len)),
        pool=tuple((at, value) for at, value, _ in sorted(pool)),
        failures=tuple((at, value) for at, value, _ in sorted(failures)),
        notice_s=notice_s,
        len_sigma=len_sigma,
        len_cap=len_cap,
    )


def _failures_leaving_a_slot(
    gpus: int, pool: list[tuple[float, int]], failures: list[tuple]
) -> tuple[list[tuple], list[tuple[tuple, int, set[int]]]]:
    """``failures`` (``(seconds, slot, ...)``) split into those that leave the pool a slot to run
    on and those that would not (each with the pool's size then and the slots failed since its
    last size, itself included), in time order. A failure takes its slot out until the next pool
    size; one of a slot beyond the pool then takes nothing; at one time, the size comes first."""
    timeline = sorted(
        [(at, 0, i) for i, (at, _) in enumerate(pool)]
        + [(failure[0], 1, i) for i, failure in enumerate(failures)]
    )
    size, failed = gpus, set()
    kept, emptying = [], []
    for _, kind, i in timeline:
        if kind == 0:
            size, failed = pool[i][1], set()
            continue
        slot = failures[i][1]
        if slot >= size:
            kept.append(failures[i])
        elif len(failed | {slot}) >= size:
            emptying.append((failures[i], size, failed | {slot}))
        else:
            failed.add(slot)
            kept.append(failures[i])
    return kept, emptying


def _refuse_repeats(records: list[tuple], source: str, field: str, what: str) -> None:
    """Two records of one kind at one time would leave which holds to the file's order."""
    first: dict = {}
    for at, _, number in records:
        if at in first:
            raise TraceError(
                f"{source}:{number}: field '{field}': lines {first[at]} and {number} give two "
                f"{what} at {field} {at:g}"
            )
        first[at] = number


def load(path: str | Path, *, gpus: int | None = None) -> Trace:
    """The trace in file ``path``; ``gpus`` as for ``parse``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    # Lines end at "\n" only: str.splitlines also splits at U+2028 and the like, which JSON
    # strings may hold as they are.
    return parse(text.split("\n"), source=str(path), gpus=gpus)


def generate(
    shape: str,
    *,
    seed: int = 0,
    steps: int = 1000,
    gpus: int = 16,
    accelerator: str = "h100-sxm",
    start_len: int = 500,
    end_len: int = 8000,
    spot: bool = False,
    hours: float = 10.0,
    grow_to: int | None = None,
    failures: int = 0,
    notice_s: float | None = None,
    len_sigma: float = DEFAULT_LEN_SIGMA,
    len_cap: float = DEFAULT_LEN_CAP,
) -> Trace:
    """A seeded trace of one of ``SHAPES``; ``spot`` adds a spot-like pool (over a dozen changes in
    ``hours``, never above ``MAX_GPUS``), announcing each shrink ``notice_s`` before it
    (``SPOT_NOTICE_S`` unless given), ``grow_to`` a pool that doubles towards that size,
    ``failures`` slot failures (less any that would leave the pool no slot to run on);
    ``len_sigma`` and ``len_cap`` shape each response's length as the header's fields do."""
    if notice_s is None:
        notice_s = SPOT_NOTICE_S if spot else 0.0
    _number(notice_s, "notice_s", maximum=MAX_NOTICE_S)
    _number(len_sigma, "len_sigma", maximum=MAX_LEN_SIGMA)
    _number(len_cap, "len_cap", minimum=MIN_LEN_CAP, maximum=MAX_LEN_CAP)
    if shape not in SHAPES:
        raise TraceError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
    _int(gpus, "gpus", minimum=1, maximum=MAX_GPUS)
    _int(steps, "steps", minimum=min_steps(shape), maximum=MAX_STEPS)
    if grow_to is not None:
        _int(grow_to, "grow_to", minimum=0, maximum=MAX_GPUS)
    rng = random.Random(seed)
    points: list[tuple[int, float]]
    if shape == "growth":  # the seed's: 500 -> 8,000 tokens over 1,000 steps, roughly exponential
        every = max(1, steps // 20)
        points = [
            (s, start_len * (end_len / start_len) ** (s / steps))
            for s in sorted({*range(0, steps + 1, every), steps})
        ]
    elif shape == "plateau":  # grows fast, then stays
        knee = steps // 4
        points = [(0, start_len), (knee, end_len * 0.6), (steps, end_len * 0.65)]
    elif shape == "step":  # jumps at random steps
        cuts = sorted(rng.sample(range(1, steps), 3))
        levels = sorted(rng.uniform(start_len, end_len) for _ in cuts)
        points, level = [(0, float(start_len))], float(start_len)
        for cut, new in zip(cuts, levels, strict=True):
            if cut - 1 > points[-1][0]:  # hold the level up to the jump
                points.append((cut - 1, level))
            points.append((cut, new))
            level = new
        points.append((steps, level))
    elif shape == "oscillate":  # length swings up and down (a curriculum, a mixed task set)
        period = max(20, steps // rng.randint(4, 8))
        mid, amp = (start_len + end_len) / 4, (end_len - start_len) / 5
        points = [
            (s, mid + amp * math.sin(2 * math.pi * s / period))
            for s in range(0, steps + 1, max(1, period // 8))
        ]
    elif shape == "noisy":  # drifting with bursts: a random walk in log space
        value, points = float(start_len), []
        for s in sorted({*range(0, steps + 1, max(1, steps // 40)), steps}):
            points.append((s, value))
            value = min(end_len, max(start_len / 2, value * math.exp(rng.gauss(0.03, 0.25))))
    else:  # "shrink": long answers get shorter (a length penalty kicks in)
        points = [(0, end_len * 0.5), (steps // 3, end_len * 0.5), (steps, start_len)]
    pool: list[tuple[float, int]] = []
    if spot:  # 14 changes in ``hours``: instances reclaimed and returned a few at a time
        count, unit = gpus, max(1, gpus // 8)
        for t in sorted(rng.uniform(0, hours * 3600) for _ in range(14)):
            delta = unit * rng.choice((1, 2)) * (1 if rng.random() < 0.5 else -1)
            count = min(2 * gpus, MAX_GPUS, max(1, gpus // 2, count + delta))
            pool.append((round(t, 1), count))
    if grow_to:
        t, count = 0.0, gpus
        while count < grow_to:
            t += hours * 3600 / max(1, math.log2(grow_to / gpus) + 1)
            count = min(grow_to, count * 2)
            pool.append((round(t, 1), count))
    fails = []
    for _ in range(failures):
        fails.append((round(rng.uniform(0.1, 0.9) * hours * 3600, 1), rng.randrange(gpus)))
    fails, _ = _failures_leaving_a_slot(gpus, sorted(pool), sorted(fails))
    return Trace(
        name=f"{shape}-{gpus}-s{seed}",
        steps=steps,
        accelerator=accelerator,
        gpus=gpus,
        gen_len=tuple((s, round(v, 1)) for s, v in points),
        pool=tuple(sorted(pool)),
        failures=tuple(sorted(fails)),
        notice_s=float(notice_s),
        len_sigma=float(len_sigma),
        len_cap=float(len_cap),
    )
