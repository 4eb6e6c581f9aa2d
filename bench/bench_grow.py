"""Time fs.grow on two LLaMA sizes (fp32, CPU): one zero layer in the middle, then MLP width
growth of every block (f/8 new units), each with an AdamW optimizer extended; prints whether the
logits stayed bit-identical. Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python bench/bench_grow.py``.
"""

from __future__ import annotations

import time

import torch
import transformers

import fused_stats as fs

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
for d, f, layers in ((256, 688, 8), (1024, 2752, 8)):
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # so the optimizer has state to carry
    opt.zero_grad()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    start = time.perf_counter()
    fs.grow(model, fs.GrowthProtocol(candidates=[f"model.layers.{layers // 2 - 1}"]), optimizer=opt)
    t_layer = time.perf_counter() - start
    with torch.no_grad():
        same = torch.equal(model(input_ids=ids).logits, before)
    width = fs.GrowthProtocol(
        candidates=["model.embed_tokens", *[f"model.layers.{i}" for i in range(layers)]],
        family="mlp_width",
        width=f // 8,
    )
    start = time.perf_counter()
    fs.grow(model, width, optimizer=opt)
    t_width = time.perf_counter() - start
    with torch.no_grad():
        change = (model(input_ids=ids).logits - before).abs().max().item()
    n = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"d={d} f={f} layers={layers}->{layers + 1} ({n:.1f}M parameters after): one zero layer "
        f"{t_layer * 1e3:.0f} ms (logits bit-identical: {same}); +{f // 8} MLP units in all "
        f"{layers + 1} blocks {t_width * 1e3:.0f} ms (max |logit change| {change:.1e})"
    )
