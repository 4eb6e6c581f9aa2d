"""Streaming cross-gradient statistics and the depth-saturation test (depth paper, DESIGN section 2).

For a zero-output block ``h(z) = W_out φ(W_in z)`` at a point, ``c_i = Σ_{t∈i} q_t φ(W_in z_t)ᵀ``
and ``C = E[c_i]``. The state is ``n``, ``Σ c_i`` (d × r, fp64), ``Σ |c_i|_F²`` and, from pairs of
samples inside each batch, sums of ``k_ij²``, ``k_ij k_jk``, ``k_ij k_kl`` over distinct tuples
(``k_ij = <c_i, c_j>``) with their counts. Estimates:

* ``|C|_F² = (|Σ c_i|_F² − Σ |c_i|_F²) / (n(n−1))`` — the U-statistic with kernel ``<c_i, c_j>``,
  exactly unbiased (DESIGN section 2).
* Its variance (Hoeffding): ``Var = (4(n−2) ζ1 + 2 ζ2) / (n(n−1))`` with ``ζ1 = Cᵀ Σ_c C =
  E[k_ij k_jk] − |C|⁴`` and ``ζ2 = Var(k_ij) = E[k_ij²] − |C|⁴``; the three expectations are
  estimated without bias by the within-batch tuple averages (``|C|⁴`` by ``E[k_ij k_kl]``).
* Saturation test of ``H0: C = 0``: under H0, ``ζ1 = 0`` and ``Var = 2 E[k_ij²]/(n(n−1))``.
  The statistic is a degenerate U-statistic: ``(n−1)·|C|²_hat ≈ |Z|² − tr Σ_c`` with
  ``Z ~ N(0, Σ_c)``, a weighted sum of centred chi-squares, which is skewed when ``Σ_c`` has few
  dominant eigenvalues. Its upper tail is taken from the moment-matched ``a·χ²_ν``
  (Satterthwaite: ``a = tr Σ_c² / tr Σ_c``, ``ν = (tr Σ_c)² / tr Σ_c²``, with ``tr Σ_c = E|c|²``
  and ``tr Σ_c² = E[k_ij²]`` under H0) and the Wilson–Hilferty cube-root normal approximation of
  the chi-square tail. ``saturated`` means H0 was not rejected at level ``alpha``; ``z`` is the
  equivalent standard-normal score.
* Streams of one sample per batch (long-context probes) have no within-batch pairs, so a batch
  holding exactly one sample is also paired with the previous such batch: ``k = <c_prev, c_now>``
  of two independent samples adds ``2k²`` to the ``Σ k²`` sum (both orders) and 2 to its count —
  another unbiased term of ``E[k_ij²]``. The previous single sample's ``c`` (d × r) is the only
  state this needs (``carry``; saved, not summed in merges or all-reduce).

Scale-out (issue 5). Every state entry is a plain sum over samples or over within-batch tuples —
``n``, ``batches``, ``Σ c_i``, ``Σ |c_i|_F²``, the three tuple sums ``u`` and their counts ``p`` — and
none is taken about a centre, so two accumulators of the same block merge by adding them and a
``torch.distributed`` all-reduce is a plain SUM of each
(:func:`fused_stats.accumulators.distributed.all_reduce_cross_stats`); the U-statistic and its
variance estimate of the merged state are those of one stream fed every batch (the tuple sums stay
within batches, exactly as one stream would have formed them). "Same block" means equal ``dim``,
``rank``, ``in_dim``, ``activation``, ``w_in`` (dtype and every value) and, once both hold samples,
the same ``unit``; anything else is refused with the differences named. :meth:`CrossStats.save` /
:meth:`CrossStats.load` use the shared safetensors helpers of
:mod:`fused_stats.accumulators.persistence` (versioned, SHA-256 over tensors and metadata, atomic).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from .. import ops
from ..errors import FusedStatsError

F64 = torch.float64
UNITS = ("sample", "position")
FORMAT = "fused_stats.CrossStats"
VERSION = 1
TENSOR_KEYS = ("w_in", "c_sum", "sq_norm_sum", "u")


@dataclass(frozen=True)
class Saturation:
    """Depth-saturation summary at one point."""

    n: int
    rank: int
    cross_frob2: float  # unbiased |C|_F^2
    cross_frob2_se: float  # standard error (full Hoeffding variance, plug-in)
    cross_frob2_se_null: float  # standard error under H0: C = 0
    z: float
    p_value: float
    alpha: float
    saturated: bool
    ag_max: float
    ag_mean: float

    @property
    def cross_frob(self) -> float:
        """``|C|_F`` from the unbiased square (0 when the estimate is negative)."""
        return math.sqrt(max(self.cross_frob2, 0.0))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["cross_frob"] = self.cross_frob
        return out


def normal_sf(z: float) -> float:
    """Upper tail of the standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def null_tail(value: float, n: int, tr1: float, tr2: float) -> tuple[float, float]:
    """``(z, p)``: upper-tail p-value of ``|C|²_hat = value`` under H0 (module docstring)."""
    if tr2 <= 0 or tr1 <= 0:
        return (math.inf, 0.0) if value > 0 else (0.0, 1.0)
    scale, dof = tr2 / tr1, tr1 * tr1 / tr2
    x = max(((n - 1) * value + tr1) / scale, 0.0)
    # Wilson–Hilferty: (χ²_ν/ν)^(1/3) ≈ N(1 − 2/(9ν), 2/(9ν))
    z = ((x / dof) ** (1.0 / 3.0) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return z, normal_sf(z)


class CrossStats:
    """Streaming ``|C|_F²`` for a zero-output block with input projection ``w_in`` (r × d_in).

    Parameters
    ----------
    dim : int
        Size of the gradient ``q_t`` (the residual stream).
    w_in : torch.Tensor
        (rank, d_in) projection; the block's features are ``φ(w_in z_t)``.
    activation : str
        One of ``gelu, relu, silu, tanh, identity, constant`` (``constant``: φ ≡ 1, a bias).
    """

    def __init__(self, dim: int, w_in: torch.Tensor, activation: str = "gelu", device=None,
                 backend: str = "auto", name: str | None = None, group_size: int = 256):
        from ..contracts import ACTIVATIONS

        if activation not in ACTIVATIONS:
            raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if w_in.dim() != 2:
            raise FusedStatsError(f"w_in must be (rank, d_in), got shape {tuple(w_in.shape)}")
        self.dim = dim
        self.rank, self.in_dim = w_in.shape
        self.activation = activation
        self.backend = backend
        self.name = name
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else w_in.device
        self.w_in = w_in.detach().to(self.device)
        self.n = 0
        self.batches = 0
        self.c_sum = torch.zeros(dim, self.rank, dtype=F64, device=self.device)
        self.sq_norm_sum = torch.zeros((), dtype=F64, device=self.device)
        self.u = torch.zeros(3, dtype=F64, device=self.device)  # Σ k², Σ k k', Σ k k''
        self.p = [0, 0, 0]
        self.unit: str | None = None  # set by the first batch with samples
        self.carry: torch.Tensor | None = None  # c of the last batch if it held exactly one sample

    def _where(self) -> str:
        return f" at point {self.name!r}" if self.name else ""

    def prepare(self, grad: torch.Tensor, act: torch.Tensor, mask: torch.Tensor | None = None,
                unit: str = "sample", allow_nonfinite: bool = False):
        """Check one batch and compute its sums (a :class:`~fused_stats.ops.CrossBatch`) WITHOUT
        changing the state; :meth:`commit` adds them. Callers that must update several
        accumulators all-or-nothing (the probe) prepare every one before committing any.

        Raises :class:`FusedStatsError` for bad shapes, devices, masks or units and, unless
        ``allow_nonfinite``, for non-finite sums (check :meth:`is_finite` yourself then)."""
        w = self._where()
        if unit not in UNITS:
            raise FusedStatsError(f"cross gradient{w}: unit must be one of {UNITS}, got {unit!r}")
        if self.unit is not None and unit != self.unit:
            raise FusedStatsError(
                f"cross gradient{w}: batch with unit={unit!r}, but the state holds unit={self.unit!r} "
                "samples")
        if not isinstance(grad, torch.Tensor) or not isinstance(act, torch.Tensor):
            raise FusedStatsError(
                f"cross gradient{w}: grad and activation must be tensors, got "
                f"{type(grad).__name__} and {type(act).__name__}")
        if grad.dim() == 2:
            grad = grad.unsqueeze(1)
        if act.dim() == 2:
            act = act.unsqueeze(1)
        if grad.dim() != 3 or grad.shape[-1] != self.dim:
            raise FusedStatsError(
                f"cross gradient{w}: grad has shape {tuple(grad.shape)}, expected (B, T, {self.dim})")
        if act.shape[:2] != grad.shape[:2] or act.shape[-1] != self.in_dim:
            raise FusedStatsError(
                f"cross gradient{w}: activation has shape {tuple(act.shape)}, expected "
                f"({grad.shape[0]}, {grad.shape[1]}, {self.in_dim}) to match grad {tuple(grad.shape)}")
        if grad.device != self.device or act.device != self.device:
            raise FusedStatsError(
                f"cross gradient{w}: tensors on {grad.device}/{act.device}, state on {self.device}")
        if mask is not None and tuple(mask.shape) != tuple(grad.shape[:2]):
            raise FusedStatsError(
                f"cross gradient{w}: mask has shape {tuple(mask.shape)}, expected {tuple(grad.shape[:2])}")
        batch = ops.cross_reduce(grad, act, mask, self.w_in, self.activation, unit,
                                 self.group_size, self.backend)
        if batch.n and not allow_nonfinite and not self.is_finite(batch):
            raise FusedStatsError(
                f"non-finite gradient or activation{w} (grad shape {tuple(grad.shape)}, dtype "
                f"{grad.dtype}); nothing was accumulated")
        return batch

    @staticmethod
    def is_finite(batch) -> bool:
        """Whether every sum of a prepared batch is finite (also the tuple sums, which square
        ``<c_i, c_j>`` and overflow first)."""
        scalars = torch.stack([batch.sq_norm_sum, batch.u2, batch.u3, batch.u4])
        return bool(torch.isfinite(scalars).all()) and bool(torch.isfinite(batch.c_sum).all())

    def commit(self, batch, unit: str = "sample") -> None:
        """Add a batch from :meth:`prepare` (same ``unit``) to the state."""
        if batch.n == 0:
            return
        self.n += batch.n
        self.batches += 1
        self.unit = unit
        self.c_sum += batch.c_sum
        self.sq_norm_sum += batch.sq_norm_sum
        self.u += torch.stack([batch.u2, batch.u3, batch.u4])
        self.p = [self.p[0] + batch.p2, self.p[1] + batch.p3, self.p[2] + batch.p4]
        if batch.n == 1:  # pair consecutive single-sample batches (module docstring)
            if self.carry is not None:
                k = (self.carry * batch.c_sum).sum()
                self.u[0] += 2 * k * k
                self.p[0] += 2
            self.carry = batch.c_sum.clone()
        else:
            self.carry = None

    def update(self, grad: torch.Tensor, act: torch.Tensor, mask: torch.Tensor | None = None,
               unit: str = "sample") -> None:
        """``grad`` and ``act``: (B, T, d) and (B, T, d_in) (or (B, d)/(B, d_in)); ``mask`` (B, T).

        A rejected batch (:class:`FusedStatsError`) leaves the state unchanged."""
        self.commit(self.prepare(grad, act, mask, unit), unit)

    # ------------------------------------------------------------------ merging
    def differences(self, other: "CrossStats") -> list[str]:
        """What keeps ``other`` from being merged into this accumulator (empty: compatible)."""
        if not isinstance(other, CrossStats):
            return [f"other is a {type(other).__name__}, not a CrossStats"]
        out = [f"{attr} {getattr(self, attr)!r} vs {getattr(other, attr)!r}"
               for attr in ("dim", "rank", "in_dim", "activation")
               if getattr(self, attr) != getattr(other, attr)]
        if self.w_in.dtype != other.w_in.dtype:
            out.append(f"w_in dtype {self.w_in.dtype} vs {other.w_in.dtype}")
        elif self.w_in.shape == other.w_in.shape and not torch.equal(
                self.w_in.cpu(), other.w_in.cpu()):
            gap = float((self.w_in.cpu().double() - other.w_in.cpu().double()).abs().max())
            out.append(f"w_in values (max |difference| {gap:.3g})")
        if self.unit is not None and other.unit is not None and self.unit != other.unit:
            out.append(f"unit {self.unit!r} vs {other.unit!r}")
        if self.device != other.device:
            out.append(f"device {self.device} vs {other.device}")
        return out

    def merge(self, other: "CrossStats") -> "CrossStats":
        """Add ``other``'s samples (a plain sum of every state entry; ``other`` is unchanged).

        Raises :class:`FusedStatsError` naming every difference (dim, rank, in_dim, activation,
        w_in, unit, device) when the two are not statistics of the same block."""
        diffs = self.differences(other)
        if diffs:
            theirs = other._where() if isinstance(other, CrossStats) else ""
            raise FusedStatsError(
                f"cannot merge cross statistics{theirs} into those{self._where()} of a different "
                "block or unit; they differ in " + "; ".join(diffs))
        self.n += other.n
        self.batches += other.batches
        self.c_sum += other.c_sum
        self.sq_norm_sum += other.sq_norm_sum
        self.u += other.u
        self.p = [a + b for a, b in zip(self.p, other.p)]
        if other.unit is not None:
            self.unit = other.unit
        return self

    def _adopt(self, other: "CrossStats") -> None:
        """Take ``other``'s block and state (in place, so references to ``self`` stay valid)."""
        for key in ("dim", "rank", "in_dim", "activation", "group_size", "device", "w_in", "n",
                    "batches", "unit", "c_sum", "sq_norm_sum", "u", "p", "carry"):
            setattr(self, key, getattr(other, key))

    def copy(self) -> "CrossStats":
        out = CrossStats(self.dim, self.w_in.clone(), self.activation, self.device, self.backend,
                         self.name, self.group_size)
        out.n, out.batches, out.unit, out.p = self.n, self.batches, self.unit, list(self.p)
        out.c_sum, out.sq_norm_sum, out.u = self.c_sum.clone(), self.sq_norm_sum.clone(), self.u.clone()
        out.carry = None if self.carry is None else self.carry.clone()
        return out

    def all_reduce(self, group=None) -> "CrossStats":
        """Sum this accumulator over the ranks of ``group`` (a collective; see
        :func:`fused_stats.accumulators.distributed.all_reduce_cross_stats`)."""
        from .distributed import all_reduce_cross_stats

        all_reduce_cross_stats(self, group)
        return self

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        """Write the state atomically to ``path`` (safetensors, versioned, SHA-256 over the
        tensors and the metadata; the shared helpers of :mod:`.persistence`)."""
        from .persistence import save_checked

        tensors = {"w_in": self.w_in, "c_sum": self.c_sum, "sq_norm_sum": self.sq_norm_sum,
                   "u": self.u}
        if self.carry is not None:
            tensors["carry"] = self.carry
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = {
            "format": FORMAT, "version": str(VERSION),
            "config": json.dumps({"dim": self.dim, "rank": self.rank, "in_dim": self.in_dim,
                                  "activation": self.activation, "group_size": self.group_size,
                                  "name": self.name}),
            "state": json.dumps({"n": self.n, "batches": self.batches, "p": list(self.p),
                                 "unit": self.unit}),
        }
        save_checked(path, tensors, meta)

    @classmethod
    def load(cls, path, device=None, backend: str = "auto") -> "CrossStats":
        """Read a state written by :meth:`save` onto ``device`` (default CPU). The file's format,
        version, checksum, every tensor's shape/dtype and the counts are checked; loading never
        executes code."""
        from ..contracts import ACTIVATIONS
        from .persistence import read_checked

        tensors, meta = read_checked(path, FORMAT, VERSION)
        where = f"cross state file {str(path)!r}"
        try:
            config, state = json.loads(meta["config"]), json.loads(meta["state"])
            dim, rank, in_dim = int(config["dim"]), int(config["rank"]), int(config["in_dim"])
            activation, group_size, name = config["activation"], int(config["group_size"]), config["name"]
            n, batches, unit = int(state["n"]), int(state["batches"]), state["unit"]
            p = [int(v) for v in state["p"]]
        except (KeyError, ValueError, TypeError) as exc:
            raise FusedStatsError(f"{where} has unreadable or invalid metadata: {exc}") from exc
        if sorted(set(tensors) - {"carry"}) != sorted(TENSOR_KEYS):
            raise FusedStatsError(
                f"{where} holds tensors {sorted(tensors)}, expected {sorted(TENSOR_KEYS)} (and "
                "optionally 'carry')")
        shapes = {"w_in": (rank, in_dim), "c_sum": (dim, rank), "sq_norm_sum": (), "u": (3,)}
        if "carry" in tensors:
            shapes["carry"] = (dim, rank)
        for key, shape in shapes.items():
            value = tensors[key]
            wanted = value.is_floating_point() if key == "w_in" else value.dtype == F64
            if tuple(value.shape) != shape or not wanted:
                raise FusedStatsError(
                    f"{where} is inconsistent: {key} has shape {tuple(value.shape)} and dtype "
                    f"{value.dtype}, expected {shape} "
                    f"{'floating point' if key == 'w_in' else 'float64'} for dim={dim}, rank={rank}")
        bounds = (n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3))
        if (min(dim, rank, in_dim, group_size) < 1 or activation not in ACTIVATIONS or n < 0
                or not 0 <= batches <= max(n, 0) or len(p) != 3
                or any(not 0 <= v <= b for v, b in zip(p, bounds)) or unit not in (None,) + UNITS
                or (n > 0) != (unit is not None) or (n > 0) != (batches > 0)):
            raise FusedStatsError(
                f"{where} is inconsistent: dim={dim}, rank={rank}, in_dim={in_dim}, "
                f"activation={activation!r}, n={n}, batches={batches}, p={p}, unit={unit!r}")
        target = torch.device(device) if device is not None else torch.device("cpu")
        acc = cls(dim, tensors["w_in"], activation, target, backend, name, group_size)
        acc.n, acc.batches, acc.unit, acc.p = n, batches, unit, p
        acc.c_sum = tensors["c_sum"].to(target)
        acc.sq_norm_sum = tensors["sq_norm_sum"].to(target)
        acc.u = tensors["u"].to(target)
        acc.carry = tensors["carry"].to(target) if "carry" in tensors else None
        return acc

    def cross_frob2(self) -> float:
        """Unbiased ``|C|_F²`` (module docstring)."""
        if self.n < 2:
            raise FusedStatsError(f"|C|_F^2{self._where()} needs at least 2 samples, have n={self.n}")
        total = float((self.c_sum * self.c_sum).sum())
        return (total - float(self.sq_norm_sum)) / (self.n * (self.n - 1))

    def saturation(self, alpha: float = 0.05, ag_max: float = math.nan,
                   ag_mean: float = math.nan) -> Saturation:
        """The saturation test at level ``alpha`` (module docstring)."""
        if not 0 < alpha < 1:
            raise FusedStatsError(f"alpha must be in (0, 1), got {alpha}")
        value = self.cross_frob2()
        n = self.n
        if self.p[0] == 0:
            raise FusedStatsError(
                f"saturation test{self._where()} needs two independent samples in one batch or in "
                f"two consecutive single-sample batches (for the standard error); got "
                f"{self.batches} batches totalling n={n}")
        e2 = float(self.u[0]) / self.p[0]
        m4 = float(self.u[2]) / self.p[2] if self.p[2] else max(value, 0.0) ** 2
        e3 = float(self.u[1]) / self.p[1] if self.p[1] else m4
        zeta1, zeta2 = e3 - m4, e2 - m4
        var = (4 * (n - 2) * zeta1 + 2 * zeta2) / (n * (n - 1))
        se = math.sqrt(max(var, 0.0))
        se0 = math.sqrt(max(2 * e2 / (n * (n - 1)), 0.0))
        z, p = null_tail(value, n, tr1=float(self.sq_norm_sum) / n, tr2=e2)
        return Saturation(n=n, rank=self.rank, cross_frob2=value, cross_frob2_se=se,
                          cross_frob2_se_null=se0, z=z, p_value=p, alpha=alpha,
                          saturated=p > alpha, ag_max=ag_max, ag_mean=ag_mean)

    def state_nbytes(self) -> int:
        return (self.c_sum.numel() + self.w_in.numel() + 4) * 8

    def __repr__(self) -> str:
        return (f"CrossStats(dim={self.dim}, rank={self.rank}, activation={self.activation!r}, "
                f"n={self.n}, unit={self.unit!r}{self._where()})")
