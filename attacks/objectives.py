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
    P0 = layer.attention(Xh).detach()

    def f(Xp: Tensor) -> Tensor:
        diff = _fro(layer.attention(Xp) - P0)  # [R, B, h(copies), h(heads)]
        return torch.diagonal(diff, dim1=-2, dim2=-1)

    return f


def delta22(layer, Xh: Tensor) -> Objective:
    """Per head ‖X' C_l‖ (spectral), on Xh = X expanded to [B, h, n, d]."""
    C = _dot(layer, "delta22").C()

    def f(Xp: Tensor) -> Tensor:
        XC = torch.einsum("...lnd,lde->...lne", Xp, C)  # copy l times its own C_l
        return torch.linalg.matrix_norm(XC, ord=2)

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
