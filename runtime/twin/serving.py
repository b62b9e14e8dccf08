"""Generation as a serving engine runs it, one generation unit at a time.

``continuous`` plays vLLM's scheduler: sequences wait in a queue; one joins the running batch
when a seat is free (at most ``max_seqs``) and the paged KV cache has pages for its context; a
joining group is prefilled; every iteration each running sequence decodes one token and its
context grows by one; a sequence leaves when its own response ends (each has its own length);
when the cache runs out of pages, the sequence admitted last is preempted (its pages freed; it
waits again and is recomputed from its prompt and what it generated when it returns). The unit is
done when its last sequence ends: the longest responses decide generation's time.

``static`` plays a plain decode loop (the torch backend): sequences run in waves of
``max_seqs``, and each wave decodes until its longest response ends, its finished rows riding
along.

Between two events (a sequence ending, the cache filling) the batch is constant and every
context grows by one per iteration, so the iterations between them are summed in closed form:
``n · fixed(B) + kv_s · (n · C + B · n (n - 1) / 2)`` for ``B`` sequences holding ``C`` cached
tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

PAGE_TOKENS = 16
"""Tokens per KV-cache page (vLLM's default block size)."""


class DoesNotFitError(Exception):
    """The KV cache cannot hold even one sequence."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """What the unit's hardware charges."""

    fixed_s: Callable[[int], float]
    """Seconds of one decode iteration of ``B`` sequences, the cache's reads aside."""
    kv_s: Callable[[int], float]
    """Seconds per cached token an iteration of ``B`` sequences reads."""
    prefill_s: Callable[[Sequence[int]], float]
    """Seconds to prefill sequences of these context lengths together."""


def _held(prompt: int, done: int) -> int:
    """Cache tokens a sequence holds: its context, in whole pages, and room for its next token."""
    return -(-(prompt + done + 1) // PAGE_TOKENS) * PAGE_TOKENS


def _run(costs: Costs, n: int, batch: int, context: int) -> float:
    return n * costs.fixed_s(batch) + costs.kv_s(batch) * (n * context + batch * n * (n - 1) / 2)


def continuous(
    costs: Costs, prompt: int, lengths: Sequence[int], *, max_seqs: int, kv_tokens: int
) -> tuple[float, int, int]:
    """Seconds to generate ``lengths`` (one response each, after a ``prompt``-token prompt), the
    preemptions it took, and the most cache tokens it held at once."""
    if not lengths:
        return 0.0, 0, 0
    seats = max_seqs or len(lengths)
    if _held(prompt, 0) > kv_tokens:
        raise DoesNotFitError(
            f"a {prompt}-token prompt needs more than the cache's {kv_tokens} tokens"
        )
    waiting = [[length, 0] for length in reversed(lengths)]  # [response, generated]; pop() first
    running: list[list[int]] = []
    clock = 0.0
    preempted = 0
    peak = 0
    while waiting or running:
        context = sum(prompt + done for _, done in running)
        joined = []
        while waiting and len(running) < seats:
            # A sequence joins only if every running one still has room to grow by a token
            # after it (a page of slack each), so that the one preempted last does not come
            # straight back.
            after = context + prompt + waiting[-1][1]
            if after + (len(running) + 1) * (PAGE_TOKENS + 1) > kv_tokens:
                break
            seq = waiting.pop()
            context = after
            running.append(seq)
            joined.append(prompt + seq[1])
        if joined:
            clock += costs.prefill_s(joined)
        if not running:
            raise DoesNotFitError(f"a sequence outgrows the cache's {kv_tokens} tokens on its own")
        batch = len(running)
        context = sum(prompt + done for _, done in running)
        n = min(length - done for length, done in running)
        # Room for n more tokens each: a page of slack per sequence.
        room = (kv_tokens - context - batch * PAGE_TOKENS) // batch
        if room < n:
            if room < 1:
                if batch == 1:
                    raise DoesNotFitError(
                        f"a {prompt + running[0][0]}-token sequence outgrows the cache's "
                        f"{kv_tokens} tokens on its own"
                    )
                waiting.append(running.pop())  # preempted: recomputed when it returns
                preempted += 1
                continue
            n = room
        clock += _run(costs, n, batch, context)
        peak = max(peak, context + batch * (n + PAGE_TOKENS))
        for seq in running:
            seq[1] += n
        running = [seq for seq in running if seq[1] < seq[0]]
    return clock, preempted, min(peak, kv_tokens)


def static(
    costs: Costs, prompt: int, lengths: Sequence[int], *, max_seqs: int, kv_tokens: int
) -> float:
    """Seconds to generate ``lengths`` in waves of ``max_seqs``, each until its longest ends."""
    seats = max_seqs or len(lengths)
    clock = 0.0
    for start in range(0, len(lengths), seats):
        wave = lengths[start : start + seats]
        longest = max(wave)
        if len(wave) * _held(prompt, longest) > kv_tokens:
            raise DoesNotFitError(
                f"{len(wave)} sequences of {prompt + longest} tokens outgrow the cache's "
                f"{kv_tokens} tokens"
            )
        clock += costs.prefill_s([prompt] * len(wave))
        clock += _run(costs, longest, len(wave), prompt * len(wave))
    return clock


def pipelined(
    fixed_stage: Callable[[int], float], kv_stage_s: float, pp: int, send_s: float
) -> tuple[Callable[[int], float], Callable[[int], float]]:
    """Decode costs of a ``pp``-stage pipeline from one stage's (``fixed_stage(b)`` for ``b``
    sequences, ``kv_stage_s`` per cached token): the batch is split into ``m = min(pp, B)``
    micro-batches, and a round in which every sequence decodes one token takes ``max(m, pp)``
    stage-times of a micro-batch (fewer micro-batches than stages leave stages idle), each
    reading its micro-batch's share of the cache. Returns ``(fixed_s, kv_s)`` for ``Costs``."""
    cache: dict[int, float] = {}

    def fixed(batch: int) -> float:
        if batch not in cache:
            m = min(pp, batch)
            per = fixed_stage(math.ceil(batch / m)) + (send_s if pp > 1 else 0.0)
            cache[batch] = max(m, pp) * per
        return cache[batch]

    def kv(batch: int) -> float:
        m = min(pp, batch)
        return kv_stage_s * max(m, pp) / m

    return fixed, kv
