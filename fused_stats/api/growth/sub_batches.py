"""Zero-state Adam directions of B-sized train sub-batches: the state behind the Adam prediction.

Role: the first Adam step of training uses one batch of ``B`` samples, and ``s = g/(|g| + ε)``
is nonlinear in its noise, so ``⟨s(C_M), C_K⟩`` over all ``M`` probe samples is not the step's
prediction (it grows with ``M``). With ``protocol.train_batch_size = B`` the prediction is

    E_b ⟨s_b, C_K⟩ ≈ ⟨(1/n_B) Σ_b s_b, C_K⟩,   s_b = C_b/(|C_b| + ε),  C_b = (1/B) Σ_{i∈b} c_i,

over the complete sub-batches ``b`` of ``B`` consecutive train samples. A sub-batch is made of
whole probe steps (``Probe.step``; the probe never sees a step's samples one by one): the
steps' tangent sums are added until they hold exactly ``B`` samples; a step that would make
more is dropped with what was gathered (no sub-batch straddles it), and a change of the count
between steps (``load_state``, ``all_reduce``: the count going down or up) ends the sub-batch
under way without joining it. (``observe`` folds nothing into a growth probe: it is refused,
the new block needs the arguments only ``Probe.step`` records, and the sub-batch goes on.) State per candidate: ``Σ_b s_b`` (one fp64 tensor of C's shape), the count, the
partial sum of the sub-batch under way, and, for the split Adam score, ``Σ_b s_b`` over the
sub-batches that are one even train step (:attr:`SubBatches.s_even`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores import adam_direction

F64 = torch.float64


@dataclass
class SubBatches:
    """One candidate's B-sized sub-batches of its train stream (module docstring)."""

    size: int
    eps: float
    s_sum: torch.Tensor | None = None
    n_sub: int = 0
    s_even: torch.Tensor | None = None  # Σ s_b over sub-batches that are exactly one even step
    n_even: int = 0
    one_step_each: bool = True  # every complete sub-batch was exactly one probe step
    partial: torch.Tensor | None = None  # tangent sum of the sub-batch under way
    n_partial: int = 0
    n_seen: int = 0  # the stream's samples after the last step seen
    n_before: int = 0
    even: bool = False
    dropped: int = 0  # samples of steps that did not fit a sub-batch

    def begin(self, acc, even: bool) -> None:
        """Before a train step: ``acc`` the candidate's train CrossStats (None: none yet)."""
        n = 0 if acc is None else acc.n
        if n != self.n_seen:  # samples came in another way: they join no sub-batch
            self.partial, self.n_partial = None, 0
        self.n_before, self.even = n, even
        if acc is not None:
            c = acc.c_sum.detach().to(F64)
            self.partial = -c.clone() if self.partial is None else self.partial.sub_(c)

    def end(self, acc) -> None:
        """After the step (also a refused one, whose unchanged sum cancels)."""
        n = 0 if acc is None else acc.n
        added = n - self.n_before
        if acc is not None:
            c = acc.c_sum.detach().to(F64)
            # None: there was no accumulator before the step (a zero sum)
            self.partial = c.clone() if self.partial is None else self.partial.add_(c)
        self.n_seen = n
        if added <= 0:
            return
        self.n_partial += added
        if self.n_partial > self.size:  # the step does not fit: no sub-batch straddles it
            self.dropped += self.n_partial
            self.partial, self.n_partial = None, 0
            return
        if self.n_partial < self.size:
            return
        s = adam_direction(self.partial.cpu() / self.size, self.eps)
        self.s_sum = s.clone() if self.s_sum is None else self.s_sum.add_(s)
        self.n_sub += 1
        if added == self.size:
            if self.even:
                self.s_even = s.clone() if self.s_even is None else self.s_even.add_(s)
                self.n_even += 1
        else:
            self.one_step_each = False
        self.partial, self.n_partial = None, 0

    def mean(self) -> torch.Tensor | None:
        """``(1/n_B) Σ_b s_b`` (None: no complete sub-batch)."""
        return None if self.n_sub == 0 else self.s_sum / self.n_sub

    def halves(self):
        """``(mean s over the even-step sub-batches, over the odd ones)`` when every sub-batch was
        one probe step and both halves have one, else None."""
        n_odd = self.n_sub - self.n_even
        if not self.one_step_each or self.n_even == 0 or n_odd == 0:
            return None
        return self.s_even / self.n_even, (self.s_sum - self.s_even) / n_odd


__all__ = ["SubBatches"]
