"""Streaming cross-gradient statistics and the depth-saturation test (depth paper; docs/design.md, section 2).

For a zero-output block ``h(z) = W_out φ(W_in z)`` at a point, ``c_i = Σ_{t∈i} q_t φ(W_in z_t)ᵀ``
and ``C = E[c_i]``. The state is ``n``, ``Σ c_i`` (d × r, fp64), ``Σ |c_i|_F²`` and, from pairs of
samples inside each batch, sums of ``k_ij²``, ``k_ij k_jk``, ``k_ij k_kl`` over distinct tuples
(``k_ij = <c_i, c_j>``) with their counts. The estimates from them (the unbiased ``|C|_F²``, its
Hoeffding variance, the saturation test of ``H0: C = 0``) are in
:mod:`~fused_stats.accumulators.cross_estimators`; several accumulators fed at once (a probe's
points) share batched calls (:mod:`~fused_stats.accumulators.cross_stacked`).

* Streams of one sample per batch (long-context probes) have no within-batch pairs, so a batch
  holding exactly one sample is also paired with the previous such batch: ``k = <c_prev, c_now>``
  of two independent samples adds ``2k²`` to the ``Σ k²`` sum (both orders) and 2 to its count —
  another unbiased term of ``E[k_ij²]``. The previous single sample's ``c`` (d × r) is the only
  state this needs (``carry``; saved, not summed in merges or all-reduce).

Scale-out. Every state entry is a plain sum over samples or over within-batch tuples —
``n``, ``batches``, ``Σ c_i``, ``Σ |c_i|_F²``, the three tuple sums ``u`` and their counts ``p`` — and
none is taken about a centre, so two accumulators of the same block merge by adding them and a
``torch.distributed`` all-reduce is a plain SUM of each (the state is declared in
:attr:`CrossStats.FIELDS`; merge, all-reduce and save/load derive from it,
:mod:`fused_stats.accumulators.base`); the U-statistic and its
variance estimate of the merged state are those of one stream fed every batch (the tuple sums stay
within batches, exactly as one stream would have formed them). "Same block" means equal ``dim``,
``rank``, ``in_dim``, ``activation``, ``w_in`` (dtype and every value) and, once both hold samples,
the same ``unit``; anything else is refused with the differences named. Saved files are
safetensors, versioned, with a SHA-256 over tensors and metadata, written atomically.

The plug-in ``|C̄|_F²`` (``C̄ = Σ c_i / n``, biased upwards by ``tr Σ_c / n``) and ``C̄`` itself are
exposed by :meth:`CrossStats.estimate` for comparison with other tools.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from .. import ops
from ..backend import Backend
from ..contracts import ACTIVATIONS, tuple_counts
from ..errors import FusedStatsError
from .base import (
    NONFINITE_POLICIES,
    Accumulator,
    Field,
    IncompatibleStates,
    Nonfinite,
    Prepared,
)
from .cross_estimators import (  # noqa: F401  (re-exported)
    UNADJUSTED_TEST,
    CrossEstimate,
    Saturation,
    normal_sf,
    null_tail,
    saturation_test,
    unbiased_frob2,
)
from .cross_stacked import StackedCrossUpdates

F64 = torch.float64
CrossUnit = Literal["sample", "position"]
UNITS: tuple[str, ...] = ("sample", "position")


def _block(acc, c) -> tuple:
    return (acc.dim, acc.rank)


class CrossStats(StackedCrossUpdates, Accumulator):
    """Streaming ``|C|_F²`` for a zero-output block with input projection ``w_in`` (r × d_in).

    Parameters
    ----------
    dim : int
        Size of the gradient ``q_t`` (the residual stream).
    w_in : torch.Tensor or None
        (rank, d_in) projection; the block's features are ``φ(w_in z_t)``. ``None``: features
        given (``rank`` of them, the caller's ``x_t`` used as is, activation ``identity``): no
        projection is stored, which for a feature source of width ``r`` saves the ``r × r``
        identity that ``w_in = I_r`` would hold, with the same sums (``I x = x`` exactly).
    rank : int, optional
        With ``w_in=None`` only: the number of features.
    activation : str
        One of ``gelu, relu, silu, tanh, identity, constant`` (``constant``: φ ≡ 1, a bias).
    device, backend, name, group_size
        Where the state lives, the ops backend, the name used in messages, the tuple-sum group.
    nonfinite : {"raise", "skip"}
        A batch with non-finite sums raises, or is skipped and counted in ``skipped_batches``.
    """

    KIND = "cross"
    FORMAT = "fused_stats.CrossStats"
    VERSION = 1
    FIELDS = (
        # absent in features-given mode (w_in None)
        Field("w_in", lambda acc, c: (acc.rank, acc.in_dim), "same", dtype=None, optional=True),
        Field("c_sum", _block, "sum"),
        Field("sq_norm_sum", lambda acc, c: (), "sum"),
        Field("u", lambda acc, c: (3,), "sum"),  # Σ k², Σ k k', Σ k k''
        # c of the last batch if it held exactly one sample: paired with the next such batch
        Field("carry", _block, "local", optional=True),
    )
    COUNTERS: ClassVar[dict[str, str]] = {
        "n": "sum",
        "batches": "sum",
        "p": "sum_list",
        "unit": "label",
        "skipped_batches": "sum",
    }
    COUNTER_DEFAULTS: ClassVar[dict] = {"skipped_batches": 0}

    def __init__(
        self,
        dim: int,
        w_in: torch.Tensor,
        activation: str = "gelu",
        device=None,
        backend: Backend = "auto",
        name: str | None = None,
        group_size: int = 256,
        nonfinite: Nonfinite = "raise",
        rank: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if activation not in ACTIVATIONS:
            raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if w_in is None:
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or activation != "identity":
                raise FusedStatsError(
                    f"w_in=None (features given) needs rank=, a positive int, and activation 'identity'; "
                    f"got rank={rank!r}, activation={activation!r}"
                )
        elif rank is not None:
            raise FusedStatsError("rank= is for w_in=None only; with a w_in the rank is its row count")
        elif w_in.dim() != 2:
            raise FusedStatsError(f"w_in must be (rank, d_in), got shape {tuple(w_in.shape)}")
        if nonfinite not in NONFINITE_POLICIES:
            raise FusedStatsError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.dim = dim
        self.rank, self.in_dim = (rank, rank) if w_in is None else tuple(w_in.shape)
        self.activation = activation
        self.backend = backend
        self.name = name
        self.group_size = group_size
        self.nonfinite = nonfinite
        default = torch.device("cpu") if w_in is None else w_in.device
        self.device = torch.device(device) if device is not None else default
        self.w_in = None if w_in is None else w_in.detach().to(self.device)
        self._dtype = dtype if w_in is None else w_in.dtype
        self.n = 0
        self.batches = 0
        self.skipped_batches = 0
        self.c_sum = torch.zeros(dim, self.rank, dtype=F64, device=self.device)
        self.sq_norm_sum = torch.zeros((), dtype=F64, device=self.device)
        self.u = torch.zeros(3, dtype=F64, device=self.device)
        self.p = [0, 0, 0]
        self.unit: str | None = None  # set by the first batch with samples
        self.carry: torch.Tensor | None = None

    def prepare(
        self,
        grad: torch.Tensor,
        act: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        unit: CrossUnit = "sample",
        *,
        features: torch.Tensor | None = None,
    ) -> Prepared:
        """Check one batch and compute its sums WITHOUT changing the state; :meth:`commit` adds
        them. Callers that must update several accumulators all-or-nothing (the probe) prepare
        every one before committing any. ``features``: instead of ``act``, the block's features
        of it from :meth:`features` (same ``mask``): the same batch, bit for bit.

        Raises :class:`FusedStatsError` for bad shapes, devices, masks or units; a batch with
        non-finite sums comes back with ``finite=False`` (``commit`` applies ``nonfinite``)."""
        if (act is None) == (features is None):
            raise FusedStatsError(
                f"cross gradient{self._where()}: give exactly one of the activation and features="
            )
        if features is None and self.w_in is None:  # features given at construction: act holds them
            features = act
        if features is not None:
            return self._prepare_features(grad, features, mask, unit)
        grad, act = self._checked(grad, act, mask, unit)
        batch = ops.cross_reduce(
            grad, act, mask, self.w_in, self.activation, unit, self.group_size, self.backend
        )
        finite = not batch.n or self._finite(batch)
        return Prepared(unit=unit, base_n=self.n, batch=batch, finite=finite)

    def features(self, act: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's features ``φ(W_in z_t)`` (B, T, rank) of ``act`` (B, T, d_in), zero where
        ``mask`` (B, T) is 0, for ``prepare(features=)``: a caller that keeps these instead of
        ``act`` (r numbers a position instead of d_in) prepares the same batch, bit for bit."""
        if act.dim() == 2:
            act = act.unsqueeze(1)
        if act.dim() != 3 or act.shape[-1] != self.in_dim:
            raise FusedStatsError(
                f"cross gradient{self._where()}: activation has shape {tuple(act.shape)}, "
                f"expected (B, T, {self.in_dim})"
            )
        if act.device != self.device:
            raise FusedStatsError(
                f"cross gradient{self._where()}: activation on {act.device}, state on {self.device}"
            )
        if mask is not None and tuple(mask.shape) != tuple(act.shape[:2]):
            raise FusedStatsError(
                f"cross gradient{self._where()}: mask has shape {tuple(mask.shape)}, expected "
                f"{tuple(act.shape[:2])}"
            )
        if self.w_in is None:
            # where, not a product: a NaN at an uncounted position must not survive (NaN·0)
            if mask is None:
                return act
            keep = (mask != 0).unsqueeze(-1)
            return torch.where(keep, act, torch.zeros((), dtype=act.dtype, device=act.device))
        return ops.cross_features(act, mask, self.w_in, self.activation, self.backend)

    def _prepare_features(self, grad, phi, mask, unit) -> Prepared:
        """:meth:`prepare` from the features ``phi`` of :meth:`features`."""
        if not isinstance(phi, torch.Tensor):
            raise FusedStatsError(
                f"cross gradient{self._where()}: features must be a tensor, got {type(phi).__name__}"
            )
        if phi.dim() == 2:
            phi = phi.unsqueeze(1)
        grad, _ = self._checked(grad, None, mask, unit)
        if tuple(phi.shape) != (*grad.shape[:2], self.rank) or phi.device != self.device:
            raise FusedStatsError(
                f"cross gradient{self._where()}: features of shape {tuple(phi.shape)} on "
                f"{phi.device}, expected ({grad.shape[0]}, {grad.shape[1]}, {self.rank}) on {self.device}"
            )
        batch = ops.cross_reduce_features(grad, phi, mask, unit, self.group_size, self.backend)
        finite = not batch.n or self._finite(batch)
        return Prepared(unit=unit, base_n=self.n, batch=batch, finite=finite)

    def _checked(self, grad, act, mask, unit):
        """The checks of :meth:`prepare`; returns ``grad`` and ``act`` viewed as (B, T, ·)
        (``act`` None: :meth:`_prepare_features`, which checks its features itself)."""
        w = self._where()
        if unit not in UNITS:
            raise FusedStatsError(f"cross gradient{w}: unit must be one of {UNITS}, got {unit!r}")
        if self.unit is not None and unit != self.unit:
            raise FusedStatsError(
                f"cross gradient{w}: batch with unit={unit!r}, but the state holds unit={self.unit!r} samples"
            )
        if not isinstance(grad, torch.Tensor) or not isinstance(act, (torch.Tensor, type(None))):
            raise FusedStatsError(
                f"cross gradient{w}: grad and activation must be tensors, got "
                f"{type(grad).__name__} and {type(act).__name__}"
            )
        if grad.dim() == 2:
            grad = grad.unsqueeze(1)
        if act is not None and act.dim() == 2:
            act = act.unsqueeze(1)
        if grad.dim() != 3 or grad.shape[-1] != self.dim:
            raise FusedStatsError(
                f"cross gradient{w}: grad has shape {tuple(grad.shape)}, expected (B, T, {self.dim})"
            )
        if act is not None and (act.shape[:2] != grad.shape[:2] or act.shape[-1] != self.in_dim):
            raise FusedStatsError(
                f"cross gradient{w}: activation has shape {tuple(act.shape)}, expected "
                f"({grad.shape[0]}, {grad.shape[1]}, {self.in_dim}) to match grad {tuple(grad.shape)}"
            )
        if grad.device != self.device or (act is not None and act.device != self.device):
            raise FusedStatsError(
                f"cross gradient{w}: tensors on {grad.device}/{act.device}, state on {self.device}"
            )
        if mask is not None and tuple(mask.shape) != tuple(grad.shape[:2]):
            raise FusedStatsError(
                f"cross gradient{w}: mask has shape {tuple(mask.shape)}, expected {tuple(grad.shape[:2])}"
            )
        return grad, act

    @staticmethod
    def _finite(batch) -> bool:
        """Whether every sum of a batch is finite (also the tuple sums, which square
        ``<c_i, c_j>`` and overflow first)."""
        sums = torch.cat(
            [torch.stack([batch.sq_norm_sum, batch.u2, batch.u3, batch.u4]), batch.c_sum.reshape(-1)]
        )
        return bool(torch.isfinite(sums).all())  # one check, one host sync

    def commit(self, prepared) -> None:
        """Add a batch from :meth:`prepare` to the state. A bare ops-layer ``CrossBatch`` is
        taken as a finite ``unit="sample"`` batch (for callers that form the sums themselves)."""
        if not isinstance(prepared, Prepared):
            prepared = Prepared(unit="sample", base_n=self.n, batch=prepared)
        if not self._admits(
            prepared,
            "non-finite gradient or activation{where} (cross-gradient sums of a batch of {n} "
            "samples); nothing was accumulated",
        ):
            return
        batch, unit = prepared.batch, prepared.unit
        self.n += batch.n
        self.batches += 1
        self.unit = unit
        self.c_sum += batch.c_sum
        self.sq_norm_sum += batch.sq_norm_sum
        self.u += batch.u if batch.u is not None else torch.stack([batch.u2, batch.u3, batch.u4])
        self.p = [self.p[0] + batch.p2, self.p[1] + batch.p3, self.p[2] + batch.p4]
        if batch.n == 1:  # pair consecutive single-sample batches (module docstring)
            if self.carry is not None:
                k = (self.carry * batch.c_sum).sum()
                self.u[0] += 2 * k * k
                self.p[0] += 2
            self.carry = batch.c_sum.clone()
        else:
            self.carry = None

    def update(
        self,
        grad: torch.Tensor,
        act: torch.Tensor,
        mask: torch.Tensor | None = None,
        unit: CrossUnit = "sample",
    ) -> None:
        """``grad`` and ``act``: (B, T, d) and (B, T, d_in) (or (B, d)/(B, d_in)); ``mask`` (B, T).

        A rejected batch (:class:`FusedStatsError`) leaves the state unchanged."""
        self.commit(self.prepare(grad, act, mask, unit))

    # ------------------------------------------------------------------ protocol hooks
    def _differences(self, other) -> list[str]:
        if not isinstance(other, CrossStats):
            return [f"other is a {type(other).__name__}, not a CrossStats"]
        out = [
            f"{attr} {getattr(self, attr)!r} vs {getattr(other, attr)!r}"
            for attr in ("dim", "rank", "in_dim", "activation")
            if getattr(self, attr) != getattr(other, attr)
        ]
        if (self.w_in is None) != (other.w_in is None):
            out.append(
                "w_in "
                + " vs ".join(
                    "features given" if w is None else "projection" for w in (self.w_in, other.w_in)
                )
            )
        elif self.w_in is None:
            pass
        elif self.w_in.dtype != other.w_in.dtype:
            out.append(f"w_in dtype {self.w_in.dtype} vs {other.w_in.dtype}")
        elif self.w_in.shape == other.w_in.shape and not torch.equal(self.w_in.cpu(), other.w_in.cpu()):
            gap = float((self.w_in.cpu().double() - other.w_in.cpu().double()).abs().max())
            out.append(f"w_in values (max |difference| {gap:.3g})")
        if self.unit is not None and other.unit is not None and self.unit != other.unit:
            out.append(f"unit {self.unit!r} vs {other.unit!r}")
        if self.device != other.device:
            out.append(f"device {self.device} vs {other.device}")
        return out

    def check_compatible(self, other) -> None:
        """Raise :class:`~fused_stats.accumulators.base.IncompatibleStates` naming every
        difference (dim, rank, in_dim, activation, w_in, unit, device) when the two are not
        statistics of the same block."""
        diffs = self._differences(other)
        if diffs:
            theirs = other._where() if isinstance(other, CrossStats) else ""
            raise IncompatibleStates(
                f"cannot merge cross statistics{theirs} into those{self._where()} of a different "
                "block or unit; they differ in " + "; ".join(diffs),
                diffs,
            )

    def describe(self) -> dict:
        return {"rank": self.rank, "activation": self.activation, "unit": self.unit}

    def block_digest(self) -> int:
        from .distributed import names_digest, tensor_digest

        w = "features given" if self.w_in is None else str(tensor_digest(self.w_in))
        return names_digest([self.activation, w])

    def factory_dtype(self) -> torch.dtype:
        return self._dtype

    def config(self) -> dict:
        out = {
            "dim": self.dim,
            "rank": self.rank,
            "in_dim": self.in_dim,
            "activation": self.activation,
            "group_size": self.group_size,
            "name": self.name,
            "nonfinite": self.nonfinite,
        }
        if self.w_in is None:  # only then: files with a w_in keep the config they had
            out["features_given"] = True
            out["feature_dtype"] = str(self._dtype).removeprefix("torch.")
        return out

    @classmethod
    def from_config(cls, config, tensors, device=None, backend="auto") -> CrossStats:
        dim, rank, in_dim = int(config["dim"]), int(config["rank"]), int(config["in_dim"])
        activation, group_size = config["activation"], int(config["group_size"])
        w_in = tensors.get("w_in")
        if config.get("features_given"):
            if w_in is not None or in_dim != rank or min(dim, rank, group_size) < 1:
                raise FusedStatsError(
                    f"features-given cross state with dim={dim}, rank={rank}, in_dim={in_dim} "
                    f"{'holds a w_in' if w_in is not None else ''}: inconsistent"
                )
            dtype = getattr(torch, str(config.get("feature_dtype", "float32")), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise FusedStatsError(f"feature_dtype {config.get('feature_dtype')!r} is not a float dtype")
            return cls(
                dim,
                None,
                activation,
                device,
                backend,
                config["name"],
                group_size,
                config.get("nonfinite", "raise"),
                rank=rank,
                dtype=dtype,
            )
        if min(dim, rank, in_dim, group_size) < 1 or activation not in ACTIVATIONS:
            raise FusedStatsError(
                f"dim={dim}, rank={rank}, in_dim={in_dim}, activation={activation!r}, "
                f"group_size={group_size} do not describe a block"
            )
        if (
            not isinstance(w_in, torch.Tensor)
            or tuple(w_in.shape) != (rank, in_dim)
            or not w_in.is_floating_point()
        ):
            shape = None if w_in is None else (tuple(w_in.shape), w_in.dtype)
            raise FusedStatsError(
                f"w_in is {shape}, expected ({rank}, {in_dim}) floating point for dim={dim}, rank={rank}"
            )
        return cls(
            dim,
            w_in,
            activation,
            device,
            backend,
            config["name"],
            group_size,
            config.get("nonfinite", "raise"),
        )

    @classmethod
    def _file_label(cls) -> str:
        return "cross state file"

    def _state_label(self, counters) -> str:
        return f"dim={self.dim}, rank={self.rank}, n={counters['n']}"

    def _check_counters(self, counters, where: str) -> None:
        n, batches, p, unit = counters["n"], counters["batches"], counters["p"], counters["unit"]
        bounds = tuple_counts(n)
        if (
            n < 0
            or not 0 <= batches <= max(n, 0)
            or len(p) != 3
            or any(not 0 <= v <= b for v, b in zip(p, bounds))
            or unit not in (None, *UNITS)
            or (n > 0) != (unit is not None)
            or (n > 0) != (batches > 0)
            or counters["skipped_batches"] < 0
        ):
            raise FusedStatsError(
                f"{where} is inconsistent: dim={self.dim}, rank={self.rank}, in_dim={self.in_dim}, "
                f"activation={self.activation!r}, n={n}, batches={batches}, p={p}, unit={unit!r}"
            )

    def settings_row(self) -> list[int]:
        from .distributed import tensor_digest

        return [
            self.dim,
            self.rank,
            self.in_dim,
            ACTIVATIONS.index(self.activation),
            -1 if self.unit is None else UNITS.index(self.unit),
            self.n,
            self.batches,
            *self.p,
            0 if self.w_in is None else tensor_digest(self.w_in),
            self.skipped_batches,
        ]

    def check_settings(self, table: torch.Tensor) -> None:
        where = self._where()
        diffs = []
        for col, what in ((0, "dim"), (1, "rank"), (2, "in_dim"), (3, "activation"), (10, "w_in")):
            values = table[:, col].tolist()
            if len(set(values)) > 1:
                if col == 3:
                    values = [ACTIVATIONS[v] for v in values]
                if col == 10:
                    # which ranks share a projection: group labels by first occurrence
                    first: dict = {}
                    values = [first.setdefault(v, len(first)) for v in values]
                    diffs.append(f"w_in (dtype or values; projection groups by rank {values})")
                else:
                    diffs.append(f"{what} {values} (by rank)")
        units = {int(u) for u, n in zip(table[:, 4], table[:, 5]) if n > 0}
        if len(units) > 1:
            diffs.append(f"unit {[None if u < 0 else UNITS[u] for u in table[:, 4].tolist()]} (by rank)")
        if diffs:
            raise IncompatibleStates(
                f"all_reduce of cross statistics{where}: ranks disagree on " + "; ".join(diffs), diffs
            )

    def _reduce_start(self, table: torch.Tensor, group, device):
        totals = table.sum(dim=0).tolist()
        units = [int(u) for u, n in zip(table[:, 4], table[:, 5]) if n > 0]
        counters = {
            "n": int(totals[5]),
            "batches": int(totals[6]),
            "p": [int(totals[7]), int(totals[8]), int(totals[9])],
            "unit": UNITS[units[0]] if units else None,
            "skipped_batches": int(totals[11]),
        }
        return self.state_dict(), counters

    # ------------------------------------------------------------------ results
    def cross_frob2(self) -> float:
        """Unbiased ``|C|_F²`` (:func:`~fused_stats.accumulators.cross_estimators.unbiased_frob2`)."""
        if self.n < 2:
            raise FusedStatsError(f"|C|_F^2{self._where()} needs at least 2 samples, have n={self.n}")
        return unbiased_frob2(self.c_sum, self.sq_norm_sum, self.n)

    def saturation(
        self, alpha: float = 0.05, ag_max: float | None = None, ag_mean: float | None = None
    ) -> Saturation:
        """The saturation test at level ``alpha`` (:mod:`~fused_stats.accumulators.cross_estimators`)."""
        if not 0 < alpha < 1:
            raise FusedStatsError(f"alpha must be in (0, 1), got {alpha}")
        value = self.cross_frob2()
        n = self.n
        if self.p[0] == 0:
            raise FusedStatsError(
                f"saturation test{self._where()} needs two independent samples in one batch or in "
                f"two consecutive single-sample batches (for the standard error); got "
                f"{self.batches} batches totalling n={n}"
            )
        return saturation_test(
            value, n, self.rank, self.u, self.p, self.sq_norm_sum, alpha, ag_max=ag_max, ag_mean=ag_mean
        )

    def estimate(self) -> CrossEstimate:
        """Unbiased ``|C|_F²`` with the plug-in ``|C̄|_F²`` and ``C̄`` (:class:`CrossEstimate`)."""
        value = self.cross_frob2()
        mean = (self.c_sum / self.n).detach().to("cpu")
        return CrossEstimate(
            n=self.n,
            dim=self.dim,
            rank=self.rank,
            cross_frob2=value,
            plugin_frob2=float(mean.square().sum()),
            mean_sq_norm=float(self.sq_norm_sum) / self.n,
            c_mean=mean,
        )

    def state_nbytes(self) -> int:
        return (self.c_sum.numel() + (0 if self.w_in is None else self.w_in.numel()) + 4) * 8

    def __repr__(self) -> str:
        return (
            f"CrossStats(dim={self.dim}, rank={self.rank}, activation={self.activation!r}, "
            f"n={self.n}, unit={self.unit!r}{self._where()})"
        )
