"""pytest-benchmark runs of bench/: one torch thread, as the scripts default to (their docstrings
say why: on a shared 2-core machine a second thread makes timings swing)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
