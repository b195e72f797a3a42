"""OLSA (Xu et al., seed 002), Theorem 4.1, on the OLSA layer (docs/bounds.md §3.3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models import OLSA, InputError

from ..base import radius
from ..certificates import Ledger

FINDING = (
    "fails at finite ε: a search over inputs and orthogonal weights finds σ_max(J)/Lip = 1.06 (n = 2, "
    "d = 4, h = 1, relu, α₁ = α₂ = 1, ‖X‖_F = 32, two nearly opposite tokens, attention ≈ ½–½), where "
    "the proof's softmax constant ¼ is below the true ½; the bound is 6% under the true change for ε "
    "from 3e-4 to 3e-2 (docs/bounds.md §3.3; tests/bounds/test_findings.py)"
)


def check_assumptions(layer: OLSA, tol: float = 1e-5) -> None:
    """Theorem 4.1's assumptions: orthogonal stacked W^Q, W^K, W^V and ‖w^S_l‖ = 1 (σ is 1-Lipschitz
    by construction of the layer). Raises InputError naming the first one that fails."""
    eye = torch.eye(layer.d, dtype=layer.W_q.dtype, device=layer.W_q.device)
    for name in ("W_q", "W_k", "W_v"):
        W = getattr(layer, name).reshape(-1, layer.d)  # [W_1; …; W_h], d×d
        err = float((W.T @ W - eye).abs().max())
        if err > tol:
            raise InputError(f"olsa bound needs orthogonal stacked {name} (max |WᵀW − I| = {err:.2e})")
    err = float((layer.w_s.norm(dim=-1) - 1).abs().max())
    if err > tol:
        raise InputError(f"olsa bound needs ‖w_s_l‖ = 1 for every head (off by {err:.2e})")


def olsa_lipschitz(layer: OLSA, c: Tensor, n: int) -> Tensor:
    """``(1/α2)(1 + c√n/(4α1))``, Theorem 4.1, valid on the ball ‖X‖_F ≤ c."""
    return (1 + c * math.sqrt(n) / (4 * layer.alpha1)) / layer.alpha2


def olsa(layer: OLSA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """``ε(‖H‖ + Lip)`` with Lip taken at c = ‖X‖_F + ε, the smallest ball holding every X'.

    Implemented as published; its proof's weak points (a softmax constant of ¼, ‖P‖ ≤ 1 for
    row-stochastic P) are left to the soundness audit (docs/bounds.md §3.3).
    """
    check_assumptions(layer)
    e = radius(eps, X)
    c = X.flatten(1).norm(dim=-1) + e
    return e * (layer.H_norm + olsa_lipschitz(layer, c, X.shape[1]))
