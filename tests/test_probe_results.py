"""The results view over a probe's table (api/probe/results.py) and the report dict
(api/report/data.py), each on its own: no Probe, no model step.

References: the brute-force U-statistics over distinct index tuples (tests/reference.py) for the
estimates, the explicit mean inner product for the realized alignment, and the pooled brute force
for the certificate's moments.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.api.probe.results import ProbeResults
from fused_stats.api.report.data import report_data
from tests.reference import brute_force_targets


def _grad_stats(q: torch.Tensor, name: str) -> fs.GradStats:
    acc = fs.GradStats(q.shape[1], second_moment="pool", backend="torch", name=name)
    acc.update(q)
    return acc


def _table(gen, n_train=7, n_test=5, d=4):
    q_train = torch.randn(n_train, d, generator=gen, dtype=torch.float64) + 0.4
    q_test = torch.randn(n_test, d, generator=gen, dtype=torch.float64) + 0.4
    table = {
        ("grad", "train", "a"): _grad_stats(q_train, "a"),
        ("grad", "test", "a"): _grad_stats(q_test, "a"),
    }
    return table, q_train, q_test


def test_results_read_the_table_live_and_match_brute_force():
    gen = torch.Generator().manual_seed(11)
    table, q_train, q_test = _table(gen)
    results = ProbeResults(table, ["a"])
    for stream, q in (("train", q_train), ("test", q_test)):
        est = results.estimate("a", stream)
        for key, value in brute_force_targets(q).items():
            assert getattr(est, key) == pytest.approx(value, rel=1e-9, abs=1e-12), (stream, key)
    realized = results.realized_alignment("a").to_dict()["value"]
    assert realized == pytest.approx(float(q_train.mean(0) @ q_test.mean(0)), rel=1e-12)
    pooled = torch.cat([q_train, q_test])
    cert = results.certificate("a")
    assert (cert.M, cert.K) == (7, 5)
    assert results.pooled("a").estimate().mu_norm4 == pytest.approx(
        brute_force_targets(pooled)["mu_norm4"], rel=1e-9
    )
    # live: a later update to the table's accumulator shows without a new view
    more = torch.randn(3, 4, generator=gen, dtype=torch.float64) + 0.4
    table[("grad", "train", "a")].update(more)
    est = results.estimate("a", "train")
    assert est.n == 10
    assert est.mu_norm2 == pytest.approx(
        brute_force_targets(torch.cat([q_train, more]))["mu_norm2"], rel=1e-9
    )


def test_results_refusals_name_what_is_missing():
    gen = torch.Generator().manual_seed(12)
    table, _, _ = _table(gen)
    results = ProbeResults(table, ["a", "b"])
    with pytest.raises(fs.FusedStatsError, match=r"'c' is not a point of this probe"):
        results.estimate("c")
    with pytest.raises(fs.FusedStatsError, match=r"point 'b' has no samples in the train stream"):
        results.estimate("b")
    with pytest.raises(fs.FusedStatsError, match=r"stream must be one of"):
        results.estimate("a", "valid")
    with pytest.raises(fs.FusedStatsError, match=r"needs a Probe built with cross="):
        results.saturation("a")
    with pytest.raises(fs.FusedStatsError, match=r"no cross-gradient samples"):
        ProbeResults(table, ["a"], has_cross=True).saturation("a")


class _PartlyRefusing:
    """Results whose test stream and certificate are refused, as at a point with too few samples."""

    def __init__(self, results):
        self.inner = results
        self.misalignment_calls = 0

    def estimate(self, point, stream="train"):
        if stream == "test":
            raise fs.FusedStatsError("too few test samples")
        return self.inner.estimate(point, stream)

    def certificate(self, point):
        raise fs.FusedStatsError("no test stream")

    def misalignment(self, point, trials):
        self.misalignment_calls += 1
        return self.inner.misalignment(point, trials=trials)

    def realized_alignment(self, point):
        return self.inner.realized_alignment(point)

    def saturation(self, point):
        raise AssertionError("saturation is read only with_saturation=True")


def test_report_data_reads_any_results_and_leaves_refused_entries_none():
    gen = torch.Generator().manual_seed(13)
    table, q_train, q_test = _table(gen)
    results = _PartlyRefusing(ProbeResults(table, ["a"]))
    model = nn.Linear(4, 4)
    common = dict(
        points=["a"],
        unit="sample",
        second_moment="pool",
        summary={"class": "Linear", "num_parameters": 20, "config": {}},
    )
    data = report_data(
        results, model, dims={"a": 4}, norm_histograms={}, meta={"width": 4}, misalignment_trials=50, **common
    )
    fs.Report(data)  # the dict passes the format's validation
    (entry,) = data["points"]
    assert entry["train"]["n"] == 7 and entry["test"] is None and entry["certificate"] is None
    assert entry["saturation"] is None and entry["misalignment"]["trials"] == 50
    assert entry["realized_alignment"] == pytest.approx(float(q_train.mean(0) @ q_test.mean(0)), rel=1e-12)
    assert data["meta"] == {"width": 4} and data["model"]["class"] == "Linear"
    assert "growth_protocol" not in data
    calls = results.misalignment_calls
    no_mis = report_data(results, model, dims={"a": 4}, norm_histograms={}, misalignment_trials=0, **common)
    assert no_mis["points"][0]["misalignment"] is None
    assert results.misalignment_calls == calls  # 0 trials: not drawn at all
    with pytest.raises(fs.FusedStatsError, match=r"nothing probed yet"):
        report_data(results, model, dims={}, norm_histograms={}, **common)
