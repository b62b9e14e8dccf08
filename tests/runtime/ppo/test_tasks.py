"""Synthetic tasks and programmatic rewards."""

import pytest

from runtime.ppo.tasks import (
    BOS,
    EOS,
    FIRST_SYMBOL,
    SEP,
    Prompt,
    TaskSet,
    correct_reward,
    partial_reward,
    reward_function,
)


def test_prompts_are_seeded_and_answers_follow_the_task():
    tasks = TaskSet(tasks=("copy", "reverse", "sort", "add"), vocab_size=64, max_len=4)
    prompts = tasks.sample(200, seed=3)
    assert prompts == tasks.sample(200, seed=3)
    assert prompts != tasks.sample(200, seed=4)
    assert {p.task for p in prompts} == {"copy", "reverse", "sort", "add"}
    for p in prompts:
        assert p.tokens[0] == BOS and p.tokens[-1] == SEP
        assert all(FIRST_SYMBOL <= t < FIRST_SYMBOL + 10 for t in p.answer)
        if p.task == "add":
            sep = p.tokens.index(SEP)
            a, b = (
                int("".join(str(t - FIRST_SYMBOL) for t in part))
                for part in (p.tokens[1:sep], p.tokens[sep + 1 : -1])
            )
            assert int("".join(str(t - FIRST_SYMBOL) for t in p.answer)) == a + b
        else:
            symbols = list(p.tokens[1:-1])
            assert 1 <= len(symbols) <= 4
            expected = {"copy": symbols, "reverse": symbols[::-1], "sort": sorted(symbols)}
            assert list(p.answer) == expected[p.task]


PROMPT = Prompt(task="copy", tokens=(BOS, 5, 6, 7, SEP), answer=(5, 6, 7))


@pytest.mark.parametrize(
    ("response", "correct", "partial"),
    [
        ([5, 6, 7, EOS], 1.0, 1.0),
        ([5, 6, 7], 0.0, 1.0),  # right symbols but never ended
        ([5, 9, 7, EOS, 4], 0.0, 2 / 3),  # tokens after EOS do not count
        ([5, 6, 7, 8, EOS], 0.0, 2 / 3),  # one surplus token costs one position
        ([EOS], 0.0, 0.0),
    ],
)
def test_correct_and_partial_rewards(response, correct, partial):
    assert correct_reward(PROMPT, response) == correct
    assert partial_reward(PROMPT, response) == pytest.approx(partial)


def test_length_reward_counts_tokens_before_eos():
    length = reward_function("length", max_new_tokens=8)
    assert length(PROMPT, [5, EOS]) == 1 / 8
    assert length(PROMPT, [5, 6, 7, 8, 9, 10, 11, 12]) == 1.0
    assert length(PROMPT, [EOS, 5, 6]) == 0.0


def test_unknown_reward_is_named():
    with pytest.raises(ValueError, match="reward: unknown reward 'speed'"):
        reward_function("speed", max_new_tokens=8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tasks": ()}, "tasks: the task set is empty"),
        ({"tasks": ("copy", "poetry")}, "tasks: unknown task 'poetry'"),
        ({"tasks": ("copy",), "vocab_size": 8}, "vocab_size: 8 cannot hold"),
        ({"tasks": ("add",), "num_symbols": 5}, "num_symbols: 'add' needs 10"),
        ({"tasks": ("copy",), "min_len": 3, "max_len": 2}, "min_len:"),
    ],
)
def test_bad_task_sets_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TaskSet(**{"vocab_size": 64, **kwargs})
