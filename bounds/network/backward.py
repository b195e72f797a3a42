"""The backward pass of ``taylor_net`` (docs/bounds.md §5.1): lower bounds of functionals of the last
tokens, by one pass back through the logged stages to the pixels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .record import Fork, Join
from .stages.attention import AttentionRecord
from .stages.batchnorm import ScaleRecord
from .stages.ffn import FFNRecord
from .stages.layernorm import NormRecord
from .stages.project import ProjectRecord

# every stage record the pass knows (each with ``step``), and the residuals' marks
STAGES = (AttentionRecord, FFNRecord, NormRecord, ProjectRecord, ScaleRecord)


def has_relus(rec) -> bool:
    """Whether a stage record has ReLU units (a ReLU FFN's neurons, LayerProject's radial changes): the
    units whose slopes :mod:`bounds.network.slopes` tunes and :mod:`bounds.network.branches` splits."""
    return isinstance(rec, ProjectRecord) or (isinstance(rec, FFNRecord) and rec.act == "relu")


@dataclass
class Losses:
    """What a backward bound loses where, each [B, C]: its first order, its kinks (net of the
    relaxations' offsets) and each stage's remainder by its source's name (the diagnostics where
    this bound is the better); and each ReLU unit's offset, by record."""

    first_order: Tensor | None = None
    kinks: Tensor | None = None
    remainders: dict[str, Tensor] = field(default_factory=dict)
    # per index of the log, each ReLU unit's offset [B, C, *units] (negative: what its relaxation costs)
    units: dict[int, Tensor] = field(default_factory=dict)


def backward(log: list, Lam: Tensor, embed: Tensor, eps: float,
             losses: Losses | None = None,
             alphas: dict[int, Tensor] | None = None,
             phases: dict[int, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Lower bounds of ⟨Λ_j, Δ_N⟩ for C functionals Λ [B, C, n, d] on the last tokens, by one pass
    back through the stages of ``log`` (docs/bounds.md §5.1, "the backward pass"): every smooth stage
    by its exact Jacobian (transposed) with its remainder charged at its own coefficients, every
    kink by its relaxation's slopes on the ranges of the forward set (each record's ``step``:
    :mod:`bounds.network.record`). Returns (bounds [B, C], the sum
    of the magnitudes of their terms, for the rounding slack); ``losses`` (a :class:`Losses`, empty at
    first) receives what the bound loses where.
    ``alphas``: the ReLUs' lower slopes of the records at these indices of ``log``, in place of
    CROWN's (:mod:`bounds.network.slopes`); any values in [0, 1] give a sound bound.
    ``phases``: the ReLU units of the records at these indices held on one side of 0 (int8 [B, C,
    *units], +1 / −1 / 0 free): a bound over the part of the ball where they are
    (:mod:`bounds.network.branches`)."""
    B, C = Lam.shape[:2]
    const = Lam.new_zeros(B, C)
    mag = Lam.new_zeros(B, C)
    if losses is not None:
        losses.kinks = Lam.new_zeros(B, C)
    skips: list[Tensor] = []  # the functionals on a residual's input, from its join to its fork
    for at in range(len(log) - 1, -1, -1):
        rec = log[at]
        if isinstance(rec, Join):  # out = x + branch(x): Λ reaches x both ways
            skips.append(Lam)
            continue
        if isinstance(rec, Fork):
            # a fork whose join is not in the log (a unit inside the branch, refined) has no skip
            Lam = Lam + skips.pop() if skips else Lam
            continue
        if not isinstance(rec, STAGES):
            # a stage this pass does not know has no backward step: crossing it as another would be unsound
            kind = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"backward: unknown stage record {kind!r}")
        extra = {}
        if alphas and at in alphas:
            extra["alpha"] = alphas[at]
        if phases and at in phases:
            extra["phase"] = phases[at]
        step = rec.step(Lam, **extra)
        Lam = step.Lam
        if step.charge is None:
            const, mag = const + step.gain, mag + step.offsets
        else:
            const, mag = const + step.gain - step.charge, mag + step.offsets + step.charge
        if losses is not None:
            losses.kinks = losses.kinks - step.gain
            if step.charge is not None:
                losses.remainders[rec.name] = step.charge
            if step.units is not None:
                losses.units[at] = step.units
    first = eps * torch.einsum("bcnd,ndp->bcp", Lam, embed).norm(dim=-1)
    if losses is not None:
        losses.first_order = first
    return const - first, mag + first

