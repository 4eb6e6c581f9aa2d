"""The README's two set-up commands, read from README.md: ``main`` (the main job) and ``tests``.

Each is the one line of the fenced ``bash`` block that follows its marker comment,
``<!-- readme-command: main -->`` or ``<!-- readme-command: tests -->``. ``.ci/run`` executes
exactly this text, so a change to the README's command is a change to CI; the tests read it too
(tests/test_readme_commands.py: every module a test imports is installed by that command).

    python tools/readme_commands.py main          # print the main job's command
    python tools/readme_commands.py main --ci     # ... as CI runs it: with --quick appended
    python tools/readme_commands.py tests
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = ("main", "tests")
# CI runs the main job in its short form; the README says so beside the command
CI_SUFFIX = " --quick"


def readme_command(name: str, text: str | None = None) -> str:
    """The command under the marker ``name``; ValueError naming what is missing or malformed."""
    if name not in NAMES:
        raise ValueError(f"unknown README command {name!r}; known: {', '.join(NAMES)}")
    text = README.read_text(encoding="utf-8") if text is None else text
    marker = f"<!-- readme-command: {name} -->"
    if text.count(marker) != 1:
        raise ValueError(f"README.md holds {text.count(marker)} markers {marker!r}, expected exactly one")
    after = text.split(marker, 1)[1]
    block = re.match(r"\s*```bash\n(.*?)\n```", after, re.S)
    if block is None:
        raise ValueError(f"no ```bash block right after {marker!r} in README.md")
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 1:
        raise ValueError(f"the block after {marker!r} holds {len(lines)} lines, expected one command")
    return lines[0].strip()


def ci_command(name: str, text: str | None = None) -> str:
    """What CI runs: the main job with ``--quick`` appended (it must end in ``fused-stats demo``)."""
    command = readme_command(name, text)
    if name == "main":
        if not command.endswith("fused-stats demo"):
            raise ValueError(f"the README's main command must end in 'fused-stats demo', got {command!r}")
        command += CI_SUFFIX
    return command


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in NAMES or set(argv[1:]) - {"--ci"}:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(ci_command(argv[0]) if "--ci" in argv[1:] else readme_command(argv[0]))
    except ValueError as exc:
        print(f"tools/readme_commands.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
