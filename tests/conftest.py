"""Shared test set-up: make ``tests/reference.py`` importable and give each test its own seed.

The references themselves live in ``tests/reference.py`` (independent of the package code).
"""

from __future__ import annotations

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
