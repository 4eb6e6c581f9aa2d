"""The CPU path without Triton (an optional dependency, the ``gpu`` extra): in a subprocess where a
meta-path finder makes every ``triton`` import fail as on a machine without it, every module of
the package but the kernels imports, a GradStats update and estimate run (checked against exact
U-statistics of the same vectors, :func:`reference.brute_force_targets`), ``fused-stats --help``
and a CPU command print, and no ``triton`` module is loaded. A Triton backend there (``"triton"``,
``"auto"`` on a CUDA device) is refused with the install command, the accumulator unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fused_stats import backend
from fused_stats.errors import FusedStatsError

from reference import assert_targets_close, brute_force_targets

BLOCK_TRITON = textwrap.dedent(
    """
    import importlib.abc, pathlib, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        # every attempt of the package's code to import triton, even one that catches the error
        # (torch's own guarded probes, e.g. torch.utils._triton, are not the package's)
        asked = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "triton":
                frame = sys._getframe(1)
                while frame.f_code.co_filename.startswith("<frozen"):
                    frame = frame.f_back
                if "fused_stats" in pathlib.PurePath(frame.f_code.co_filename).parts:
                    NoTriton.asked.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    """
)

CHECKS = textwrap.dedent(
    """
    import contextlib, importlib, io, json, pkgutil
    import torch
    import fused_stats as fs
    from fused_stats.backend import resolve_backend
    from fused_stats.cli import main

    imported, peers_missing = [], []

    def import_all(package):  # pkgutil.walk_packages would import the kernels package itself
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if info.name == "fused_stats.kernels":
                continue
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as exc:  # an integration whose peer (lightning) is absent
                if exc.name.split(".")[0] in ("triton", "fused_stats"):
                    raise
                peers_missing.append(info.name)
                continue
            imported.append(info.name)
            if info.ispkg:
                import_all(module)

    import_all(fs)

    q = torch.randn(9, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    acc = fs.GradStats(5)
    acc.update(q[:4])
    acc.update(q[4:])
    est = acc.estimate()
    targets = {key: getattr(est, key) for key in TARGETS}

    helps = {}
    for argv in (["--help"], ["plan", "--help"], ["probe", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
        helps[" ".join(argv)] = out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_rc = main(["plan", "--preset", "gpt2"])
    asked_on_cpu_path = list(NoTriton.asked)

    refusals = {}
    for name, device in (("triton", "cpu"), ("auto", "cuda"), ("triton", "cuda")):
        try:
            resolve_backend(name, device)
            refusals[f"{name}/{device}"] = None
        except fs.FusedStatsError as exc:
            refusals[f"{name}/{device}"] = str(exc)
    triton_acc = fs.GradStats(5, backend="triton")
    try:
        triton_acc.update(q[:4])
        update_refused = None
    except fs.FusedStatsError as exc:
        update_refused = str(exc)
    print(json.dumps(dict(
        imported=imported, peers_missing=peers_missing, q=q.tolist(), targets=targets, helps=helps, plan_rc=plan_rc,
        plan=out.getvalue(), auto_cpu=resolve_backend("auto", "cpu"), refusals=refusals,
        update_refused=update_refused, untouched=triton_acc.n == 0, asked_on_cpu_path=asked_on_cpu_path,
        asked_by_triton_backend=NoTriton.asked[len(asked_on_cpu_path):],
        triton_modules=sorted(m for m in sys.modules if m.split(".")[0] == "triton"),
    )))
    """
)


@pytest.fixture(scope="module")
def without_triton():
    env = {k: v for k, v in os.environ.items() if k not in ("FUSED_STATS_BACKEND", "TRITON_INTERPRET")}
    tests = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    script = BLOCK_TRITON + "from reference import TARGETS\n" + CHECKS
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_cpu_path_runs_and_loads_no_triton(without_triton):
    r = without_triton
    assert r["triton_modules"] == [] and r["asked_on_cpu_path"] == []
    assert {"fused_stats.cli", "fused_stats.ops", "fused_stats.api.probe.driver"} <= set(r["imported"])
    assert set(r["peers_missing"]) <= {
        "fused_stats.integrations.lightning",
        "fused_stats.integrations.transformers",
    }
    assert_targets_close(r["targets"], brute_force_targets(r["q"]), rel=1e-10, context="without triton")
    assert "plan" in r["helps"]["--help"] and "--tangent" in r["helps"]["plan --help"]
    assert "--model" in r["helps"]["probe --help"]
    assert r["plan_rc"] == 0 and "gpt2" in r["plan"]
    assert r["auto_cpu"] == "torch"


def test_triton_backend_without_triton_names_the_install(without_triton):
    r = without_triton
    for key, message in r["refusals"].items():
        assert message is not None, key
        assert "Triton is not installed" in message and "pip install 'fused-stats[gpu]'" in message, key
        assert "backend='torch'" in message, key
    assert "backend='auto' on a cuda tensor" in r["refusals"]["auto/cuda"]
    assert r["update_refused"] is not None and "fused-stats[gpu]" in r["update_refused"]
    assert r["untouched"] and r["asked_by_triton_backend"] == ["triton"]


@pytest.mark.parametrize(
    "error",
    [
        ImportError("libcuda.so.1: cannot open shared object file"),
        # a module Triton itself needs is missing: Triton is installed, its import fails
        ModuleNotFoundError("No module named 'filelock'", name="filelock"),
    ],
    ids=["shared-library", "its-dependency"],
)
def test_a_broken_triton_install_is_named(monkeypatch, error):
    """Triton present but failing to import: its own error is shown, not "not installed"."""

    class BrokenTriton:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "triton":
                raise error
            return None

    for name in [m for m in sys.modules if m.split(".")[0] == "triton"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BrokenTriton(), *sys.meta_path])
    backend.triton_import_error.cache_clear()
    try:
        with pytest.raises(FusedStatsError) as refused:
            backend.resolve_backend("auto", "cuda")
    finally:
        backend.triton_import_error.cache_clear()
    message = str(refused.value)
    assert f"Triton does not import ({type(error).__name__}: {error})" in message
    assert "not installed" not in message and "pip install 'fused-stats[gpu]'" in message


def test_probe_command_on_cuda_without_triton_refused_before_work(here, capsys, monkeypatch):
    """``fused-stats probe --device cuda`` (backend auto) on a CUDA machine without Triton stops at
    the argument checks, naming the install command, with nothing loaded or written."""
    import torch
    from test_cli_errors import fails, probe_args

    (here / "corpus.txt").write_text("some text to probe " * 40)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backend, "triton_import_error", lambda: "Triton is not installed")
    argv = probe_args(here / "no-model-read", here / "corpus.txt", "--out", here / "o", "--device", "cuda")
    fails(argv, capsys, here, "backend='auto' on a cuda tensor", "pip install 'fused-stats[gpu]'")
