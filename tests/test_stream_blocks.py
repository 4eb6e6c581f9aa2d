"""fs.stream_blocks: weight-streamed blocks give the in-memory probe's statistics exactly.

References are independent of the streaming code: the same model probed in memory by fs.Probe
(every block resident, one ordinary backward) and fs.intervene on the plain model. Tiny fp64 HF
LLaMA, GPT-NeoX and GPT-2 models, padded batches, unit="sample" with cross=fs.CrossSpec and
unit="position", train and test streams; the streamed model comes from the module itself and from
a checkpoint folder written by save_pretrained into several shards (also one whose tensors are not
multiples of 64 bytes, against from_pretrained), and a model in training mode with dropout. The
blocks read per step are counted by spying on the weight source. Memory is checked by the
streamer's own counter and, independently, by the peak RSS of a fresh process. Bad checkpoints
must raise FusedStatsError naming the file or tensor and leave every accumulator bit-identical.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fused_stats as fs

from tiny_models import TanhBlock, padded_lm_batch
from tiny_models import tiny_lm_config as config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
F64 = torch.float64
VOCAB = 40
REL = 1e-10


def tiny(arch: str, layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(arch, layers), dtype=F64)
    with torch.no_grad():  # LayerNorm / RMSNorm weights away from 1, biases away from 0
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    train = [
        padded_lm_batch(gen, [9, 6, 4], 9, VOCAB, prompts=[2, 1, 0]),
        padded_lm_batch(gen, [8, 8, 3, 5], 8, VOCAB),
    ]
    test = [padded_lm_batch(gen, [7, 5, 6], 7, VOCAB), padded_lm_batch(gen, [6, 4, 7], 7, VOCAB)]
    return train, test


def probe(model, unit, train, test):
    cross = fs.CrossSpec(rank=5, seed=1) if unit == "sample" else None
    mask = "labels" if unit == "position" else None
    p = fs.Probe(model, unit=unit, cross=cross, second_moment="pool")
    for batch in train:
        p.step(batch, fs.causal_lm_loss, mask=mask)
    for batch in test:
        p.step(batch, fs.causal_lm_loss, stream="test", mask=mask)
    return p


def assert_close(got, want, where):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-15) or (
            math.isnan(got) and math.isnan(want)
        ), (where, got, want)
    else:
        assert got == want, (where, got, want)


def assert_same_probe(got, want):
    assert got.points == want.points
    for point in want.points:
        for stream in ("train", "test"):
            assert_close(
                got.estimates(stream)[point].to_dict(),
                want.estimates(stream)[point].to_dict(),
                f"{point}/{stream}",
            )
        assert_close(got.certificate(point).to_dict(), want.certificate(point).to_dict(), f"{point}/cert")
        assert_close(got.realized_alignment(point), want.realized_alignment(point), f"{point}/align")
        if want.cross is not None:
            assert_close(got.saturation(point).to_dict(), want.saturation(point).to_dict(), f"{point}/sat")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """arch -> checkpoint folder of tiny(arch) in at least 3 shards."""
    out = {}
    for arch in ("llama", "neox", "gpt2"):
        path = tmp_path_factory.mktemp(arch)
        tiny(arch).save_pretrained(path, max_shard_size="20KB")
        assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
        out[arch] = path
    return out


def streamed(source, arch, folders, **kwargs):
    return fs.stream_blocks(folders[arch] if source == "folder" else source, **kwargs)


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("source", ["module", "folder"])
@pytest.mark.parametrize("arch", ["llama", "neox", "gpt2"])
def test_streamed_equals_in_memory(arch, source, folders):
    model = tiny(arch)
    train, test = data(3)
    want = {unit: probe(model, unit, train, test) for unit in ("sample", "position")}
    want_iv = {
        kind: fs.intervene(
            model,
            fs.residual_points(model)[1],
            train,
            test,
            eta=[1e-3, 1e-2],
            kind=kind,
            loss_fn=fs.causal_lm_loss,
            spec=fs.CrossSpec(rank=3),
        )
        for kind in ("bias", "block")
    }
    with streamed(model if source == "module" else "folder", arch, folders) as st:
        assert fs.residual_points(st.model) == fs.residual_points(tiny(arch))
        for unit in ("sample", "position"):
            assert_same_probe(probe(st.model, unit, train, test), want[unit])
        for kind, ref in want_iv.items():
            got = fs.intervene(
                st.model,
                ref.point,
                train,
                test,
                eta=[1e-3, 1e-2],
                kind=kind,
                loss_fn=fs.causal_lm_loss,
                spec=fs.CrossSpec(rank=3),
            )
            assert_close(got.to_dict(), ref.to_dict(), f"intervene/{kind}")
        assert st.peak_resident_bytes > 0


def test_resnet_blocks_stream():
    from fused_stats.networks.resnet import cifar_resnet20

    model = cifar_resnet20(width=4, seed=0).double().eval()
    gen = torch.Generator().manual_seed(5)
    batch = (torch.randn(6, 3, 8, 8, generator=gen, dtype=F64), torch.randint(0, 10, (6,), generator=gen))
    want = fs.Probe(model, second_moment="dense")
    want.step(batch, fs.classification_loss)
    points = fs.residual_points(model)
    with fs.stream_blocks(model) as st:
        assert fs.residual_points(st.model) == points
        got = fs.Probe(st.model, second_moment="dense")
        got.step(batch, fs.classification_loss)
    for point in points:
        assert_close(got.stats[point].estimate().to_dict(), want.stats[point].estimate().to_dict(), point)


@pytest.mark.parametrize("case", ["gpt2", "llama", "mixed"])
def test_folder_with_tensors_not_a_multiple_of_64_bytes(tmp_path, gen, case):
    """fp32 tensors whose sizes are not multiples of 64 bytes (hidden 12, an MLP width of 13,
    biases), in several shards: the streamed model computes the logits of from_pretrained of the
    same folder. ``mixed``: the odd-length tensors stored in fp16 among the fp32 ones (a config
    without a dtype, both read with dtype=float32), so packed end to end an fp32 tensor would
    start at a byte offset that is not a multiple of 4."""
    if case == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=12,
            intermediate_size=13,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            max_position_embeddings=16,
            mlp_bias=True,
            attention_bias=True,
        )
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=12, n_inner=13, n_layer=3, n_head=3, n_positions=16
        )
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path, max_shard_size="4KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    assert sum(size % 64 != 0 for size in sizes) >= 3 * 4, sizes
    dtype = None
    if case == "mixed":
        from safetensors.torch import load_file, save_file

        for path in shards:
            tensors = {k: v.half() if v.numel() % 2 else v for k, v in load_file(path).items()}
            save_file(tensors, path, metadata={"format": "pt"})
        cfg_path = tmp_path / "config.json"
        cfg_path.write_text(
            json.dumps({k: v for k, v in json.loads(cfg_path.read_text()).items() if k != "dtype"})
        )
        dtype = torch.float32
    want_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, dtype=dtype
    ).eval()
    batch = padded_lm_batch(gen, [9, 5, 7], 9, VOCAB)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        want = want_model(**inputs).logits
    with fs.stream_blocks(tmp_path, dtype=dtype) as st, torch.no_grad():
        got = st.model(**inputs).logits
    assert got.dtype == torch.float32 and float(want.abs().max()) > 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


# ----------------------------------------------------------------------------- training mode
def test_dropout_in_training_mode_recomputes_the_same_masks(gen):
    """A model in training mode: the backward's recomputed forward must draw the dropout masks
    of the forward (the RNG state is captured per block), so the streamed input gradients are
    the in-memory ones; the streamed backward leaves the global RNG where the in-memory one does."""
    cfg = config("gpt2", layers=3)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.3
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=F64).train()
    batch = padded_lm_batch(gen, [9, 6, 4], 9, VOCAB)
    embeds = torch.randn(3, 9, cfg.n_embd, generator=gen, dtype=F64)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))

    def run(m):
        x = embeds.clone().requires_grad_()
        torch.manual_seed(seed)
        logits = m(inputs_embeds=x, attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
        )
        loss.backward()
        return logits.detach(), x.grad, torch.get_rng_state()

    want = run(model)
    with fs.stream_blocks(model) as st:
        assert all(m.training for m in st.model.modules())
        got = run(st.model)
    scale = float(want[1].abs().max())
    assert scale > 0
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12 * scale)
    assert torch.equal(got[2], want[2])


# ----------------------------------------------------------------------------- load order
@pytest.mark.parametrize("source", ["module", "folder"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_block_loads_per_step(tmp_path, monkeypatch, source, prefetch):
    """The blocks read per Probe.step of a 4-block model: each once forward; backward from the
    last (kept from its forward when prefetching) down to the first block whose input needs a
    gradient (block 0's input, the embeddings, does not), each prefetched in turn."""
    model = tiny("llama", layers=4)
    if source == "folder":
        model.save_pretrained(tmp_path, max_shard_size="20KB")
        st = fs.stream_blocks(tmp_path, prefetch=prefetch)
    else:  # a dtype given: the blocks are copied per use, not used in place
        st = fs.stream_blocks(model, dtype=F64, prefetch=prefetch)
    loads = []
    host = st._weights.host

    def spy(i):
        loads.append(i)
        return host(i)

    monkeypatch.setattr(st._weights, "host", spy)
    want = [0, 1, 2, 3, 2, 1] if prefetch else [0, 1, 2, 3, 3, 2, 1]
    train, test = data(11)
    with st:
        p = fs.Probe(st.model)
        for batch, stream in ((train[0], "train"), (train[1], "train"), (test[0], "test")):
            loads.clear()
            p.step(batch, fs.causal_lm_loss, stream=stream)
            assert loads == want, f"{stream} step read blocks {loads}"
        loads.clear()
        with torch.no_grad():  # a forward without grad reads each block once
            st.model(input_ids=train[0]["input_ids"])
        assert loads == [0, 1, 2, 3], f"a forward without grad read blocks {loads}"


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("prefetch", [0, 1])
def test_peak_block_bytes(tmp_path, prefetch):
    model = tiny("llama", layers=8)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    train, test = data(4)
    with fs.stream_blocks(tmp_path, prefetch=prefetch) as st:
        blocks = [st.model.get_submodule(n).block for n in fs.residual_points(st.model)]
        want = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
        assert st.block_bytes == want
        p = probe(st.model, "sample", train, test)
        assert st.block_bytes <= st.peak_resident_bytes <= (1 + prefetch) * st.block_bytes
        # between steps the block parameters are on the meta device, the resident ones are real
        assert all(t.device.type == "meta" for b in blocks for t in b.parameters())
        resident = [t for n, t in st.model.named_parameters() if ".layers." not in n]
        assert resident and all(t.device.type == "cpu" for t in resident)
        buffers = [t for n, t in st.model.named_buffers() if ".layers." not in n]
        assert st.resident_bytes == sum(
            t.numel() * t.element_size() for t in {id(t): t for t in resident + buffers}.values()
        )
    assert_same_probe(p, probe(model, "sample", train, test))


RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, fused_stats as fs
    import transformers; transformers.logging.set_verbosity_error()
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    def peak_growth(run):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        start = rss("VmRSS:")
        run()
        return rss("VmHWM:") - start
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    # warm-up on a tiny model: imports and first-use allocations are not the probe's memory
    cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
    small = transformers.AutoModelForCausalLM.from_config(
        type(cfg)(**{**cfg.to_dict(), "hidden_size": 24, "intermediate_size": 32,
                     "num_attention_heads": 2, "num_key_value_heads": 2}))
    with fs.stream_blocks(small) as st:
        fs.Probe(st.model).step(batch, fs.causal_lm_loss)
    def streamed():
        with fs.stream_blocks(sys.argv[1]) as st:
            fs.Probe(st.model).step(batch, fs.causal_lm_loss)
    def in_memory():
        model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True)
        fs.Probe(model).step(batch, fs.causal_lm_loss)
    print(json.dumps({"streamed": peak_growth(streamed), "in_memory": peak_growth(in_memory)}))
""")


def test_peak_rss_of_a_fresh_process(tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=640,
        intermediate_size=1792,
        num_hidden_layers=8,
        num_attention_heads=10,
        max_position_embeddings=32,
    )
    with torch.device("meta"):
        shapes = transformers.AutoModelForCausalLM.from_config(cfg)
    param_bytes = sum(p.numel() * 4 for p in shapes.parameters())
    assert param_bytes > 150e6
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path, max_shard_size="64MB")
    del model
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(fs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(tmp_path), "stream"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])
    assert growth["streamed"] < 0.5 * param_bytes, (growth, param_bytes)
    # the measurement sees a full copy of the weights when there is one
    assert growth["in_memory"] > 0.8 * param_bytes, (growth, param_bytes)


# ----------------------------------------------------------------------------- close()
def test_module_left_as_it_was():
    model = tiny("gpt2")
    modules = [(n, id(m)) for n, m in model.named_modules()]
    params = [(n, id(p), p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()]
    flags = [m.training for m in model.modules()]
    batch = data(6)[0][0]
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    use_cache = model.config.use_cache
    with fs.stream_blocks(model, dtype=torch.float32, device="cpu") as st:
        assert st.model is model
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".h." not in n)
        probe(st.model, "sample", *data(7))
    assert [(n, id(m)) for n, m in model.named_modules()] == modules
    now = list(model.named_parameters())
    assert [(n, id(p)) for n, p in now] == [(n, i) for n, i, _, _ in params]
    assert all(
        torch.equal(p, v) and p.dtype == v.dtype and p.requires_grad == r
        for (_, p), (_, _, v, r) in zip(now, params)
    )
    assert [m.training for m in model.modules()] == flags and model.config.use_cache == use_cache
    with torch.no_grad():
        after = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("switch", ["train", "eval"])
def test_close_restores_every_modules_training_flag(switch):
    """Flags changed through st.model (train() or eval() inside the block) are put back on every
    module, nested ones included, from a mix of training and eval modules."""
    model = tiny("gpt2")
    if switch == "eval":
        model.train()
        model.transformer.h[1].attn.eval()
        model.transformer.ln_f.eval()
    else:
        model.transformer.h[1].train()
        model.transformer.h[2].mlp.dropout.train()
    flags = [(n, m.training) for n, m in model.named_modules()]
    assert len({f for _, f in flags}) == 2  # a mix
    with fs.stream_blocks(model) as st:
        getattr(st.model, switch)()
        assert all(m.training == (switch == "train") for m in st.model.modules())
    assert [(n, m.training) for n, m in model.named_modules()] == flags


# ----------------------------------------------------------------------------- bad input
def state(p):
    out = {"steps": dict(p.steps)}
    for table in ("stats", "test_stats", "cross_stats", "test_cross_stats"):
        for name, acc in getattr(p, table).items():
            out[f"{table}/{name}/n"] = acc.n
            for key, value in vars(acc).items():
                if isinstance(value, torch.Tensor):
                    out[f"{table}/{name}/{key}"] = value.clone()
    return out


def same_state(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


TARGET = "model.layers.1.mlp.up_proj.weight"


def shard_of(folder: Path, name: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][name]


def rewrite(folder: Path, change):
    from safetensors.torch import load_file, save_file

    path = shard_of(folder, TARGET)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def corrupt(folder: Path, case: str) -> str:
    """Damage ``folder`` as ``case`` says; returns the word the error must name."""
    path = shard_of(folder, TARGET)
    if case == "missing_shard":
        path.unlink()
        return path.name
    if case == "truncated":
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.truncate(size // 2)
        return path.name
    if case == "shape":
        rewrite(folder, lambda t: t.__setitem__(TARGET, t[TARGET][:-1].clone()))
        return TARGET
    if case == "dtype":
        rewrite(folder, lambda t: t.__setitem__(TARGET, t[TARGET].float()))
        return TARGET
    if case == "missing_tensor":
        rewrite(folder, lambda t: t.pop(TARGET))
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        del index["weight_map"][TARGET]
        index_path.write_text(json.dumps(index))
        return TARGET
    raise AssertionError(case)


CASES = ["missing_shard", "truncated", "shape", "dtype", "missing_tensor"]


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_at_construction(case, folders, tmp_path):
    folder = Path(shutil.copytree(folders["llama"], tmp_path / "ckpt"))
    word = corrupt(folder, case)
    with pytest.raises(fs.FusedStatsError, match=word.replace(".", r"\.")):
        fs.stream_blocks(folder)


@pytest.mark.parametrize("case", ["missing_shard", "truncated", "shape", "dtype"])
def test_bad_checkpoint_during_a_step_changes_nothing(case, folders, tmp_path):
    folder = Path(shutil.copytree(folders["llama"], tmp_path / "ckpt"))
    train, test = data(8)
    with fs.stream_blocks(folder) as st:
        p = probe(st.model, "sample", train, test)
        before = state(p)
        word = corrupt(folder, case)
        for stream in ("train", "test"):
            with pytest.raises(fs.FusedStatsError, match=word.replace(".", r"\.")):
                p.step(train[0], fs.causal_lm_loss, stream=stream)
            assert same_state(state(p), before)


def test_no_block_stack(tmp_path):
    with pytest.raises(fs.FusedStatsError, match="no recognisable block stack"):
        fs.stream_blocks(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()))
    tiny("llama", layers=0).save_pretrained(tmp_path)
    with pytest.raises(fs.FusedStatsError, match=r"no recognisable block stack.*config.json"):
        fs.stream_blocks(tmp_path)


@pytest.mark.parametrize("device", ["cuda:7", "nonsense", "mps"])
def test_device_that_does_not_exist(device):
    model = tiny("llama")
    with pytest.raises(fs.FusedStatsError, match=device):
        fs.stream_blocks(model, device=device)
    assert not any(isinstance(m, fs.api.streaming.StreamedBlock) for m in model.modules())


def test_kv_cache_is_rejected():
    model = tiny("llama")
    ids = data(9)[0][0]["input_ids"]
    with fs.stream_blocks(model) as st, pytest.raises(fs.FusedStatsError, match="use_cache=False"):
        st.model(input_ids=ids, use_cache=True)


# ----------------------------------------------------------------------------- devices
class SpreadNet(torch.nn.Module):
    """Residual blocks placed on given devices, the stream moved between them (as accelerate's
    dispatch hooks do)."""

    def __init__(self, devices, d=6):
        super().__init__()
        torch.manual_seed(0)
        self.devices = [torch.device(x) for x in devices]
        self.inp = torch.nn.Linear(3, d).double().to(self.devices[0])
        self.blocks = torch.nn.ModuleList([TanhBlock(d).double().to(dev) for dev in self.devices])
        self.out = torch.nn.Linear(d, 4).double().to(self.devices[-1])

    def forward(self, x):
        h = self.inp(x.to(self.devices[0]))
        for dev, block in zip(self.devices, self.blocks):
            h = block(h.to(dev))
        return self.out(h)


def spread_check(devices):
    model = SpreadNet(devices)
    gen = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(7, 3, generator=gen, dtype=F64), torch.randint(0, 4, (7,), generator=gen))
        for _ in range(2)
    ]

    def loss(m, b):
        logits = m(b[0])
        return torch.nn.functional.cross_entropy(logits, b[1].to(logits.device), reduction="none")

    p = fs.Probe(model, second_moment="pool", cross=fs.CrossSpec(rank=3))
    for b in batches:
        p.step(b, loss)
    p.step(batches[0], loss, stream="test")
    ref_model = SpreadNet(["cpu"] * len(devices))
    ref = fs.Probe(ref_model, second_moment="pool", cross=fs.CrossSpec(rank=3))
    for b in batches:
        ref.step(b, loss)
    for point, dev in zip(p.points, devices):
        assert p.stats[point].device == torch.device(dev)
        assert p.cross_stats[point].w_in.device == torch.device(dev)
        est = p.stats[point].estimate()
        fields = est.to_dict()
        scalars = {k: v for k, v in fields.items() if k not in ("n", "dim", "plugin", "not_estimable")}
        scalars.update({f"plugin.{k}": v for k, v in fields["plugin"].items() if k != "not_estimable"})
        # host floats, never device tensors; None only where the estimate says why
        reasons = set(fields.get("not_estimable") or {})
        reasons |= {f"plugin.{k}" for k in fields["plugin"].get("not_estimable") or {}}
        assert all(
            isinstance(v, (float, bool)) or (v is None and k in reasons) for k, v in scalars.items()
        ), (
            scalars,
            reasons,
        )
        assert isinstance(p.certificate(point).b_exact, float)
        assert isinstance(p.saturation(point).cross_frob2, float)
        assert_close(est.to_dict(), ref.stats[point].estimate().to_dict(), point)


def test_state_on_each_points_device_cpu():
    spread_check(["cpu", "cpu", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
def test_state_on_each_points_device_two_gpus():
    spread_check(["cuda:0", "cuda:1", "cuda:1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_to_gpu_equals_in_memory(folders):
    model = tiny("llama")
    train, test = data(10)

    def to(bs):
        return [{k: v.cuda() for k, v in b.items()} for b in bs]

    want = probe(tiny("llama").cuda(), "sample", to(train), to(test))
    for source in (model, folders["llama"]):
        with fs.stream_blocks(source, device="cuda") as st:
            assert_same_probe(probe(st.model, "sample", to(train), to(test)), want)
            assert st.peak_resident_bytes <= 2 * st.block_bytes
    assert all(p.device.type == "cpu" for p in model.parameters())


# ----------------------------------------------------------------------------- CLI and plan
def test_cli_probe_stream_blocks_equals_in_memory(tmp_path):
    from fused_stats.cli import main

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=F64).save_pretrained(
        tmp_path / "ckpt", max_shard_size="40KB"
    )
    reports = {}
    for flag in ([], ["--stream-blocks"]):
        out = tmp_path / ("streamed" if flag else "plain")
        rc = main(
            [
                "probe",
                "--model",
                str(tmp_path / "ckpt"),
                *flag,
                "--batches",
                "2",
                "--batch-size",
                "3",
                "--seq-len",
                "16",
                "--dtype",
                "float64",
                "--trials",
                "0",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        assert rc == 0
        reports[bool(flag)] = json.loads((out / "report.json").read_text())
    for got, want in zip(reports[True]["points"], reports[False]["points"]):
        assert got["name"] == want["name"]
        assert_close(got["train"], want["train"], got["name"])


def test_plan_stream_blocks_counts_the_models_parameters(capsys):
    from fused_stats.api.streaming.plan import plan_streaming
    from fused_stats.cli import main

    cfg = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=1,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    resident = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    plan = plan_streaming("llama-70b", tokens=4096, prefetch=1, pool_size=64)
    assert (plan.block_params, plan.resident_params) == (block, resident)
    assert plan.streamed_blocks_bytes == 2 * 2 * block
    assert plan.saved_input_bytes == 80 * 4096 * 8192 * 2
    assert main(["plan", "--preset", "llama-70b", "--stream-blocks", "--tokens", "4096"]) == 0
    assert "2 blocks" in capsys.readouterr().out


def test_shard_reads_own_their_bytes(folders, tmp_path):
    """A block's tensors are views of one fresh buffer, equal to safetensors' own load_file, and
    never alias the file: rewriting the shard afterwards leaves them unchanged."""
    from safetensors.torch import load_file, save_file

    from fused_stats.api.streaming.shards import CheckpointShards

    folder = Path(shutil.copytree(folders["llama"], tmp_path / "ckpt"))
    shards = CheckpointShards(folder)
    names = [n for n in shards.files if n.startswith("model.layers.1.")]
    entries = {n: (shards.files[n], n) for n in names}
    got = shards.load(entries)
    want = {n: load_file(shards.files[n])[n] for n in names}
    assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in names)
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1
    before = {n: t.clone() for n, t in got.items()}
    for path in {shards.files[n] for n in names}:
        tensors = load_file(path)
        save_file({k: v + 1 for k, v in tensors.items()}, path, metadata={"format": "pt"})
    assert all(torch.equal(got[n], before[n]) for n in names)
    assert all(torch.equal(t, before[n] + 1) for n, t in shards.load(entries).items())
