"""LoFAST (Havens et al., seed 000): naive δ₁, ζ(X), ‖M_l(X)‖, ξ_l, δ₂ and Theorem 1 (docs/bounds.md §2).

With biases (docs/bounds.md §1.5) every function here holds as written: P_l is the layer's biased
attention, the logit operator carries the biased U and V, and b_v, b_o cancel from F(X') − F(X).

Shapes: X [B, n, d]; per-head quantities [B, h]; eps a float or [B].
"""

from __future__ import annotations

import math

from torch import Tensor

from models import DotMHA
from models.operators import (
    M_GRAM_LIMIT,
    ZETA_GRAM_LIMIT,
    delta1_matrix,
    logit_matrix,
    m_norms_lanczos,
    zeta_lanczos,
)
from models.spectral import spectral
from models.structured import logit_gram, logit_gram_cols, reduced_logit, zeta_gram

from .base import radius
from .certificates import Ledger
from .norms import certified_norm

METHODS = ("certified", "probabilistic", "lanczos", "dense")


def _method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


ALL_TENSORS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")


def layer_key(layer: DotMHA,
              names: tuple[str, ...] = ALL_TENSORS) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    """The names and tensors among ``names`` that the layer has (absent biases left out), which
    name an operator for the reuse of its certified norm (bounds.certificates.Ledger.cache): the names go into
    the key, so layers that differ only in their biases never share a norm (docs/bounds.md §1.5)."""
    present = tuple(k for k in names if getattr(layer, k) is not None)
    return present, tuple(getattr(layer, k) for k in present)


def zeta_dense(layer: DotMHA, X: Tensor) -> Tensor:
    """Exact ζ(X) by SVD of the nd×nd matrix ``H⊗I_d + Σ_l P_l⊗C_lᵀ``; small sizes only."""
    return spectral(delta1_matrix(layer, X))


def zeta(layer: DotMHA, X: Tensor, eps=None, *, method: str = "certified",
         ledger: Ledger | None = None) -> Tensor:
    """ζ(X) = ‖H⊗I_d + Σ_l P_l(X)⊗C_lᵀ‖, LoFAST eq. 15 (the text's H⊗I_n is a typo for H⊗I_d).

    ``certified`` (what every bound uses) is exact or probabilistic by size (docs/bounds.md §2.4),
    ``probabilistic`` forces the Lanczos certificate; ``lanczos`` is the restarted-Lanczos estimate
    from below; ``dense`` the plain SVD.
    """
    if _method(method) == "dense":
        return zeta_dense(layer, X)
    if method == "lanczos":
        return zeta_lanczos(layer, X).sigma
    B, n, d = X.shape
    names, tensors = layer_key(layer)
    # the exact path eigendecomposes KᵀK formed from its Kronecker structure (models.structured)
    return certified_norm(("zeta", layer.residual, names), (*tensors, X),
                          lambda: zeta_gram(layer, X), lambda: layer.delta1_operator(X),
                          (B,), (n, d), X, probabilistic=method == "probabilistic", gram=True,
                          limit=ZETA_GRAM_LIMIT, ledger=ledger)


def m_norms(layer: DotMHA, X: Tensor, *, method: str = "certified", ledger: Ledger | None = None) -> Tensor:
    """‖M_l(X)‖ = max_{‖Γ‖_F=1} ‖Γ A_l Xᵀ + X A_l Γᵀ‖_F, LoFAST eq. 25 / appendix B.4 (eq. 25 of the
    main text writes W^K W^Qᵀ in both terms: a typo). With biases, ‖Γ Uᵀ + V Γᵀ‖_F with U = K_l W^Q_lᵀ,
    V = Q_l W^K_lᵀ (docs/bounds.md §1.5). [B, h]. Methods as for :func:`zeta`."""
    if _method(method) == "dense":
        return spectral(logit_matrix(layer, X))
    if method == "lanczos":
        return m_norms_lanczos(layer, X).sigma
    B, n, _ = X.shape
    names, tensors = layer_key(layer, ("W_q", "W_k", "b_q", "b_k"))  # what U and V depend on
    # certified on the r = min(d, 2d_h) columns the map sees (models.structured), then lifted back
    red = reduced_logit(layer, X)
    r = red.U.shape[-1]
    # the smaller of the two Grams, each formed from n×n or r×r products (models.structured)
    norm = certified_norm(("M", names), (*tensors, X),
                          lambda: logit_gram(red) if n <= r else logit_gram_cols(red),
                          lambda: red.operator, (B, layer.h), (n, r), X,
                          probabilistic=method == "probabilistic", gram=True,
                          dense_dim=min(n * n, n * r), limit=M_GRAM_LIMIT, ledger=ledger)
    return red.bound(norm)


def xi(layer: DotMHA, X: Tensor) -> Tensor:
    """ξ_l(X) = ‖A_l Xᵀ‖ + ‖X A_l‖ ≥ ‖M_l(X)‖, LoFAST eq. 26; with biases ‖U‖ + ‖V‖ for the U, V of
    :func:`m_norms` (docs/bounds.md §1.5). Each through its thin factors, ‖U‖ = ‖K_l W^Q_lᵀ‖ and
    ‖V‖ = ‖Q_l W^K_lᵀ‖ (``DotMHA.logit_factor_norms``, docs/bounds.md §2.1). [B, h]."""
    U, V = layer.logit_factor_norms(X)
    return U + V


def _delta21(layer: DotMHA, X: Tensor, eps, core: Tensor) -> Tensor:
    e = radius(eps, X)[:, None]
    return e / math.sqrt(layer.d_h) * (core + e * layer.A_norm())


def delta21_M(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """δ_{2,1,l}^(1) = (ε/√d_h)(‖M_l(X)‖ + ε‖A_l‖) ≥ ‖P_l(X') − P_l(X)‖_F, LoFAST §5.1. [B, h]."""
    return _delta21(layer, X, eps, m_norms(layer, X, ledger=ledger))


def delta21_xi(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """δ_{2,1,l}^(2) = (ε/√d_h)(ξ_l(X) + ε‖A_l‖), LoFAST §5.1. [B, h]."""
    return _delta21(layer, X, eps, xi(layer, X))


def delta22_tight(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """δ_{2,2,l}^(1) = ‖X C_l‖ + ε‖C_l‖ ≥ ‖X' C_l‖, LoFAST eq. 18. [B, h]."""
    return layer.XC_norm(X) + radius(eps, X)[:, None] * layer.C_norm()


def delta22_naive(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """δ_{2,2,l}^(2) = ‖C_l‖(‖X‖ + ε), LoFAST §5.1. [B, h]."""
    return layer.C_norm() * (spectral(X) + radius(eps, X))[:, None]


def naive_delta1(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """(‖H‖ + Σ_l ‖C_l‖‖P_l(X)‖)ε, LoFAST eq. 12 (appendix B.2 drops the ε on ‖H‖: a typo)."""
    s = (layer.C_norm() * spectral(layer.attention(X))).sum(-1)
    return (layer.H_norm + s) * radius(eps, X)


def delta1(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """δ₁ = ζ(X)ε, the exact maximum of ‖Δ₁‖ over the ball (LoFAST Lemma 1)."""
    return zeta(layer, X, ledger=ledger) * radius(eps, X)


def delta2_M(layer: DotMHA, X: Tensor, eps, *, factor: float = 1.0,
             ledger: Ledger | None = None) -> Tensor:
    """δ₂^(1) = Σ_l δ_{2,1,l}^(1) δ_{2,2,l}^(1), LoFAST eq. 27."""
    return factor * (delta21_M(layer, X, eps, ledger=ledger) * delta22_tight(layer, X, eps)).sum(-1)


def delta2_xi(layer: DotMHA, X: Tensor, eps, *, factor: float = 1.0,
              ledger: Ledger | None = None) -> Tensor:
    """δ₂^(2) = Σ_l δ_{2,1,l}^(2) δ_{2,2,l}^(1), LoFAST eq. 28."""
    return factor * (delta21_xi(layer, X, eps) * delta22_tight(layer, X, eps)).sum(-1)


def lofast_M(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """ζ(X)ε + δ₂^(1), LoFAST Theorem 1."""
    return delta1(layer, X, eps, ledger=ledger) + delta2_M(layer, X, eps, ledger=ledger)


def lofast_xi(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """ζ(X)ε + δ₂^(2), LoFAST Theorem 1."""
    return delta1(layer, X, eps, ledger=ledger) + delta2_xi(layer, X, eps)


def lofast_M_half(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """ζ(X)ε + ½δ₂^(1): softmax is ½-Lipschitz (docs/bounds.md §2.2); this suite's tightening, not
    LoFAST's."""
    return delta1(layer, X, eps, ledger=ledger) + delta2_M(layer, X, eps, factor=0.5, ledger=ledger)


def lofast_xi_half(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """ζ(X)ε + ½δ₂^(2) (docs/bounds.md §2.2); this suite's tightening, not LoFAST's."""
    return delta1(layer, X, eps, ledger=ledger) + delta2_xi(layer, X, eps, factor=0.5)


def naive(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """naive δ₁ + δ₂^(2), the comparison of LoFAST Fig. 1."""
    return naive_delta1(layer, X, eps, ledger=ledger) + delta2_xi(layer, X, eps)
