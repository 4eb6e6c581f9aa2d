"""Shared test set-up: make ``tests/reference.py`` importable, give each test its own seed and run
the tiny test models on one thread.

The references themselves live in ``tests/reference.py`` (independent of the package code).
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # so `import reference` works under any pytest import mode
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch generator seeded from the test's id: fresh inputs per test, reproducible per run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny shapes run as fast on one thread, and a second OpenMP thread spinning on a shared, busy
    2-core CI machine can slow them down tenfold; restored at the end of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The test's own folder as the working directory (default output folders land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def llama_json(here):
    """A two-layer tiny llama as a HF ``config.json`` file (the CLI's ``--model`` input)."""
    from tiny_models import TINY_LLAMA_CONFIG

    path = here / "llama.json"
    path.write_text(json.dumps(TINY_LLAMA_CONFIG))
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped without a CUDA device. ``FUSED_STATS_GPU_TESTS_ON_CPU=1``
    runs tests/test_gpu_kernels.py on CPU at tiny sizes (a check of those tests' own code)."""
    if torch.cuda.is_available():
        return
    import os

    on_cpu = os.environ.get("FUSED_STATS_GPU_TESTS_ON_CPU") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not (on_cpu and item.path.name == "test_gpu_kernels.py"):
            item.add_marker(skip)
