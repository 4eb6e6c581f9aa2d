"""``probe --growth ... --optimizer`` with the settings torch accepts at their edges: a zero in
``--betas`` (torch takes β₁ = 0 and β₂ = 0), and the protocol's ``train_batch_size = B`` against
``--batch-size b`` (accepted exactly when b divides B: the sub-batches are whole probe steps).

Reference: torch's own first step, realised. In fp64 (the CLI's fp32 model cast after the growth,
so the drawn block is the one the CLI measured; LlamaRMSNorm in the input's dtype), each candidate
is grown on a copy, the named ``torch.optim`` class steps the new parameters once on the gradient
of the mean train loss, and the mean test loss is measured before and after. With
``train_batch_size = B`` each B-row sub-batch of the train rows the command read steps its own
fresh copy, and the changes are averaged (the Adam prediction's definition at a batch of B).
Prediction and realised change agree to 0.5 % (measured: at most 0.18 %, the step's O(η²)
remainder and the CLI's fp32).
"""

# ruff: noqa: F811  (the imported fixture `folder` is the tests' argument of the same name)
from __future__ import annotations

import copy
import re

import pytest
import torch
from test_cli_growth import (  # noqa: F401  (folder: the saved tiny LLaMA and its corpus)
    fails,
    folder,
    load,
    probe_argv,
    windows,
    write_protocol,
)

import fused_stats as fs
from fused_stats.cli import main

transformers = pytest.importorskip("transformers")
from test_growth_scores import fp64_rms_norm  # noqa: E402

CANDIDATES = ("model.layers.0", "model.layers.1")
PROTOCOL = 'candidates = ["model.layers.0", "model.layers.1"]\nseed = 1\n'
LR = 1e-4


def printed(out: str) -> dict[str, float]:
    section = out[out.index("first-step prediction for") :]
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\S+): ([-+0-9.e]+)", section, re.M)}


def mean_loss(model, rows) -> torch.Tensor:
    return fs.causal_lm_loss(model, {"input_ids": rows, "labels": rows}).mean()


def realised(folder, protocol, make, train_parts, test) -> dict[str, float]:
    """Per candidate: the mean over ``train_parts`` of the test-loss change of one step of
    ``make(new parameters)`` on that part alone (module docstring)."""
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", fp64_rms_norm)
        base = load(folder / "my-llama")
        for point in CANDIDATES:
            changes = []
            for rows in train_parts:
                grown = copy.deepcopy(base)
                result = fs.grow(grown, protocol, at=[point])
                grown.double().eval()
                named = dict(grown.named_parameters())
                new = [named[n] for n in result.new_parameters]
                optimizer = make(new)
                with torch.no_grad():
                    before = float(mean_loss(grown, test))
                for p, g in zip(new, torch.autograd.grad(mean_loss(grown, rows), new)):
                    p.grad = g
                optimizer.step()
                with torch.no_grad():
                    changes.append(float(mean_loss(grown, test)) - before)
            out[point] = sum(changes) / len(changes)
    return out


# ---------------------------------------------------------------- a zero in --betas
BETAS = [
    ("adam", "0,0.999"),
    ("adamw", "0,0"),
    ("nadam", "0,0.999"),  # NAdam's first step depends on β₁: 1 here, about 1.056 at β₁ = 0.9
    ("nadam", "0.9,0"),
    ("adamax", "0,0.999"),
    ("radam", "0,0"),
]
CLASSES = {"adam": "Adam", "adamw": "AdamW", "nadam": "NAdam", "adamax": "Adamax", "radam": "RAdam"}


@pytest.mark.parametrize("name, betas", BETAS, ids=[f"{n}-{b}" for n, b in BETAS])
def test_a_zero_beta_is_accepted_and_predicts_the_realised_step(name, betas, folder, capsys):
    path = write_protocol(folder, PROTOCOL)
    argv = probe_argv(folder, path, "--optimizer", name, "--lr", LR, "--betas", betas)
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    values = tuple(float(v) for v in betas.split(","))
    assert f"{CLASSES[name]}(lr={LR}, betas={values})" in out
    ours = printed(out)
    train, test = windows(folder / "corpus.txt")
    cls = getattr(torch.optim, CLASSES[name])
    protocol = fs.GrowthProtocol(CANDIDATES, seed=1)
    reference = realised(folder, protocol, lambda ps: cls(ps, lr=LR, betas=values), [train[:16]], test)
    assert set(ours) == set(CANDIDATES)
    for point in CANDIDATES:
        assert reference[point] != 0.0
        assert ours[point] / reference[point] == pytest.approx(1, abs=0.005), (point, ours, reference)
    if name == "nadam" and values[0] == 0:
        # the betas reach the prediction: at torch's default β₁ the realised step is another
        default = realised(folder, protocol, lambda ps: cls(ps, lr=LR), [train[:16]], test)
        assert all(abs(default[p] / ours[p] - 1) > 0.03 for p in CANDIDATES), (default, ours)


# ---------------------------------------------------------------- --batch-size against train_batch_size
ACCEPTED = [(8, 8, 2), (8, 4, 4), (16, 8, 2), (12, 6, 4), (8, 1, 8)]  # (B, --batch-size, --batches)


@pytest.mark.parametrize("size, batch, count", ACCEPTED, ids=[f"B{s}-b{b}" for s, b, _ in ACCEPTED])
def test_a_batch_size_dividing_train_batch_size_predicts_the_realised_b_sized_steps(
    size, batch, count, folder, capsys
):
    path = write_protocol(folder, PROTOCOL + f"train_batch_size = {size}\n")
    argv = probe_argv(folder, path, "--optimizer", "adam", "--lr", LR, "--batch-size", batch)
    argv[argv.index("--batches") + 1] = count
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    ours = printed(capsys.readouterr().out)
    train, test = windows(folder / "corpus.txt")
    rows = train[: batch * count]
    assert len(rows) == batch * count and len(rows) % size == 0 and batch * count >= len(test)
    parts = [rows[i : i + size] for i in range(0, len(rows), size)]
    protocol = fs.GrowthProtocol(CANDIDATES, seed=1, train_batch_size=size)
    reference = realised(folder, protocol, lambda ps: torch.optim.Adam(ps, lr=LR), parts, test)
    assert set(ours) == set(CANDIDATES)
    for point in CANDIDATES:
        assert ours[point] / reference[point] == pytest.approx(1, abs=0.005), (point, ours, reference)


REFUSED = [(8, 3), (8, 5), (8, 7), (8, 9), (8, 16), (16, 12), (12, 8)]  # b's neighbours of the accepted


@pytest.mark.parametrize("size, batch", REFUSED, ids=[f"B{s}-b{b}" for s, b in REFUSED])
def test_a_batch_size_not_dividing_train_batch_size_is_refused_before_the_model_loads(
    size, batch, folder, capsys, monkeypatch
):
    import fused_stats.commands.probe as probe_cmd

    monkeypatch.setattr(probe_cmd, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    path = write_protocol(folder, PROTOCOL + f"train_batch_size = {size}\n")
    argv = probe_argv(folder, path, "--optimizer", "adam", "--lr", LR, "--batch-size", batch)
    fails(argv, capsys, folder, f"--batch-size must divide {size}, got {batch}")
