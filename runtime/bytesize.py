"""Byte counts as people read them in messages: "needs 30.7 MiB, over its 30.0 MiB".

A message that compares sizes (a need against a capacity) must never print two different
figures the same: at a fixed "0.2f GiB" a 31 MiB need over a 30 MiB capacity read "0.03 GiB over
its 0.03 GiB". ``byte_sizes`` prints the figures it is given in one unit, the largest binary
unit that the largest of them reaches (GiB, MiB, KiB, else bytes), with three significant digits
of that largest (at least one decimal above bytes), and more decimals wherever two different
figures would still read the same. The planner's figures are estimates, so a fraction of a byte
shows as one ("0.110 bytes over"), never as a bare "0 bytes".
"""

from __future__ import annotations

import math

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
_MOST_DECIMALS = 12


def byte_sizes(*nbytes: float) -> tuple[str, ...]:
    """The figures as text in one unit (the one the largest reaches), each with its unit, so
    that figures that differ read differently (down to a trillionth of the unit)."""
    finite = [abs(n) for n in nbytes if math.isfinite(n)]
    largest = max(finite, default=0.0)
    size, unit = next(((s, u) for s, u in _UNITS if largest >= s), (1, "bytes"))
    scaled = [n / size for n in nbytes]
    # Three significant digits of the largest (1.23, 12.3, 123.4 MiB), at least one decimal of
    # a unit above bytes; whole bytes, or three digits of a fraction of one.
    lead = math.floor(math.log10(largest / size)) if largest else 0
    least = 1 if unit != "bytes" else 0
    decimals = least if unit == "bytes" and (largest >= 1 or not largest) else max(least, 2 - lead)

    def text(d: int) -> list[str]:
        return [f"{v:.{d}f}" for v in scaled]

    shown = text(decimals)
    while decimals < _MOST_DECIMALS and _ambiguous(nbytes, shown):
        decimals += 1
        shown = text(decimals)
    return tuple(f"{s} {unit}" for s in shown)


def byte_size(nbytes: float) -> str:
    """One figure as ``byte_sizes`` prints it."""
    return byte_sizes(nbytes)[0]


def _ambiguous(nbytes: tuple[float, ...], shown: list[str]) -> bool:
    seen: dict[str, float] = {}
    for value, text in zip(nbytes, shown, strict=True):
        if text in seen and seen[text] != value:
            return True
        seen.setdefault(text, value)
    return False
