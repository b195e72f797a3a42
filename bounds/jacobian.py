"""The Cauchy view (Wang & Ruan, seed 003): Jacobian σ_max as a first-order estimate (docs/bounds.md §3.4).

The Jacobian products, their Lanczos norm and the dense Jacobian live in models/operators.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from models import InputError, Stack
from models.operators import jacobian_lanczos, jacobian_matrix
from models.spectral import spectral

from .base import radius
from .certificates import Ledger


def jacobian(layer, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """σ_max(J_F(X))·ε, a first-order estimate, not a certificate (Wang & Ruan, docs/bounds.md §3.4)."""
    return jacobian_lanczos(layer.forward, X).sigma * radius(eps, X)


def jacobian_l1linf(layer, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """√(‖J‖₁‖J‖_∞)·ε, the paper's cheap surrogate of σ_max (induced 1- and ∞-norms); an estimate."""
    J = jacobian_matrix(layer.forward, X).abs()
    return (J.sum(-2).amax(-1) * J.sum(-1).amax(-1)).sqrt() * radius(eps, X)


def jacobian_exp(stack: Stack, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """ε·exp(Σ_k ‖J_{G_k}(X_k)‖) for residual blocks X_{k+1} = X_k + G_k(X_k), Wang & Ruan eq. 15.

    G_k is block k without its residual branch, evaluated at its projected input; an estimate.
    """
    if not isinstance(stack, Stack):
        raise InputError("jacobian_exp applies to stacks only")
    if not all(b.residual for b in stack.blocks):
        raise InputError("jacobian_exp needs residual blocks (x_{k+1} = x_k + G_k(x_k))")
    states = stack.trajectory(X)
    total = sum(jacobian_lanczos(replace(b, residual=False).forward, Xk).sigma
                for b, Xk in zip(stack.blocks, states, strict=False))
    return radius(eps, X) * torch.exp(total)


def sigma_exact(layer, X: Tensor) -> Tensor:
    """Exact σ_max(J_F(X)) by SVD of the dense Jacobian, for tests and small reports."""
    return spectral(jacobian_matrix(layer.forward, X))
