"""Bounds on attention's Taylor remainder ``R(Γ) = F(X+Γ) − F(X) − J_F(X)[Γ]`` over ‖Γ‖_F ≤ r, per
head (docs/bounds.md §2.3 and §2.3.1). ``taylor`` and ``taylor_net`` pay the smaller of the two:

* :func:`global_remainder`, softmax's global constants (½-Lipschitz, curvature ≤ 1) and the worst
  directions of ‖M_l‖ and ‖X C_l‖ (docs/bounds.md §2.3);
* :func:`local_remainder`, the clean point's own row probabilities (docs/bounds.md §2.3.1): every
  spread is centred at the attention-weighted mean, so a saturated row or a row whose values agree
  pays almost nothing, and only factors that tend to 1 as r → 0 are taken over the ball;
* :func:`first_order_remainder`, of order r, not r² (docs/bounds.md §2.3.3): the attention change and
  its linear part bounded apart, each row's change capped by its values' diameter; it is the
  smallest where the logits move by more than about 2 over the ball;
* :func:`quadratic_remainder`, the second-order term as the quadratic form it is (§2.3.2), and the
  third as the cubic form it is, every other term jointly over heads and rows (§2.3.4); the forms'
  certified norms are in :mod:`bounds.forms`.

The first three are in :mod:`bounds.remainder.row_bounds`, the fourth in :mod:`bounds.remainder.quadratic`;
:func:`remainder` takes the smallest.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from models import DotMHA

from ..base import radius
from ..certificates import Ledger, book
from ..forms import (
    logit_form_norm,
    nan_inf,
)
from ..lofast import xi
from .quadratic import FormCache, quadratic_remainder
from .row_bounds import (
    ROUND_ABS,
    RowFactors,
    RowStats,
    first_order_remainder,
    functional_beyond,
    functional_rows,
    global_remainder,
    local_remainder,
    row_bound,
    row_factors,
    row_remainders,
    row_stats,
)

__all__ = [
    "FormCache",
    "RowFactors",
    "RowStats",
    "first_order_remainder",
    "functional_beyond",
    "functional_rows",
    "global_remainder",
    "local_remainder",
    "logit_form_norm",
    "quadratic_remainder",
    "remainder",
    "row_bound",
    "row_factors",
    "row_remainders",
]


def remainder(layer: DotMHA, X: Tensor, eps, core: Tensor | None = None,
              quadratic: bool | None = None, cache: FormCache | None = None,
              negligible: Tensor | None = None, enough: Tensor | None = None, *,
              ledger: Ledger | None = None, spans: Tensor | None = None) -> Tensor:
    """A certified bound of ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F over ‖Γ‖_F ≤ r, [B]: each head's share by
    the smallest of :func:`global_remainder`, :func:`local_remainder` and
    :func:`first_order_remainder` (each bounds the same head's term, docs/bounds.md §2.3.1–2.3.3),
    summed over heads, and the smaller of that and
    :func:`quadratic_remainder`. ``quadratic`` None takes the quadratic form where its eigenproblem
    (h·n²) is no larger than the Jacobian's (n·d), which ``taylor`` pays anyway; False never, True
    up to QUAD_LIMIT. ``core`` as in :func:`global_remainder`, ``cache`` as in
    :func:`quadratic_remainder`. ``negligible`` [B]: the quadratic remainder is computed only at the
    inputs where the others exceed it (``bounds.taylor.TaylorOptions``). ``enough`` [B]: where
    the global bound is at most this at an input and ``quadratic`` is not True, the global bound
    alone there (the others' row quantities cost 2–3× it, and are computed only where some input
    needs them; each input's value is the one it gets alone; ``taylor_net``'s first pass, where the
    remainder is negligible beside its first order: docs/bounds.md §5, "What a network certificate
    skips")."""
    core = xi(layer, X) if core is None else core
    glob = global_remainder(layer, X, eps, core)
    skip = None if enough is None or quadratic else glob.sum(-1) <= enough  # [B]
    if skip is not None and bool(skip.all()):
        return glob.sum(-1)
    rows = row_stats(layer, X, radius(eps, X)[:, None, None])  # what the three bounds share
    if spans is not None:  # each row's logit span over the deviations considered, where it is smaller
        rows = replace(rows, s=torch.minimum(rows.s, spans))
    local = nan_inf(local_remainder(layer, X, eps, rows) + ROUND_ABS * glob)
    first = nan_inf(first_order_remainder(layer, X, eps, core, rows) + ROUND_ABS * glob)
    out = torch.minimum(torch.minimum(glob, local), first).sum(-1)
    n, d = X.shape[-2:]
    if quadratic or (quadratic is None and layer.h * n * n <= n * d):
        need = None if negligible is None else out > negligible
        if need is None or bool(need.all()):
            quad = quadratic_remainder(layer, X, eps, cache, rows, ledger=ledger)
            out = torch.minimum(out, quad + ROUND_ABS * glob.sum(-1))
        elif bool(need.any()):  # those inputs alone, so that each input's value is its own
            idx = need.nonzero().squeeze(-1)
            # one tensor per (X, inputs) on the ledger's cache, so that the forms kept for it (keyed by
            # the tensor) serve a second bound that needs the same inputs (taylor, then best)
            ledger = book(ledger)
            sub = ledger.value(("inputs", tuple(idx.tolist())), (X,), lambda: X[idx])
            quad = quadratic_remainder(layer, sub, radius(eps, X)[idx], ledger=ledger)
            out[idx] = torch.minimum(out[idx], quad + ROUND_ABS * glob.sum(-1)[idx])
    # an input whose global bound is enough keeps it, as it would alone (no input's value depends on
    # the inputs beside it)
    return out if skip is None else torch.where(skip, glob.sum(-1), out)
