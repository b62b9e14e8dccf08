"""``runtime.bytesize``: sizes in messages, in a unit that shows them, and two different figures
never read the same."""

import pytest

from runtime.bytesize import byte_size, byte_sizes

GIB, MIB = 2**30, 2**20


@pytest.mark.parametrize(
    ("figures", "shown"),
    [
        ((72 * GIB,), ("72.0 GiB",)),
        ((2477.8 * GIB, 72 * GIB), ("2477.8 GiB", "72.0 GiB")),
        ((1.234 * GIB,), ("1.23 GiB",)),
        # under a GiB, in MiB: "0.03 GiB ... over its 0.03 GiB" (found by review)
        ((31 * MIB, 30 * MIB), ("31.0 MiB", "30.0 MiB")),
        ((0.03 * GIB + 1, 0.03 * GIB), ("30.720001 MiB", "30.720000 MiB")),
        ((72 * GIB, 72 * GIB - 1), ("72.000000000 GiB", "71.999999999 GiB")),
        ((GIB, GIB - 0.5 * MIB), ("1.0000 GiB", "0.9995 GiB")),
        ((999,), ("999 bytes",)),
        ((10.4, 10.2), ("10.4 bytes", "10.2 bytes")),
        ((0.11,), ("0.110 bytes",)),
        ((0,), ("0 bytes",)),
        ((5 * MIB, 5 * MIB), ("5.00 MiB", "5.00 MiB")),  # equal figures may read the same
    ],
)
def test_figures_read_in_one_unit_and_apart(figures, shown):
    assert byte_sizes(*figures) == shown


def test_one_figure_reads_as_among_others():
    assert byte_size(80 * GIB) == "80.0 GiB" and byte_size(3.5 * MIB) == "3.50 MiB"
