"""Attention's second-order term along a functional, exactly (docs/bounds.md §5.1, "Attention's
remainder along a functional, its second order exact").

Along a functional Λ on attention's output, the second-order term of F's Taylor expansion at the clean
input X is ⟨Λ, Q₂(Γ)⟩ = ½γᵀH_Λγ, with H_Λ the Hessian of X ↦ ⟨Λ, F(X)⟩ and γ = vec Γ. So over
‖Γ‖_F ≤ r, −⟨Λ, Q₂(Γ)⟩ ≤ ½·max(0, λ_max(−H_Λ))·r²: the heads, rows and keys share Γ's energy, and the
sign of the curvature is kept, where the row bounds pay each row its own worst Γ, in absolute value.
H_Λ is formed by torch.func (forward over reverse), its top eigenvalue certified by Cholesky.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models import DotMHA

from ...forms import ROUND_REL
from ...norms import cholesky_check, top_estimate

# the most functionals a backward step forms Hessians for: a pass over the margins (classes − 1), not
# the units' ranges (thousands of functionals, each an n·d-square Hessian)
CURVED_MAX = 16
# the largest n·d for which they are formed: n·d Hessian-vector products a functional, about 40 ms
# a functional at the digits ViTs' n·d of 544, 1.8 s at the Fashion-MNIST ViTs' 2,176 (nine of them on
# each block cost more than the whole second pass there)
CURVED_ND = 1024
# the guess's relative raise that the Cholesky check must confirm (as bounds.norms.VERIFY_TAU, of
# the Hessian's Frobenius norm: the guess may be near 0 where the curvature is all positive)
TAU = 1e-9


def hessians(layer: DotMHA, X: Tensor, Lam: Tensor) -> Tensor:
    """H_Λ for each functional, [B, C, n·d, n·d]: the Hessian of Z ↦ ⟨Λ_c, F(Z)⟩ at X [B, n, d],
    Λ [B, C, n, d], symmetrised (forward-over-reverse mode leaves it symmetric up to rounding)."""
    B, C, n, d = Lam.shape

    def value(Z: Tensor, L: Tensor) -> Tensor:
        return (layer.forward(Z[None])[0] * L).sum()

    hess = torch.func.vmap(torch.func.jacfwd(torch.func.grad(value)), in_dims=(None, 0))
    H = torch.stack([hess(X[b], Lam[b]).reshape(C, n * d, n * d) for b in range(B)])
    return 0.5 * (H + H.mT)


def negative_curvature(layer: DotMHA, X: Tensor, Lam: Tensor) -> Tensor:
    """An upper bound of max(0, λ_max(−H_Λ)) for each functional, [B, C] (:func:`hessians`): a guess
    from below (:func:`bounds.norms.top_estimate`) raised by TAU of ‖H‖_F and confirmed by a Cholesky
    factorisation (:func:`bounds.norms.cholesky_check`), where that fails ‖H‖_F itself (|λ| ≤ ‖H‖_F);
    plus ROUND_REL of ‖H‖_F for the formation of H's entries (each a few roundings of sums of products
    of p, the logits' factors and the values, far below 1e-9 of the whole on the layers measured)."""
    B, C = Lam.shape[:2]
    H = -hessians(layer, X, Lam).flatten(0, 1).to(torch.float64)
    fro = H.flatten(1).norm(dim=-1)
    theta = top_estimate(H)
    mu = theta.clamp_min(0) + TAU * fro
    guessed = torch.isfinite(mu) & (mu > 0)
    ok, lam = cholesky_check(H, torch.where(guessed, mu, torch.ones_like(mu)))
    top = torch.where(ok & guessed, lam, fro)
    return (top.clamp_min(0) + ROUND_REL * fro).reshape(B, C).to(Lam.dtype)
