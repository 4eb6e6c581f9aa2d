"""GradMax directions for new units: :func:`gradmax_directions` and the probe source that feeds it.

GradMax (Evci et al. 2022, "GradMax: growing neural networks using gradient information",
section 3): new hidden units with input rows ``w_j`` (``|w_j| = 1``) and zero output columns,
added to a module ``y = f(u) + W_out σ(W_in u)`` whose output ``y`` receives the gradient ``q``,
get the output-column gradients ``E[Σ_t q_t σ(w_jᵀ u_t)]``, to first order in small ``w_j``
(``σ(0) = 0``) ``σ'(0) · C w_j`` with

    C = E[Σ_t q_t u_tᵀ]    (d_out, d_in): q at the module's OUTPUT, u its INPUT,

so the ``k`` orthonormal rows maximising ``Σ_j |C w_j|²`` are ``C``'s top ``k`` right singular
vectors. For ``mlp_width`` growth at candidate ``p`` the module is the MLP of the block that
follows ``p`` (``model.layers.{i+1}.mlp`` for ``p = model.layers.{i}``; ``model.layers.0.mlp`` for
the input boundary), ``u`` its normalised input and ``q`` the stream gradient after that block.
:class:`ModuleInputs` is the probe's feature source for exactly this ``C``:
``fs.Probe(model, points=[mlp], cross=ModuleInputs(d))`` measures ``Σ_t q_t u_tᵀ`` per sample.

The cross-gradient of an ``mlp_width`` growth probe (``fs.Probe(cross=GrowthProtocol(family=
"mlp_width"))``) is ``E[Σ_t q_t h_tᵀ]`` over the new units' *activations* ``h`` (d, width): the
gradient of the new output columns, not ``C``; its right singular vectors live in unit space, not
in the input space of the rows, and are refused here (as is every growth tangent), also when
``width == d`` gives it the shape of ``C``.

Gated MLPs (LLaMA's ``silu(W_gate u) ⊙ (W_up u)``, an adapter with two ``mlp_inputs``) are
refused, here for a probe of such an MLP and in :func:`~fused_stats.api.growth.blocks.new_units`
for ``init_directions``: a new unit is ``silu(g_jᵀu) (v_jᵀu) ≈ ½ (g_jᵀu)(v_jᵀu)`` for small rows
(``silu(0) = 0``, ``silu'(0) = ½``), so its output-column gradient has no first-order term in
either row, and the top singular vectors of ``C`` set as the gate rows (the up rows random) do
not maximise it.
"""

from __future__ import annotations

import torch

from ...accumulators import CrossStats
from ...errors import FusedStatsError
from ..probe.spec import CrossSpec
from .architecture import describe

GATED_REFUSAL = (
    "its MLP is gated (silu(gate u) * (up u)): with zero output columns the new units' gradient "
    "has no first-order term in their input rows, so GradMax's directions (top singular vectors "
    "of C, set as the gate rows) do not maximise it; grow with random rows (no init_directions)"
)


def gated_mlp_refusal(adapter, where: str) -> None:
    """Raise :class:`FusedStatsError` for GradMax directions on a gated MLP (module docstring)."""
    if adapter is not None and adapter.mlp_inputs is not None and len(adapter.mlp_inputs) == 2:
        raise FusedStatsError(
            f"GradMax directions at {where} (model_type {adapter.model_type!r}): {GATED_REFUSAL}"
        )


def _gated_adapter(model, point: str):
    """The model's adapter when the module at ``point`` is its gated MLP, else None."""
    try:
        adapter = describe(model).adapter
    except FusedStatsError:
        return None  # a model growth does not know: nothing says the module is gated
    inputs = adapter.mlp_inputs or ()
    module = model.get_submodule(point)
    names = [name.partition(".")[2] for name in inputs]
    return adapter if len(inputs) == 2 and all(hasattr(module, n) for n in names) else None


class ModuleInputs:
    """Feature source: at each probed module, its own first positional input ``u`` (width
    ``width``), so the probe's cross-gradient is ``Σ_t q_t u_tᵀ`` with ``q`` at the module's
    output: GradMax's ``C`` for new units of that module (module docstring)."""

    def __init__(self, width: int):
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise FusedStatsError(f"ModuleInputs width must be a positive int, got {width!r}")
        self.width = width

    def features(self, point, module, z, kwargs):
        raise FusedStatsError("ModuleInputs reads a module's input (input_features), not its output")

    def input_features(self, point: str, module, u: torch.Tensor) -> torch.Tensor:
        if u.dim() != 3 or u.shape[-1] != self.width:
            raise FusedStatsError(
                f"point {point!r}: ModuleInputs(width={self.width}) expects a (B, T, {self.width}) input, "
                f"{type(module).__name__} got {tuple(u.shape)}"
            )
        return u.detach()

    def feature_rank(self, point: str) -> int:
        return self.width

    def feature_w_in(self, point: str, dtype=torch.float32, device=None):
        return None  # the inputs enter as they are


def _matrix_from_probe(probe, point) -> torch.Tensor:
    if not isinstance(point, str) or point not in probe.points:
        raise FusedStatsError(
            f"gradmax_directions: {point!r} is not a point of the probe {list(probe.points)}"
        )
    cross = probe.cross
    if cross is None:
        raise FusedStatsError(
            "gradmax_directions: the probe measures no cross-gradient (built without cross=)"
        )
    stats = probe.cross_stats[point]
    if isinstance(cross, ModuleInputs):
        gated_mlp_refusal(_gated_adapter(probe.model, point), repr(point))
        if stats.n < 1:
            raise FusedStatsError(f"gradmax_directions: no samples at {point!r}")
        return stats.c_sum.to(torch.float64).cpu() / stats.n
    if isinstance(cross, CrossSpec):
        return _matrix_from_stats(stats)
    family = getattr(getattr(cross, "protocol", None), "family", None)
    space = (
        "the new units' activations h (d, width), the gradient of their output columns"
        if family == "mlp_width"
        else "the features of the block it would insert"
    )
    raise FusedStatsError(
        f"gradmax_directions: the probe's cross-gradient at {point!r} ({type(cross).__name__}"
        f"{f', family {family!r}' if family else ''}) is over {space}, not over the inputs new units "
        "read; probe the module that grows with cross=ModuleInputs(d) (fused_stats.api.growth.gradmax)"
    )


def _matrix_from_stats(source: CrossStats) -> torch.Tensor:
    if source.w_in is None:
        raise FusedStatsError(
            "gradmax_directions: a CrossStats with features given (no w_in) does not say which space its "
            "features are in (a growth tangent's are the new block's own features); pass the Probe, "
            "whose source says it, or C itself"
        )
    if source.activation != "identity":
        raise FusedStatsError(
            f"gradmax_directions needs a CrossStats with activation 'identity', got {source.activation!r}"
        )
    if source.n < 1:
        raise FusedStatsError("gradmax_directions: the CrossStats has no samples")
    w_in = source.w_in.to(torch.float64).cpu()
    if source.rank < source.in_dim or torch.linalg.matrix_rank(w_in) < source.in_dim:
        raise FusedStatsError(
            f"gradmax_directions: w_in of shape {tuple(w_in.shape)} does not have full column rank, "
            f"so C = E[q zᵀ] cannot be recovered from C W_inᵀ"
        )
    return (source.c_sum.to(torch.float64).cpu() / source.n) @ torch.linalg.pinv(w_in.T)


def gradmax_directions(source, point: str | None, k: int) -> torch.Tensor:
    """The ``k`` input directions that maximise the first gradient of zero-output new units.

    ``source`` gives ``C = E[Σ_t q_t u_tᵀ]`` (module docstring):

    * a :class:`~fused_stats.Probe` and one of its ``point`` names, with ``cross=ModuleInputs(d)``
      (``u`` = that module's input, ``q`` at its output: GradMax's ``C`` for new units of that
      module, e.g. ``model.layers.1.mlp`` for ``mlp_width`` growth at ``model.layers.0``) or with
      ``cross=fs.CrossSpec(activation="identity")`` and a full-column-rank ``w_in`` (``u`` and
      ``q`` both at the point's output: the stream, ``C = (Σ c_i / n)(W_inᵀ)⁺``); the train stream;
    * a :class:`~fused_stats.CrossStats` of the latter kind (``point`` unused);
    * ``C`` itself, a (d_out, d_in) tensor (``point`` unused).

    Refused: a growth protocol's tangent probe (any family: its cross-gradient is over the new
    block's own features), a features-given CrossStats (its space is unknown), a non-identity
    activation, a ``w_in`` without full column rank, non-finite ``C``, ``k`` outside
    ``1..min(C.shape)``. Returns (k, d_in) fp64 orthonormal rows, each row's largest entry
    positive (a fixed sign). Pass it to :func:`fused_stats.grow` as ``init_directions``.
    """
    from ..probe.driver import Probe

    if isinstance(source, Probe):
        matrix = _matrix_from_probe(source, point)
    elif isinstance(source, CrossStats):
        matrix = _matrix_from_stats(source)
    elif isinstance(source, torch.Tensor) and source.dim() == 2:
        matrix = source.detach().to(torch.float64).cpu()
    else:
        shape = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
        raise FusedStatsError(
            f"gradmax_directions needs a Probe, a CrossStats or a (d_out, d_in) tensor, got {shape}"
        )
    if not torch.isfinite(matrix).all():
        raise FusedStatsError("gradmax_directions: the cross-gradient has non-finite entries")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= min(matrix.shape):
        raise FusedStatsError(f"gradmax_directions: k must be an int in 1..{min(matrix.shape)}, got {k!r}")
    _, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    rows = vh[:k]
    sign = torch.sign(rows.gather(1, rows.abs().argmax(dim=1, keepdim=True)))
    return rows * sign


__all__ = ["ModuleInputs", "gradmax_directions"]
