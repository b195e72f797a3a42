"""SpecFormer (Hu et al., seed 001), Theorem 4.3, adapted to the residual multi-head layer
(docs/bounds.md §3.1)."""

from __future__ import annotations

from torch import Tensor

from models import DotMHA
from models.spectral import spectral

from ..base import radius
from ..certificates import Ledger

FINDING = (
    "unsound for small inputs: its constant vanishes like (‖X‖_F + ε)², but at X = 0 the "
    "perturbation Γ = (ε/√N)·1·u₁ᵀ (u₁ the top left singular vector of H + C) keeps P uniform "
    "and gives ‖F(Γ) − F(0)‖_F = ε‖H + C‖ (one head); tests/bounds/test_soundness.py holds the witness"
)


def specformer(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """``ε(‖H‖ + Σ_l N(N+1)(‖X‖_F + ε)²[‖C_l‖‖W^Q_l‖‖W^K_l‖ + ‖C_l‖])``.

    Theorem 4.3 is stated for one head, no W^O and no residual: ``Lip ≤ N(N+1)(‖X0‖_F + δ0)²
    [‖W^V‖‖W^Q‖‖W^K‖ + ‖W^V‖]`` on B(X0, δ0). This adaptation (docs/bounds.md §3.1) puts C_l = W^V_l W^O_l in
    the place of W^V, sums over heads and adds ‖H‖ for the residual branch; the statement drops the
    softmax's 1/√D, which only loosens it, and so do we.
    """
    e = radius(eps, X)
    N = X.shape[1]
    C = layer.C_norm()
    per_head = C * spectral(layer.W_q) * spectral(layer.W_k) + C  # [h]
    radius_sq = (X.flatten(1).norm(dim=-1) + e) ** 2  # [B]
    return e * (layer.H_norm + N * (N + 1) * radius_sq * per_head.sum())
