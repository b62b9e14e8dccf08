"""The header's response-length shape (``len_sigma``, ``len_cap``): its round trip, its errors by
line and field, and the lengths ``Trace.response_lengths`` draws from it."""

import json
import random
import re
import statistics

import pytest

from runtime.engine.traces import (
    DEFAULT_LEN_CAP,
    DEFAULT_LEN_SIGMA,
    TraceError,
    generate,
    load,
    parse,
)

HEADER = {"trace": "t", "version": 1, "steps": 10, "accelerator": "h100-sxm", "gpus": 8}
POINTS = ['{"at_step": 0, "gen_len": 1000.0}', '{"at_step": 10, "gen_len": 2000.0}']


def lines(**header_fields) -> list[str]:
    return [json.dumps({**HEADER, **header_fields}), *POINTS]


def test_non_default_values_round_trip_through_a_file(tmp_path):
    trace = parse(lines(len_sigma=1.25, len_cap=8))
    assert (trace.len_sigma, trace.len_cap) == (1.25, 8.0)
    path = tmp_path / "t.jsonl"
    trace.save(path)
    assert load(path) == trace
    header = json.loads(trace.to_lines()[0])
    assert (header["len_sigma"], header["len_cap"]) == (1.25, 8.0)
    made = generate("growth", seed=2, steps=40, len_sigma=0, len_cap=1)
    assert (made.len_sigma, made.len_cap) == (0.0, 1.0) and parse(made.to_lines()) == made


def test_defaults_are_not_written_so_existing_files_read_and_write_as_before():
    trace = parse(lines())
    assert (trace.len_sigma, trace.len_cap) == (DEFAULT_LEN_SIGMA, DEFAULT_LEN_CAP) == (0.6, 4.0)
    assert trace.to_lines() == lines()
    given = parse(lines(len_sigma=0.6, len_cap=4))  # the defaults, written out: the same trace
    assert given == trace and given.to_lines() == lines()
    made = generate("growth", seed=2, steps=40)
    assert (made.len_sigma, made.len_cap) == (0.6, 4.0)
    assert "len_" not in made.to_lines()[0]


BAD = [
    ("len_sigma", -0.1, "must be a finite number from 0 to 3, got -0.1"),
    ("len_sigma", 3.5, "must be a finite number from 0 to 3, got 3.5"),
    ("len_sigma", "x", "must be a finite number from 0 to 3, got 'x'"),
    ("len_sigma", True, "must be a finite number from 0 to 3, got True"),
    ("len_sigma", None, "must be a finite number from 0 to 3, got None"),
    # a long value is shortened in the message
    (
        "len_sigma",
        10**30,
        "must be a finite number from 0 to 3, got 1000000000000...00000000000000",
    ),
    ("len_sigma", "NaN", "must be a finite number from 0 to 3, got nan"),
    ("len_cap", 0.5, "must be a finite number from 1 to 64, got 0.5"),
    ("len_cap", 64.5, "must be a finite number from 1 to 64, got 64.5"),
    ("len_cap", "x", "must be a finite number from 1 to 64, got 'x'"),
    ("len_cap", True, "must be a finite number from 1 to 64, got True"),
    ("len_cap", None, "must be a finite number from 1 to 64, got None"),
    ("len_cap", "HUGE", "must be a finite number from 1 to 64, got an integer of 400 digits"),
    ("len_cap", "Infinity", "must be a finite number from 1 to 64, got inf"),
]


def _header_with(field, value) -> str:
    """The header giving ``value`` for ``field``; "NaN", "Infinity" and "HUGE" are written bare
    (JSON's non-finite extensions, and an integer past ``MAX_DIGITS``)."""
    bare = {"NaN": "NaN", "Infinity": "Infinity", "HUGE": "1" + "0" * 399}
    text = json.dumps({**HEADER, field: "@"})
    return (
        text.replace('"@"', bare[value]) if value in bare else json.dumps({**HEADER, field: value})
    )


@pytest.mark.parametrize(("field", "value", "why"), BAD)
def test_a_bad_value_is_refused_naming_the_line_and_the_field(field, value, why):
    message = f"trace:1: field '{field}': {why}"
    with pytest.raises(TraceError, match=f"^{re.escape(message)}$"):
        parse([_header_with(field, value), *POINTS])


@pytest.mark.parametrize("field", ["len_sigma", "len_cap"])
def test_a_bad_value_in_a_file_names_the_files_line(field, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + _header_with(field, -0.1) + "\n" + "\n".join(POINTS) + "\n")
    with pytest.raises(TraceError, match=f"^{re.escape(f'{path}:2: field {field!r}: ')}"):
        load(path)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"at_step": 5, "gen_len": 1500, "len_sigma": 0.9}', "field 'len_sigma'"),
        ('{"len_cap": 8}', "field 'len_cap'"),
        ('{"at_s": 60, "gpus": 4, "len_cap": 2, "len_sigma": 1}', "field 'len_sigma'"),
    ],
)
def test_the_fields_on_a_record_line_are_refused(record, message):
    expected = f"trace:4: {message}: belongs in the header (line 1)"
    with pytest.raises(TraceError, match=f"^{re.escape(expected)}$"):
        parse([*lines(), record])


def test_a_repeated_key_is_still_refused_first():
    header = json.dumps(HEADER).replace("}", ', "len_cap": 2, "len_cap": 3}')
    with pytest.raises(TraceError, match=r"^trace:1: field 'len_cap': given twice in one object$"):
        parse([header, *POINTS])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"len_sigma": -0.1}, "len_sigma: must be a finite number from 0 to 3, got -0.1"),
        ({"len_cap": 0.5}, "len_cap: must be a finite number from 1 to 64, got 0.5"),
        ({"len_cap": float("nan")}, "len_cap: must be a finite number from 1 to 64, got nan"),
    ],
)
def test_generate_refuses_bad_values_by_name(kwargs, message):
    with pytest.raises(TraceError, match=f"^{re.escape(message)}$"):
        generate("growth", **kwargs)


def test_lengths_keep_the_steps_mean_within_the_cap_with_a_long_tail():
    trace = parse(lines())  # sigma 0.6, cap 4; mean 1,500 at step 5
    mean = trace.gen_len_at(5)
    assert mean == 1500
    many = trace.response_lengths(5, 20_000, random.Random(7))
    assert len(many) == 20_000 and all(isinstance(n, int) and n >= 1 for n in many)
    assert statistics.fmean(many) == pytest.approx(mean, rel=0.03)
    assert max(many) <= 4 * mean
    assert statistics.median(many) < mean  # the mass sits below the mean, the tail above
    batch = trace.response_lengths(5, 256, random.Random(1))
    assert max(batch) > 1.5 * mean


def test_the_cap_cuts_the_tail_and_never_passes_it():
    trace = parse(lines(len_sigma=3, len_cap=1.5))
    mean = trace.gen_len_at(3)  # 1,300; the cap, 1,950
    lengths = trace.response_lengths(3, 5000, random.Random(3))
    assert max(lengths) == int(1.5 * mean) and min(lengths) >= 1
    odd = parse([*lines(len_cap=1.5)[:1], '{"at_step": 0, "gen_len": 3}'])  # a cap of 4.5 tokens
    assert max(odd.response_lengths(0, 2000, random.Random(0))) == 4


def test_sigma_zero_gives_every_response_the_mean():
    trace = parse(lines(len_sigma=0))
    for step in (0, 3, 7, 10, 99):
        assert (
            trace.response_lengths(step, 50, random.Random(step)) == [trace.gen_len_at(step)] * 50
        )
    assert trace.response_lengths(4, 0, random.Random(0)) == []


def test_lengths_are_deterministic_for_a_seeded_rng():
    trace = generate("noisy", seed=4, steps=200)
    first = trace.response_lengths(120, 64, random.Random(11))
    assert trace.response_lengths(120, 64, random.Random(11)) == first
    assert trace.response_lengths(120, 64, random.Random(12)) != first
    rng = random.Random(11)
    state = rng.getstate()
    trace.response_lengths(120, 64, rng)
    rng.setstate(state)
    assert trace.response_lengths(120, 64, rng) == first
