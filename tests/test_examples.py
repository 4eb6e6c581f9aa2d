"""The examples run end to end (tiny settings), so the README's pointers to them stay true.

Each runs in a fresh interpreter, as a user would start it; the assertions check that each printed
what it promises (the examples' numbers are checked against references in the other test files).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from example_scripts import run_script


def run_example(name: str, *args: str, tmp_path: Path) -> str:
    proc = run_script(name, *args, cwd=tmp_path, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart(tmp_path):
    out = run_example("quickstart.py", tmp_path=tmp_path)
    for needle in (
        "d_align=",
        "Certificate(",
        "Misalignment(",
        "realized alignment",
        "test of C = 0 (SE under H0 = ",  # print(probe.saturation(point)): the labelled line
        "| eta | predicted | measured (central) | ratio | one-sided step |",  # fs.intervene's table
    ):
        assert needle in out, needle
    # at n = 32 the plug-in variance of |C|_F^2 comes out negative at a point: no false "0"
    assert "SE of the estimate = not estimable" in out and "cross_frob2_se=0," not in out


def test_probe_llama_tiny(tmp_path):
    out = run_example(
        "probe_llama.py",
        "--width",
        "16",
        "--depth",
        "2",
        "--seq",
        "16",
        "--batch",
        "4",
        "--train-steps",
        "2",
        "--probe-batches",
        "2",
        "--out",
        str(tmp_path / "o"),
        tmp_path=tmp_path,
    )
    assert "model.layers.1" in out
    assert (tmp_path / "o" / "report.json").is_file()


def test_probe_resnet_tiny(tmp_path):
    out = run_example(
        "probe_resnet.py",
        "--width",
        "2",
        "--side",
        "8",
        "--train-steps",
        "1",
        "--batch",
        "8",
        "--probe-batches",
        "1",
        tmp_path=tmp_path,
    )
    assert "layer3.2" in out  # the table reaches the last block
    # the example checks the probe's q_b against one backward per image and prints the agreement
    found = re.search(r"self-check at layer3\.2: .*= ([0-9.e+-]+)", out)
    assert found, out
    assert float(found.group(1)) < 1e-4


@pytest.mark.parametrize("name", ["backend_in_own_hook.py"])
def test_backend_in_own_hook(name, tmp_path):
    out = run_example(name, tmp_path=tmp_path)
    # the example's own hook against Probe: every quantity printed, with its relative difference
    for key in ("n", "mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "d_align", "ag_max"):
        row = re.search(rf"^{key}\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
        assert row, (key, out)
        mine, probe, rel = (float(v) for v in row.groups())
        assert rel < 1e-6 and mine == pytest.approx(probe, rel=1e-5), (key, row.group(0))


@pytest.mark.parametrize(
    "name, module", [("probe_nnsight.py", "nnsight"), ("probe_transformer_lens.py", "transformer_lens")]
)
def test_missing_peer_library_names_the_install_command(name, module, tmp_path):
    """A peer library that is absent (shadowed here by a package whose import fails as a missing
    one would) stops the example with the command that installs the peers."""
    import os

    fake = tmp_path / "shadow" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"raise ModuleNotFoundError({'No module named ' + module!r}, name={module!r})\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = run_script(name, "--tiny", cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert "bash .ci/install-peers" in proc.stderr and repr(module) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_grow_resnet_tiny_saturated_grows_nothing(tmp_path):
    """6 steps at width 4: saturated everywhere (advice.top is None), so no growth."""
    out = run_example("grow_resnet.py", "--steps", "6", "--width", "4", tmp_path=tmp_path)
    assert "Saturated everywhere" in out and "no growth: saturated everywhere" in out
    assert "grown at" not in out and "first SGD step" not in out
    written = Path(re.search(r"^wrote (\S+)/advice\.md,", out, flags=re.M).group(1))
    shutil.rmtree(written)


def test_grow_resnet_tiny(tmp_path):
    # saturated everywhere at this size (previous test): --at grows at the largest |C|^2 anyway
    out = run_example("grow_resnet.py", "--steps", "6", "--width", "4", "--at", "layer3.2", tmp_path=tmp_path)
    assert "grown at layer3.2:" in out and "eval logits bit-identical: True" in out
    # no --out: the advice goes to a new temporary folder, nothing into the working directory
    written = Path(re.search(r"^wrote (\S+)/advice\.md,", out, flags=re.M).group(1))
    assert list(tmp_path.iterdir()) == [] and not written.is_relative_to(tmp_path)
    assert (written / "advice.md").read_text().count("| layer") == 9
    assert (written / "advice.png").stat().st_size > 0
    shutil.rmtree(written)
    rows = re.findall(r"^(\S+) +[-+]\S+ +[-+]\S+ +(\S+)$", out, flags=re.M)
    errors = {float(eta): float(err) for eta, err in rows}
    assert sorted(errors) == [1e-5, 1e-4, 1e-3, 1e-2, 1e-1], out
    # the new block is smooth at its origin: the first-step error is proportional to eta
    assert errors[1e-4] <= 1e-2, out
    for eta in (1e-3, 1e-4):
        assert 8.5 <= errors[eta] / errors[eta / 10] <= 11.5, out


def test_first_step_predictions(tmp_path):
    out = run_example("first_step_predictions.py", "--width", "16", "--depth", "2", tmp_path=tmp_path)
    rows = re.findall(r"\| (SGD|Adam) \| ([0-9.e-]+) \| .* \| ([0-9.]+) \|\n", out)
    assert len(rows) == 12, out
    # measured / predicted at the smallest step (the ratios themselves are tested in test_growth_scores.py)
    assert all(abs(float(ratio) - 1) < 0.01 for _, eta, ratio in rows if float(eta) == 1e-4), rows
    assert "curvature gain at" in out and "x one forward-backward" in out


def test_grow_during_training(tmp_path):
    out = run_example("grow_during_training.py", "--steps", "5", tmp_path=tmp_path)
    # every 2nd step with at most 2 growths over 5 steps: decisions at 2 and 4, then stopped
    assert re.search(r"step 2: grew model\.layers\.\d", out) and re.search(
        r"step 4: grew model\.layers\.\d", out
    )
    assert "stopped: True | layers now: 4" in out
    assert len(re.findall(r"growth record: step=[24] point=model\.layers\.\d", out)) == 2
    assert out.count("'fused_stats/growth/grew': 1.0") == 2
