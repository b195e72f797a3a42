"""This suite's Taylor bound, exact as ε → 0 (docs/bounds.md §2.3), and ``best``, the smallest
certified bound at each input.

Split around the Jacobian J = J_F(X) instead of around P_l(X) as LoFAST does:

    F(X') − F(X) − J[Γ] = Σ_l [ (P_l' − P_l − dP_l[Γ]) X C_l + (P_l' − P_l) Γ C_l ].

Row-wise softmax is ½-Lipschitz and its Taylor remainder is ≤ ½‖Δs‖² (docs/bounds.md §2.3), so
with a_l = ‖A_l‖ and m_l = ε(‖M_l‖ + ε a_l)/√d_h ≥ ‖S_l' − S_l‖_F:

    taylor = σ̄_J ε + Σ_l [ (½ m_l² + ½ ε² a_l/√d_h)·‖X C_l‖ + ½ m_l ε ‖C_l‖ ].

The remainder is O(ε²), so taylor/truth → 1 as ε → 0, where LoFAST's ratio stays at 1 + δ₂/(ζε).
The remainder paid is the smallest of that global bound, a local one from the clean row
probabilities (§2.3.1) and the quadratic form at the clean point (§2.3.2): ``bounds.remainder``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models import DotMHA
from models.operators import JACOBIAN_LIMIT, jacobian_matrix, jacobian_operator
from models.spectral import LinearOperator
from models.structured import dot_jacobian, dot_jacobian_operator

from .base import radius
from .certificates import Ledger
from .lofast import layer_key, m_norms, xi
from .norms import certified_norm
from .remainder import remainder
from .remainder.row_bounds import global_remainder


def sigma_J(layer: DotMHA, X: Tensor, *, probabilistic: bool = False, ledger: Ledger | None = None) -> Tensor:
    """A certified upper bound σ̄_J of ‖J_F(X)‖ per input (docs/bounds.md §2.4). [B]."""
    B, n, d = X.shape
    names, tensors = layer_key(layer)
    return certified_norm(("jacobian", layer.kind, layer.residual, names), (*tensors, X),
                          lambda: dense_jacobian(layer, X),
                          lambda: jacobian_map(layer, X), (B,), (n, d), X,
                          probabilistic=probabilistic, limit=JACOBIAN_LIMIT, ledger=ledger)


def jacobian_map(layer, X: Tensor) -> LinearOperator:
    """J_F(X) and its adjoint as maps: in closed form for a dot layer (models.structured), else by
    autograd (models.operators.jacobian_operator)."""
    return dot_jacobian_operator(layer, X) if layer.kind == "dot" else jacobian_operator(layer.forward, X)


def dense_jacobian(layer, X: Tensor) -> Tensor:
    """[B, nd, nd]: in closed form for a dot layer (models.structured), else by autograd."""
    return dot_jacobian(layer, X) if layer.kind == "dot" else jacobian_matrix(layer.forward, X)


def taylor_remainder(layer: DotMHA, X: Tensor, eps, negligible: Tensor | None = None, *,
                     ledger: Ledger | None = None) -> Tensor:
    """The remainder ``taylor`` pays, [B]: the smallest of its certified bounds
    (``bounds.remainder.remainder``, docs/bounds.md §2.3–2.3.2); the global one's m_l takes the
    smaller of the certified ‖M_l‖ and ξ_l (both bound the linear logit change). ``negligible`` as in
    ``bounds.remainder.remainder`` (:class:`TaylorOptions`)."""
    return remainder(layer, X, eps, remainder_core(layer, X, ledger), negligible=negligible, ledger=ledger)


def taylor_remainder_global(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """The remainder of docs/bounds.md §2.3 alone (softmax's global constants), [B]: what ``taylor``
    paid before §2.3.1–2.3.2, kept to show what they buy."""
    return global_remainder(layer, X, eps, remainder_core(layer, X, ledger)).sum(-1)


def remainder_core(layer: DotMHA, X: Tensor, ledger: Ledger | None = None) -> Tensor:
    return torch.minimum(m_norms(layer, X, ledger=ledger), xi(layer, X))


@dataclass(frozen=True)
class TaylorOptions:
    """What a network certificate lets ``taylor`` (and ``best``, which passes them on) skip of the
    remainder's forms (§2.3.2, §2.3.4), docs/bounds.md §5, "What a network certificate skips". The
    defaults skip nothing: a layer's own rows never pass options, so that ``taylor = σ̄_J ε +
    taylor_remainder`` stays exact there.

    ``negligible``: at each input where the cheaper remainders (global, local, first-order) are
    already at most this share of σ̄_J·ε, the forms are skipped, as they could lower the bound by no
    more than that share (0: never). ``not_needed``: [B] bool, the inputs at which no remainder can
    change what ``taylor`` is used for (the images the first-order terms alone already fail to
    certify); they skip the forms too, and their value stays a certified bound, looser."""

    negligible: float = 0.0
    not_needed: Tensor | None = None

    def __post_init__(self):
        if not 0 <= self.negligible < 1:
            raise ValueError(f"share must be in [0, 1), got {self.negligible}")


NO_OPTIONS = TaylorOptions()


def taylor(layer: DotMHA, X: Tensor, eps, *, options: TaylorOptions = NO_OPTIONS,
           ledger: Ledger | None = None) -> Tensor:
    """``σ̄_J ε + taylor_remainder``, docs/bounds.md §2.3 (with :class:`TaylorOptions`, the remainder
    without the forms where they are negligible and at the inputs named not needed)."""
    first = sigma_J(layer, X, ledger=ledger) * radius(eps, X)
    share = options.negligible
    negligible = share * first if share else None
    skip = options.not_needed
    if skip is not None and skip.shape == first.shape and bool(skip.any()):
        negligible = torch.where(skip, torch.inf, -torch.inf if negligible is None else negligible)
    return first + taylor_remainder(layer, X, eps, negligible, ledger=ledger)


