"""Trace files: the generator's shapes, the round trip, and errors that name the line and field."""

import pytest

from runtime.engine.traces import SHAPES, TraceError, generate, load, min_steps, parse


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_round_trips_through_a_file(shape, tmp_path):
    trace = generate(shape, seed=3, steps=400, gpus=16, spot=True, failures=2)
    path = tmp_path / f"{shape}.jsonl"
    trace.save(path)
    again = load(path)
    assert again == trace
    assert all(again.gen_len_at(s) >= 1 for s in range(0, 401, 7))


def test_the_growth_trace_is_the_seeds_and_spot_changes_more_than_ten_times():
    trace = generate("growth", steps=1000, gpus=16, spot=True, hours=10)
    assert trace.gen_len_at(0) == 500 and trace.gen_len_at(1000) == 8000
    assert 1000 < trace.gen_len_at(500) < 3000  # roughly exponential: 500·16^0.5 = 2,000
    assert trace.pool_changes() > 10
    assert all(0 <= t <= 10 * 3600 for t, _ in trace.pool)
    grow = generate("growth", gpus=16, grow_to=1024)
    assert grow.gpus_at(1e9) == 1024 and [g for _, g in grow.pool][:2] == [32, 64]


def test_interpolation_and_pool_lookup():
    trace = parse(
        [
            '{"trace": "t", "version": 1, "steps": 10, "accelerator": "h100-sxm", "gpus": 8}',
            '{"at_step": 0, "gen_len": 100}',
            '{"at_step": 10, "gen_len": 200}',
            '{"at_s": 50, "gpus": 16}',
            '{"at_s": 70, "fail_slot": 3}',
        ]
    )
    assert trace.gen_len_at(5) == 150 and trace.gen_len_at(99) == 200
    assert trace.gpus_at(49.9) == 8 and trace.gpus_at(50) == 16
    assert trace.failures_between(60, 70) == [3] and trace.failures_between(70, 80) == []


HEADER = '{"trace": "t", "version": 1, "steps": 10, "accelerator": "h100-sxm", "gpus": 8}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], r"trace: empty"),
        (["{not json"], r"trace:1: not JSON"),
        (['{"at_step": 0, "gen_len": 1}'], r"trace:1: field 'trace'"),
        ([HEADER.replace('"version": 1', '"version": 2')], r"trace:1: field 'version'"),
        ([HEADER.replace('"gpus": 8', '"gpus": 0')], r"trace:1: field 'gpus'"),
        ([HEADER, '{"at_step": 0, "gen_len": -5}'], r"trace:2: field 'gen_len'"),
        ([HEADER, '{"at_step": 0, "gen_len": 5}', '{"gpus": 4}'], r"trace:3: field 'at_s'"),
        ([HEADER, '{"at_step": 0, "gen_len": 5, "colour": 1}'], r"trace:2: field 'colour'"),
        ([HEADER, '{"at_step": 0, "gen_len": 5, "gpus": 3}'], r"trace:2: expected exactly one"),
        ([HEADER], r"field 'gen_len': at least one point"),
        ([HEADER, '{"at_step": "x", "gen_len": 5}'], r"trace:2: field 'at_step'"),
        (
            [HEADER, '{"at_step": 3, "gen_len": 5}', '{"at_step": 3, "gen_len": 9}'],
            r"trace:3: field 'at_step': lines 2 and 3 give two gen_len points at at_step 3",
        ),
        (
            [
                HEADER,
                '{"at_step": 0, "gen_len": 5}',
                '{"at_s": 9, "gpus": 24}',
                '{"at_s": 9, "gpus": 8}',
            ],
            r"trace:4: field 'at_s': lines 3 and 4 give two pool sizes at at_s 9",
        ),
        (
            [HEADER, '{"at_step": 0, "gen_len": 5}', '{"at_s": 0, "fail_slot": 1}'],
            r"trace:3: field 'at_s': a failure must come after 0 s",
        ),
        (
            [
                HEADER,
                '{"at_step": 0, "gen_len": 5}',
                '{"at_s": 9, "gpus": 12}',
                '{"at_s": 5, "fail_slot": 12}',
            ],
            r"trace:4: field 'fail_slot': slot 12 never exists \(the pool holds at most 12",
        ),
    ],
)
def test_malformed_traces_name_the_line_and_field(lines, message):
    with pytest.raises(TraceError, match=message):
        parse(lines)


def test_an_unknown_shape_or_missing_file_is_refused(tmp_path):
    with pytest.raises(TraceError, match="shape: expected one of"):
        generate("zigzag")
    with pytest.raises(TraceError, match="cannot read"):
        load(tmp_path / "missing.jsonl")


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(HEADER.encode() + b'\n{"at_step": 0, "gen_len": 5, "note": "caf\xe9"}\n')
    with pytest.raises(TraceError, match=r"latin1.jsonl:2: not UTF-8 text"):
        load(path)


@pytest.mark.parametrize("shape", SHAPES)
def test_generated_traces_are_valid_at_their_smallest(shape, tmp_path):
    """The fewest steps and a one-slot spot pool still make a trace that reads back (a spot pool
    of one slot once shrank to none; short shapes once repeated a corner step)."""
    for seed in range(5):
        trace = generate(shape, seed=seed, steps=min_steps(shape), gpus=1, spot=True, failures=1)
        assert min(g for _, g in trace.pool) >= 1
        trace.save(tmp_path / "t.jsonl")
        assert load(tmp_path / "t.jsonl") == trace
    if min_steps(shape) > 1:
        with pytest.raises(
            TraceError, match=f"steps: must be an integer of at least {min_steps(shape)}"
        ):
            generate(shape, steps=min_steps(shape) - 1)
