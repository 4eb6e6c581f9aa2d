"""``fs.causal_lm_loss`` reads the logits without copying them.

A model stands in that returns fixed random logits (B, T, V) as a leaf tensor, so the loss and the
gradient reaching the logits (what every probe backward starts from) can be compared with:

* a per-token loop in fp64 (log-softmax by hand, one sequence and one position at a time, the
  mean over the counted targets of each sequence);
* the shifted-logits formula written out here (``cross_entropy(logits[:, :-1], labels[:, 1:])``),
  which must agree to the last bit in fp32: the rows are the same rows;

and the number of full-vocabulary tensors the forward and backward write is counted with a
dispatch mode: the log-softmax, the loss's backward and the log-softmax's backward, no more (the
slice ``logits[:, :-1]`` flattened is a copy of every logit, and its backward a second one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fused_stats as fs

B, T, V = 3, 9, 50


class FixedLogits(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None):
        return self.logits


def random_case(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=gen)).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, 4] = -100
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 6:] = 0  # right padding
    return logits, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def per_token_reference(logits, batch):
    """Mean over counted targets of -log softmax, one sequence and one position at a time, fp64."""
    x = logits.detach().double()
    labels, mask = batch["labels"], batch["attention_mask"]
    out = []
    for b in range(B):
        total, count = 0.0, 0
        for t in range(T - 1):
            if labels[b, t + 1] == -100 or mask[b, t] == 0 or mask[b, t + 1] == 0:
                continue
            row = x[b, t]
            total += float(torch.logsumexp(row, 0) - row[labels[b, t + 1]])
            count += 1
        out.append(total / count)
    return torch.tensor(out, dtype=torch.float64)


def test_loss_and_logit_gradient_match_a_per_token_loop_in_fp64():
    logits, batch = random_case(torch.float64, seed=11)
    loss = fs.causal_lm_loss(FixedLogits(logits), batch)
    torch.testing.assert_close(loss, per_token_reference(logits, batch), rtol=1e-12, atol=0)
    weights = torch.randn(B, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    # by hand: d/dx of -log softmax(x)[y] is softmax(x) - onehot(y), per counted position
    expected = torch.zeros_like(grad)
    labels, mask = batch["labels"], batch["attention_mask"]
    for b in range(B):
        counted = [
            t for t in range(T - 1) if labels[b, t + 1] != -100 and mask[b, t] == 1 and mask[b, t + 1] == 1
        ]
        for t in counted:
            row = torch.softmax(logits.detach()[b, t], 0)
            row[labels[b, t + 1]] -= 1
            expected[b, t] = weights[b] * row / len(counted)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert torch.all(grad[:, -1] == 0)  # the last position predicts nothing


def test_fp32_loss_and_gradient_equal_the_shifted_logits_formula_bit_for_bit():
    logits, batch = random_case(torch.float32, seed=21)
    loss = fs.causal_lm_loss(FixedLogits(logits), batch)
    labels, mask = batch["labels"], batch["attention_mask"]
    valid = (labels[:, 1:] != -100) & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    shifted = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].masked_fill(~valid, 0).reshape(-1), reduction="none"
    ).view(B, T - 1)
    shifted = torch.where(valid, shifted, torch.zeros(())).sum(1) / valid.sum(1)
    assert torch.equal(loss, shifted)
    weights = torch.randn(B, generator=torch.Generator().manual_seed(22))
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    (grad_shifted,) = torch.autograd.grad((shifted * weights).sum(), logits)
    assert torch.equal(grad, grad_shifted)


class FullVocabWrites(TorchDispatchMode):
    """The ops that write a new tensor of at least (B, T - 1, V) elements (views and in-place ops,
    whose output shares an input's storage, write nothing new)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.numel() >= B * (T - 1) * V
                and tensor.untyped_storage().data_ptr() not in inputs
            ):
                self.ops.append(func.__name__)
        return out


def test_the_logits_are_not_copied_forward_or_backward():
    logits, batch = random_case(torch.float32, seed=31)
    with FullVocabWrites() as writes:
        loss = fs.causal_lm_loss(FixedLogits(logits), batch)
        loss.sum().backward()
    # log_softmax forward, the nll loss's backward and log_softmax's backward
    assert writes.ops == [
        "_log_softmax.default",
        "nll_loss_backward.default",
        "_log_softmax_backward_data.default",
    ]
