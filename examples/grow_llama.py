"""Grow a small LLaMA in the middle of training, without re-creating the optimizer.

1. train a 4-layer LLaMA (built from a config, no download) for a few AdamW steps;
2. fix a GrowthProtocol (candidates, family, init, seed) and print its digest;
3. fs.grow: two zero-output layers, the optimizer extended; check that logits and greedy
   generation with a KV cache are bit-identical, then keep training with the same optimizer;
4. the first SGD step on the new parameters against the first-order prediction -eta |grad|^2;
5. save_pretrained -> from_pretrained, and MLP width growth of every block.

Run: ``PYTHONPATH=. python examples/grow_llama.py`` (a few seconds on 2 CPU cores).
"""

from __future__ import annotations

import copy
import tempfile
import time

import torch
import transformers

import fused_stats as fs

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
VOCAB, T, B = 64, 24, 16


def batch(gen):
    # sequences that repeat a random motif: learnable by attention
    motif = torch.randint(3, VOCAB, (B, 6), generator=gen)
    ids = motif.repeat(1, T // 6)
    mask = torch.ones_like(ids)
    mask[: B // 4, -5:] = 0  # some right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


config = transformers.LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
model = transformers.LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
gen = torch.Generator().manual_seed(1)


def train(steps):
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch(gen)).loss
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


print(f"loss after 40 steps, 4 layers: {train(40):.4f}")

protocol = fs.GrowthProtocol(
    candidates=["model.layers.1", "model.layers.3"], family="layer", init="zero", seed=0
)
print(
    f"protocol digest {protocol.digest[:16]}...  zero parameters: {protocol.to_dict()['zero_parameters']['llama']}"
)

probe_batch = batch(torch.Generator().manual_seed(2))
with torch.no_grad():
    before = model(input_ids=probe_batch["input_ids"], attention_mask=probe_batch["attention_mask"]).logits
    gen_before = model.generate(input_ids=probe_batch["input_ids"][:4, :8], max_new_tokens=6, do_sample=False)
start = time.perf_counter()
result = fs.grow(model, protocol, optimizer=opt)
elapsed = time.perf_counter() - start
with torch.no_grad():
    after = model(input_ids=probe_batch["input_ids"], attention_mask=probe_batch["attention_mask"]).logits
    gen_after = model.generate(input_ids=probe_batch["input_ids"][:4, :8], max_new_tokens=6, do_sample=False)
print(f"grown to {model.config.num_hidden_layers} layers in {elapsed * 1e3:.1f} ms at {result.positions}")
print(f"logits bit-identical: {torch.equal(before, after)}; cached greedy generation identical: "
      f"{torch.equal(gen_before, gen_after)}")  # fmt: skip
print(f"new parameters: {len(result.new_parameters)} tensors, e.g. {result.new_parameters[:2]}")
print(f"loss after 40 more steps, same optimizer, 6 layers: {train(40):.4f}")

# the first step on the zero-initialised parameters is a fresh optimizer's first step: for SGD the
# loss changes by -eta |grad_new|^2 to first order (the depth paper's gain)
fresh = copy.deepcopy(model).double()
fresh_protocol = fs.GrowthProtocol(candidates=["model.layers.4"], seed=1)
sgd_batch = batch(torch.Generator().manual_seed(3))


def lm_loss(m, b):
    # in fp64 throughout: HF's own loss upcasts the logits to fp32 only, whose rounding would
    # swamp the second-order term at small steps
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1)
    )


print("eta     loss change       -eta|g|^2         relative error")
for eta in (1.0, 0.1, 0.01):
    m = copy.deepcopy(fresh)
    sgd = torch.optim.SGD(m.parameters(), lr=eta, momentum=0.9)
    grown = fs.grow(m, fresh_protocol, optimizer=sgd)
    new = {id(p) for n, p in m.named_parameters() if n in set(grown.new_parameters)}
    loss0 = lm_loss(m, sgd_batch)
    loss0.backward()
    g2 = sum((p.grad**2).sum() for p in m.parameters() if id(p) in new)
    for p in m.parameters():
        if id(p) not in new:
            p.grad = None  # only the new parameters step
    sgd.step()
    with torch.no_grad():
        change = (lm_loss(m, sgd_batch) - loss0).item()
    pred = -eta * g2.item()
    print(f"{eta:<7} {change:<+17.6e} {pred:<+17.6e} {abs(change - pred) / abs(pred):.2e}")

with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()
    with torch.no_grad():
        a = model(input_ids=probe_batch["input_ids"]).logits
        b = loaded(input_ids=probe_batch["input_ids"]).logits
    print(
        f"reloaded: {loaded.config.num_hidden_layers} layers, max |logit difference| {(a - b).abs().max().item():.1e}"
    )

width = fs.GrowthProtocol(
    candidates=["model.embed_tokens", *[f"model.layers.{i}" for i in range(5)]], family="mlp_width", width=32
)
old_size = model.config.intermediate_size
with torch.no_grad():
    narrow = model(input_ids=probe_batch["input_ids"], attention_mask=probe_batch["attention_mask"]).logits
fs.grow(model, width, optimizer=opt)
with torch.no_grad():
    wide = model(input_ids=probe_batch["input_ids"], attention_mask=probe_batch["attention_mask"]).logits
print(f"MLP width {old_size} -> {model.config.intermediate_size} in every block; "
      f"max |logit change| {(wide - narrow).abs().max().item():.1e}")  # fmt: skip
print(f"loss after 20 more steps, wider: {train(20):.4f}")
