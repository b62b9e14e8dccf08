"""Found by audit: a trace line giving one key twice (``{"at_step": 0, "gen_len": 500,
"gen_len": 600}``) ran with the last value. It is refused naming the line and the key, as the
catalog loader refuses a repeated key."""

import json
import re

import pytest

from runtime.engine.traces import TraceError, load, parse

HEADER = '{"trace": "t", "version": 1, "steps": 10, "accelerator": "h100-sxm", "gpus": 8}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [HEADER, '{"at_step": 0, "gen_len": 500, "gen_len": 600}'],
            "trace:2: field 'gen_len': given twice in one object",
        ),
        (  # the same value twice is still a repeat
            [HEADER, '{"at_step": 0, "gen_len": 500}', '{"at_s": 5, "at_s": 5, "gpus": 4}'],
            "trace:3: field 'at_s': given twice in one object",
        ),
        (
            [HEADER.replace('"gpus": 8', '"gpus": 8, "gpus": 16'), '{"at_step": 0, "gen_len": 5}'],
            "trace:1: field 'gpus': given twice in one object",
        ),
        (  # inside a value, too (refused as unknown after, but the repeat is found first)
            [HEADER, "", '{"at_step": 0, "gen_len": 5, "x": {"y": 1, "y": 2}}'],
            "trace:3: field 'y': given twice in one object",
        ),
    ],
)
def test_a_key_given_twice_on_a_line_is_refused_naming_the_line_and_the_key(lines, message):
    with pytest.raises(TraceError, match=f"^{re.escape(message)}$"):
        parse(lines)


def test_a_file_with_a_repeated_key_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{HEADER}\n{{"at_step": 0, "gen_len": 500, "gen_len": 600}}\n')
    with pytest.raises(TraceError, match=re.escape(f"{path}:2: field 'gen_len': given twice")):
        load(path)


def test_a_repeated_key_is_shown_short_and_escaped():
    key = json.dumps("\n" + "k" * 500)
    with pytest.raises(TraceError) as refused:
        parse([HEADER, f'{{"at_step": 0, "gen_len": 5, {key}: 1, {key}: 2}}'])
    assert str(refused.value).startswith("trace:2: field '\\nkkk")
    assert str(refused.value).endswith("': given twice in one object")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 200
