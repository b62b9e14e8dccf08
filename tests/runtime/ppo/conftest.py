"""One intra-op thread per test: the numbers do not depend on the machine's core count, and the
tiny models run faster than with threads contending for two cores."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
