"""Kim, Papamakarios & Mnih (ICML 2021): the global 2-norm Lipschitz bound of L2-MHA (docs/bounds.md §3.2)."""

from __future__ import annotations

import math

from scipy.special import lambertw
from torch import Tensor

from models import L2MHA
from models.spectral import spectral

from ..base import radius
from ..certificates import Ledger

FINDING = (
    "not a bound for ‖W^Q_l‖ > 1: the layer is quadratic in W^Q (A_l = W^Q_l W^Q_lᵀ/√d_h) but the "
    "formula is linear in ‖W^Q_l‖; with n = 1, d = d_h = 4, W^Q = 3I, W^V = W^O = I, H = 0 the layer "
    "is F(x) = 4.5x while the formula gives 1.5 (docs/bounds.md §3.2; tests/bounds/test_findings.py)"
)


def phi_inv(y: float) -> float:
    """φ⁻¹(y) for φ(x) = x e^{x+1}: the principal Lambert W of y/e."""
    return float(lambertw(y / math.e).real)


def kim_lipschitz(layer: L2MHA, n: int) -> Tensor:
    """``‖H‖ + (√n/√d_h)(4φ⁻¹(n−1) + 1)·√(Σ_l ‖W^Q_l‖²‖W^V_l‖²)·‖W^O‖`` (Kim et al., Theorem 3.2).

    φ⁻¹ is taken at n−1 as Kim states it (the OLSA paper's worked example uses n: docs/bounds.md §3.2).
    ‖W^O‖ is the norm of the whole output map, the h blocks W^O_l stacked into an (h·d_h)×d matrix.
    """
    W_o = layer.W_o.reshape(-1, layer.W_o.shape[-1])
    heads = (spectral(layer.W_q) ** 2 * spectral(layer.W_v) ** 2).sum().sqrt()
    attn = math.sqrt(n) / math.sqrt(layer.d_h) * (4 * phi_inv(n - 1) + 1)
    return layer.H_norm + attn * heads * spectral(W_o)


def kim(layer: L2MHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """Lip₂(F)·ε with Kim et al.'s global constant; it depends on X only through n."""
    return kim_lipschitz(layer, X.shape[1]) * radius(eps, X)


