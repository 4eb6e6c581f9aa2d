"""Use ``fs.GradStats`` as the statistics backend inside another tool's own backward hook.

Situation: a tool already has its own forward/backward (e.g. an interpretability or pruning
library) and only wants the exact streaming statistics of the activation gradients it sees. It
registers a tensor hook on the activation; autograd calls the hook with ``∂L/∂z`` during backward,
and the hook folds it into a :class:`fused_stats.GradStats` — nothing per-sample is stored (with
``second_moment="dense"``), and on CUDA the update runs the fused Triton kernels.

Two things the tool must get right, both shown here:

* **per-sample scaling**: the statistics are about per-sample gradients ``∂ℓ_b/∂z_b``. With
  ``L = Σ_b ℓ_b`` the hook's gradient already is that; with the usual ``L = mean_b ℓ_b`` every row
  is divided by B, so the hook multiplies by B (``scale`` below). (Samples must not interact in the
  forward — e.g. BatchNorm in train mode breaks per-sample gradients.)
* **masks**: padding positions must not count (``mask`` = the attention mask).

The script checks the result against :class:`fused_stats.Probe` on the same batches. They agree to
about 1e-7 relative here, not 1e-15: HF LLaMA's RMSNorm computes in fp32 even in an fp64 model, so
its backward rounds the gradient to fp32, and the 1/B of a batch-mean loss is rounded there before
the hook multiplies it back (with a summed loss the two paths agree to fp64 rounding).

    python examples/backend_in_own_hook.py
"""

from __future__ import annotations

import torch

import fused_stats as fs


class OwnTool:
    """A minimal "other tool": forward hook on one module, tensor hook on its output."""

    def __init__(self, module: torch.nn.Module, dim: int):
        self.stats = fs.GradStats(dim, second_moment="dense", name="own hook")
        self.mask = None
        self.scale = 1.0
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            mask, scale = self.mask, self.scale  # bind this batch's values to this backward
            hidden.register_hook(lambda g: self.stats.update(g * scale, mask=mask, unit="sample"))

    def close(self):
        self._handle.remove()


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 128, (6, 16), generator=gen)
        mask = torch.ones_like(ids)
        mask[::2, 12:] = 0  # every other sequence is padded
        batches.append({"input_ids": ids, "attention_mask": mask})

    point = "model.layers.1"
    tool = OwnTool(model.get_submodule(point), dim=32)
    for batch in batches:
        tool.mask, tool.scale = batch["attention_mask"], float(batch["input_ids"].shape[0])
        loss = fs.causal_lm_loss(model, batch).mean()  # the tool's own (batch-mean) loss
        model.zero_grad(set_to_none=True)
        loss.backward()  # the hook fires here and updates tool.stats
    tool.close()

    probe = fs.Probe(model, points=[point], second_moment="dense")
    for batch in batches:
        probe.step(batch, fs.causal_lm_loss)

    mine, ref = tool.stats.estimate(), probe.stats[point].estimate()
    print(f"{'quantity':14s} {'own hook':>14s} {'Probe':>14s} {'rel. diff':>10s}")
    for key in ("n", "mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "d_align", "ag_max"):
        a, b = getattr(mine, key), getattr(ref, key)
        rel = abs(a - b) / max(abs(b), 1e-300)
        print(f"{key:14s} {a:14.6e} {b:14.6e} {rel:10.1e}")
        assert rel < 1e-6, key


if __name__ == "__main__":
    main()
