"""Projected gradient ascent over the Frobenius ball ‖Γ‖_F ≤ ε (docs/bounds.md §4): a lower bound for every
upper bound. Restarts are one tensor dimension; the best value ever seen is kept.

The search may run in any dtype; the value reported is measured in float64 (docs/bounds.md §4, "The
dtype"): a float32 objective such as ‖F(X+Γ) − F(X)‖_F is a small difference of large outputs, and
its cancellation can read above the true maximum, which no lower bound may."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models import DotMHA, InputError, Stack, as_batch, check_eps
from models.operators import jacobian_lanczos, m_norms_lanczos, zeta_lanczos

from .objectives import OBJECTIVES, PER_HEAD, Objective
from .objectives import remainder as remainder_objective

# a perturbation Γ [R, *S, n, d] in float64 → the objective at X + Γ in float64 [R, *S]
Measure = Callable[[Tensor], Tensor]
STEP_FIRST, STEP_LAST = 0.5, 0.005  # step sizes as fractions of ε, decayed geometrically


@dataclass(frozen=True)
class PGDResult:
    value: Tensor  # [*S], the best value seen
    delta: Tensor  # [*S, n, d], the perturbation that reached it


def _unit(G: Tensor) -> Tensor:
    """Each trailing n×d matrix scaled to Frobenius norm 1 (zero stays zero)."""
    norm = G.flatten(-2).norm(dim=-1)[..., None, None]
    return torch.where(norm > 0, G / norm.clamp_min(1e-300), torch.zeros_like(G))


def into_ball(G: Tensor, eps: float) -> Tensor:
    """Each trailing n×d matrix of G scaled down onto ‖G‖_F ≤ ρ where it lies outside, in G's dtype,
    with ρ = ε(1 − (N + 4)u) (N = n·d entries, u the unit roundoff): a computed Frobenius norm of N
    entries is within about (N/2 + 1)u of the true one, so the true norm of the result is ≤ ε, and the
    value lost is at most (N + 4)u relative (1.7e-11 at ViT-B's n·d, float64)."""
    rho = eps * (1 - (G.shape[-2] * G.shape[-1] + 4) * torch.finfo(G.dtype).eps / 2)
    norm = G.flatten(-2).norm(dim=-1)[..., None, None]
    return G * torch.clamp(rho / norm.clamp_min(1e-300), max=1.0)


def measured(measure: Measure, G: Tensor, eps: float) -> PGDResult:
    """The best of candidate perturbations G [R, *S, n, d] as ``measure`` sees them: each cast to
    float64 and put into the ball there (:func:`into_ball`), then measured; per problem the largest
    value over R (a NaN counts as −inf) with its perturbation."""
    G = into_ball(G.detach().to(torch.float64), eps)
    values = measure(G).detach()
    values = torch.where(torch.isnan(values), -torch.inf, values)
    value, idx = values.max(dim=0)
    return PGDResult(value, torch.take_along_dim(G, idx[None, ..., None, None], dim=0)[0])


def maximize(objective: Objective, X: Tensor, eps: float, *, steps: int = 100, restarts: int = 8,
             seed: int = 0, starts: Tensor | None = None, measure: Measure | None = None) -> PGDResult:
    """max over ‖Γ‖_F ≤ ε of objective(X + Γ) for each problem of X [*S, n, d].

    Starts: ``restarts`` random points on the sphere (drawn on the CPU from ``seed``, so runs are
    deterministic and device-independent) plus each direction in ``starts`` [k, *S, n, d] scaled to ε.
    Steps are normalised gradients of a size decaying from 0.5ε to 0.005ε, then projection.

    ``measure`` (Γ [R, *S, n, d] in float64 → values [R, *S] in float64), where given, is what the
    value returned is: each start's best perturbation is measured by it (:func:`measured`) and the
    largest is kept, so the value and the perturbation are float64 whatever X's dtype. Without it
    the value is the search's own, in X's dtype.
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
    if measure is not None:
        return measured(measure, best_G, eps)
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


def in_float64(factory: Callable[..., Objective], layer: DotMHA | Stack, X: Tensor, dtype: torch.dtype,
               per_head: bool = False) -> Measure | None:
    """The objective ``factory`` builds, measured in float64: on the layer and X [B, n, d] cast to
    float64, the function the certified bounds are computed on (bounds.registry.evaluate_certified), as
    a :data:`Measure`; None where the search's ``dtype`` is float64 already (its values are kept, bit for
    bit). ``per_head``: X expanded to [B, h, n, d] as the per-head objectives take it."""
    if dtype == torch.float64:
        return None
    X64 = X.detach().to(torch.float64)
    layer64 = layer.to(X64)
    if per_head:
        X64 = X64.unsqueeze(1).expand(-1, layer64.h, -1, -1)
    f = factory(layer64, X64)
    return lambda G: f(X64 + G)


def search_dtype(dtype: torch.dtype | None, X: Tensor) -> torch.dtype:
    """The dtype an attack searches in: ``dtype``, else X's; a floating dtype (InputError otherwise)."""
    dtype = X.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"an attack searches in a floating dtype, not {dtype}")
    return dtype


def attack(layer: DotMHA | Stack, X: Tensor, eps: float, objective: str = "output", *,
           steps: int = 100, restarts: int = 8, seed: int = 0, warm: bool = True,
           dtype: torch.dtype | None = None) -> Tensor:
    """The best PGD value of a named objective: [B], or [B, h] for the per-head objectives.

    The search runs in ``dtype`` (default X's) on the layer and X cast to it. Unless that is float64,
    the value is each start's best perturbation measured in float64 on the layer and X as given
    (:func:`in_float64`), a float64 tensor attained at a point of the ball whatever the search's dtype
    (docs/bounds.md §4); a float64 search's values are its own, as they always were.
    """
    if objective not in OBJECTIVES:
        raise InputError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if objective != "output" and not isinstance(layer, DotMHA):
        raise InputError(f"objective {objective!r} applies to dot layers only, not {layer.kind}")
    if objective == "remainder":  # a second-order objective: its own two-stage ascent
        return attack_remainder(layer, X, eps, steps=steps, restarts=restarts, seed=seed, dtype=dtype)
    X = as_batch(X, layer.d)
    eps = check_eps(eps)
    dtype = search_dtype(dtype, X)
    measure = in_float64(OBJECTIVES[objective], layer, X, dtype, objective in PER_HEAD)
    X = X.to(dtype)
    layer = layer.to(X)
    if objective in PER_HEAD:
        X = X.unsqueeze(1).expand(-1, layer.h, -1, -1)
    starts = warm_starts(layer, X, objective) if warm else None
    fn = OBJECTIVES[objective](layer, X)
    return maximize(fn, X, eps, steps=steps, restarts=restarts, seed=seed, starts=starts,
                    measure=measure).value


# the first ascent's radius, as a fraction of r: attention's Taylor remainder is second order, at a
# small radius it is its quadratic term Q₂ = ½D²F(X)[Γ,Γ], the same at every scale, so an ascent there
# finds Q₂'s maximisers, which start the ascent at r
SMALL = 1e-2


def attack_remainder(layer, X: Tensor, r, *, steps: int = 200, restarts: int = 8,
                     seed: int = 0, dtype: torch.dtype | None = None) -> Tensor:
    """The best attained ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F over ‖Γ‖_F ≤ r, [B] (objective ``remainder``,
    a lower bound of every bound of docs/bounds.md §2.3.1–2.3.2): an ascent at r/100 from
    ``restarts`` random points, then one at r from its best direction (±), ± J's top singular
    direction and ``restarts`` fresh random points; each of the two ascents decays its step from
    0.5r to 0.005r (:func:`maximize`). Both ascents run in ``dtype`` (default X's); the value is
    measured in float64 as :func:`attack`'s is."""
    X = as_batch(X, layer.d)
    r = check_eps(r)
    dtype = search_dtype(dtype, X)
    measure = in_float64(remainder_objective, layer, X, dtype)
    X = X.to(dtype)
    layer = layer.to(X)
    fn = remainder_objective(layer, X)
    small = maximize(fn, X, SMALL * r, steps=steps // 2, restarts=restarts, seed=seed + 1)
    starts = [small.delta, -small.delta]
    warm = warm_starts(layer, X, "output")
    if warm is not None:
        starts.extend(warm)
    return maximize(fn, X, r, steps=steps, restarts=restarts, seed=seed,
                    starts=torch.stack(starts), measure=measure).value
