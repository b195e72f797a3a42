"""Spectral norms of linear maps without forming their matrices (docs/bounds.md §2.1).

Restarted Lanczos with full reorthogonalisation on T*T, batched over every leading dimension. Plain
power iteration needs thousands of steps here (a residual layer's singular values cluster near 1);
Lanczos needs tens. Like power iteration it converges from below: a Ritz value never exceeds the
top eigenvalue, so the result is an estimate, not a certificate (docs/bounds.md §2.4); the dense
paths are exact. Both the bounds and the PGD warm starts use it, so it lives with the layers.

Also the type of such a map (``LinearOperator``: T and its adjoint) and the exact norms of small
matrices: ``spectral`` (an SVD) and ``product_norm``, the norm of a product of thin factors from
their QRs, without forming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

KRYLOV_DIM = 24  # Lanczos steps between restarts
DEFAULT_MAX_ITER = 2000  # matrix-vector products with T*T


@dataclass(frozen=True)
class LinearOperator:
    """A linear map ``T`` and its adjoint ``Tt`` (⟨T(x), y⟩ = ⟨x, Tt(y)⟩), closed over a point X."""

    T: Callable[[Tensor], Tensor]
    Tt: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class LogitOperator(LinearOperator):
    """The logit map of every head, with its factors U = X A_lᵀ and V = X A_l ([B, h, n, d]; with
    biases U = K_l W^Q_lᵀ and V = Q_l W^K_lᵀ, docs/bounds.md §1.5), from which ξ_l (LoFAST eq. 26)
    and the dense M_l (Lemma 2) are built."""

    U: Tensor
    V: Tensor


def default_tol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


@dataclass(frozen=True)
class LanczosResult:
    sigma: Tensor  # [*batch], the estimate of ‖T‖ (from below)
    vector: Tensor  # [*batch, *shape], unit estimate of the top right singular vector
    iters: int  # products with T*T
    rel_change: float  # largest relative change of sigma over the batch at the last restart
    converged: bool


def _normalize(v: Tensor) -> tuple[Tensor, Tensor]:
    n = v.norm(dim=-1, keepdim=True)
    return torch.where(n > 0, v / n.clamp_min(1e-300), torch.zeros_like(v)), n.squeeze(-1)


def _lanczos(A: Callable[[Tensor], Tensor], v: Tensor, m: int) -> tuple[Tensor, Tensor, int]:
    """One Lanczos cycle of up to m steps from unit v [Bt, N]: (top Ritz value [Bt], vector, steps).

    Each batch element stops on its own once its Krylov space is invariant (β below rounding at the
    operator's scale): continuing would build the basis from rounding noise, lose orthogonality and
    overshoot the top eigenvalue. A stopped element carries zero vectors, which only append zero
    rows to its tridiagonal matrix and leave its top Ritz value alone (T*T is positive semidefinite).
    """
    Q = [v]
    alpha, beta = [], []
    alive = torch.ones(v.shape[0], dtype=torch.bool, device=v.device)
    scale = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    breakdown = 100 * torch.finfo(v.dtype).eps
    for j in range(m):
        w = A(Q[j])
        basis = torch.stack(Q, dim=1)  # [Bt, j+1, N]
        for rep in range(2):  # twice is enough to keep the basis orthogonal in floating point
            c = torch.einsum("bkn,bn->bk", basis, w)
            w = w - torch.einsum("bk,bkn->bn", c, basis)
            if rep == 0:
                alpha.append(c[:, j])
        scale = torch.maximum(scale, alpha[-1].abs())
        q, b = _normalize(w)
        alive = alive & (b > breakdown * scale)
        if j == m - 1 or not bool(alive.any()):
            break
        beta.append(torch.where(alive, b, torch.zeros_like(b)))
        Q.append(torch.where(alive[:, None], q, torch.zeros_like(q)))
    k = len(alpha)
    Tm = torch.diag_embed(torch.stack(alpha, -1))
    if beta:
        off = torch.diag_embed(torch.stack(beta[: k - 1], -1), offset=1)
        Tm = Tm + off + off.transpose(-1, -2)
    evals, evecs = torch.linalg.eigh(Tm)
    ritz = torch.einsum("bk,bkn->bn", evecs[:, :, -1], torch.stack(Q[:k], dim=1))
    return evals[:, -1].clamp_min(0), _normalize(ritz)[0], k


def lanczos_norm(
    T: Callable[[Tensor], Tensor], Tt: Callable[[Tensor], Tensor], start: Tensor, nbatch: int,
    *, tol: float | None = None, max_iter: int = DEFAULT_MAX_ITER, name: str = "operator norm",
) -> LanczosResult:
    """‖T‖ for each batch element by restarted Lanczos on T*T, from ``start`` ([*batch, *shape]);
    T and Tt act on that shape, the first ``nbatch`` dimensions are the batch.

    Stops when the largest relative change of the estimate between restarts falls below ``tol``
    (default 1e-12 in float64), or at ``max_iter`` products with T*T (with a warning).
    """
    tol = default_tol(start.dtype) if tol is None else tol
    batch, shape = start.shape[:nbatch], start.shape[nbatch:]
    flat = lambda t: t.reshape(-1, shape.numel())
    A = lambda u: flat(Tt(T(u.reshape(*batch, *shape))))
    v = _normalize(flat(start))[0]
    theta = torch.zeros(v.shape[0], dtype=start.dtype, device=start.device)
    rel, used = float("inf"), 0
    with torch.no_grad():
        while used < max_iter:
            m = min(KRYLOV_DIM, max_iter - used, shape.numel())
            new, v, k = _lanczos(A, v, m)
            used += k
            rel = float(((new - theta).abs() / new.clamp_min(1e-300)).max())
            theta = torch.maximum(theta, new)
            if rel <= tol or k < m:
                rel = 0.0 if k < m else rel
                break
    converged = rel <= tol
    if not converged:
        warnings.warn(f"{name}: not converged after {used} products (relative change {rel:.2e})",
                      stacklevel=2)
    sigma = theta.sqrt().reshape(batch)
    return LanczosResult(sigma, v.reshape(*batch, *shape), used, rel, converged)


def random_start(shape: tuple[int, ...], like: Tensor, seed: int = 0) -> Tensor:
    """A Gaussian start drawn on the CPU in float64, so every device starts from the same vector."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(like)


def spectral(M: Tensor) -> Tensor:
    """Exact spectral norm of each trailing matrix (SVD); for the small d×d, n×d and n×n factors.
    For a product of thin factors use :func:`product_norm`."""
    return torch.linalg.matrix_norm(M, ord=2)


def product_norm(L: Tensor, R: Tensor) -> Tensor:
    """Exact ‖L R‖₂ for each trailing pair L [..., m, r], R [..., r, p] (leading dimensions
    broadcast as in ``L @ R``), without forming the m×p product (docs/bounds.md §2.1).

    With the QR factorisations ``L = Q_L R_L`` and ``Rᵀ = Q_R R_R`` (Q_L, Q_R with orthonormal
    columns), ``L R = Q_L (R_L R_Rᵀ) Q_Rᵀ``, so ``‖L R‖ = ‖R_L R_Rᵀ‖``: two QRs of the thin factors and
    the SVD of an r×r matrix instead of the SVD of an m×p one. Householder QR is backward stable, so
    the value is as accurate as the SVD of the formed product (relative error O(u·poly(size))).
    Used only where the factors are thin, ``2r ≤ min(m, p)`` (2× to 150× faster than the SVD of the
    product at the suite's sizes; near r = min(m, p) the two QRs cost more than the SVD they save):
    otherwise ``spectral(L @ R)``. Differentiable through the reduced QR when an input requires
    grad (the R-only QR has no derivative).
    """
    m, r = L.shape[-2:]
    p = R.shape[-1]
    if R.shape[-2] != r:
        raise ValueError(f"product_norm: inner sizes differ, L is [..., {m}, {r}], R is {tuple(R.shape)}")
    if 2 * r > min(m, p):
        return spectral(L @ R)
    mode = "reduced" if torch.is_grad_enabled() and (L.requires_grad or R.requires_grad) else "r"
    RL = torch.linalg.qr(L, mode=mode).R  # [..., r, r]
    RR = torch.linalg.qr(R.mT, mode=mode).R  # [..., r, r]
    return spectral(RL @ RR.mT)
