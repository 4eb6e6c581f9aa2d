"""Running a script of ``examples/`` as a user would: a fresh interpreter, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_script(name: str, *args: str, **run_options) -> subprocess.CompletedProcess:
    """``python examples/<name> *args`` with text output captured and a 300 s limit;
    ``run_options`` (``cwd``, ``env``) go to :func:`subprocess.run`."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        **run_options,
    )
