"""``bench/bench_cross_step.py`` runs end to end at a tiny size, also with ``--baseline`` (another
checkout's package imported under another name: here this checkout itself), and writes its JSON;
the probe it times folds every sample into both kinds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_cross_step

    yield bench_cross_step
    for name in [m for m in sys.modules if m.split(".")[0] == "fused_stats_baseline"]:
        del sys.modules[name]


def test_cross_step_bench_writes_its_ratios(bench, tmp_path, capsys):
    out = tmp_path / "cross.json"
    bench.main(["--rounds", "3", "--dim", "8", "--batch", "6", "--blocks", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["median_wall_s"]) == {"train step (fwd + bwd + Adam)", "probe step (cross=)"}
    assert result["cpu_ratio_probe_over_train"] > 0
    assert result["probe_samples"] == result["cross_samples"] == 6 * (10 + 3)  # warm-up rounds too
    assert "probe / train" in capsys.readouterr().out


def test_cross_step_bench_times_a_baseline_checkout(bench, tmp_path):
    out = tmp_path / "ab.json"
    bench.main(
        [
            "--rounds",
            "2",
            "--dim",
            "8",
            "--batch",
            "6",
            "--blocks",
            "2",
            "--baseline",
            str(ROOT),
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert "probe step, baseline checkout" in result["per_round_ratio_over_train"]
    assert sys.modules["fused_stats_baseline"].__name__ == "fused_stats_baseline"
    with pytest.raises(SystemExit, match="no fused_stats package"):
        bench.main(["--baseline", str(tmp_path), "--out", str(out)])
