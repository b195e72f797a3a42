"""Projected gradient ascent over the Frobenius ball ‖Γ‖_F ≤ ε (docs/bounds.md §4): a lower bound for every
upper bound. Restarts are one tensor dimension; the best value ever seen is kept."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from models import DotMHA, InputError, Stack, as_batch, check_eps
from models.operators import jacobian_lanczos, m_norms_lanczos, zeta_lanczos

from .objectives import OBJECTIVES, PER_HEAD, Objective
from .objectives import remainder as remainder_objective

STEP_FIRST, STEP_LAST = 0.5, 0.005  # step sizes as fractions of ε, decayed geometrically


@dataclass(frozen=True)
class PGDResult:
    value: Tensor  # [*S], the best value seen
    delta: Tensor  # [*S, n, d], the perturbation that reached it


def _unit(G: Tensor) -> Tensor:
    """Each trailing n×d matrix scaled to Frobenius norm 1 (zero stays zero)."""
    norm = G.flatten(-2).norm(dim=-1)[..., None, None]
    return torch.where(norm > 0, G / norm.clamp_min(1e-300), torch.zeros_like(G))


def maximize(objective: Objective, X: Tensor, eps: float, *, steps: int = 100, restarts: int = 8,
             seed: int = 0, starts: Tensor | None = None) -> PGDResult:
    """max over ‖Γ‖_F ≤ ε of objective(X + Γ) for each problem of X [*S, n, d].

    Starts: ``restarts`` random points on the sphere (drawn on the CPU from ``seed``, so runs are
    deterministic and device-independent) plus each direction in ``starts`` [k, *S, n, d] scaled to ε.
    Steps are normalised gradients of a size decaying from 0.5ε to 0.005ε, then projection.
    """
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(restarts, *X.shape, generator=g, dtype=torch.float64).to(X)
    G = eps * _unit(rand if starts is None else torch.cat([starts.to(X), rand]))
    best = torch.full(G.shape[:-2], -torch.inf, dtype=X.dtype, device=X.device)
    best_G = torch.zeros_like(G)
    X = X.detach()
    with torch.enable_grad():
        for t in range(steps + 1):
            G.requires_grad_(True)
            val = objective(X + G)
            with torch.no_grad():
                better = val > best
                best = torch.where(better, val, best)
                best_G = torch.where(better[..., None, None], G, best_G)
            if t == steps:
                break
            (grad,) = torch.autograd.grad(val.sum(), G)
            with torch.no_grad():
                step = eps * STEP_FIRST * (STEP_LAST / STEP_FIRST) ** (t / max(steps - 1, 1))
                G = G + step * _unit(torch.nan_to_num(grad))
                norm = G.flatten(-2).norm(dim=-1)[..., None, None]
                G = G * torch.clamp(eps / norm.clamp_min(1e-300), max=1.0)
    value, idx = best.max(dim=0)
    delta = torch.take_along_dim(best_G, idx[None, ..., None, None], dim=0)[0]
    return PGDResult(value, delta)


def warm_starts(layer, X: Tensor, objective: str) -> Tensor | None:
    """Directions [k, *S, n, d] likely near the maximiser: ± the top right singular vector of the
    linear part (Δ₁ for dot layers, J_F for any layer, M_l per head for Δ₂,₁)."""
    loose = {"max_iter": 200, "tol": 1e-6}  # a start needs a direction, not a converged norm
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if objective in ("output", "delta1", "delta2"):
            vs = [jacobian_lanczos(layer.forward, X, **loose).vector]
            if isinstance(layer, DotMHA):
                vs.append(zeta_lanczos(layer, X, **loose).vector)
        elif objective == "delta21":
            vs = [m_norms_lanczos(layer, X[:, 0], **loose).vector]
        else:
            return None
    return torch.stack([s * v for v in vs for s in (1.0, -1.0)])


def attack(layer: DotMHA | Stack, X: Tensor, eps: float, objective: str = "output", *,
           steps: int = 100, restarts: int = 8, seed: int = 0, warm: bool = True) -> Tensor:
    """The best PGD value of a named objective: [B], or [B, h] for the per-head objectives."""
    if objective not in OBJECTIVES:
        raise InputError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if objective != "output" and not isinstance(layer, DotMHA):
        raise InputError(f"objective {objective!r} applies to dot layers only, not {layer.kind}")
    if objective == "remainder":  # a second-order objective: its own two-stage ascent
        return attack_remainder(layer, X, eps, steps=steps, restarts=restarts, seed=seed)
    X = as_batch(X, layer.d)
    eps = check_eps(eps)
    layer = layer.to(X)
    if objective in PER_HEAD:
        X = X.unsqueeze(1).expand(-1, layer.h, -1, -1)
    starts = warm_starts(layer, X, objective) if warm else None
    fn = OBJECTIVES[objective](layer, X)
    return maximize(fn, X, eps, steps=steps, restarts=restarts, seed=seed, starts=starts).value


# the first ascent's radius, as a fraction of r: attention's Taylor remainder is second order, at a
# small radius it is its quadratic term Q₂ = ½D²F(X)[Γ,Γ], the same at every scale, so an ascent there
# finds Q₂'s maximisers, which start the ascent at r
SMALL = 1e-2


def attack_remainder(layer, X: Tensor, r, *, steps: int = 200, restarts: int = 8,
                     seed: int = 0) -> Tensor:
    """The best attained ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F over ‖Γ‖_F ≤ r, [B] (objective ``remainder``,
    a lower bound of every bound of docs/bounds.md §2.3.1–2.3.2): an ascent at r/100 from
    ``restarts`` random points, then one at r from its best direction (±), ± J's top singular
    direction and ``restarts`` fresh random points; each of the two ascents decays its step from
    0.5r to 0.005r (:func:`maximize`)."""
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
