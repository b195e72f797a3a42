"""The Cauchy view (Wang & Ruan, seed 003): Jacobian σ_max as a first-order estimate (docs/bounds.md §3.4)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor
from torch.func import jacrev

from models import InputError, Stack

from .base import radius
from .spectral import PowerResult, power_norm, random_start, spectral

DENSE_LIMIT = 2048  # n·d above which the full (nd)×(nd) Jacobian is refused


def jacobian_power(F: Callable[[Tensor], Tensor], X: Tensor, **kw) -> PowerResult:
    """‖J_F(X)‖ for each input, matrix-free (F maps [B, n, d] input by input).

    vjp is one backward pass through the recorded graph; jvp is the derivative of the (linear)
    vjp in its cotangent u, a second backward pass: three times faster here than torch.func.jvp,
    which re-traces F at every product.
    """
    Xr = X.detach().requires_grad_(True)
    with torch.enable_grad():
        Y = F(Xr)
        u = torch.zeros_like(Y, requires_grad=True)
        (vjp_u,) = torch.autograd.grad(Y, Xr, u, create_graph=True)

    def T(V: Tensor) -> Tensor:
        return torch.autograd.grad(vjp_u, u, V, retain_graph=True)[0]

    def Tt(W: Tensor) -> Tensor:
        return torch.autograd.grad(Y, Xr, W, retain_graph=True)[0]

    return power_norm(T, Tt, random_start(tuple(X.shape), X, seed=2), 1, name="jacobian", **kw)


def jacobian_dense(F: Callable[[Tensor], Tensor], X: Tensor) -> Tensor:
    """The full Jacobians [B, nd, nd] (rows: output entries, row-major); small sizes only."""
    B, n, d = X.shape
    if n * d > DENSE_LIMIT:
        raise InputError(f"the dense Jacobian needs n*d <= {DENSE_LIMIT}, got n*d = {n * d}")
    return torch.stack([jacrev(lambda x: F(x[None])[0])(X[b]).reshape(n * d, n * d)
                        for b in range(B)])


def jacobian(layer, X: Tensor, eps) -> Tensor:
    """σ_max(J_F(X))·ε, a first-order estimate, not a certificate (Wang & Ruan, docs/bounds.md §3.4)."""
    return jacobian_power(layer.forward, X).sigma * radius(eps, X)


def jacobian_l1linf(layer, X: Tensor, eps) -> Tensor:
    """√(‖J‖₁‖J‖_∞)·ε, the paper's cheap surrogate of σ_max (induced 1- and ∞-norms); an estimate."""
    J = jacobian_dense(layer.forward, X).abs()
    return (J.sum(-2).amax(-1) * J.sum(-1).amax(-1)).sqrt() * radius(eps, X)


def jacobian_exp(stack: Stack, X: Tensor, eps) -> Tensor:
    """ε·exp(Σ_k ‖J_{G_k}(X_k)‖) for residual blocks X_{k+1} = X_k + G_k(X_k), Wang & Ruan eq. 15.

    G_k is block k without its residual branch, evaluated at its projected input; an estimate.
    """
    if not isinstance(stack, Stack):
        raise InputError("jacobian_exp applies to stacks only")
    if not all(b.residual for b in stack.blocks):
        raise InputError("jacobian_exp needs residual blocks (x_{k+1} = x_k + G_k(x_k))")
    states = stack.trajectory(X)
    total = sum(jacobian_power(replace(b, residual=False).forward, Xk).sigma
                for b, Xk in zip(stack.blocks, states, strict=False))
    return radius(eps, X) * torch.exp(total)


def sigma_exact(layer, X: Tensor) -> Tensor:
    """Exact σ_max(J_F(X)) by SVD of the dense Jacobian, for tests and small reports."""
    return spectral(jacobian_dense(layer.forward, X))
