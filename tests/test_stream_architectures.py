"""Streamed from a folder equals ``from_pretrained`` of the same folder, on ten HF architectures.

Each architecture is built from a tiny config in fp64 (1-d weights moved away from their
initial 1 / 0), written by ``save_pretrained`` in several shards, then loaded twice: by
transformers' own ``from_pretrained`` (the reference) and by ``fs.stream_blocks``. Checked:

* every buffer of the reference model (the non-persistent rotary tables and masks included),
  dtype and bits;
* the logits of a padded batch (both without grad, where the same kernels run) to 1e-13;
* ``fs.residual_points`` and the probe's estimates, certificate and saturation test after
  ``Probe.step`` on both (train and test streams, unit="sample" with cross-gradient statistics) to 1e-10 relative (the
  in-memory forward runs with grad, whose attention kernels may differ in the last bit).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_stream_blocks import assert_close

import fused_stats as fs

from tiny_models import padded_lm_batch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
F64 = torch.float64
VOCAB = 40
ATTENTION = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB)
GQA = dict(ATTENTION, intermediate_size=24, num_key_value_heads=2, max_position_embeddings=32)

CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**GQA),
    "qwen3": lambda: transformers.Qwen3Config(**GQA, head_dim=4),
    "mistral": lambda: transformers.MistralConfig(**GQA),
    "gemma2": lambda: transformers.Gemma2Config(**GQA, head_dim=4),
    "phi3": lambda: transformers.Phi3Config(**GQA, pad_token_id=0),
    "opt": lambda: transformers.OPTConfig(
        **ATTENTION, ffn_dim=24, word_embed_proj_dim=16, max_position_embeddings=32
    ),
    "falcon": lambda: transformers.FalconConfig(**ATTENTION),
    "gptj": lambda: transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=32,
        rotary_dim=4,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=4),
    "olmo2": lambda: transformers.Olmo2Config(**GQA),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    arch = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=F64)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path, max_shard_size="20KB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    return arch, path


def batches():
    gen = torch.Generator().manual_seed(1)
    return [
        padded_lm_batch(gen, [9, 6, 4, 8, 5], 9, VOCAB, prompts=[2, 1, 0, 0, 1]),
        padded_lm_batch(gen, [8, 5, 7, 9], 9, VOCAB),
    ]


def probed(model):
    probe = fs.Probe(model, unit="sample", cross=fs.CrossSpec(rank=3, seed=2), second_moment="pool")
    train, test = batches()
    probe.step(train, fs.causal_lm_loss)
    probe.step(test, fs.causal_lm_loss, stream="test")
    return probe


def test_streamed_folder_equals_from_pretrained(folder):
    arch, path = folder
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64, local_files_only=True).eval()
    batch = batches()[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    want_probe = probed(ref)
    with fs.stream_blocks(path) as st:
        # a streamed block keeps the real block as its child `block`
        names = fs.residual_points(ref)
        assert fs.residual_points(st.model) == names
        streamed_buffers = dict(st.model.named_buffers())
        for name, want in ref.named_buffers():
            block = next((n for n in names if name.startswith(n + ".")), None)
            key = name if block is None else f"{block}.block.{name[len(block) + 1 :]}"
            got = streamed_buffers[key]
            assert got.dtype == want.dtype and torch.equal(got, want), (arch, name)
        with torch.no_grad():
            want = ref(**inputs, use_cache=False).logits
            got = st.model(**inputs).logits
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14, msg=lambda m: f"{arch}: {m}")
        got_probe = probed(st.model)
    for point in names:
        for stream in ("train", "test"):
            assert_close(
                got_probe.estimates(stream)[point].to_dict(),
                want_probe.estimates(stream)[point].to_dict(),
                f"{arch}/{point}/{stream}",
            )
        assert_close(
            got_probe.certificate(point).to_dict(),
            want_probe.certificate(point).to_dict(),
            f"{arch}/{point}/cert",
        )
        assert_close(
            got_probe.saturation(point).to_dict(),
            want_probe.saturation(point).to_dict(),
            f"{arch}/{point}/sat",
        )


# ----------------------------------------------------------------------------- mixture of experts
MOE = dict(GQA, num_experts_per_tok=2)
MOE_CONFIGS = {
    # save_pretrained writes these per expert (experts.0.w1 ...); from_pretrained fuses them
    "mixtral": lambda: transformers.MixtralConfig(**MOE, num_local_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **MOE, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=12
    ),
}


def moe_block_params(cfg) -> int:
    """Parameters of one MoE block by hand: attention, router, every expert's gated MLP, norms
    (and Qwen2-MoE's shared expert with its gate and the q/k/v biases)."""
    d, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d_kv = d * kv // heads
    attention = 2 * d * d + 2 * d * d_kv
    if cfg.model_type == "mixtral":
        experts = cfg.num_local_experts
        return attention + d * experts + experts * 3 * d * cfg.intermediate_size + 2 * d
    experts = cfg.num_experts
    shared = 3 * d * cfg.shared_expert_intermediate_size + d
    biases = d + 2 * d_kv
    return attention + biases + d * experts + experts * 3 * d * cfg.moe_intermediate_size + shared + 2 * d


@pytest.mark.parametrize("arch", sorted(MOE_CONFIGS))
def test_moe_folder_streams_as_from_pretrained(arch, tmp_path):
    from fused_stats.api.streaming.plan import plan_streaming

    torch.manual_seed(0)
    cfg = MOE_CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # fp32: the expert matmul refuses fp64
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.3." in k for k in stored) and not any(k.endswith("gate_up_proj") for k in stored)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    batch = batches()[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    want_probe = probed(ref)
    with fs.stream_blocks(tmp_path) as st:
        block = st.model.get_submodule(fs.residual_points(st.model)[0]).block
        # the block's bytes count all its experts
        assert st.block_bytes == 4 * moe_block_params(cfg) == 4 * sum(p.numel() for p in block.parameters())
        with torch.no_grad():
            want = ref(**inputs, use_cache=False).logits
            got = st.model(**inputs).logits
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got_probe = probed(st.model)
    for point in fs.residual_points(ref):
        g, w = got_probe.estimates("train")[point].to_dict(), want_probe.estimates("train")[point].to_dict()
        for key in ("n", "mu_norm2", "trace_sigma2", "ag_max"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), (arch, point, key)
    plan = plan_streaming(tmp_path, tokens=64)
    assert plan.block_params == moe_block_params(cfg)


def test_moe_experts_beyond_ten_keep_their_order(tmp_path):
    """Twelve experts: ``from_pretrained`` fuses ``experts.10`` after ``experts.9`` (natural order);
    a plain string sort would put 10 and 11 after 1 and shift every later expert's weights."""
    torch.manual_seed(3)
    cfg = transformers.MixtralConfig(**MOE, num_local_experts=12)
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # fp32: the expert matmul refuses fp64
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.11." in k for k in stored)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    batch = batches()[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with fs.stream_blocks(tmp_path) as st, torch.no_grad():
        want = ref(**inputs, use_cache=False).logits
        got = st.model(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
