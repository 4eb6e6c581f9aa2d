"""The growth protocol: what may be grown where, declared before any gradient is seen.

Role: a :class:`GrowthProtocol` fixes the finite set of insertion candidates (block boundaries:
growing at point ``p`` inserts the new block right after module ``p``), the residual family, the
function-preserving origin (which parameters start at zero), the seed of the non-zero parts and
the zero-state update rule. Its :meth:`~GrowthProtocol.to_dict` and :attr:`~GrowthProtocol.digest`
(SHA-256 of the canonical JSON) are recorded in reports, so a reader can check that the protocol
was fixed before the statistics were measured. The block probed at a candidate and the block
:func:`fused_stats.grow` inserts there are built by one function
(:func:`fused_stats.api.growth.blocks.new_block`) from the protocol, hence identical.

Families:

* ``"layer"``: one new block of the model's own class after ``p``; ``init="zero"`` sets the
  branch's last maps to zero (see :mod:`.architecture`), so the model's function is unchanged.
* ``"mlp_width"``: ``width`` new hidden units in the MLP of the block that *follows* ``p`` (for
  the input boundary, block 0): new input rows random, new output columns zero.
* ``"cross_block"``: the probe's own ``W_out φ(W_in z)`` block (:class:`~fused_stats.CrossSpec`,
  rank ``width`` or its default), ``W_out = 0``.

Zero-state update rule (hashed with the protocol): new parameters start with no optimizer state,
so their first step after growth is the first step of a fresh optimizer on them: for SGD the loss
changes by ``-η |∇_new L|²`` to first order (the depth paper's gain ``|C|_F²``); a zero gradient
there (saturation) gives no change for SGD and Adam alike. Widened parameters (``mlp_width``)
keep one scalar state per tensor, so their new slice shares Adam's step count, and its first
update (at count ``t``: the count kept at growth plus one) is ``(1-β₁)/(1-β₁ᵗ) · √((1-β₂ᵗ)/(1-β₂))`` times a zero-state start's (ε → 0)
(:data:`WIDTH_STATE_RULE`; the other families keep :data:`ZERO_STATE_RULE` and their digests).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from torch import nn

from ...errors import FusedStatsError
from .architecture import ADAPTERS, RESNET_BLOCKS, Architecture, boundary, describe

FAMILIES = ("layer", "mlp_width", "cross_block")
INITS = ("zero", "copy", "random")
# version 2: a candidate's block is seeded by its name (SEEDING_RULE); version 1 seeded it by its
# position in the candidate list, so its blocks were other weights
PROTOCOL_VERSION = 2
SEEDING_RULE = (
    "name-v2: the non-zero parts of the block at a candidate are drawn from a torch generator "
    "seeded by the first 8 bytes (little-endian, shifted right by 1: 63 bits) of the SHA-256 of "
    'the JSON text ["fused_stats.growth.block", seed, candidate name, growth events at that '
    "name already in the model's growth record] (compact, ASCII)"
)
# what fs.advise ranks by (docs/design.md 2.13): the unbiased |C|_F² (SGD's first-step gain), the
# signal fraction |C|_F²/E|c|², or zero-state Adam's first-step gain on the test stream
SCORES = ("cross_frob2", "signal_fraction", "adam_first_step", "split_adam")
DEFAULT_SCORE = "cross_frob2"
DEFAULT_ADAM_EPS = 1e-8  # torch.optim.Adam / AdamW's default

ZERO_STATE_RULE = (
    "new parameters, and the new slices of widened parameters, start with zero optimizer state "
    "(SGD: no momentum buffer; Adam/AdamW: zero first and second moments and their own step count "
    "from 0); old parameters keep their state bit for bit"
)

# A widened tensor has one scalar state (Adam's step count) for all its slices, so its new slice
# cannot have a step count of its own: the rule recorded for mlp_width says what happens instead
# (derivation: docs/design.md 2.12)
WIDTH_STATE_RULE = (
    "new parameters start with no optimizer state; a widened parameter keeps its slot in its "
    "param group and its state bit for bit in its old slice, its new slice gets zero state tensors "
    "(SGD: a zero momentum buffer; Adam/AdamW: zero first and second moments) and shares the "
    "tensor's scalar state: with the step count t of the first update after growth, Adam/AdamW's "
    "first update of the new slice is (1-b1)/(1-b1^t)*sqrt((1-b2^t)/(1-b2)) times a zero-state "
    "start's (eps -> 0; 1 at t = 1, 0.708 at t = 51, 3.16 as t grows), and SGD's first momentum "
    "buffer is (1-dampening)*grad, as a fresh start's only when dampening = 0"
)


# The feature source a protocol stands for (the tangent probe, :mod:`.tangent`) sits layers above
# this module: it builds the protocol's blocks from a plan, which checks the protocol. The tangent
# module registers its maker here when imported (the growth package imports it), so this module
# imports nothing above it.
_FEATURE_SOURCE_MAKERS: list = []


def register_feature_source(make) -> None:
    """Set the maker of a protocol's (or plan's) feature source: ``make(protocol_or_plan, model)``."""
    _FEATURE_SOURCE_MAKERS[:] = [make]


def make_feature_source(protocol_or_plan, model: nn.Module):
    """The feature source of a protocol or plan on ``model`` (:func:`register_feature_source`)."""
    if not _FEATURE_SOURCE_MAKERS:
        raise FusedStatsError(
            "the growth tangent is not loaded: import fused_stats (or fused_stats.api.growth) first"
        )
    return _FEATURE_SOURCE_MAKERS[0](protocol_or_plan, model)


def block_seed(seed: int, point: str, earlier_growths: int) -> int:
    """The seed of the block at ``point`` (:data:`SEEDING_RULE`): its own name and the growths
    at that name so far, never its place among the candidates."""
    text = json.dumps(
        ["fused_stats.growth.block", int(seed), str(point), int(earlier_growths)],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:8], "little") >> 1


def check_record_version(record, where: str = "GrowthProtocol record") -> None:
    """Refuse a protocol record of another version than :data:`PROTOCOL_VERSION`, naming it."""
    version = record.get("version") if isinstance(record, dict) else None
    if version == PROTOCOL_VERSION:
        return
    if version == 1:
        raise FusedStatsError(
            f"{where} is of version 1, whose blocks were seeded by the candidate's position in the "
            f"list; this fused_stats (protocol version {PROTOCOL_VERSION}) seeds each block by the "
            "candidate's name, so statistics measured under it were measured on other blocks: "
            "probe again under the protocol as it is now"
        )
    raise FusedStatsError(
        f"{where} has version {version!r}; this fused_stats reads protocol version {PROTOCOL_VERSION}"
    )


def zero_state_rule(family: str) -> str:
    """The hashed zero-state rule of ``family`` (see :data:`ZERO_STATE_RULE`, :data:`WIDTH_STATE_RULE`)."""
    return WIDTH_STATE_RULE if family == "mlp_width" else ZERO_STATE_RULE


def check_init(family: str, init: str) -> None:
    """Refuse an ``init`` other than ``"zero"`` for a family whose new outputs start at zero."""
    if init not in INITS:
        raise FusedStatsError(f"init must be one of {INITS}, got {init!r}")
    if family != "layer" and init != "zero":
        # new units and the cross block have zero outputs by definition: nothing to copy or draw
        raise FusedStatsError(
            f"init {init!r} needs family 'layer'; family {family!r} starts its outputs at zero"
        )


# the architectures a version-1 record lists (a record must stay loadable by from_dict, which
# rebuilds it, and its digest unchanged, so this list is fixed; the others are in ADAPTERS)
RECORDED_MODEL_TYPES = ("llama", "gpt2", "gpt_neox")


def _zero_parameters_table(family: str, init: str) -> dict[str, list[str]]:
    """Per architecture, the parameters of the grown part that start at zero under ``init``."""
    if init != "zero":
        # "copy" and "random" are not function preserving: nothing is forced to zero
        return {}
    adapters = [ADAPTERS[k] for k in RECORDED_MODEL_TYPES] + list(RESNET_BLOCKS.values())
    if family == "layer":
        return {
            a.model_type: [f"{m}.{p}" for m in a.origin_modules for p in ("weight", "bias")] for a in adapters
        }
    if family == "mlp_width":
        out = {}
        for a in adapters:
            if a.mlp_output is not None:
                # Conv1D (GPT-2) stores (in, out): the new *rows* of c_proj.weight are its new inputs
                out[a.model_type] = [f"{a.mlp_output}.weight[new {'rows' if a.conv1d else 'columns'}]"]
        return out
    return {"any": ["w_out"]}


@dataclass(frozen=True)
class GrowthProtocol:
    """Insertion candidates, residual family, initialisation and seed of a growth experiment.

    ``candidates``: residual point names (module names whose output is the stream; for
    transformers also the module producing the stream into block 0). ``family``: ``"layer"``,
    ``"mlp_width"`` (needs ``width``, the number of new hidden units) or ``"cross_block"``.
    ``init``: ``"zero"`` (function preserving), ``"copy"`` (a copy of the block before the
    boundary, as G_stack) or ``"random"`` (the architecture's own initialisation). ``seed``: the
    non-zero parts of the block at candidate ``p`` are drawn from ``(seed, p, the growths at p so
    far)`` (:data:`SEEDING_RULE`), whatever the other candidates. ``projection``:
    optional rank of a fixed random projection of the probed features, drawn from ``seed``.
    ``budget``: optional ``(M, K)``, the train and test sample sizes at which the advisor evaluates
    the width certificate (declared with the protocol, like everything the verdict depends on;
    None: the report's own sizes). ``score``: what :func:`fused_stats.advise` ranks by, one of
    :data:`SCORES` (default ``"cross_frob2"``, the unbiased ``|C|_F²``); ``adam_eps``: the ε of
    the Adam first-step prediction (default torch's 1e-8). ``train_batch_size``: the training
    batch size ``B`` of the optimizer step the Adam prediction is for: set, the prediction is the
    mean of ``⟨s_b, C_K⟩`` over B-sized sub-batches of the train stream (:mod:`.sub_batches`);
    None: ``⟨s_M, C_K⟩``, the whole train stream as one batch (its value depends on the probe's
    size M). Only a set budget / train_batch_size and non-default score / eps enter
    :meth:`to_dict`, so protocols without them keep the record and digest they had before the
    fields existed.
    """

    candidates: tuple[str, ...]
    family: str = "layer"
    init: str = "zero"
    seed: int = 0
    width: int | None = None
    projection: int | None = None
    budget: tuple[int, int] | None = None
    score: str = DEFAULT_SCORE
    adam_eps: float = DEFAULT_ADAM_EPS
    train_batch_size: int | None = None

    def __post_init__(self):
        cands = self.candidates
        if isinstance(cands, str):
            cands = (cands,)
        try:
            cands = tuple(cands)
        except TypeError:
            raise FusedStatsError(
                f"GrowthProtocol candidates must be a sequence of point names, got {type(cands).__name__}"
            ) from None
        if not cands:
            raise FusedStatsError("GrowthProtocol needs at least one candidate point")
        for c in cands:
            if not isinstance(c, str) or not c:
                raise FusedStatsError(f"GrowthProtocol candidate {c!r} is not a module name")
        dup = sorted({c for c in cands if cands.count(c) > 1})
        if dup:
            raise FusedStatsError(f"GrowthProtocol candidates listed twice: {dup}")
        object.__setattr__(self, "candidates", cands)
        if self.family not in FAMILIES:
            raise FusedStatsError(f"GrowthProtocol family must be one of {FAMILIES}, got {self.family!r}")
        if self.init not in INITS:
            raise FusedStatsError(f"GrowthProtocol init must be one of {INITS}, got {self.init!r}")
        check_init(self.family, self.init)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            # the one check of the seed, a protocol file's included (protocol_file.build): a
            # protocol accepted in code is accepted in a file, and the other way round
            raise FusedStatsError(
                f"seed must be an integer >= 0, got {self.seed!r} (the GrowthProtocol seed of the new "
                "blocks' non-zero parts)"
            )
        for name in ("width", "projection"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise FusedStatsError(f"GrowthProtocol {name} must be a positive int or None, got {value!r}")
        if self.family == "layer" and self.width is not None:
            # refused rather than dropped: an ignored field would still have to enter the digest
            raise FusedStatsError(
                f"GrowthProtocol width={self.width!r} has no meaning for family 'layer' (a new block has "
                f"the model's own widths); width is for 'mlp_width' (new units) and 'cross_block' (rank)"
            )
        if self.budget is not None:
            try:
                budget = tuple(self.budget)
            except TypeError:
                budget = ()
            if len(budget) != 2 or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in budget
            ):
                raise FusedStatsError(
                    f"GrowthProtocol budget must be None or (M, K), two positive ints, got {self.budget!r}"
                )
            object.__setattr__(self, "budget", budget)
        if self.score not in SCORES:
            raise FusedStatsError(f"GrowthProtocol score must be one of {SCORES}, got {self.score!r}")
        eps = self.adam_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and eps < float("inf")):
            raise FusedStatsError(f"GrowthProtocol adam_eps must be a finite float > 0, got {eps!r}")
        object.__setattr__(self, "adam_eps", float(eps))
        size = self.train_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise FusedStatsError(
                f"GrowthProtocol train_batch_size must be a positive int or None, got {size!r}"
            )
        if self.score in ("adam_first_step", "split_adam") and self.projection is not None:
            raise FusedStatsError(
                f"GrowthProtocol score {self.score!r} needs the full tangent: under projection="
                f"{self.projection} the Adam prediction is not available (the sign of C P^T is not "
                "the projection of the sign of C)"
            )
        if self.family == "mlp_width" and self.width is None:
            raise FusedStatsError(
                "GrowthProtocol family 'mlp_width' needs width= (the number of new hidden units)"
            )

    def feature_source(self, model: nn.Module):
        """The exact tangent of this protocol's new blocks on ``model``
        (:class:`.tangent.GrowthTangent`): what ``fs.Probe(model, cross=protocol)`` measures."""
        return make_feature_source(self, model)

    def index(self, point: str) -> int:
        """Position of ``point`` among the candidates (it seeds that candidate's block)."""
        if point not in self.candidates:
            raise FusedStatsError(
                f"point {point!r} is not a candidate of this growth protocol; candidates: {list(self.candidates)}"
            )
        return self.candidates.index(point)

    def to_dict(self) -> dict:
        """Plain JSON-able record: the fields, the zero-state rule and the zero parameters."""
        record = {
            "version": PROTOCOL_VERSION,
            "candidates": list(self.candidates),
            "family": self.family,
            "init": self.init,
            "seed": self.seed,
            "width": self.width,
            "projection": self.projection,
            "zero_parameters": _zero_parameters_table(self.family, self.init),
            "zero_state_rule": zero_state_rule(self.family),
            "seeding": SEEDING_RULE,
        }
        if self.budget is not None:
            # absent, not null, when unset: digests of protocols recorded before stay valid
            record["budget"] = list(self.budget)
        if self.score != DEFAULT_SCORE:
            record["score"] = self.score
        if self.adam_eps != DEFAULT_ADAM_EPS:
            record["adam_eps"] = self.adam_eps
        if self.train_batch_size is not None:
            record["train_batch_size"] = self.train_batch_size
        return record

    @classmethod
    def from_dict(cls, record: dict) -> GrowthProtocol:
        """The protocol a :meth:`to_dict` record describes (the derived entries are checked);
        a record of another version (version 1: blocks seeded by position) is refused."""
        if not isinstance(record, dict):
            raise FusedStatsError(f"not a GrowthProtocol record: a {type(record).__name__}, not a dict")
        check_record_version(record)
        try:
            protocol = cls(
                candidates=tuple(record["candidates"]),
                family=record["family"],
                init=record["init"],
                seed=record["seed"],
                width=record.get("width"),
                projection=record.get("projection"),
                budget=record.get("budget"),
                score=record.get("score", DEFAULT_SCORE),
                adam_eps=record.get("adam_eps", DEFAULT_ADAM_EPS),
                train_batch_size=record.get("train_batch_size"),
            )
        except (KeyError, TypeError) as exc:
            raise FusedStatsError(f"not a GrowthProtocol record: missing or bad entry {exc}") from None
        if protocol.to_dict() != record:
            raise FusedStatsError(
                "GrowthProtocol record does not match the protocol it names (edited or other version)"
            )
        return protocol

    @property
    def digest(self) -> str:
        """SHA-256 hex digest of the canonical JSON of :meth:`to_dict` (sorted keys, no spaces)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def check(self, model: nn.Module, arch: Architecture | None = None) -> Architecture:
        """Raise :class:`FusedStatsError` unless every candidate can be grown in ``model``.

        Rejected: candidates that are not block boundaries; a family the architecture does not
        support (``mlp_width`` on a ResNet, ``mlp_width`` after the last block); parameters of an
        affected block tied to another module (growth would untie them); configs growth cannot
        keep consistent (GPT-2 ``scale_attn_by_inverse_layer_idx``, a per-layer list of the adapter of the
        wrong length, per-layer intermediate sizes). Returns the model's architecture (``arch``:
        the model's, already described; see :class:`.plan.GrowthPlan`).
        """
        arch = describe(model) if arch is None else arch
        bounds = [boundary(arch, model, c) for c in self.candidates]
        config = getattr(model, "config", None)
        if self.family == "mlp_width":
            if not arch.transformer:
                raise FusedStatsError(
                    f"family 'mlp_width' is not supported for {type(model).__name__} ({arch.kind}): "
                    f"its blocks have no MLP; use family 'layer'"
                )
            if arch.adapter.mlp_output is None:
                raise FusedStatsError(
                    f"family 'mlp_width' is not supported for model_type {arch.kind!r}: "
                    f"{arch.adapter.mlp_refused}; use family 'layer'"
                )
            for b in bounds:
                stack = model.get_submodule(b.container)
                if b.position >= len(stack):
                    raise FusedStatsError(
                        f"candidate {b.point!r}: family 'mlp_width' grows the MLP of the block that follows "
                        f"the point, and {b.point!r} is the last block"
                    )
            size = _intermediate_size(config, arch.adapter.mlp_size) if config is not None else None
            if config is not None and not isinstance(size, int):
                raise FusedStatsError(
                    f"config of {type(model).__name__} has intermediate size {size!r}, not one int: "
                    f"per-layer intermediate sizes are not supported by width growth"
                )
        if self.family == "layer" and config is not None:
            if getattr(config, "scale_attn_by_inverse_layer_idx", False):
                raise FusedStatsError(
                    "config.scale_attn_by_inverse_layer_idx=True: attention scales by 1/(layer_idx+1), so "
                    "renumbering the layers after an insertion would change every later layer"
                )
            layers = getattr(config, "num_hidden_layers", None)
            for key in arch.adapter.layer_lists:
                values = getattr(config, key, None)
                if values is not None and layers is not None and len(values) != layers:
                    raise FusedStatsError(
                        f"config.{key} lists {len(values)} layers but num_hidden_layers is {layers} "
                        f"(model_type {arch.kind!r})"
                    )
        _check_untied(model, arch, bounds, self.family)
        return arch


def _intermediate_size(config, name: str | None = None):
    for key in (name,) if name else ("intermediate_size", "ffn_hidden_size", "n_inner"):
        if hasattr(config, key):
            value = getattr(config, key)
            if key == "n_inner" and value is None:
                return 4 * int(config.hidden_size)
            return value
    return None


def _check_untied(model: nn.Module, arch: Architecture, bounds, family: str) -> None:
    """Refuse growth touching a block whose parameters are shared with another module."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for b in bounds:
        if family == "mlp_width":
            block = f"{b.container}.{b.position}"
        else:
            block = b.neighbour
        for name, param in model.get_submodule(block).named_parameters(prefix=block, remove_duplicate=False):
            names = owners.get(id(param), [])
            others = [n for n in names if not n.startswith(block + ".")]
            if others:
                raise FusedStatsError(
                    f"candidate {b.point!r}: parameter {name!r} is tied to {others[0]!r}; growing there "
                    f"would break the tie (a tied embedding or shared block)"
                )


__all__ = [
    "FAMILIES",
    "INITS",
    "SCORES",
    "WIDTH_STATE_RULE",
    "ZERO_STATE_RULE",
    "GrowthProtocol",
    "check_init",
]
