"""``fused-stats suite``: a family of tiny sharded-safetensors checkpoints probed on shared windows.

References are independent of the suite code: each run is redone with ``from_pretrained`` and a
separate ``fs.Probe`` on windows tokenised here; sharded, torchrun and killed-and-resumed suites
are compared with one uninterrupted process. ``suite.json`` is compared with each report's
``created`` timestamp left out (the one wall-clock field; everything else must match exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import suite_models
import torch

import fused_stats as fs
from fused_stats.api.report.schema import encode
from fused_stats.cli import main

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, SEQUENCES, BATCH = 16, 16, 8
SUITE = f"""
[data]
train = "train.txt"
test = "test.txt"
seq_len = {SEQ_LEN}
sequences = {SEQUENCES}
batch_size = {BATCH}
[probe]
points = "residual"
unit = "sample"
second_moment = "pool"
cross = 4
splits = [[4, 4], [8, 8], [16, 16]]
trials = 200
seed = 3
[[runs]]
glob = "ckpts/llama-*"
[[runs]]
glob = "ckpts/neox/step*"
"""


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    info = suite_models.build_all(tmp_path_factory.mktemp("suite"))
    (info["root"] / "suite.toml").write_text(SUITE)
    return info


@pytest.fixture(scope="session")
def reference(family):
    """One uninterrupted suite run in this process."""
    out = family["root"] / "out-one"
    assert main(["suite", str(family["root"] / "suite.toml"), "--out", str(out), "--no-progress"]) == 0
    return out


def normalised(path: Path) -> dict:
    suite = json.loads(path.read_text())
    for run in suite["runs"].values():
        if run["report"] is not None:
            run["report"].pop("created")
    return suite


def windows(tokenizer, text_file: Path) -> np.ndarray:
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    return np.asarray(ids[: SEQ_LEN * SEQUENCES], dtype=np.int64).reshape(SEQUENCES, SEQ_LEN)


# ---------------------------------------------------------------------------- 1: bit for bit
def test_every_run_equals_a_separate_probe(family, reference):
    import hashlib

    import transformers

    suite = json.loads((reference / "suite.json").read_text())
    names = {f"llama-w{w}-d{d}" for w in suite_models.WIDTHS for d in suite_models.DEPTHS}
    names |= {f"step{s}" for s in suite_models.STEPS}
    assert set(suite["runs"]) == names and suite["failed"] == []
    for folder in family["folders"].values():  # sharded safetensors, as the issue asks
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    root = family["root"]
    for name, entry in sorted(suite["runs"].items()):
        folder = family["folders"][name]
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        train, test = windows(tokenizer, root / "train.txt"), windows(tokenizer, root / "test.txt")
        shas = {
            k: hashlib.sha256(v.astype("<i8").tobytes()).hexdigest()
            for k, v in (("train", train), ("test", test))
        }
        assert {k: suite["data"][entry["tokenizer"]][k]["sha256"] for k in shas} == shas
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        config = json.loads((folder / "config.json").read_text())
        assert entry["labels"]["width"] == config["hidden_size"]
        assert entry["labels"]["depth"] == config["num_hidden_layers"]
        assert entry["labels"]["model_type"] == config["model_type"]
        assert entry["labels"]["parameters"] == model.num_parameters()
        assert entry["labels"].get("step") == (int(name[4:]) if name.startswith("step") else None)
        probe = fs.Probe(
            model, points="residual", unit="sample", second_moment="pool", cross=fs.CrossSpec(rank=4, seed=3)
        )
        for stream, rows in (("train", train), ("test", test)):
            for i in range(0, SEQUENCES, BATCH):
                ids = torch.from_numpy(rows[i : i + BATCH])
                probe.step(
                    {"input_ids": ids, "labels": ids}, fs.causal_lm_loss, stream=stream, mask="attention"
                )
        want = json.loads(json.dumps(encode(probe.report(misalignment_trials=0).data)))
        # without [growth]: no advice, and the held-out loss of the same pass (fp32 sums)
        assert entry["advice"] is None
        assert entry["test_loss"] == pytest.approx(held_out_loss(model, test), rel=1e-5), name
        got = entry["report"]
        assert [p["name"] for p in got["points"]] == list(probe.points)
        for mine, theirs in zip(got["points"], want["points"]):
            for key in ("train", "test", "certificate", "realized_alignment", "saturation"):
                assert mine[key] == theirs[key], (name, mine["name"], key)
        for budget, (M, K) in zip(entry["budgets"], [(4, 4), (8, 8), (16, 16)]):
            assert (budget["M"], budget["K"]) == (M, K)
            for point in probe.points:
                cert = probe.certificate(point, M=M, K=K).to_dict()
                mis = probe.misalignment(point, M, K, trials=200, seed=3).to_dict()
                assert budget["points"][point]["certificate"] == json.loads(json.dumps(encode(cert)))
                assert budget["points"][point]["misalignment"] == mis
    md = (reference / "suite.md").read_text()
    assert "| width | depth=2, model_type=llama | d_align (train) | 3 |" in md
    assert "| step | depth=2, model_type=gpt_neox, width=16 |" in md
    for png in (
        "suite_width.png",
        "suite_budgets.png",
        "suite_depth.png",
        "suite_saturation.png",
        "suite_steps.png",
    ):
        assert (reference / png).stat().st_size > 1000


def test_trend_rows_match_a_brute_force_spearman(reference):
    """ρ against width at fixed depth and its exact p-value, redone with scipy's ρ and every permutation."""
    import itertools
    import math

    from scipy.stats import spearmanr

    suite = json.loads((reference / "suite.json").read_text())
    md = (reference / "suite.md").read_text()
    for depth in suite_models.DEPTHS:
        runs = [
            r
            for r in suite["runs"].values()
            if r["labels"]["model_type"] == "llama" and r["labels"]["depth"] == depth
        ]
        xs = [r["labels"]["width"] for r in runs]
        ys = [r["report"]["points"][-1]["train"]["ag_max"] for r in runs]
        rho = spearmanr(xs, ys).statistic
        perms = [spearmanr(xs, list(p)).statistic for p in itertools.permutations(ys)]
        p = sum(abs(r) >= abs(rho) - 1e-12 for r in perms) / math.factorial(len(ys))
        row = f"| width | depth={depth}, model_type=llama | AG_max (train) | 3 | {rho:+.2f} | {p:.3g} |"
        assert row in md, row


# ---------------------------------------------------------------------------- 2: sharding
def test_three_shards_and_torchrun_equal_one_process(family, reference, capsys):
    toml = str(family["root"] / "suite.toml")
    out = family["root"] / "out-shards"
    for i in range(3):
        assert main(["suite", toml, "--out", str(out), "--shard", f"{i}/3", "--no-progress"]) == 0
        # only the last shard to finish writes the suite files
        assert (out / "suite.json").exists() == (i == 2)
    assert "not finished yet" in capsys.readouterr().out
    assert normalised(out / "suite.json") == normalised(reference / "suite.json")

    out = family["root"] / "out-torchrun"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "-m",
        "fused_stats.cli",
    ]
    done = subprocess.run(
        cmd + ["suite", toml, "--out", str(out), "--no-progress"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchrun" in done.stdout and "takes 3 on cpu" in done.stdout
    ranks = {json.loads(p.read_text())["name"] for p in (out / "runs").glob("*.json")}
    assert len(ranks) == 9
    assert normalised(out / "suite.json") == normalised(reference / "suite.json")


def test_shard_from_the_environment():
    from fused_stats.api.suite.runner import Shard, my_runs, shard_from_env
    from fused_stats.errors import FusedStatsError

    assert shard_from_env(env={}) == Shard(0, 1, "single")
    assert shard_from_env(env={"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}) == Shard(
        2, 3, "torchrun", 0
    )
    # sbatch --array=1-4: ids 1..4, MIN 1, COUNT 4
    slurm = {
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_ARRAY_TASK_MIN": "1",
        "SLURM_ARRAY_TASK_MAX": "4",
        "SLURM_ARRAY_TASK_COUNT": "4",
    }
    assert shard_from_env(env=slurm) == Shard(2, 4, "slurm")
    stepped = {
        "SLURM_ARRAY_TASK_ID": "4",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_MAX": "6",
        "SLURM_ARRAY_TASK_STEP": "2",
        "SLURM_ARRAY_TASK_COUNT": "4",
    }
    assert shard_from_env(env=stepped) == Shard(2, 4, "slurm")
    both = dict(slurm, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert shard_from_env(env=both) == Shard(5, 8, "slurm+torchrun", 1)
    assert shard_from_env("1/2", env=both) == Shard(1, 2, "--shard", 1)
    with pytest.raises(FusedStatsError, match="not evenly spaced"):  # --array=1,2,7
        shard_from_env(
            env={
                "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_MAX": "7",
                "SLURM_ARRAY_TASK_COUNT": "3",
            }
        )
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(FusedStatsError, match="--shard"):
            shard_from_env(bad, env={})
    runs = list(range(10))
    shares = [my_runs(runs, Shard(i, 3, "x")) for i in range(3)]
    assert sorted(r for share in shares for r in share) == runs and all(len(s) in (3, 4) for s in shares)


# ---------------------------------------------------------------------------- 3: killed and resumed
def test_killed_after_two_runs_then_resumed(family, reference, capsys):
    toml = str(family["root"] / "suite.toml")
    out = family["root"] / "out-killed"
    child = subprocess.Popen(
        [sys.executable, "-m", "fused_stats.cli", "suite", toml, "--out", str(out), "--no-progress"],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while len(list((out / "runs").glob("*.json"))) < 2:
        assert child.poll() is None and time.monotonic() < deadline, "the child ended before its second run"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    before = {p.name: p.read_bytes() for p in (out / "runs").glob("*.json")}
    assert 2 <= len(before) < 9 and not (out / "suite.json").exists()
    assert main(["suite", toml, "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"{9 - len(before)} probed, {len(before)} finished earlier (skipped)" in text
    for name, payload in before.items():  # not probed again: the same bytes, timing and timestamp included
        assert (out / "runs" / name).read_bytes() == payload
    assert normalised(out / "suite.json") == normalised(reference / "suite.json")


# ---------------------------------------------------------------------------- 4: bad input
def _suite_file(root: Path, tmp_path: Path, text: str) -> Path:
    """A suite file in a fresh folder whose ckpts / data point at the family's."""
    for item in ("ckpts", "train.txt", "test.txt"):
        target = tmp_path / item
        if not target.exists():
            target.symlink_to(root / item)
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return path


BAD = [
    (("[probe]", "[probe]\nbogus = 1"), "unknown key 'bogus' in [probe]"),
    (("[data]", "[extra]\nx = 1\n[data]"), "unknown section or key 'extra'"),
    (
        ('[[runs]]\nglob = "ckpts/llama-*"', '[[runs]]\nglob = "ckpts/gpt2-*"'),
        "glob 'ckpts/gpt2-*' matches no checkpoint",
    ),
    (
        ("[[runs]]", '[compare]\ntrends = ["width", "step"]\n[[runs]]'),
        "trends asks for label 'step', which run(s) llama-w16-d1",
    ),
    ((f"sequences = {SEQUENCES}", "sequences = 100000"), "is too short"),
    (("splits = [[4, 4]", "splits = [[30, 4]"), "splits [30, 4]: the misalignment draws M + K = 34"),
    ((f"seq_len = {SEQ_LEN}", "seq_len = 65"), "seq_len 65 exceeds its 64 positions"),
    (
        ('unit = "sample"', 'unit = "sample"\nstream_blocks = "yes"'),
        'stream_blocks must be "auto", true or false',
    ),
    (('unit = "sample"', 'unit = "token"'), "[probe] unit must be one of"),
    (
        ('[[runs]]\nglob = "ckpts/llama-*"', '[[runs]]\nmodel = "ckpts/missing"'),
        "is not a folder with a config.json",
    ),
    (
        (
            '[[runs]]\nglob = "ckpts/llama-*"',
            '[[runs]]\nglob = "ckpts/llama-*"\n[[runs]]\nmodel = "ckpts/llama-w16-d1"',
        ),
        "named by more than one",
    ),
]


@pytest.mark.parametrize(("edit", "message"), BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_refused_before_any_model_loads(family, tmp_path, monkeypatch, capsys, edit, message):
    old, new = edit
    assert old in SUITE
    path = _suite_file(family["root"], tmp_path, SUITE.replace(old, new, 1))

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the suite file was checked")

    monkeypatch.setattr("fused_stats.commands.probe.load_model", no_loading)
    out = tmp_path / "out"
    assert main(["suite", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fused-stats: error: ") and message in err, err
    assert not out.exists()  # nothing created


def test_differing_tokenizers_refused_unless_per_model(family, tmp_path, capsys):
    from fused_stats.api.suite.spec import read_suite
    from fused_stats.commands.suite import prepare

    other = tmp_path / "ckpts-other" / "llama-retok"
    shutil.copytree(family["folders"]["llama-w16-d1"], other)
    suite_models.build_tokenizer(suite_models.corpus(5, 600)).save_pretrained(other)
    text = SUITE + '[[runs]]\nmodel = "ckpts-other/llama-retok"\n'
    path = _suite_file(family["root"], tmp_path, text)
    assert main(["suite", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tokenizers differ" in err and "llama-retok" in err and 'tokenizer = "per-model"' in err
    assert not (tmp_path / "out").exists()
    path.write_text(text.replace("[data]", '[data]\ntokenizer = "per-model"'))
    windows, identity = prepare(read_suite(path))
    assert len(windows) == 2 and identity["llama-retok"] != identity["llama-w16-d1"]
    import transformers

    for name in ("llama-retok", "llama-w16-d1"):  # each tokenizer's own windows of the same text
        folder = other if name == "llama-retok" else family["folders"][name]
        want = windows_of(transformers.AutoTokenizer.from_pretrained(folder), family["root"] / "train.txt")
        assert np.array_equal(windows[identity[name]].train, want)


def windows_of(tokenizer, text_file):
    return windows(tokenizer, text_file)


def test_corrupt_shard_fails_alone_and_force_redoes(family, tmp_path, capsys):
    broken = tmp_path / "ckpts-broken" / "llama-broken"
    shutil.copytree(family["folders"]["llama-w16-d2"], broken)
    shard = sorted(broken.glob("model-*-of-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn download
    text = (
        SUITE.split("[[runs]]")[0]
        + '[[runs]]\nmodel = "ckpts/llama-w16-d1"\n[[runs]]\nmodel = "ckpts-broken/llama-broken"\n'
    )
    path = _suite_file(family["root"], tmp_path, text)
    out = tmp_path / "out"
    assert main(["suite", str(path), "--out", str(out), "--no-progress"]) == 1
    printed = capsys.readouterr().out
    assert "FAILED runs (1 of 2):" in printed and "llama-broken:" in printed.split("FAILED runs")[1]
    assert f"shard {shard.name} is unreadable" in printed.split("FAILED runs")[1]
    suite = json.loads((out / "suite.json").read_text())
    assert suite["failed"] == ["llama-broken"] and suite["runs"]["llama-w16-d1"]["status"] == "done"
    assert suite["runs"]["llama-broken"]["report"] is None and suite["runs"]["llama-broken"]["error"]
    assert "failed" in (out / "suite.md").read_text()
    # the suite file changed: refused for this folder unless --force
    path.write_text(text.replace("trials = 200", "trials = 100"))
    assert main(["suite", str(path), "--out", str(out), "--no-progress"]) == 2
    assert "different suite file" in capsys.readouterr().err
    assert main(["suite", str(path), "--out", str(out), "--no-progress", "--force"]) == 1
    assert "1 probed, 0 finished earlier (skipped), 1 failed" in capsys.readouterr().out
    assert json.loads((out / "suite.json").read_text())["settings"]["trials"] == 100


# ---------------------------------------------------------------------------- data sources
def test_data_sources_give_the_expected_windows(family, tmp_path):
    from fused_stats.api.suite.data import stream_windows
    from fused_stats.errors import FusedStatsError

    rng = np.random.default_rng(11)
    flat = rng.integers(0, 100, size=1000, dtype=np.int32)
    np.save(tmp_path / "flat.npy", flat)
    got = stream_windows(tmp_path / "flat.npy", None, 16, 20, "text", "train")
    assert got.dtype == np.int64 and np.array_equal(got, flat[:320].reshape(20, 16))
    rows = rng.integers(0, 100, size=(30, 16), dtype=np.int64)
    np.save(tmp_path / "rows.npy", rows)
    notes = []
    assert np.array_equal(
        stream_windows(tmp_path / "rows.npy", None, 16, 20, "text", "test", notes), rows[:20]
    )
    assert notes == []  # rows of exactly seq_len: nothing cut, nothing said
    # rows longer than seq_len: their first seq_len tokens, as `fused-stats probe --tokens` cuts them
    notes = []
    assert np.array_equal(
        stream_windows(tmp_path / "rows.npy", None, 8, 4, "text", "test", notes), rows[:4, :8]
    )
    assert notes == [
        f"[data] test = {str(tmp_path / 'rows.npy')!r} holds (30, 16) sequences; using the first "
        "[data] seq_len 8 tokens of each: (30, 8)"
    ]
    with pytest.raises(
        FusedStatsError, match="shorter than \\[data\\] seq_len = 20; set seq_len = 16 or less"
    ):
        stream_windows(tmp_path / "rows.npy", None, 20, 4, "text", "test")
    with pytest.raises(FusedStatsError, match="too short: 30 windows"):
        stream_windows(tmp_path / "rows.npy", None, 16, 31, "text", "test")
    np.save(tmp_path / "float.npy", rng.random(100))
    with pytest.raises(FusedStatsError, match="float64; expected integers"):
        stream_windows(tmp_path / "float.npy", None, 16, 2, "text", "test")

    tokenizer = family["tokenizer"]
    docs = [suite_models.corpus(20 + i, 60) for i in range(12)]
    with (tmp_path / "docs.jsonl").open("w") as handle:
        for doc in docs:
            handle.write(json.dumps({"body": doc, "id": 1}) + "\n")
    want = []
    for doc in docs:  # documents joined by the end-of-text id
        want += ([tokenizer.eos_token_id] if want else []) + tokenizer(doc, add_special_tokens=False)[
            "input_ids"
        ]
    want = np.asarray(want[: 16 * 10]).reshape(10, 16)
    assert np.array_equal(stream_windows(tmp_path / "docs.jsonl", tokenizer, 16, 10, "body", "train"), want)
    with pytest.raises(FusedStatsError, match="line 1 has no string field 'text'"):
        stream_windows(tmp_path / "docs.jsonl", tokenizer, 16, 10, "text", "train")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "ds"))
    assert np.array_equal(stream_windows(tmp_path / "ds", tokenizer, 16, 10, "body", "train"), want)
    text = (family["root"] / "train.txt").read_text()  # bytes when a folder has no tokenizer
    raw = np.frombuffer(text.encode()[: 16 * 4], dtype=np.uint8).astype(np.int64).reshape(4, 16)
    assert np.array_equal(stream_windows(family["root"] / "train.txt", None, 16, 4, "text", "train"), raw)


def test_token_ids_beyond_a_vocabulary_refused_before_loading(family, tmp_path, monkeypatch, capsys):
    vocab = len(family["tokenizer"])
    rows = np.random.default_rng(4).integers(0, vocab, size=(SEQUENCES, SEQ_LEN))
    np.save(tmp_path / "ok.npy", rows)
    rows[5, 7] = vocab  # one id past the embedding table
    np.save(tmp_path / "bad.npy", rows)
    text = SUITE.replace('"train.txt"', '"bad.npy"').replace('"test.txt"', '"ok.npy"')
    path = _suite_file(family["root"], tmp_path, text)
    monkeypatch.setattr("fused_stats.commands.probe.load_model", lambda *a, **k: pytest.fail("loaded"))
    assert main(["suite", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"token ids span [0, {vocab}] but its vocab_size is {vocab}" in err, err


def test_report_suite_rerenders_and_lists_pending_runs(reference, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    for name in ("suite.json", "suite.md", "suite_width.png"):
        (copy / name).unlink()
    assert main(["report", "--suite", str(copy)]) == 0
    for name in ("suite.json", "suite.md"):  # the same bytes from the same run files
        assert (copy / name).read_bytes() == (reference / name).read_bytes()
    assert (copy / "suite_width.png").is_file()
    (copy / "runs" / "step100.json").unlink()
    capsys.readouterr()
    assert main(["report", "--suite", str(copy), "--no-plots"]) == 0
    assert "1 run(s) not finished yet, left out: step100" in capsys.readouterr().out
    partial = json.loads((copy / "suite.json").read_text())
    assert (
        partial["pending"] == ["step100"] and "step100" not in partial["runs"] and len(partial["runs"]) == 8
    )
    runs_table = (copy / "suite.md").read_text().split("## Runs")[1].split("\n## ")[0]
    assert "| step100 | gpt_neox | 16 | 2 | 100 | — | pending (not finished yet) |" in runs_table, runs_table
    assert main(["report", "--suite", str(tmp_path / "nowhere")]) == 2
    assert "is not a suite folder (no plan.json)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- run keys and resume
ONE_RUN = SUITE.split("[[runs]]")[0] + '[[runs]]\nmodel = "own/llama"\n'


def _own_family(family, tmp_path) -> Path:
    """A suite folder with its own copies of the data and of one checkpoint, free to change."""
    for name in ("train.txt", "test.txt"):
        shutil.copy(family["root"] / name, tmp_path / name)
    shutil.copytree(family["folders"]["llama-w16-d1"], tmp_path / "own" / "llama")
    path = tmp_path / "suite.toml"
    path.write_text(ONE_RUN)
    return path


def _run(path, out, capsys, *extra) -> tuple[int, str, str]:
    code = main(["suite", str(path), "--out", str(out), "--no-progress", "--no-plots", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_changed_data_checkpoint_or_version_probes_again(family, tmp_path, monkeypatch, capsys):
    import transformers

    path, out = _own_family(family, tmp_path), tmp_path / "out"
    assert "1 probed, 0 finished earlier" in _run(path, out, capsys)[1]
    assert "0 probed, 1 finished earlier" in _run(path, out, capsys)[1]
    # new data at the same path: refused without --force, then --force probes on the new windows
    (tmp_path / "train.txt").write_text(suite_models.corpus(9, 3000))
    code, _, err = _run(path, out, capsys)
    assert code == 2 and "data windows changed" in err
    code, printed, _ = _run(path, out, capsys, "--force")
    assert code == 0 and "1 probed, 0 finished earlier" in printed
    suite = json.loads((out / "suite.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "own" / "llama")
    want = hashlib_sha256(windows(tokenizer, tmp_path / "train.txt"))
    run = suite["runs"]["llama"]
    assert suite["data"][run["tokenizer"]]["train"]["sha256"] == want
    assert run["report"]["meta"]["data"]["train"] == want  # the report measured the new windows
    before = run["report"]["points"][0]["train"]["d_align"]
    # other weights written into one shard, same names, shapes and size: probed again without --force
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = sorted((tmp_path / "own" / "llama").glob("model-*-of-*.safetensors"))[0]
    with safe_open(shard, framework="pt") as handle:
        names = list(handle.keys())
        tensors = {k: handle.get_tensor(k) * 1.5 for k in names}
        metadata = handle.metadata()
    size = shard.stat().st_size
    save_file(tensors, shard, metadata=metadata)
    assert shard.stat().st_size == size
    code, printed, _ = _run(path, out, capsys)
    assert code == 0 and "1 probed, 0 finished earlier" in printed
    assert "llama: probed again: the checkpoint's files changed" in printed
    after = json.loads((out / "suite.json").read_text())["runs"]["llama"]["report"]
    assert after["points"][0]["train"]["d_align"] != before
    # another package version: probed again
    monkeypatch.setattr("fused_stats.api.suite.identity.__version__", "99.0")
    printed = _run(path, out, capsys)[1]
    assert (
        "1 probed, 0 finished earlier" in printed and f"it ran under fused_stats {fs.__version__}" in printed
    )
    # --force probes every run again, changed or not
    assert "1 probed, 0 finished earlier" in _run(path, out, capsys, "--force")[1]
    assert "0 probed, 1 finished earlier" in _run(path, out, capsys)[1]


def hashlib_sha256(rows: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(rows.astype("<i8").tobytes()).hexdigest()


def test_a_failed_run_is_probed_again_on_resume(family, tmp_path, monkeypatch, capsys):
    from fused_stats.commands import probe as probe_command

    path, out = _own_family(family, tmp_path), tmp_path / "out"
    real = probe_command.load_model

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(probe_command, "load_model", out_of_memory)
    code, printed, _ = _run(path, out, capsys)
    assert code == 1 and "0 probed, 0 finished earlier (skipped), 1 failed" in printed
    monkeypatch.setattr(probe_command, "load_model", real)
    code, printed, _ = _run(path, out, capsys)  # the same file, no --force
    assert code == 0 and "1 probed, 0 finished earlier" in printed
    assert "llama: probed again: its last try failed" in printed
    # a folder none of whose runs finished does not hold another suite file back
    monkeypatch.setattr(probe_command, "load_model", out_of_memory)
    shutil.rmtree(out)
    assert _run(path, out, capsys)[0] == 1
    monkeypatch.setattr(probe_command, "load_model", real)
    path.write_text(ONE_RUN.replace("trials = 200", "trials = 100"))
    code, printed, _ = _run(path, out, capsys)
    assert code == 0 and "1 probed" in printed
    assert json.loads((out / "suite.json").read_text())["settings"]["trials"] == 100


def test_point_names_checked_on_the_first_model_and_depth_from_its_residual_points(
    family, tmp_path, monkeypatch, capsys
):
    from fused_stats.api.report.schema import fmt
    from fused_stats.api.suite.compare import relative_depths
    from fused_stats.commands import probe as probe_command

    real, loads = probe_command.load_model, []

    def counting(path, *args, **kwargs):
        loads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(probe_command, "load_model", counting)
    base = SUITE.split("[[runs]]")[0] + '[[runs]]\nglob = "ckpts/llama-w16-*"\n'
    misspelt = base.replace('points = "residual"', 'points = ["model.layers.0", "model.layer.0"]')
    path = _suite_file(family["root"], tmp_path, misspelt)
    out = tmp_path / "out"
    code, _, err = _run(path, out, capsys)
    assert code == 2 and "'model.layer.0'" in err and "checked on run llama-w16-d1" in err
    assert loads == ["llama-w16-d1"] and not out.exists()
    path.write_text(base.replace('points = "residual"', 'points = ["model.embed_tokens", "model.layers.0"]'))
    loads.clear()
    code, printed, _ = _run(path, out, capsys)  # the fixed file, no --force
    assert code == 0 and "2 probed" in printed
    assert loads == ["llama-w16-d1", "llama-w16-d2"]  # the checked model is probed, not loaded again
    suite = json.loads((out / "suite.json").read_text())
    for name, run in suite["runs"].items():
        depth = json.loads((Path(run["model"]) / "config.json").read_text())["num_hidden_layers"]
        # model.layers.0 is the stream after block 1 of `depth`; the embedding is off the stream
        assert [r for r, _ in relative_depths(run)] == ["model.embed_tokens", 1 / depth], name
    md = (out / "suite.md").read_text()
    assert "| run | 0.5 | 1 | model.embed_tokens |" in md
    d_align = md.split("## d_align (train)")[1].split("\n## ")[0]
    for name, run in suite["runs"].items():
        cells = {r: fmt(p["train"]["d_align"]) for r, p in relative_depths(run)}
        want = [cells.get(0.5, ""), cells.get(1.0, ""), cells["model.embed_tokens"]]
        assert f"| {name} | " + " | ".join(want) + " |" in d_align, d_align


def test_default_mask_follows_the_unit(family, tmp_path):
    from fused_stats.api.suite.spec import read_suite

    for unit, mask in (("sample", "attention"), ("position", "labels"), ("flat", "attention")):
        text = SUITE.replace('unit = "sample"', f'unit = "{unit}"').replace("cross = 4\n", "")
        spec = read_suite(_suite_file(family["root"], tmp_path, text))
        assert (spec.probe["unit"], spec.probe["mask"]) == (unit, mask)


def test_shard_k_takes_the_runs_k_mod_n():
    from fused_stats.api.suite.runner import Shard, my_runs

    names = [f"run{k}" for k in range(10)]
    assert my_runs(names, Shard(0, 3, "x")) == ["run0", "run3", "run6", "run9"]
    assert my_runs(names, Shard(1, 3, "x")) == ["run1", "run4", "run7"]
    assert my_runs(names, Shard(2, 4, "x")) == ["run2", "run6"]


def test_parameters_trend_holds_only_the_other_labels_fixed(reference):
    import itertools
    import math

    from scipy.stats import spearmanr

    suite = json.loads((reference / "suite.json").read_text())
    runs = [r for r in suite["runs"].values() if r["labels"]["model_type"] == "llama"]
    xs = [r["labels"]["parameters"] for r in runs]
    ys = [r["report"]["points"][-1]["train"]["ag_max"] for r in runs]
    assert len(set(xs)) == 6  # every width × depth a different size: one group across both
    rho = spearmanr(xs, ys).statistic
    perms = [spearmanr(xs, list(p)).statistic for p in itertools.permutations(ys)]
    p = sum(abs(r) >= abs(rho) - 1e-12 for r in perms) / math.factorial(len(ys))
    row = f"| parameters | model_type=llama | AG_max (train) | 6 | {rho:+.2f} | {p:.3g} |"
    assert row in (reference / "suite.md").read_text(), row


def test_a_two_by_two_grid_says_which_groups_it_has(reference):
    from fused_stats.api.suite.compare import render_markdown

    suite = json.loads((reference / "suite.json").read_text())
    keep = {"llama-w16-d1", "llama-w16-d2", "llama-w24-d1", "llama-w24-d2"}
    suite["runs"] = {n: r for n, r in suite["runs"].items() if n in keep}
    for trends in (None, ["width", "depth"]):
        suite["trends"] = trends
        md = render_markdown(suite)
        # parameters varies across all four: a trend of its own; width and depth have n = 2 a group
        assert ("| parameters | model_type=llama | AG_max (train) | 4 |" in md) == (trends is None)
        assert ("No trend: a trend needs 3 or more runs at 2 or more values" in md) == (trends is not None)
        assert "Groups without a trend (fewer than 3 runs, or one value of the label):" in md
        for depth in (1, 2):
            assert f"| width | depth={depth}, model_type=llama | 2 | 16, 24 |" in md
        for width in (16, 24):
            assert f"| depth | model_type=llama, width={width} | 2 | 1, 2 |" in md


def test_same_train_and_test_file_is_warned_and_recorded(family, tmp_path, capsys):
    path = _own_family(family, tmp_path)
    path.write_text(ONE_RUN.replace('test = "test.txt"', 'test = "train.txt"'))
    code, _, err = _run(path, tmp_path / "out", capsys)
    assert code == 0 and "warning: [data] train and test are the same file" in err
    suite = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert len(suite["warnings"]) == 1 and "not held out" in suite["warnings"][0]
    assert (
        "**warning**: [data] train and test are the same file" in (tmp_path / "out" / "suite.md").read_text()
    )


def test_memory_in_the_plan_units(family):
    import re

    from fused_stats.api.streaming.plan import human_bytes
    from fused_stats.api.suite.runner import stream_decision
    from fused_stats.api.suite.spec import read_suite

    spec = read_suite(family["root"] / "suite.toml")
    spec.probe["stream_blocks"] = "auto"
    _, why = stream_decision(spec, spec.runs[0], torch.device("cpu"))
    match = re.fullmatch(r"auto: whole model needs ~([\d.]+ [KMGT]?i?B), ([\d.]+ [KMGT]iB) free", why)
    assert match, why
    assert human_bytes(2 * 1024**2) == "2.00 MiB"  # the plan's own formatter


def test_a_shard_on_new_data_never_pairs_it_with_old_runs(family, tmp_path, capsys):
    """Data changed, shard 0 redone with --force: suite.json waits for shard 1's run on the new windows."""
    for name in ("train.txt", "test.txt"):
        shutil.copy(family["root"] / name, tmp_path / name)
    (tmp_path / "ckpts").symlink_to(family["root"] / "ckpts")
    path = tmp_path / "suite.toml"
    path.write_text(SUITE.split("[[runs]]")[0] + '[[runs]]\nglob = "ckpts/llama-w16-*"\n')
    out = tmp_path / "out"
    assert _run(path, out, capsys)[0] == 0 and (out / "suite.json").is_file()
    (tmp_path / "train.txt").write_text(suite_models.corpus(9, 3000))
    code, printed, _ = _run(path, out, capsys, "--force", "--shard", "0/2")
    assert code == 0 and "1 run(s) not finished yet (other shards): llama-w16-d2" in printed
    assert not (out / "suite.json").exists() and not (out / "suite.md").exists()
    code, printed, _ = _run(path, out, capsys, "--shard", "1/2")
    assert code == 0 and "llama-w16-d2: probed again: the data windows changed" in printed
    suite = json.loads((out / "suite.json").read_text())
    want = suite["data"][next(iter(suite["data"]))]["train"]["sha256"]
    assert {r["report"]["meta"]["data"]["train"] for r in suite["runs"].values()} == {want}


# ---------------------------------------------------------------------------- [growth]: advice and held-out loss
GROWTH_SUITE = f"""
[data]
train = "train.txt"
test = "test.txt"
seq_len = {SEQ_LEN}
sequences = {SEQUENCES}
batch_size = {BATCH}
[probe]
unit = "sample"
second_moment = "pool"
dtype = "float64"
splits = [[8, 8]]
trials = 0
[growth]
candidates = [0, 0.5, 1.0]
family = "layer"
init = "zero"
seed = 5
budget = [8, 8]
alpha = 0.1
[[runs]]
glob = "ckpts/llama-w16-*"
[[runs]]
glob = "ckpts/llama-w24-*"
"""
# the boundaries relative depths 0, 0.5 and 1 name, written out by hand per depth
GROWTH_POINTS = {
    1: ["model.embed_tokens", "model.layers.0"],
    2: ["model.embed_tokens", "model.layers.0", "model.layers.1"],
}


def held_out_loss(model, rows: np.ndarray) -> float:
    """Nats per predicted token of a plain forward: every next token of every window counts."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], BATCH):
            ids = torch.from_numpy(rows[i : i + BATCH])
            logits = model(input_ids=ids).logits[:, :-1]
            nll = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])
            total += float(nll.sum())
            tokens += nll.numel()
    return total / tokens


@pytest.fixture(scope="session")
def grown(family, tmp_path_factory):
    folder = tmp_path_factory.mktemp("growth-suite")
    path = _suite_file(family["root"], folder, GROWTH_SUITE)
    out = folder / "out"
    assert main(["suite", str(path), "--out", str(out), "--no-progress"]) == 0
    return path, out


def test_growth_advice_and_test_loss_equal_a_separate_probe_and_forward(family, grown):
    import transformers

    _, out = grown
    suite = json.loads((out / "suite.json").read_text())
    assert sorted(suite["runs"]) == ["llama-w16-d1", "llama-w16-d2", "llama-w24-d1", "llama-w24-d2"]
    root = family["root"]
    for name, entry in sorted(suite["runs"].items()):
        assert entry["status"] == "done", entry["error"]
        folder = family["folders"][name]
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        train, test = windows(tokenizer, root / "train.txt"), windows(tokenizer, root / "test.txt")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        depth = model.config.num_hidden_layers
        protocol = fs.GrowthProtocol(candidates=GROWTH_POINTS[depth], seed=5, budget=(8, 8))
        probe = fs.Probe(model, unit="sample", second_moment="pool", cross=protocol)
        for stream, rows in (("train", train), ("test", test)):
            for i in range(0, SEQUENCES, BATCH):
                ids = torch.from_numpy(rows[i : i + BATCH])
                probe.step(
                    {"input_ids": ids, "labels": ids}, fs.causal_lm_loss, stream=stream, mask="attention"
                )
        advice = fs.advise(probe, alpha=0.1)
        got = entry["advice"]
        assert got["verdict"] == advice.verdict and got["digest"] == protocol.digest
        assert got["saturated_everywhere"] == advice.saturated_everywhere
        assert got["top"] == (None if advice.top is None else advice.top.point)
        want = [
            {
                "point": c.point,
                "cross_frob2": c.cross_frob2,
                "se": c.se,
                "p_value": c.p_value,
                "p_adjusted": c.p_adjusted,
                "saturated": c.saturated,
            }
            for c in advice.ranked
        ]
        assert got["ranked"] == json.loads(json.dumps(encode(want))), name
        assert [p["name"] for p in entry["report"]["points"]] == GROWTH_POINTS[depth]
        points = GROWTH_POINTS[depth]
        assert got["depths"] == {"0": points[0], "0.5": points[1], "1.0": points[-1]}
        loss = held_out_loss(model, test)
        assert entry["test_loss"] == pytest.approx(loss, rel=1e-12, abs=0), name
        assert entry["test_perplexity"] == pytest.approx(np.exp(loss), rel=1e-12), name


def test_growth_table_trends_and_plot(grown):
    from fused_stats.api.report.schema import fmt

    _, out = grown
    suite = json.loads((out / "suite.json").read_text())
    md = (out / "suite.md").read_text()
    table = md.split("## Depth sufficiency ([growth])")[1].split("\n## ")[0]
    for name, entry in suite["runs"].items():
        ranked = entry["advice"]["ranked"]
        significant = [c for c in ranked if not c["saturated"]]
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert fmt(entry["test_loss"]) in row
        if significant:
            top = max(significant, key=lambda c: c["cross_frob2"])
            assert f"not saturated at {len(significant)} of {len(ranked)}" in row
            assert f"`{top['point']}` | {fmt(top['cross_frob2'])} | {fmt(top['p_adjusted'])}" in row
        else:
            assert "saturated everywhere" in row and "| — | — | — |" in row
    png = out / "suite_growth.png"
    assert png.stat().st_size > 1000
    # parameters varies over the 4 runs (model_type fixed): both run-level statistics trend there,
    # redone with scipy's rho and every permutation
    import itertools
    import math

    from scipy.stats import spearmanr

    runs = list(suite["runs"].values())
    xs = [r["labels"]["parameters"] for r in runs]
    trends = md.split("## Trends")[1]
    for title, value in (
        ("test loss (nats/token)", lambda r: r["test_loss"]),
        (
            "max \\|C\\|²_F over the growth candidates",
            lambda r: max(c["cross_frob2"] for c in r["advice"]["ranked"]),
        ),
    ):
        ys = [value(r) for r in runs]
        rho = spearmanr(xs, ys).statistic
        perms = [spearmanr(xs, list(q)).statistic for q in itertools.permutations(ys)]
        p = sum(abs(r) >= abs(rho) - 1e-12 for r in perms) / math.factorial(len(ys))
        row = f"| parameters | model_type=llama | {title} | 4 | {rho:+.2f} | {p:.3g} |"
        assert row in trends, (row, trends)


GROWTH_BAD = [
    (("[growth]", "[growth]\nbogus = 1"), "unknown key 'bogus' in [growth]"),
    (('family = "layer"', 'family = "deep"'), "[growth]: family must be one of"),
    (("seed = 5", 'seed = "5"'), "[growth]: seed must be an integer >= 0"),
    (("budget = [8, 8]", "budget = [8]"), "[growth]: budget must be [M, K]"),
    (("candidates = [0, 0.5, 1.0]", 'candidates = [0.5, "model.layers.0"]'), "[growth] candidates must be"),
    (("candidates = [0, 0.5, 1.0]", "candidates = [1.5]"), "[growth] candidates must be"),
    (("candidates = [0, 0.5, 1.0]", "candidates = [0.5, 0.5]"), "[growth] candidates lists 0.5 twice"),
    (("candidates = [0, 0.5, 1.0]", ""), "[growth] needs candidates"),
    (('family = "layer"', 'family = "mlp_width"'), "family 'mlp_width' needs width="),
    (("alpha = 0.1", "alpha = 1.5"), "[growth] alpha must be a number in (0, 1)"),
    (('unit = "sample"', 'unit = "sample"\ncross = 4'), "[probe] cross cannot be set with [growth]"),
    (('unit = "sample"', 'unit = "position"'), '[growth] needs [probe] unit = "sample"'),
    (
        ('unit = "sample"', 'unit = "sample"\nstream_blocks = true'),
        "stream_blocks = true cannot be set with [growth]",
    ),
]


@pytest.mark.parametrize(("edit", "message"), GROWTH_BAD, ids=[m[:30] for _, m in GROWTH_BAD])
def test_bad_growth_section_refused_before_any_model_loads(
    family, tmp_path, monkeypatch, capsys, edit, message
):
    old, new = edit
    assert old in GROWTH_SUITE
    path = _suite_file(family["root"], tmp_path, GROWTH_SUITE.replace(old, new, 1))

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the suite file was checked")

    monkeypatch.setattr("fused_stats.commands.probe.load_model", no_loading)
    out = tmp_path / "out"
    assert main(["suite", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fused-stats: error: ") and message in err, err
    assert not out.exists()


def test_a_missing_candidate_is_refused_on_the_first_model(family, tmp_path, monkeypatch, capsys):
    from fused_stats.commands import probe as probe_command

    real, loads = probe_command.load_model, []

    def counting(path, *args, **kwargs):
        loads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(probe_command, "load_model", counting)
    text = GROWTH_SUITE.replace(
        "candidates = [0, 0.5, 1.0]", 'candidates = ["model.layers.0", "model.layers.1"]'
    )
    path = _suite_file(family["root"], tmp_path, text)
    out = tmp_path / "out"
    code, _, err = _run(path, out, capsys)
    assert code == 2 and "[growth] candidates, checked on run llama-w16-d1" in err, err
    assert "'model.layers.1'" in err
    assert loads == ["llama-w16-d1"] and not out.exists()


def test_all_candidates_and_a_changed_growth_section_probes_again(family, tmp_path, capsys):
    import transformers

    text = GROWTH_SUITE.split("[[runs]]")[0].replace("candidates = [0, 0.5, 1.0]", 'candidates = "all"')
    text += '[[runs]]\nglob = "ckpts/llama-w16-d2"\n'
    path = _suite_file(family["root"], tmp_path, text)
    out = tmp_path / "out"
    code, _, _ = _run(path, out, capsys)
    assert code == 0
    run = json.loads((out / "suite.json").read_text())["runs"]["llama-w16-d2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(family["folders"]["llama-w16-d2"])
    assert run["advice"]["protocol"]["candidates"] == fs.growth_points(model)
    assert run["advice"]["depths"] is None
    path.write_text(text.replace("seed = 5", "seed = 6"))
    code, _, err = _run(path, out, capsys)
    assert code == 2 and "different suite file" in err, err
    code, _, _ = _run(path, out, capsys, "--force")
    assert code == 0
    run = json.loads((out / "suite.json").read_text())["runs"]["llama-w16-d2"]
    assert run["advice"]["protocol"]["seed"] == 6
    # the run file's key names the section, so a stale file says why
    from fused_stats.api.suite.identity import run_key, stale_because
    from fused_stats.api.suite.spec import read_suite

    spec = read_suite(path)
    key = run_key("x", {}, family["folders"]["llama-w16-d2"], spec.growth)
    other = run_key("x", {}, family["folders"]["llama-w16-d2"], dict(spec.growth, seed=5))
    assert stale_because(other, key) == "the [growth] section changed"
    assert stale_because(key, key) is None
    no_growth = run_key("x", {}, family["folders"]["llama-w16-d2"])
    assert no_growth["growth"] is None and stale_because(no_growth, key) == "the [growth] section changed"


def test_token_loss_weights_each_sequence_by_its_counted_targets():
    from fused_stats.api.suite.runner import TokenLoss

    torch.manual_seed(0)
    vocab, B, T = 11, 3, 7

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(vocab, 5), torch.nn.Linear(5, vocab)

        def forward(self, input_ids, attention_mask=None):
            return self.head(self.embed(input_ids))

    model = TinyLM().double()
    ids = torch.randint(0, vocab, (B, T))
    labels = ids.clone()
    labels[0, 3:] = -100  # sequence 0 predicts 2 tokens
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0  # sequence 1 left-padded: its first real token has no prediction
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    loss = TokenLoss()
    loss.recording(fs.causal_lm_loss)(model, batch)
    logp = torch.log_softmax(model(ids), -1).detach()
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T - 1):
            if labels[b, t + 1] != -100 and mask[b, t] and mask[b, t + 1]:
                total -= float(logp[b, t, ids[b, t + 1]])
                count += 1
    assert loss.tokens == count == 2 + 4 + 6
    assert loss.mean() == pytest.approx(total / count, rel=1e-12)
    assert loss.perplexity() == pytest.approx(np.exp(total / count), rel=1e-12)


def test_depth_sufficiency_rows_for_saturated_and_lower_ranked_tops(grown):
    """Hand-set advice: a run saturated everywhere has no top; a run whose largest |C|²_F is
    saturated shows the significant candidate below it."""
    from fused_stats.api.report.schema import fmt
    from fused_stats.api.suite.compare import render_markdown

    _, out = grown
    suite = json.loads((out / "suite.json").read_text())
    saturated, second = suite["runs"]["llama-w16-d2"], suite["runs"]["llama-w24-d2"]
    for c in saturated["advice"]["ranked"]:
        c["saturated"] = True
    saturated["advice"].update(saturated_everywhere=True, top=None)
    ranked = second["advice"]["ranked"]
    ranked[0]["saturated"] = True
    for c in ranked[2:]:
        c["saturated"] = True
    second["advice"].update(saturated_everywhere=False, top=ranked[1]["point"])
    table = render_markdown(suite).split("## Depth sufficiency ([growth])")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| llama")}
    assert "| saturated everywhere (3 candidates) | — | — | — |" in rows["llama-w16-d2"]
    want = f"| not saturated at 1 of 3 | `{ranked[1]['point']}` | {fmt(ranked[1]['cross_frob2'])} |"
    assert want in rows["llama-w24-d2"]
