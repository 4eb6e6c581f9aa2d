"""The tangent probe's self-checks: its feature code against autograd, at each candidate's first use.

Role: :class:`TangentSelfCheck` is the checking half of :class:`.tangent.GrowthTangent`. Each
check takes one sample of what the probe saw at a candidate, a seeded random gradient ``q``
(the candidate's block seed), and compares the tangent ``Σ_t q'_t x'_tᵀ`` that the feature code
gives with ``∂⟨q, h⟩/∂θ`` by autograd through an fp64 copy of the block ``h`` that ``fs.grow``
would insert, over its origin parameters ``θ``: :meth:`~TangentSelfCheck.check_point` (zero
maps and post-norm scales), :meth:`~TangentSelfCheck.check_cross_block_point`,
:meth:`~TangentSelfCheck.check_channel_point` (ResNet BatchNorm) and
:meth:`~TangentSelfCheck.check_width_point` (new MLP units); above
:data:`SELF_CHECK_TOLERANCE` relative error they raise, naming the point and the model_type.
:meth:`~TangentSelfCheck.check_input_scale` checks the adapter's input scale on the model's own
forward. The checks read the host's plan, blocks (``block``, ``maps``) and feature code
(``_features``, ``_map_features``, ``_unit_features``, ``cross_terms``, ``channel_terms``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...errors import FusedStatsError
from ..probe.fold import cross_view


class TangentSelfCheck:
    """The self-checks of a :class:`.tangent.GrowthTangent` (module docstring)."""

    def check_input_scale(self) -> float:
        """The self-check of the input boundary's scale: the model run on three tokens up to
        block 0's input, which must be the input point's output times the adapter's input scale
        (1e-6 relative, or a few roundings of the model's dtype); :class:`FusedStatsError`
        otherwise, naming the model_type. Returns the relative error."""
        arch, model = self.arch, self.model
        seen: dict[str, torch.Tensor] = {}

        class _Reached(Exception):
            pass

        def on_input(mod, args, out):
            seen["point"] = out.detach()

        def on_block(mod, args, kwargs):
            stream = args[0] if args else kwargs.get("hidden_states")
            if isinstance(stream, torch.Tensor):
                seen["stream"] = stream.detach()
            raise _Reached

        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        pad = getattr(model.config, "pad_token_id", None)
        ids = [i for i in range(min(vocab, 8)) if i != pad][:3]
        device = next(model.parameters()).device
        handles = [
            model.get_submodule(arch.input_point).register_forward_hook(on_input),
            model.get_submodule(arch.boundaries[arch.input_point].neighbour).register_forward_pre_hook(
                on_block, with_kwargs=True
            ),
        ]
        try:
            with torch.no_grad():
                model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        except _Reached:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if "stream" not in seen or "point" not in seen:
            raise FusedStatsError(
                f"tangent self-check (model_type {self.adapter.model_type!r}): the model did not run "
                f"{arch.input_point!r} and then block 0 on three tokens; cannot check the input scale"
            )
        point, stream = seen["point"].to(torch.float64), seen["stream"].to(torch.float64)
        error = float((stream - point * self.input_scale).norm() / stream.norm().clamp_min(1e-300))
        tolerance = max(SELF_CHECK_TOLERANCE, 8 * torch.finfo(seen["stream"].dtype).eps)
        if not error <= tolerance:
            raise FusedStatsError(
                f"tangent self-check failed at {arch.input_point!r} (model_type {self.adapter.model_type!r}): "
                f"block 0's input is not the input point's output times {self.input_scale} (relative "
                f"error {error:.3g}); the growth adapter's input scale is wrong for this model"
            )
        return error

    def check_point(self, point: str, z: torch.Tensor, kwargs: dict) -> float:
        """The self-check: for one sample of ``z`` and a seeded random stream gradient ``q`` (at
        :data:`CHECKED_POSITIONS` random positions, zero at the others), the
        tangent ``Σ_t q'_t x'_tᵀ`` of the feature code (this source's :meth:`_features` and
        ``cross_terms``, on an fp64 copy of the block) against autograd, ``∂⟨q, h(s z)⟩/∂θ`` over
        the origin parameters ``θ`` of that copy, ``s`` the stream scale (the feature code gets
        ``s q``, the gradient at the point's output). Raises :class:`FusedStatsError` above 1e-6
        relative error, naming the point and the model_type; returns the error."""
        block = copy.deepcopy(self.block(point)).to(torch.float64)
        B, sample = z.shape[0], _finite_index(z)
        z1 = _one_sample(z, sample, B).detach().to(torch.float64)
        kw1 = _fp64(_one_sample(kwargs, sample, B))
        units = None
        if self.normwise:
            units = {
                name: self._unit_norm(name, block.get_submodule(name)) for name, _, _ in self.maps[point]
            }
        q = self._check_gradient(point, z1, limit_positions=True)
        scale = self.stream_scale(point)
        x = self._features(point, block, units, z1, kw1).to(torch.float64)
        q_point = q * scale
        terms = getattr(self, "cross_terms", None)
        q2, x2 = terms(point, q_point, z1, x) if terms is not None else (q_point, x)
        ours = torch.einsum("btk,btr->kr", q2, x2)
        params = []
        for name, _, bias in self.maps[point]:
            sub = block.get_submodule(name)
            params.append(sub.weight)
            if bias:
                params.append(sub.bias)
        for p in block.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            out = block(z1 * scale if scale != 1.0 else z1, **kw1)
            out = out[0] if isinstance(out, (tuple, list)) else out
            grads = torch.autograd.grad((q * out).sum(), params)
        if self.normwise:
            ref = torch.cat([g.flatten() for g in grads])[None, :]
        else:
            pieces, columns = list(grads), []
            for name, _, bias in self.maps[point]:
                w = pieces.pop(0)
                columns.append(w if isinstance(block.get_submodule(name), nn.Linear) else w.T)
                if bias:
                    columns.append(pieces.pop(0)[:, None])
            ref = torch.cat(columns, dim=1)
        return self._verdict(point, ours, ref, "the new block")

    def _verdict(self, point: str, ours: torch.Tensor, ref: torch.Tensor, through: str) -> float:
        """The relative error of the feature code's tangent ``ours`` against autograd's ``ref``;
        :class:`FusedStatsError` above :data:`SELF_CHECK_TOLERANCE`, naming the point and the
        model_type."""
        error = float((ours - ref).norm() / ref.norm().clamp_min(torch.finfo(torch.float64).tiny))
        if not error <= SELF_CHECK_TOLERANCE:
            raise FusedStatsError(
                f"tangent self-check failed at {point!r} (model_type {self.adapter.model_type!r}): the "
                f"feature code's tangent (family {self.family!r}) differs from autograd through "
                f"{through} by {error:.3g} (relative; tolerance {SELF_CHECK_TOLERANCE}); the growth "
                "adapter of this model_type does not describe the block exactly"
            )
        return error

    def _check_gradient(self, point: str, like: torch.Tensor, limit_positions: bool) -> torch.Tensor:
        """The self-check's seeded random gradient, shaped like ``like`` (fp64); with
        ``limit_positions``, zero but at :data:`CHECKED_POSITIONS` random positions of axis 1."""
        gen = torch.Generator().manual_seed(self.plan.seed(point) % (2**31))
        q = torch.randn(like.shape, generator=gen, dtype=torch.float64)
        if limit_positions and q.dim() == 3 and q.shape[1] > CHECKED_POSITIONS:
            # q at a few positions only: a norm computing in fp32 (Gemma's) sums its scale
            # gradient over the positions in fp32, whose rounding would grow with T
            keep = torch.randperm(q.shape[1], generator=gen)[:CHECKED_POSITIONS]
            q = q * torch.zeros(q.shape[1], 1, dtype=q.dtype).index_fill_(0, keep, 1.0)
        return q.to(like.device)

    def check_cross_block_point(self, point: str, z: torch.Tensor) -> float:
        """The self-check of ``family="cross_block"``: ``Σ_t q_t φ(W_in z_t)ᵀ`` from the feature
        code against ``∂⟨q, h(z)⟩/∂W_out`` by autograd through an fp64 copy of the block ``h``
        (one sample of ``z``, ``q`` seeded random). Returns the relative error."""
        block = copy.deepcopy(self.block(point)).to(torch.float64)
        z1 = _finite_sample(z).to(torch.float64)
        q = self._check_gradient(point, z1, limit_positions=False)
        ours = torch.einsum("btk,btr->kr", q, self.cross_block_features(block, z1).to(torch.float64))
        block.w_out.requires_grad_(True)
        with torch.enable_grad():
            (ref,) = torch.autograd.grad((q * block(z1)).sum(), [block.w_out])
        return self._verdict(point, ours, ref, "the new block")

    def check_channel_point(self, point: str, act: torch.Tensor) -> float:
        """The self-check of a ResNet candidate: ``Σ_t`` of :meth:`channel_terms` on
        :meth:`map_features` against ``∂⟨q, h(a)⟩/∂(γ, β)`` by autograd through an fp64 copy of
        the new block ``h`` (its output, ``a + F(a)``, as the model adds it), on one sample ``a``
        of the point's output and a seeded random ``q`` (B, C, H, W). Returns the relative error."""
        block = copy.deepcopy(self.block(point)).to(torch.float64)
        a1 = _finite_sample(act).to(torch.float64)
        q = self._check_gradient(point, a1, limit_positions=False)
        q2, x2 = self.channel_terms(point, cross_view(q, 1), a1, self._map_features(point, block, a1))
        ours = torch.einsum("btk,btr->kr", q2, x2)
        bn = block.get_submodule(self.maps[point][0][0])
        params = [bn.weight, bn.bias]
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            grads = torch.autograd.grad((q * block(a1)).sum(), params)
        ref = torch.cat([g.flatten() for g in grads])[None, :]
        return self._verdict(point, ours, ref, "the new block")

    def check_width_point(self, point: str, u: torch.Tensor) -> float:
        """The self-check of ``family="mlp_width"``: ``Σ_t q'_t h_tᵀ`` from the feature code
        (:meth:`unit_features`) against ``∂⟨q', β·mlp'(u)⟩/∂W_new`` by autograd, ``mlp'`` an fp64
        copy of the widened MLP of the block ``fs.grow`` would produce, ``W_new`` the new columns
        of its output map, ``u`` one sample of the MLP input the probe saw, ``q'`` seeded random
        and ``β`` the branch scale (checked against the whole block by the ``layer`` family's
        check). Returns the relative error."""
        grown = self._new_block(self.model, self.protocol, point)
        mlp_name, _, out_name = self.adapter.mlp_output.rpartition(".")
        mlp = copy.deepcopy(grown.get_submodule(mlp_name)).to(torch.float64).eval()
        mlp.requires_grad_(False)
        u1 = _finite_sample(u).to(torch.float64)
        q = self._check_gradient(point, u1, limit_positions=False)
        ours = torch.einsum("btk,btr->kr", q, self._unit_features(point, mlp, u1).to(torch.float64))
        out_map = mlp.get_submodule(out_name)
        out_map.weight.requires_grad_(True)
        with torch.enable_grad():
            out = mlp(u1)
            (g,) = torch.autograd.grad((q * out).sum() * self.branch_scale, [out_map.weight])
        k = int(self.protocol.width)
        ref = g[-k:].T if self.adapter.conv1d else g[:, -k:]  # Conv1D stores (in, out)
        return self._verdict(point, ours, ref, "the widened MLP")


SELF_CHECK_TOLERANCE = 1e-6
CHECKED_POSITIONS = 4


def _finite_index(t: torch.Tensor) -> int:
    """The first sample (row of axis 0) of ``t`` with only finite values, else 0."""
    return next((b for b in range(t.shape[0]) if bool(torch.isfinite(t[b]).all())), 0)


def _finite_sample(t: torch.Tensor) -> torch.Tensor:
    """:func:`_finite_index`'s sample of ``t`` as a batch of one, detached."""
    sample = _finite_index(t)
    return t[sample : sample + 1].detach()


def _one_sample(value, b: int, batch: int):
    """Sample ``b`` of a call argument: tensors with a leading batch axis (dim ≥ 2) sliced to one
    row, containers element-wise, everything else (a broadcast rotary table, ``cache_position``)
    as it is."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and batch > 1 and value.shape[0] % batch == 0 and value.shape[0] > batch:
            # samples x heads on one axis (BLOOM's ALiBi bias, (B·H, 1, T)): sample b's H rows
            per = value.shape[0] // batch
            return value[b * per : (b + 1) * per]
        return value[b : b + 1] if value.dim() >= 2 and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, tuple):
        return tuple(_one_sample(v, b, batch) for v in value)
    if isinstance(value, list):
        return [_one_sample(v, b, batch) for v in value]
    if isinstance(value, dict):
        return {k: _one_sample(v, b, batch) for k, v in value.items()}
    return value


def _fp64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_fp64(v) for v in value)
    if isinstance(value, list):
        return [_fp64(v) for v in value]
    if isinstance(value, dict):
        return {k: _fp64(v) for k, v in value.items()}
    return value
