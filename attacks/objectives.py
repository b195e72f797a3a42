"""The objectives of docs/bounds.md §4, each a map from perturbed inputs X' [R, *S, n, d] to values [R, *S].

A factory takes the layer and the clean input X [*S, n, d] and returns the objective; per-head
objectives take X expanded to [B, h, n, d] so that every head gets its own perturbation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from models import DotMHA, InputError

Objective = Callable[[Tensor], Tensor]


def _fro(x: Tensor) -> Tensor:
    return x.flatten(-2).norm(dim=-1)


def output(layer, X: Tensor) -> Objective:
    """End to end: ‖F(X') − F(X)‖_F, for any layer or stack."""
    FX = layer(X).detach()
    return lambda Xp: _fro(layer(Xp) - FX)


def _dot(layer, name: str) -> DotMHA:
    if not isinstance(layer, DotMHA):
        raise InputError(f"objective {name!r} applies to dot layers only, not {layer.kind}")
    return layer


def delta1(layer, X: Tensor) -> Objective:
    """‖Δ₁‖ = ‖HΓ + Σ_l P_l(X) Γ C_l‖_F with Γ = X' − X (X: [B, n, d])."""
    T = _dot(layer, "delta1").delta1_operator(X).T
    return lambda Xp: _fro(T(Xp - X))


def delta2(layer, X: Tensor) -> Objective:
    """‖Δ₂‖ = ‖Σ_l (P_l(X') − P_l(X)) X' C_l‖_F."""
    layer = _dot(layer, "delta2")
    P0, C = layer.attention(X).detach(), layer.C()

    def f(Xp: Tensor) -> Tensor:
        dP = layer.attention(Xp) - P0
        return _fro(torch.einsum("...hne,hef->...nf", dP @ Xp.unsqueeze(-3), C))

    return f


def delta21(layer, Xh: Tensor) -> Objective:
    """Per head ‖P_l(X') − P_l(X)‖_F, on Xh = X expanded to [B, h, n, d]."""
    layer = _dot(layer, "delta21")
    P0 = layer.attention(Xh, own=True).detach()  # each copy through its own head alone
    return lambda Xp: _fro(layer.attention(Xp, own=True) - P0)  # [R, B, h]


def delta22(layer, Xh: Tensor) -> Objective:
    """Per head ‖X' C_l‖ (spectral), on Xh = X expanded to [B, h, n, d]: through its thin factors,
    ‖X'C_l‖² = λ_max(V M Vᵀ) with V = X'W^V_l [n, d_h] and M = W^O_l W^O_lᵀ [d_h, d_h], the top
    eigenvalue of the n×n Gram V M Vᵀ (C_l = W^V_l W^O_l), where an SVD of the n×d product X'C_l was
    12× the work on MiniLM's layers."""
    layer = _dot(layer, "delta22")
    M = layer.W_o @ layer.W_o.mT  # [h, d_h, d_h]

    def f(Xp: Tensor) -> Tensor:
        V = torch.einsum("...lnd,lde->...lne", Xp, layer.W_v)  # copy l through its own W^V_l
        gram = V @ M @ V.mT
        return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()

    return f


def remainder(layer, X: Tensor) -> Objective:
    """Attention's Taylor remainder ‖F(X') − F(X) − J_F(X)[X' − X]‖_F (docs/bounds.md §2.3.1), J_F(X)[Γ]
    by forward-mode AD (which reverse mode differentiates through); pgd.attack_remainder attacks it."""
    layer = _dot(layer, "remainder")
    FX = layer(X).detach()

    def f(Xp: Tensor) -> Tensor:
        G = Xp - X
        _, lin = torch.func.jvp(layer.forward, (X.expand_as(G).contiguous(),), (G,))
        return _fro(layer(Xp) - FX - lin)

    return f


OBJECTIVES: dict[str, Callable] = {"output": output, "delta1": delta1, "delta2": delta2,
                                   "delta21": delta21, "delta22": delta22, "remainder": remainder}
PER_HEAD = frozenset({"delta21", "delta22"})
