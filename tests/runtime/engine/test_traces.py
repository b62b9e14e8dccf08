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
        ([HEADER.replace("}", ', "notice_s": -1}'), '{"at_step": 0, "gen_len": 5}'], "notice_s"),
        ([HEADER.replace("}", ', "notice_s": "2m"}'), '{"at_step": 0, "gen_len": 5}'], "notice_s"),
        ([HEADER.replace("}", ', "notice": 120}'), '{"at_step": 0, "gen_len": 5}'], "'notice'"),
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
            TraceError, match=f"steps: must be an integer from {min_steps(shape)} to 1,000,000"
        ):
            generate(shape, steps=min_steps(shape) - 1)


def _failing(*records: str, gpus: int = 2) -> list[str]:
    header = HEADER.replace('"gpus": 8', f'"gpus": {gpus}')
    return [header, '{"at_step": 0, "gen_len": 5}', *records]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        # Each of these once ended `nereus simulate` in a traceback (a decoder error, an
        # overflow in the planner, the planner's refusal of a pool, or of no slot at all).
        ([HEADER, "[" * 200_000], r"^trace:2: not JSON \(nested too deeply\)$"),
        (
            [HEADER, '{"at_step": 1' + "0" * 5000 + ', "gen_len": 5}'],
            r"^trace:2: field 'at_step': must be an integer from 0 to 1,000,000, got an integer "
            r"of 5001 digits$",
        ),
        (
            [HEADER.replace('"steps": 10', '"steps": -' + "9" * 5000)],
            r"^trace:1: field 'steps': .* got an integer of 5000 digits$",
        ),
        (
            [HEADER, '{"at_step": 0, "gen_len": 1e300}'],
            r"^trace:2: field 'gen_len': must be a finite number from 1 to 10,000,000, got 1e\+300$",
        ),
        ([HEADER, '{"at_step": 0, "gen_len": 10000001}'], r"^trace:2: field 'gen_len'"),
        ([HEADER, '{"at_step": 1000001, "gen_len": 5}'], r"^trace:2: field 'at_step'"),
        ([HEADER.replace('"steps": 10', '"steps": 1000001')], r"^trace:1: field 'steps'"),
        ([HEADER.replace('"version": 1', '"version": true')], r"^trace:1: field 'version'"),
        ([HEADER.replace('"version": 1', '"version": 1.0')], r"^trace:1: field 'version'"),
        (
            [HEADER.replace('"trace": "t"', '"trace": {"a": 1}')],
            r"^trace:1: field 'trace': must be a name$",
        ),
        (
            [HEADER.replace('"gpus": 8', '"gpus": 4097')],
            r"^trace:1: field 'gpus': must be an integer from 1 to 4,096, got 4097$",
        ),
        (
            _failing('{"at_s": 1, "gpus": 100000000}'),
            r"^trace:3: field 'gpus': must be an integer from 1 to 4,096, got 100000000$",
        ),
        (
            _failing('{"at_s": 1, "fail_slot": 0}', gpus=1),
            r"^trace:3: field 'fail_slot': slot 0 failing at 1 s leaves no slot to run on \(the "
            r"pool holds 1 then, and failures since its last size took slots \[0\]\)$",
        ),
        (  # two failures of a two-slot pool, in the file's order or not
            _failing('{"at_s": 9, "fail_slot": 0}', '{"at_s": 5, "fail_slot": 1}'),
            r"^trace:3: field 'fail_slot': slot 0 failing at 9 s leaves no slot .* \[0, 1\]",
        ),
        (  # the pool shrank to one slot, which then fails
            _failing(
                '{"at_s": 5, "gpus": 1}',
                '{"at_s": 6, "fail_slot": 1}',
                '{"at_s": 7, "fail_slot": 0}',
            ),
            r"^trace:5: field 'fail_slot': slot 0 failing at 7 s leaves no slot",
        ),
        (  # the pool's size and a failure at one time: the size comes first
            _failing('{"at_s": 5, "fail_slot": 0}', '{"at_s": 5, "gpus": 1}'),
            r"^trace:3: field 'fail_slot': slot 0 failing at 5 s leaves no slot",
        ),
    ],
)
def test_inputs_that_crashed_the_simulator_are_refused_by_line_and_field(lines, message):
    with pytest.raises(TraceError, match=message):
        parse(lines)


def test_failures_that_leave_a_slot_are_read_and_a_pool_size_gives_the_slots_back():
    trace = parse(
        _failing(
            '{"at_s": 1, "fail_slot": 1}',  # one of two: one left
            '{"at_s": 2, "gpus": 2}',  # a new size: both slots again
            '{"at_s": 3, "fail_slot": 0}',
            '{"at_s": 4, "gpus": 1}',
            '{"at_s": 5, "fail_slot": 1}',  # not in the pool then: takes nothing
        )
    )
    assert trace.failures == ((1.0, 1), (3.0, 0), (5.0, 1))
    limits = parse(
        [
            HEADER.replace('"gpus": 8', '"gpus": 4096').replace('"steps": 10', '"steps": 1000000'),
            '{"at_step": 1000000, "gen_len": 10000000}',
        ]
    )
    assert limits.gpus == 4096 and limits.gen_len_at(10**6) == 10**7


def test_a_smaller_pool_in_place_of_the_headers_must_still_leave_a_slot(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(_failing('{"at_s": 1, "fail_slot": 0}', gpus=16)) + "\n")
    assert load(path).gpus == 16 and load(path, gpus=2).gpus == 2
    with pytest.raises(TraceError, match=r"t.jsonl:3: field 'fail_slot': slot 0 failing at 1 s"):
        load(path, gpus=1)
    with pytest.raises(TraceError, match=r"^gpus: must be an integer from 1 to 4,096"):
        load(path, gpus=4097)


def test_generated_failures_leave_a_slot_and_pools_stay_within_the_planners_most():
    assert generate("growth", gpus=1, failures=3).failures == ()
    two = generate("growth", gpus=2, failures=5, seed=4)
    assert len(two.failures) <= 5 and parse(two.to_lines()) == two
    big = generate("growth", gpus=3000, spot=True, seed=2)
    assert max(g for _, g in big.pool) <= 4096 and parse(big.to_lines()) == big
    with pytest.raises(TraceError, match="gpus: must be an integer from 1 to 4,096"):
        generate("growth", gpus=4097)


def test_a_shrink_is_announced_notice_s_before_it_and_growth_is_not():
    trace = parse(
        [
            HEADER.replace("}", ', "notice_s": 120}'),
            '{"at_step": 0, "gen_len": 100}',
            '{"at_s": 500, "gpus": 4}',
            '{"at_s": 550, "gpus": 2}',
            '{"at_s": 900, "gpus": 16}',
        ]
    )
    assert trace.notice_s == 120.0 and load_again(trace) == trace
    assert [trace.announced_gpus_at(t) for t in (379, 380, 430, 500, 899, 900)] == [
        8,
        4,
        2,
        2,
        2,
        16,
    ]
    assert [trace.gpus_at(t) for t in (430, 500, 550)] == [8, 4, 2]  # the slots go at the shrink
    unannounced = generate("growth", seed=1, steps=50, gpus=16, spot=True, notice_s=0)
    assert unannounced.notice_s == 0 and all(
        unannounced.announced_gpus_at(t) == unannounced.gpus_at(t) for t, _ in unannounced.pool
    )
    assert generate("growth", seed=1, steps=50, gpus=16, spot=True).notice_s == 120.0


def load_again(trace):
    return parse(trace.to_lines())


def test_a_file_is_read_line_by_line_at_newlines_only_and_names_ignore_case(tmp_path):
    """Found by review: U+2028 inside a JSON string (valid JSON, written as it is) split the
    line, and an upper-case accelerator name was refused though the catalog ignores case."""
    path = tmp_path / "t.jsonl"
    header = HEADER.replace('"trace": "t"', '"trace": "line\u2028break"').replace(
        '"h100-sxm"', '"H100-SXM"'
    )
    path.write_text(header + "\n" + '{"at_step": 0, "gen_len": 500}' + "\n", encoding="utf-8")
    trace = load(path)
    assert trace.name == "line\u2028break" and trace.accelerator == "h100-sxm"
