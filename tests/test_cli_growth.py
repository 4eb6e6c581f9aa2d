"""Growth from the command line: ``probe --growth`` -> ``advise`` -> ``grow`` on a saved tiny LLaMA.

The "Growth from the command line" blocks of docs/cli.md (its ``growth.toml`` and its three commands)
run in-process through ``fused_stats.cli.main``. References, each built here without the CLI:
``fs.advise`` of an ``fs.Probe(model, cross=GrowthProtocol(...))`` stepped over the windows cut
from the same bytes (the advice JSON text must be identical); the original folder's logits (the
zero-init grown folder must give the same, after ``from_pretrained``); the grown model's own
parameter names (the record's new parameters). Bad input: exit status 2, one error line naming
the key or point, and no file or folder created.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

import fused_stats as fs
from fused_stats.cli import main

from tiny_models import TINY_LLAMA_CONFIG

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCHES, BATCH_SIZE = 32, 4, 8
HELD_OUT = 0.1


def readme_blocks() -> tuple[str, list[list[str]]]:
    """The section's TOML block and its ``fused-stats`` command lines (as argv lists)."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Growth from the command line\n") :]
    section = section[: section.index("\n## ", 1)]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in bash.splitlines() if line.startswith("fused-stats ")]
    return toml, [argv[1:] for argv in commands]


def listing(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files
    )


def fails(argv, capsys, root, *needles) -> str:
    capsys.readouterr()
    before = listing(root)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fused-stats: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert listing(root) == before
    return lines[0]


def save_llama(folder: Path, seed: int) -> None:
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "model_type"})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture
def folder(here):
    save_llama(here / "my-llama", seed=3)
    rng = np.random.default_rng(7)
    (here / "corpus.txt").write_bytes(rng.integers(32, 127, size=40 * SEQ_LEN + 5).astype(np.uint8).tobytes())
    return here


def load(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def windows(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test windows as docs/cli.md says: SEQ_LEN bytes each, the last 10 % held out."""
    data = torch.tensor(list(path.read_bytes()), dtype=torch.int64)
    n = data.numel() // SEQ_LEN
    rows = data[: n * SEQ_LEN].reshape(n, SEQ_LEN)
    n_test = max(1, round(n * HELD_OUT))
    return rows[: n - n_test], rows[n - n_test :]


def test_readme_probe_advise_grow(folder, capsys):
    toml, commands = readme_blocks()
    assert [argv[0] for argv in commands] == ["probe", "advise", "grow"]
    (folder / "growth.toml").write_text(toml)
    for argv in commands:
        assert main(argv) == 0, capsys.readouterr().err

    # reference advice: the same protocol built in Python, probed over the same windows
    model = load(folder / "my-llama")
    protocol = fs.GrowthProtocol(
        candidates=tuple(fs.growth_points(model)), family="layer", init="zero", seed=0
    )
    probe = fs.Probe(model, cross=protocol)
    train, test = windows(folder / "corpus.txt")
    for stream, rows in (("train", train), ("test", test)):
        for i in range(0, min(len(rows), BATCHES * BATCH_SIZE), BATCH_SIZE):
            batch = rows[i : i + BATCH_SIZE]
            probe.step(
                {"input_ids": batch, "labels": batch}, fs.causal_lm_loss, stream=stream, mask="attention"
            )
    reference = fs.advise(probe)
    reference.to_json(folder / "reference.json")
    assert (folder / "advice" / "advice.json").read_text() == (folder / "reference.json").read_text()
    assert (folder / "advice" / "advice.png").is_file()

    grown = load(folder / "my-llama-grown")
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder / "my-llama-grown", dtype="auto")
    assert {p.dtype for p in saved.parameters()} == {torch.float32}  # the checkpoint's own dtype
    ids = torch.randint(0, TINY_LLAMA_CONFIG["vocab_size"], (3, 11))
    with torch.no_grad():
        assert torch.equal(grown(input_ids=ids).logits, load(folder / "my-llama")(input_ids=ids).logits)
    assert grown.config.num_hidden_layers == TINY_LLAMA_CONFIG["num_hidden_layers"] + 1
    (entry,) = fs.growth_history(grown)
    row = next(c for c in reference.ranked if c.point == "model.layers.0")
    assert entry["point"] == "model.layers.0" and entry["position"] == "model.layers.1"
    assert entry["protocol_digest"] == protocol.digest
    assert (entry["family"], entry["init"]) == ("layer", "zero")
    assert (entry["cross_frob2"], entry["p_value"], entry["p_adjusted"]) == (
        row.cross_frob2,
        row.p_value,
        row.p_adjusted,
    )
    own = sorted(n for n, _ in grown.named_parameters() if n.startswith("model.layers.1."))
    assert sorted(entry["new_parameters"]) == own


def write_protocol(folder: Path, text: str) -> Path:
    path = folder / "g.toml"
    path.write_text(text)
    return path


def probe_argv(folder, protocol, *extra):
    return [
        "probe",
        "--model",
        folder / "my-llama",
        "--text",
        folder / "corpus.txt",
        "--seq-len",
        SEQ_LEN,
        "--batches",
        2,
        "--trials",
        0,
        "--growth",
        protocol,
        "--out",
        folder / "out",
        *extra,
    ]


def grow_argv(folder, protocol, *at, out="grown", extra=()):
    return ["grow", folder / "my-llama", "--protocol", protocol, "--at", *at, "--out", folder / out, *extra]


@pytest.mark.parametrize(
    "text, needles",
    [
        ('candidates = "all"\nfamilly = "layer"\n', ["unknown key 'familly'", "g.toml"]),
        ('candidates = "model.layers.0"\n', ["candidates must be"]),
        ('candidates = "all"\nseed = "0"\n', ["seed must be an integer", "'0'"]),
        ('candidates = "all"\nseed = true\n', ["seed must be an integer"]),
        ('candidates = "all"\nseed = -1\n', ["seed must be an integer >= 0"]),
        ('candidates = "all"\nfamily = "mlp_width"\nwidth = 0\n', ["width must be an integer >= 1"]),
        ('candidates = "all"\nprojection = 2.5\n', ["projection must be an integer >= 1"]),
        ('candidates = "all"\nbudget = [8]\n', ["budget must be [M, K]"]),
        ('candidates = "all"\nfamily = "deep"\n', ["family must be one of", "'deep'"]),
        ('candidates = "all"\ninit = "ones"\n', ["init must be one of"]),
        ('family = "layer"\n', ["needs 'candidates'"]),
        ('candidates = ["model.layers.0", "model.layers.0"]\n', ["listed twice"]),
        ('candidates = ["model.layers.0"]\nwidth = 4\n', ["width=4 has no meaning"]),
        ('candidates = "all"\nfamily = "mlp_width"\n', ["needs width="]),
        ("candidates = [\n", ["not valid TOML"]),
    ],
)
def test_bad_protocol_file_refused_before_the_model_loads(text, needles, folder, capsys, monkeypatch):
    import fused_stats.commands.grow as grow_cmd
    import fused_stats.commands.probe as probe_cmd

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the protocol file was checked")

    monkeypatch.setattr(probe_cmd, "load_model", never)
    monkeypatch.setattr(grow_cmd, "load_folder", never)
    protocol = write_protocol(folder, text)
    fails(probe_argv(folder, protocol), capsys, folder, *needles)
    fails(grow_argv(folder, protocol, "model.layers.0"), capsys, folder, *needles)


def test_cross_block_growth_is_not_saved_as_a_folder(folder, capsys):
    protocol = write_protocol(folder, 'candidates = ["model.layers.0"]\nfamily = "cross_block"\n')
    fails(grow_argv(folder, protocol, "model.layers.0"), capsys, folder, "cross_block", "from_pretrained")


def test_candidate_the_model_lacks_is_refused_naming_it(folder, capsys):
    protocol = write_protocol(folder, 'candidates = ["model.layers.0", "model.layers.7"]\n')
    fails(probe_argv(folder, protocol), capsys, folder, "'model.layers.7'", "g.toml", "model.layers.1")
    fails(grow_argv(folder, protocol, "model.layers.0"), capsys, folder, "'model.layers.7'", "g.toml")


def test_at_outside_the_protocol_refused(folder, capsys, monkeypatch):
    import fused_stats.commands.grow as grow_cmd

    load_folder = grow_cmd.load_folder

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before --at was checked against the listed candidates")

    monkeypatch.setattr(grow_cmd, "load_folder", never)
    listed = write_protocol(folder, 'candidates = ["model.embed_tokens", "model.layers.0"]\n')
    fails(grow_argv(folder, listed, "model.layers.1"), capsys, folder, "--at 'model.layers.1'", "candidates")
    fails(grow_argv(folder, listed, "model.layers.0", "model.layers.0"), capsys, folder, "twice")
    monkeypatch.setattr(grow_cmd, "load_folder", load_folder)  # "all" needs the model
    every = write_protocol(folder, 'candidates = "all"\n')
    fails(grow_argv(folder, every, "model.layers.9"), capsys, folder, "--at 'model.layers.9'")


def test_non_empty_out_refused_without_force(folder, capsys):
    protocol = write_protocol(folder, 'candidates = "all"\n')
    (folder / "grown").mkdir()
    (folder / "grown" / "notes.txt").write_text("keep")
    fails(grow_argv(folder, protocol, "model.layers.0"), capsys, folder, "'notes.txt'", "--force")
    fails(
        grow_argv(folder, protocol, "model.layers.0", out="my-llama", extra=["--force"]),
        capsys,
        folder,
        "is the model folder itself",
    )
    assert main([str(a) for a in grow_argv(folder, protocol, "model.layers.0", extra=["--force"])]) == 0
    assert (folder / "grown" / "notes.txt").read_text() == "keep"
    assert fs.growth_history(load(folder / "grown"))[0]["point"] == "model.layers.0"


def test_probe_growth_refuses_other_cross_and_streaming(folder, capsys):
    protocol = write_protocol(folder, 'candidates = "all"\n')
    fails(probe_argv(folder, protocol, "--cross", "4"), capsys, folder, "--growth", "--cross")
    fails(probe_argv(folder, protocol, "--stream-blocks"), capsys, folder, "--growth", "--stream-blocks")
    fails(probe_argv(folder, protocol, "--points", "model.layers.0"), capsys, folder, "--points")
    fails(probe_argv(folder, protocol, "--unit", "flat"), capsys, folder, "--unit flat")


def test_grow_copies_tokenizer_files_and_checks_the_advice(folder, capsys):
    protocol = write_protocol(folder, 'candidates = ["model.layers.0", "model.layers.1"]\nseed = 5\n')
    rng = np.random.default_rng(11)
    tokenizer = {name: rng.bytes(64) for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt")}
    assert main([str(a) for a in probe_argv(folder, protocol)]) == 0, capsys.readouterr().err
    assert (
        main(["advise", str(folder / "out" / "report.json"), "--out", str(folder / "adv"), "--no-plot"]) == 0
    )
    for name, payload in tokenizer.items():
        (folder / "my-llama" / name).write_bytes(payload)

    other = write_protocol(folder, 'candidates = ["model.layers.0", "model.layers.1"]\nseed = 6\n')
    advice = ["--advice", folder / "adv" / "advice.json"]
    fails(grow_argv(folder, other, "model.layers.1", extra=advice), capsys, folder, "under protocol")
    save_llama(folder / "other-llama", seed=4)
    protocol = write_protocol(folder, 'candidates = ["model.layers.0", "model.layers.1"]\nseed = 5\n')
    fails(
        [
            "grow",
            folder / "other-llama",
            "--protocol",
            protocol,
            "--at",
            "model.layers.1",
            "--out",
            folder / "x",
            *advice,
        ],
        capsys,
        folder,
        "another model",
    )

    assert main([str(a) for a in grow_argv(folder, protocol, "model.layers.1", extra=advice)]) == 0
    for name, payload in tokenizer.items():
        assert (folder / "grown" / name).read_bytes() == payload
    (entry,) = fs.growth_history(load(folder / "grown"))
    row = next(r for r in fs.advise(folder / "out" / "report.json").ranked if r.point == "model.layers.1")
    assert (entry["point"], entry["position"], entry["cross_frob2"]) == (
        "model.layers.1",
        "model.layers.2",
        row.cross_frob2,
    )


def test_protocol_file_gives_the_protocol_of_its_keys(folder):
    from fused_stats.api.growth.protocol_file import read_protocol_file

    model = load(folder / "my-llama")
    text = (
        'candidates = ["model.layers.0", "model.embed_tokens"]\nfamily = "mlp_width"\ninit = "zero"\n'
        "seed = 9\nwidth = 3\nprojection = 5\nbudget = [16, 4]\n"
    )
    direct = fs.GrowthProtocol(
        candidates=("model.layers.0", "model.embed_tokens"),
        family="mlp_width",
        init="zero",
        seed=9,
        width=3,
        projection=5,
        budget=(16, 4),
    )
    assert read_protocol_file(write_protocol(folder, text)).resolve(model).to_dict() == direct.to_dict()
    every = read_protocol_file(write_protocol(folder, 'candidates = "all"\n')).resolve(model)
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert every.digest == fs.GrowthProtocol(candidates=tuple(names)).digest
