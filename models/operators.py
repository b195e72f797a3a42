"""The linear maps whose norms the bounds need and whose top directions PGD starts from: the
Jacobian of any forward, their Lanczos norms and, for small sizes, their dense matrices
(docs/bounds.md §2, §2.1, §3.4). Their type (``LinearOperator``) lives in models.spectral, beside the
Lanczos that consumes it, so that the layers can build their maps without importing this module.

A dot layer builds its own maps (``DotMHA.delta1_operator``, ``DotMHA.logit_operator``), as
auto_LiRPA keeps an operator's forward and its relaxations on one class. Each norm starts from a
fixed Gaussian (seed 0 for ζ, 1 for ‖M_l‖, 2 for the Jacobian): the bounds and the warm starts of
PGD then see the same values and vectors on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.func import jacrev, vmap

from .errors import InputError
from .spectral import LanczosResult, LinearOperator, lanczos_norm, random_start

if TYPE_CHECKING:
    from .layers import DotMHA

DENSE_LIMIT = 2048  # n·d above which the (nd)×(nd) Jacobian is refused and bench skips dense solvers
# the side of the structured Gram (models.structured) or the dense Jacobian's Gram above which the
# certified ζ, ‖M_l‖ and σ̄_J take the probabilistic certificate instead of the dense one, which is
# tighter (within 1e-9 of the truth, p = 0) and kept while it costs at most about twice as much
# (the measurements: docs/scale.md, "The thresholds in the code")
ZETA_GRAM_LIMIT = 1536
M_GRAM_LIMIT = 1024
JACOBIAN_LIMIT = 1536
# the side of a Gram from which (on the CPU) a Cholesky check of a Lanczos guess replaces its
# eigendecomposition (bounds.norms.verified_gram_norm): the check is the cheaper there (docs/scale.md)
VERIFY_MIN = 256


def jacobian_operator(F: Callable[[Tensor], Tensor], X: Tensor) -> LinearOperator:
    """J_F(X) as a map on [B, n, d] (F maps input by input): T is the jvp, Tt the vjp.

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

    return LinearOperator(T, Tt)


def zeta_lanczos(layer: DotMHA, X: Tensor, **kw) -> LanczosResult:
    """ζ(X) = ‖Δ₁ map‖ per input (LoFAST eq. 15) by restarted Lanczos; ``kw`` goes to lanczos_norm."""
    op = layer.delta1_operator(X)
    return lanczos_norm(op.T, op.Tt, random_start(tuple(X.shape), X, seed=0), 1, name="zeta", **kw)


def m_norms_lanczos(layer: DotMHA, X: Tensor, **kw) -> LanczosResult:
    """‖M_l(X)‖ per input and head (LoFAST eq. 25) by restarted Lanczos; vectors [B, h, n, d]."""
    op = layer.logit_operator(X)
    B, n, d = X.shape
    return lanczos_norm(op.T, op.Tt, random_start((B, layer.h, n, d), X, seed=1), 2, name="M_l", **kw)


def jacobian_lanczos(F: Callable[[Tensor], Tensor], X: Tensor, **kw) -> LanczosResult:
    """‖J_F(X)‖ per input (Wang & Ruan's σ_max, docs/bounds.md §3.4) by restarted Lanczos."""
    op = jacobian_operator(F, X)
    return lanczos_norm(op.T, op.Tt, random_start(tuple(X.shape), X, seed=2), 1, name="jacobian", **kw)


def delta1_matrix(layer: DotMHA, X: Tensor) -> Tensor:
    """K(X) = H⊗I_d + Σ_l P_l(X)⊗C_lᵀ as [B, nd, nd] (row-major vec), LoFAST eq. 15; small sizes."""
    B, n, d = X.shape
    K = torch.einsum("bhij,hca->biajc", layer.attention(X), layer.C()).reshape(B, n * d, n * d)
    return K + layer.H_norm * torch.eye(n * d, dtype=X.dtype, device=X.device)


def logit_matrix(layer: DotMHA, X: Tensor) -> Tensor:
    """M_l(X) as [B, h, n², nd]: row (i,j) is β_ij's coefficients, δ_ik U_ja + δ_jk V_ia (LoFAST
    Lemma 2); small sizes."""
    op = layer.logit_operator(X)
    U, V = op.U, op.V
    B, h, n, d = U.shape
    eye = torch.eye(n, dtype=X.dtype, device=X.device)
    M = torch.einsum("ik,bhja->bhijka", eye, U) + torch.einsum("jk,bhia->bhijka", eye, V)
    return M.reshape(B, h, n * n, n * d)


def jacobian_matrix(F: Callable[[Tensor], Tensor], X: Tensor) -> Tensor:
    """The full Jacobians [B, nd, nd] (rows: output entries, row-major); n·d ≤ DENSE_LIMIT only."""
    B, n, d = X.shape
    if n * d > DENSE_LIMIT:
        raise InputError(f"the dense Jacobian needs n*d <= {DENSE_LIMIT}, got n*d = {n * d}")
    # vmapped over the batch: one batched backward per basis vector for all inputs, not a loop
    return vmap(jacrev(lambda x: F(x[None])[0]))(X).reshape(B, n * d, n * d)
