"""Synthetic prompts and programmatic rewards for PPO on tiny vocabularies.

The task set ships as code: a seeded generator of prompts over a small alphabet of symbols, each
with its expected answer, so runs are reproducible without any data download. Token ids:

- ``PAD`` 0, ``BOS`` 1, ``EOS`` 2, ``SEP`` 3;
- symbols ``4 .. 4 + num_symbols - 1`` (for ``add``, symbol ``d`` is the digit ``d``).

A prompt reads ``BOS x_1 .. x_n SEP`` (``add``: ``BOS a-digits SEP b-digits SEP``); the answer is
the symbols the task asks for, and a response is the answer followed by ``EOS``.

Rewards score one response (a list of tokens, EOS included when sampled) against its prompt:

- ``correct``: 1 when the response is exactly the answer and then EOS, else 0;
- ``partial``: the fraction of the answer's positions the response gets right, minus a share for
  each surplus token (a dense signal for learning correctness);
- ``length``: response tokens before EOS divided by ``max_new_tokens``, which rewards longer
  answers, so response length grows under it (the drift Nereus must follow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

PAD, BOS, EOS, SEP = 0, 1, 2, 3
FIRST_SYMBOL = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One task instance: the prompt's tokens and the answer it expects (without EOS)."""

    task: str
    tokens: tuple[int, ...]
    answer: tuple[int, ...]


def _symbols(generator: torch.Generator, count: int, num_symbols: int) -> list[int]:
    return (torch.randint(0, num_symbols, (count,), generator=generator) + FIRST_SYMBOL).tolist()


def _copy(symbols: list[int]) -> list[int]:
    return list(symbols)


def _reverse(symbols: list[int]) -> list[int]:
    return symbols[::-1]


def _sort(symbols: list[int]) -> list[int]:
    return sorted(symbols)


_SEQUENCE_TASKS: dict[str, Callable[[list[int]], list[int]]] = {
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
}
TASK_NAMES = (*_SEQUENCE_TASKS, "add")


def _digits(number: int) -> list[int]:
    return [FIRST_SYMBOL + int(d) for d in str(number)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskSet:
    """Which tasks to draw prompts from, over how many symbols, with how long inputs."""

    tasks: tuple[str, ...]
    """Names from ``TASK_NAMES``; each prompt draws one uniformly."""
    vocab_size: int
    """The model's vocabulary; it must hold the special tokens and the symbols."""
    num_symbols: int = 10
    min_len: int = 1
    """Fewest input symbols; ``add`` draws each operand below ``10 ** length``."""
    max_len: int = 3

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"tasks: the task set is empty; choose from {', '.join(TASK_NAMES)}")
        for name in self.tasks:
            if name not in TASK_NAMES:
                raise ValueError(
                    f"tasks: unknown task {name!r}; choose from {', '.join(TASK_NAMES)}"
                )
        if "add" in self.tasks and self.num_symbols < 10:
            raise ValueError(f"num_symbols: 'add' needs 10 digit symbols, got {self.num_symbols}")
        if self.num_symbols < 1:
            raise ValueError(f"num_symbols: must be at least 1, got {self.num_symbols}")
        if FIRST_SYMBOL + self.num_symbols > self.vocab_size:
            raise ValueError(
                f"vocab_size: {self.vocab_size} cannot hold {FIRST_SYMBOL} special tokens and "
                f"{self.num_symbols} symbols"
            )
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"min_len: must be in [1, max_len={self.max_len}], got {self.min_len}")

    def sample(self, num_prompts: int, *, seed: int) -> list[Prompt]:
        """``num_prompts`` prompts, the same for the same seed."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts: must be at least 1, got {num_prompts}")
        generator = torch.Generator().manual_seed(seed)
        prompts = []
        for _ in range(num_prompts):
            task = self.tasks[int(torch.randint(len(self.tasks), (1,), generator=generator))]
            prompts.append(self._instance(task, generator))
        return prompts

    def _length(self, generator: torch.Generator) -> int:
        return int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=generator))

    def _instance(self, task: str, generator: torch.Generator) -> Prompt:
        if task == "add":
            a, b = (
                int(torch.randint(0, 10 ** self._length(generator), (1,), generator=generator))
                for _ in range(2)
            )
            tokens = [BOS, *_digits(a), SEP, *_digits(b), SEP]
            return Prompt(task=task, tokens=tuple(tokens), answer=tuple(_digits(a + b)))
        symbols = _symbols(generator, self._length(generator), self.num_symbols)
        answer = _SEQUENCE_TASKS[task](symbols)
        return Prompt(task=task, tokens=(BOS, *symbols, SEP), answer=tuple(answer))


Reward = Callable[[Prompt, Sequence[int]], float]
"""Scores one response (its tokens, EOS included when sampled) to one prompt."""


def _until_eos(response: Sequence[int]) -> tuple[list[int], bool]:
    tokens = list(response)
    if EOS in tokens:
        return tokens[: tokens.index(EOS)], True
    return tokens, False


def correct_reward(prompt: Prompt, response: Sequence[int]) -> float:
    """1 for exactly the answer followed by EOS, else 0."""
    body, ended = _until_eos(response)
    return float(ended and tuple(body) == prompt.answer)


def partial_reward(prompt: Prompt, response: Sequence[int]) -> float:
    """Right answer positions over the answer's length, minus the same share per surplus token."""
    body, _ = _until_eos(response)
    hits = sum(a == b for a, b in zip(body, prompt.answer, strict=False))
    surplus = max(0, len(body) - len(prompt.answer))
    return (hits - surplus) / len(prompt.answer)


def reward_function(name: str, *, max_new_tokens: int) -> Reward:
    """The reward called ``name`` (``correct``, ``partial`` or ``length``)."""
    if name == "correct":
        return correct_reward
    if name == "partial":
        return partial_reward
    if name == "length":

        def length_reward(prompt: Prompt, response: Sequence[int]) -> float:
            return len(_until_eos(response)[0]) / max_new_tokens

        return length_reward
    raise ValueError(f"reward: unknown reward {name!r}; choose from correct, partial, length")
