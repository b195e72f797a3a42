"""An attack on the Taylor remainder itself (docs/bounds.md §4): max over ‖Γ‖_F ≤ r of
‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F, a lower bound for every remainder bound (docs/bounds.md §2.3.1).

The remainder is second order: at a small radius it is its quadratic term Q₂ = ½D²F(X)[Γ,Γ], which
is the same at every scale. So a first ascent at r/100 finds Q₂'s maximisers, and the ascent at r
starts from them (±) beside random points and ± the top singular direction of J_F(X).
"""

from __future__ import annotations

import torch
from torch import Tensor

from models import as_batch, check_eps

from .pgd import maximize, warm_starts

SMALL = 1e-2  # the radius of the first ascent, as a fraction of r


def remainder_objective(layer, X: Tensor):
    """‖F(X') − F(X) − J_F(X)[X' − X]‖_F for X' [R, *S, n, d], J_F(X)[Γ] by forward-mode AD (which
    reverse mode differentiates through)."""
    FX = layer(X).detach()

    def f(Xp: Tensor) -> Tensor:
        G = Xp - X
        _, lin = torch.func.jvp(layer.forward, (X.expand_as(G).contiguous(),), (G,))
        return (layer(Xp) - FX - lin).flatten(-2).norm(dim=-1)

    return f


def attack_remainder(layer, X: Tensor, r, *, steps: int = 200, restarts: int = 8,
                     seed: int = 0) -> Tensor:
    """The best attained ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F over ‖Γ‖_F ≤ r, [B]: an ascent at r/100 from
    ``restarts`` random points, then one at r from its best direction (±), ± J's top singular
    direction and ``restarts`` fresh random points; each of the two ascents decays its step from
    0.5r to 0.005r (attacks.pgd.maximize)."""
    X = as_batch(X, layer.d)
    r = check_eps(r)
    layer = layer.to(X)
    fn = remainder_objective(layer, X)
    small = maximize(fn, X, SMALL * r, steps=steps // 2, restarts=restarts, seed=seed + 1)
    starts = [small.delta, -small.delta]
    warm = warm_starts(layer, X, "output")
    if warm is not None:
        starts.extend(warm)
    return maximize(fn, X, r, steps=steps, restarts=restarts, seed=seed,
                    starts=torch.stack(starts)).value
