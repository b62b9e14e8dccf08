"""Pipeline schedules played micro-batch by micro-batch: the bubble is what the timeline leaves.

``one_f_one_b`` plays the 1F1B schedule (PipeDream-Flush, as Megatron and
``torch.distributed.pipelining.Schedule1F1B`` run it): stage ``p`` runs ``pp - p - 1`` warm-up
forwards, then alternates one forward and one backward, then drains its backwards. Each operation
starts when its stage is free and its input has arrived (the previous stage's forward, or the next
stage's backward, plus the message between them). ``forward_only`` plays inference: each stage
forwards the micro-batches in order. Times may differ per micro-batch (sequences of other
lengths) and per stage (the embedding and the head).
"""

from __future__ import annotations

from collections.abc import Sequence


def forward_only(fwd: Sequence[Sequence[float]], send_s: float) -> float:
    """Makespan of ``fwd[p][j]`` (stage ``p``, micro-batch ``j``) run in order on every stage."""
    stages = len(fwd)
    if not stages:
        return 0.0
    done_prev = [0.0] * len(fwd[0])
    for p in range(stages):
        free = 0.0
        done = []
        for j, seconds in enumerate(fwd[p]):
            ready = done_prev[j] + (send_s if p else 0.0)
            free = max(free, ready) + seconds
            done.append(free)
        done_prev = done
    return max(done_prev, default=0.0)


def one_f_one_b(
    fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]], send_s: float
) -> float:
    """Makespan of the 1F1B schedule of ``fwd[p][j]`` and ``bwd[p][j]``."""
    pp = len(fwd)
    if not pp:
        return 0.0
    m = len(fwd[0])
    orders = []
    for p in range(pp):
        warm = min(pp - p - 1, m)
        order = [("f", j) for j in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(("f", f))
                f += 1
            order.append(("b", b))
            b += 1
        orders.append(order)
    f_done = [[None] * m for _ in range(pp)]
    b_done = [[None] * m for _ in range(pp)]
    cursor = [0] * pp
    free = [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(pp):
            while cursor[p] < len(orders[p]):
                kind, j = orders[p][cursor[p]]
                if kind == "f":
                    dep = 0.0 if p == 0 else f_done[p - 1][j]
                    if dep is None:
                        break
                    start = max(free[p], dep + (send_s if p else 0.0))
                    free[p] = f_done[p][j] = start + fwd[p][j]
                else:
                    dep = f_done[p][j] if p == pp - 1 else b_done[p + 1][j]
                    if dep is None:
                        break
                    start = max(free[p], dep + (send_s if p < pp - 1 else 0.0))
                    free[p] = b_done[p][j] = start + bwd[p][j]
                cursor[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for a well-formed schedule
            raise RuntimeError("pipeline: the 1F1B schedule deadlocked")
    return max(free)
