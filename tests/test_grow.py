"""Growing the real architecture: ``fs.GrowthProtocol`` and ``fs.grow``.

* Zero depth growth of LLaMA / GPT-NeoX / GPT-2 (at the input boundary and after a block) and of
  two ResNets leaves the logits bit-identical (``torch.equal``) to the ungrown model, fp32 and
  fp64, on padded batches, without and with a KV cache (incremental decoding step by step and
  greedy ``generate``); the grown HF model saves and reloads (``from_pretrained``, the
  independent loader) with identical logits. Random growth: generation with the cache equals full
  recomputation without it (the renumbered ``layer_idx`` slots are right).
* Width growth: the config's intermediate size follows, reload is identical, the function is kept
  (to rounding: a longer GEMM reduction may group the old terms differently), new rows lie along
  the given directions.
* Optimizer: tests/test_grow_optimizer.py.
* Bad input: tests/test_grow_bad_input.py.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.blocks import new_block, new_units
from fused_stats.networks.resnet import cifar_resnet20, tiny_resnet

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 40
F64 = torch.float64

# kind -> (input boundary, the stack path)
STACK = {
    "llama": ("model.embed_tokens", "model.layers"),
    "neox": ("gpt_neox.emb_dropout", "gpt_neox.layers"),
    "gpt2": ("transformer.drop", "transformer.h"),
}
# kind -> the parameters of a new zero-init layer that start at zero: each branch's output map
# (the tiny LLaMA has no biases)
ZERO_OUTPUT_MAPS = {
    "llama": ["self_attn.o_proj.weight", "mlp.down_proj.weight"],
    "neox": [
        "attention.dense.weight",
        "attention.dense.bias",
        "mlp.dense_4h_to_h.weight",
        "mlp.dense_4h_to_h.bias",
    ],
    "gpt2": ["attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"],
}


def build(kind: str, dtype=torch.float32, layers: int = 2):
    torch.manual_seed(11)
    common = dict(vocab_size=VOCAB, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=12,
            intermediate_size=20,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=12,
            intermediate_size=20,
            num_hidden_layers=layers,
            num_attention_heads=2,
            max_position_embeddings=32,
            **common,
        )
        model = transformers.GPTNeoXForCausalLM(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_embd=12, n_layer=layers, n_head=2, n_positions=32, **common)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "resnet20":
        model = cifar_resnet20(width=4, seed=11, random_batchnorm=True)
    else:
        model = tiny_resnet(block="bottleneck", width=4, seed=11, random_batchnorm=True)
    return model.to(dtype).eval()


def lm_batch(gen, left=False):
    ids = torch.randint(3, VOCAB, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    if left:
        mask[1, :2] = 0
        mask[2, :4] = 0
    else:
        mask[1, 5:] = 0
        mask[2, 3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def aligned(model):
    """The model with every tensor in a fresh allocation: safetensors hands out views at the file's
    byte offsets, and BLAS may round differently on unaligned operands (tests/misaligned_loading.py),
    which is no property of growth."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()
    return model


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k, v in sa.items():
        assert v.dtype == sb[k].dtype and torch.equal(v, sb[k]), k


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def decode_steps(model, batch, steps=3):
    """Logits of a prefix pass and ``steps`` cached single-token steps (greedy tokens)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = []
    with torch.no_grad():
        res = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = res.past_key_values
        out.append(res.logits)
        for _ in range(steps):
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            res = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            out.append(res.logits)
    return out


def generate(model, batch, use_cache):
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=4,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", ["llama", "neox", "gpt2"])
def test_zero_depth_growth_is_bit_identical_with_and_without_cache(kind, dtype, gen, tmp_path):
    model = build(kind, dtype)
    inp, stack = STACK[kind]
    points = [inp, f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(candidates=points, seed=5)
    right, left = lm_batch(gen), lm_batch(gen, left=True)
    before = (
        logits(model, right),
        decode_steps(model, left),
        generate(model, left, True),
        generate(model, left, False),
    )
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[inp, f"{stack}.1"])
    assert result.positions == {inp: f"{stack}.0", f"{stack}.1": f"{stack}.3"}
    assert len(grown.get_submodule(stack)) == 4 == grown.config.num_hidden_layers
    # the zero output maps really are zero, and the other parts really are not
    new = grown.get_submodule(f"{stack}.0")
    for rel in ZERO_OUTPUT_MAPS[kind]:
        assert not new.get_parameter(rel).any(), rel
    assert all(
        p.abs().sum() > 0
        for n, p in new.named_parameters()
        if n.endswith("weight") and "norm" not in n and n not in ZERO_OUTPUT_MAPS[kind]
    )
    assert torch.equal(logits(grown, right), before[0])
    for a, b in zip(decode_steps(grown, left), before[1]):
        assert torch.equal(a, b)
    assert torch.equal(generate(grown, left, True), before[2])
    assert torch.equal(generate(grown, left, False), before[3])
    grown.save_pretrained(tmp_path)
    loaded = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval())
    assert loaded.config.num_hidden_layers == 4
    if kind == "gpt2":  # the tied embedding stays tied, in memory and after reloading
        assert grown.lm_head.weight is grown.transformer.wte.weight
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_same_weights(loaded, grown)
    assert torch.equal(logits(loaded, right), before[0])
    for a, b in zip(decode_steps(loaded, left), before[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "neox", "gpt2"])
def test_random_and_copy_growth_cache_matches_recomputation(kind, gen, tmp_path):
    """A non-zero new layer: cached decoding must equal recomputing the whole sequence, which
    fails if two layers share a KV-cache slot (layer_idx not renumbered)."""
    inp, stack = STACK[kind]
    for init in ("random", "copy"):
        model = build(kind, F64)
        protocol = fs.GrowthProtocol(candidates=[inp, f"{stack}.0"], init=init, seed=1)
        right, left = lm_batch(gen), lm_batch(gen, left=True)
        before = logits(model, right)
        fs.grow(model, protocol)
        assert not torch.allclose(logits(model, right), before)  # really changed the function
        idx = [
            blk.get_submodule({"llama": "self_attn", "neox": "attention", "gpt2": "attn"}[kind]).layer_idx
            for blk in model.get_submodule(stack)
        ]
        assert idx == list(range(4))
        cached = generate(model, left, True)
        assert torch.equal(cached, generate(model, left, False))
        steps = decode_steps(model, left, steps=3)
        ids = torch.cat([left["input_ids"], *[s[:, -1].argmax(-1, keepdim=True) for s in steps[:-1]]], 1)
        mask = torch.cat([left["attention_mask"], torch.ones(3, 3, dtype=torch.long)], 1)
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(steps[-1][:, -1], full[:, -1], rtol=1e-10, atol=1e-10)
        model.save_pretrained(tmp_path / init)
        loaded = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / init, dtype=F64).eval())
        assert_same_weights(loaded, model)
        assert torch.equal(logits(loaded, right), logits(model, right))


def test_copy_is_the_neighbour_and_blocks_are_what_grow_inserts():
    model = build("llama", F64)
    protocol = fs.GrowthProtocol(candidates=["model.layers.0", "model.layers.1"], seed=7)
    probed = new_block(model, protocol, "model.layers.1")
    again = new_block(model, protocol, "model.layers.1")
    other = new_block(
        model, fs.GrowthProtocol(candidates=["model.layers.0", "model.layers.1"], seed=8), "model.layers.1"
    )
    other_point = new_block(model, protocol, "model.layers.0")
    fs.grow(model, protocol, at=["model.layers.1"])
    inserted = model.model.layers[2]
    for (n, a), b, c, d in zip(
        probed.state_dict().items(),
        again.state_dict().values(),
        inserted.state_dict().values(),
        other.state_dict().values(),
    ):
        assert torch.equal(a, b) and torch.equal(a, c), n
        if n.endswith("q_proj.weight"):
            assert not torch.equal(a, d)
            assert not torch.equal(a, other_point.get_parameter(n))
    copied = build("llama", F64)
    neighbour = {k: v.clone() for k, v in copied.model.layers[0].state_dict().items()}
    fs.grow(copied, fs.GrowthProtocol(candidates=["model.layers.0"], init="copy"))
    for k, v in copied.model.layers[1].state_dict().items():
        assert torch.equal(v, neighbour[k]), k
    assert copied.model.layers[1].self_attn.layer_idx == 1


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", ["resnet20", "bottleneck"])
def test_zero_growth_of_resnets_is_bit_identical(kind, dtype, gen):
    model = build(kind, dtype)
    x = torch.randn(4, 3, 16, 16, generator=gen).to(dtype)
    points = ["layer1.2", "layer2.0", "layer3.2"] if kind == "resnet20" else ["layer1.0", "layer4.0"]
    with torch.no_grad():
        before = model(x)
    result = fs.grow(model, fs.GrowthProtocol(candidates=points, seed=2))
    with torch.no_grad():
        assert torch.equal(model(x), before)
    stage = points[0].split(".")[0]
    assert len(model.get_submodule(stage)) == (4 if kind == "resnet20" else 2)
    expected = {
        "layer1.2": "layer1.3",
        "layer2.0": "layer2.1",
        "layer3.2": "layer3.3",
        "layer1.0": "layer1.1",
        "layer4.0": "layer4.1",
    }
    assert result.positions == {p: expected[p] for p in points}
    assert set(result.positions.values()) <= set(fs.residual_points(model))
    last = "bn2" if kind == "resnet20" else "bn3"
    named = dict(model.named_parameters())
    for n in result.new_parameters:
        if f".{last}." in n:
            assert not named[n].any(), n
        elif n.endswith("weight"):  # conv and the other BN scales are live (BN shifts start at 0 anyway)
            assert named[n].abs().sum() > 0, n
    # train mode (batch statistics): still the same outputs, and the old running statistics move alike
    ref = build(kind, dtype)
    ref.train()
    model.train()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert torch.equal(model.bn1.running_mean, ref.bn1.running_mean)


def test_copy_growth_of_a_resnet_block(gen):
    model = build("resnet20", F64)
    x = torch.randn(2, 3, 16, 16, generator=gen, dtype=F64)
    with torch.no_grad():
        before = model(x)
    neighbour = {k: v.clone() for k, v in model.layer1[2].state_dict().items()}
    result = fs.grow(model, fs.GrowthProtocol(candidates=["layer1.2"], init="copy"))
    assert result.positions == {"layer1.2": "layer1.3"} and len(model.layer1) == 4
    for k, v in model.layer1[3].state_dict().items():
        assert torch.equal(v, neighbour[k]), k
    assert model.layer1[3] is not model.layer1[2]
    with torch.no_grad():
        assert not torch.allclose(model(x), before)  # a copy is not function preserving


def test_protocol_record_and_digest():
    p = fs.GrowthProtocol(
        candidates=["model.layers.0", "model.layers.1"], family="mlp_width", width=3, seed=4
    )
    record = p.to_dict()
    text = json.dumps(record)  # plain JSON
    assert json.loads(text) == record
    assert record["zero_state_rule"] and record["zero_parameters"]["llama"] == [
        "mlp.down_proj.weight[new columns]"
    ]
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    assert p.digest == hashlib.sha256(canonical.encode()).hexdigest()
    assert fs.GrowthProtocol.from_dict(record) == p
    changed = fs.GrowthProtocol(
        candidates=["model.layers.0", "model.layers.1"], family="mlp_width", width=3, seed=5
    )
    assert changed.digest != p.digest
    layer = fs.GrowthProtocol(candidates=["a"]).to_dict()
    assert layer["zero_parameters"]["llama"][0] == "self_attn.o_proj.weight"
    assert fs.GrowthProtocol(candidates=["a"], init="random").to_dict()["zero_parameters"] == {}
    with pytest.raises(fs.FusedStatsError, match="width"):
        fs.GrowthProtocol(candidates=["a"], family="mlp_width")
    with pytest.raises(fs.FusedStatsError, match="family"):
        fs.GrowthProtocol(candidates=["a"], family="wide")
    with pytest.raises(fs.FusedStatsError, match="twice"):
        fs.GrowthProtocol(candidates=["a", "a"])
    with pytest.raises(fs.FusedStatsError, match="needs family 'layer'"):
        fs.GrowthProtocol(candidates=["a"], family="cross_block", init="random")
    with pytest.raises(fs.FusedStatsError, match="edited"):
        fs.GrowthProtocol.from_dict({**record, "zero_state_rule": "x"})


# ------------------------------------------------------------------------------------------ width


@pytest.mark.parametrize("kind", ["llama", "neox", "gpt2"])
def test_width_growth_all_blocks(kind, gen, tmp_path):
    model = build(kind, F64, layers=3)
    inp, stack = STACK[kind]
    points = [inp, f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(candidates=points, family="mlp_width", width=4, seed=3)
    batch = lm_batch(gen)
    before = logits(model, batch)
    size = model.config.intermediate_size if kind != "gpt2" else 4 * 12
    d = 12
    directions = torch.randn(5, d, generator=gen, dtype=F64)
    if kind == "llama":  # a gated MLP: GradMax directions refused (test_gradmax.py), random rows
        with pytest.raises(fs.FusedStatsError, match="gated"):
            fs.grow(model, protocol, init_directions={inp: directions})
        directions = None
    result = fs.grow(model, protocol, init_directions=None if directions is None else {inp: directions})
    new_size = model.config.intermediate_size if kind != "gpt2" else model.config.n_inner
    assert new_size == size + 4
    assert result.positions == {inp: f"{stack}.0", f"{stack}.0": f"{stack}.1", f"{stack}.1": f"{stack}.2"}
    torch.testing.assert_close(logits(model, batch), before, rtol=0, atol=1e-12)
    first = {"llama": "mlp.gate_proj", "neox": "mlp.dense_h_to_4h", "gpt2": "mlp.c_fc"}[kind]
    w = model.get_submodule(f"{stack}.0.{first}").weight
    rows = (w.T if kind == "gpt2" else w)[size:]
    if directions is not None:
        cos = torch.nn.functional.cosine_similarity(rows, directions[:4], dim=1)
        torch.testing.assert_close(cos, torch.ones(4, dtype=F64))
    out = {"llama": "mlp.down_proj", "neox": "mlp.dense_4h_to_h", "gpt2": "mlp.c_proj"}[kind]
    wo = model.get_submodule(f"{stack}.1.{out}").weight
    new_cols = wo[size:] if kind == "gpt2" else wo[:, size:]
    assert new_cols.shape[-1 if kind != "gpt2" else 0] == 4 and not new_cols.any()
    model.save_pretrained(tmp_path)
    loaded = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F64).eval())
    assert_same_weights(loaded, model)
    assert torch.equal(logits(loaded, batch), logits(model, batch))
    # a gradient step now moves the new units (the zero columns get gradient, GradMax's premise)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    grad = model.get_submodule(f"{stack}.1.{out}").weight.grad
    assert (grad[size:] if kind == "gpt2" else grad[:, size:]).abs().sum() > 0


def test_new_units_are_deterministic_and_seeded():
    model = build("llama", F64)
    p = fs.GrowthProtocol(candidates=["model.embed_tokens", "model.layers.0"], family="mlp_width", width=3)
    a = new_units(model, p, "model.embed_tokens")
    b = new_units(model, p, "model.embed_tokens")
    c = new_units(model, p, "model.layers.0")
    assert a.block == "model.layers.0" and c.block == "model.layers.1"
    for name, (axis, t) in a.pieces.items():
        assert torch.equal(t, b.pieces[name][1]) and axis == b.pieces[name][0]
    assert not torch.equal(a.pieces["mlp.gate_proj.weight"][1], c.pieces["mlp.gate_proj.weight"][1])


def _train_steps(model, opt, gen, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        model(**lm_batch(gen)).loss.backward()
        opt.step()


def test_layer_types_follow_the_neighbour(gen, tmp_path):
    """Qwen2 lists a window type per layer: the new layer takes its neighbour's, in the config and
    in the module, and the reloaded model computes the same."""
    torch.manual_seed(5)
    config = transformers.Qwen2Config(
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = transformers.Qwen2ForCausalLM(config).to(F64).eval()
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    batch = lm_batch(gen, left=True)
    before = decode_steps(model, batch)
    zero = copy.deepcopy(model)
    fs.grow(zero, fs.GrowthProtocol(candidates=["model.layers.0"]))
    for a, b in zip(decode_steps(zero, batch), before):
        assert torch.equal(a, b)
    fs.grow(model, fs.GrowthProtocol(candidates=["model.layers.0", "model.layers.2"], init="random"))
    assert model.config.layer_types == [
        "full_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, None, 3, 3, 3]
    model.save_pretrained(tmp_path)
    loaded = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F64).eval())
    assert loaded.config.layer_types == model.config.layer_types
    for a, b in zip(decode_steps(loaded, batch), decode_steps(model, batch)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "resnet20"])
def test_cross_block_growth(kind, gen):
    """family 'cross_block': the probe's W_out φ(W_in z) block hooked in, W_out = 0, the same W_in
    as new_block builds; the function is unchanged until W_out moves."""
    model = build(kind, F64)
    point = "model.layers.0" if kind == "llama" else "layer3.1"  # 16 channels on a 4x4 map
    protocol = fs.GrowthProtocol(candidates=[point], family="cross_block", width=5, seed=9)
    probed = new_block(model, protocol, point)
    batch = lm_batch(gen) if kind == "llama" else {"x": torch.randn(2, 3, 16, 16, generator=gen, dtype=F64)}
    run = (lambda m: logits(m, batch)) if kind == "llama" else (lambda m: m(batch["x"]).detach())
    before = run(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = fs.grow(model, protocol, optimizer=opt)
    assert result.new_parameters == [f"{point}.fused_stats_inserted.w_out"]
    inserted = model.get_submodule(f"{point}.fused_stats_inserted")
    assert torch.equal(inserted.w_in, probed.w_in) and inserted.w_in.shape[0] == 5
    assert torch.equal(run(model), before)
    assert any(p is inserted.w_out for p in opt.param_groups[0]["params"])
    with torch.no_grad():
        inserted.w_out.normal_()
    assert not torch.allclose(run(model), before)


def test_grow_example_runs(tmp_path):
    """examples/grow_llama.py (the README's growth example) end to end in a fresh interpreter."""
    import os
    import re

    from example_scripts import run_script

    proc = run_script("grow_llama.py", cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "logits bit-identical: True; cached greedy generation identical: True" in out
    assert "reloaded: 6 layers, max |logit difference| 0.0e+00" in out
    errors = [
        float(e)
        for e in re.findall(r"^[\d.]+\s+[-+][\d.e+-]+\s+[-+][\d.e+-]+\s+([\d.e+-]+)$", out, flags=re.M)
    ]
    assert len(errors) == 3 and errors[0] > errors[1] > errors[2], out
    assert "MLP width 128 -> 160 in every block" in out


def test_gradmax_directions_from_measured_cross_gradient(gen):
    """From a CrossStats (identity activation, a random full-column-rank w_in): the rows are the
    top right singular vectors of C = mean_i Σ_t q zᵀ, computed here directly from the samples and
    checked through eigh of CᵀC (another algorithm); they beat random orthonormal rows."""
    from fused_stats import gradmax_directions

    d, r, k = 6, 9, 3
    q = torch.randn(20, 4, d, generator=gen, dtype=F64)
    z = torch.randn(20, 4, d, generator=gen, dtype=F64) + 0.5 * q  # correlated: C far from 0
    w_in = torch.randn(r, d, generator=gen, dtype=F64)
    acc = fs.CrossStats(d, w_in, activation="identity")
    acc.update(q, z)  # the accumulator applies w_in: c_i = Σ_t q_t (W_in z_t)ᵀ
    c_ref = torch.einsum("btd,bte->de", q, z) / q.shape[0]
    rows = gradmax_directions(acc, None, k)
    assert rows.shape == (k, d)
    torch.testing.assert_close(rows @ rows.T, torch.eye(k, dtype=F64), rtol=0, atol=1e-10)
    evals, evecs = torch.linalg.eigh(c_ref.T @ c_ref)
    top = evecs[:, -k:].flip(1).T
    torch.testing.assert_close((rows * top).sum(1).abs(), torch.ones(k, dtype=F64), rtol=0, atol=1e-8)
    gain = (c_ref @ rows.T).pow(2).sum()
    torch.testing.assert_close(gain, evals[-k:].sum(), rtol=1e-10, atol=0)
    for _ in range(5):
        rand, _ = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=F64))
        assert (c_ref @ rand).pow(2).sum() < gain
    assert torch.equal(gradmax_directions(c_ref, None, k), gradmax_directions(c_ref.clone(), None, k))
    given = fs.CrossStats(d, None, activation="identity", rank=d, dtype=F64)  # features-given mode
    given.update(q, z)  # c_i = Σ_t q_t z_tᵀ, but nothing says which space z is in
    with pytest.raises(fs.FusedStatsError, match="features given"):
        gradmax_directions(given, None, k)
    with pytest.raises(fs.FusedStatsError, match="identity"):
        gradmax_directions(fs.CrossStats(d, w_in, activation="gelu"), None, k)
    with pytest.raises(fs.FusedStatsError, match="full column rank"):
        low = fs.CrossStats(d, w_in[:4], activation="identity")
        low.update(q, z)
        gradmax_directions(low, None, k)
    with pytest.raises(fs.FusedStatsError, match="k must be"):
        gradmax_directions(c_ref, None, d + 1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bare_models_and_gradient_checkpointing(kind, gen):
    """The bare *Model forms grow too; a new layer checkpoints like its neighbour, and a
    checkpointed training step gives the same gradients as an unchecked one."""
    full = build(kind, F64)
    bare = full.model if kind == "llama" else full.transformer
    inp = "embed_tokens" if kind == "llama" else "drop"
    stack = "layers" if kind == "llama" else "h"
    batch = lm_batch(gen)
    with torch.no_grad():
        before = bare(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    fs.grow(bare, fs.GrowthProtocol(candidates=[inp, f"{stack}.1"]))
    assert len(bare.get_submodule(stack)) == 4 and bare.config.num_hidden_layers == 4
    # the grown model owns its config: the head model around it keeps the config object it had
    assert full.config.num_hidden_layers == 2 and full.config is not bare.config
    with torch.no_grad():
        after = bare(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    assert torch.equal(after, before)

    model = build(kind, F64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fs.grow(model, fs.GrowthProtocol(candidates=[f"{STACK[kind][1]}.0"], init="random"))
    layers = model.get_submodule(STACK[kind][1])
    assert all(layer.gradient_checkpointing for layer in layers)
    plain = copy.deepcopy(model)
    plain.gradient_checkpointing_disable()
    for m in (model, plain):
        m.config.attn_pdrop = m.config.resid_pdrop = m.config.embd_pdrop = 0.0
        for sub in m.modules():
            if isinstance(sub, torch.nn.Dropout):
                sub.p = 0.0
        m(**batch).loss.backward()
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14, msg=n)
