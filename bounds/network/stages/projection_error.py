"""LayerProject's error on a token's ball, bounded through the map's symmetry (docs/bounds.md §5.1,
"LayerProject's error on the token's ball").

p(x) = x·min(1, R/‖x‖) commutes with every rotation about the clean token's direction u, and so do
both forms' linear parts. So the norm of the error e that a form leaves depends only on a = uᵀΔ and
b = ‖Δ − au‖, and its largest value over the token's ball is a maximum over a half-disc in the
(a, b) plane, cut to the range of a that the set (or the backward pass) gives. That maximum is
bounded cell by cell from the error's closed forms, each monotone in the quantities it is built from.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .symmetric import CELLS, abs_low, hyp, on_half_disc

# the parts of the error e a bound may be asked for: its norm, |uᵀe| (along the clean token) and
# ‖e − (uᵀe)u‖ (across it)
PARTS = ("norm", "along", "across")


def exact_error(nu: Tensor, R: float, r: Tensor, a_lo: Tensor, a_hi: Tensor, tangential: bool,
                cells: int = CELLS, part: str = "norm") -> tuple[Tensor, Tensor]:
    """Upper bounds of ‖e‖ and of ‖e‖/‖Δ‖² over the token's ball for one of LayerProject's forms
    (or of one part of e, ``part``).

    Args:
        nu: the clean tokens' norms ν, [B, n].
        R: the sphere's radius.
        r: the tokens' radii (upper bounds of ‖Δ_t‖), [B, n].
        a_lo, a_hi: bounds of the radial change a = uᵀΔ, [B, n].
        tangential: the tangential form (linear part (R/ν)(I − uuᵀ), ReLU v = relu(R − ν − a); meant
            for ν > R) rather than the radial one (linear part I, ReLU w = relu(ν − R + a)).
        cells: cells per axis.
        part: ``"norm"`` bounds ‖e‖; ``"along"`` |uᵀe| and ``"across"`` ‖e − (uᵀe)u‖ (:data:`PARTS`),
            both at most ‖e‖, so the closed forms' ratio still bounds them near the origin.

    Returns:
        E [B, n] ≥ sup ‖e‖ (or its part) and K [B, n] ≥ sup ‖e‖/‖Δ‖² (the same) over
        {0 < ‖Δ‖ ≤ r, a_lo ≤ uᵀΔ ≤ a_hi}, rounding included; K is +inf where e has a first-order part
        (the radial form outside the sphere).
    """
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} of LayerProject's error; expected one of {PARTS}")
    box = lambda nu_, a1, a2, b1, b2: _error_box(nu_, R, a1, a2, b1, b2, tangential, part)

    def closed(nu_: Tensor, rho: Tensor, below: Tensor, simple: bool) -> Tensor:
        # below r_v the form is simpler: tangential, no v (a ≥ −‖Δ‖ > R − ν); radial with ν ≤ R,
        # e = 0 inside the sphere
        if simple:
            return (closed_form(nu_, R, rho, True, below=torch.full_like(rho, torch.inf)) if tangential
                    else torch.zeros_like(rho))
        return closed_form(nu_, R, rho, tangential, below=below)

    rv = ((nu - R) if tangential else (R - nu)).clamp_min(0)
    return on_half_disc(box, closed, nu, r, a_lo, a_hi, rv, nu + r + R, cells)


def closed_form(nu: Tensor, R: float, rho: Tensor, tangential: bool, below: Tensor | None = None) -> Tensor:
    """The closed forms' ‖e‖/‖Δ‖² on the ball of radius ρ (docs/bounds.md §5.1, LayerProject), +inf
    where they hold a first-order part or ρ reaches ν; nondecreasing in ρ. ``below``: a lower bound of
    a on the part of the ball bounded (the tangential form's ReLU v is 0 where a ≥ R − ν)."""
    gap = nu - rho
    inf = torch.full_like(gap, torch.inf)
    if tangential:  # R/(√3 g²), and 0.809/g where the ball reaches inside the sphere (a < R − ν)
        reach = rho >= nu - R if below is None else (rho >= nu - R) & (below < R - nu)
        K = R / (3**0.5 * gap.square()) + torch.where(reach, (0.25 + 5**0.5 / 4) / gap, 0.0)
        return torch.where((gap > 0) & (nu > R), K, inf)
    D = torch.maximum(R + gap, 2 * gap)
    Rp = gap.clamp_min(R)
    K = (1 / D + (1 / D**2 + 1 / Rp**2).sqrt()) / 2
    K = torch.where(nu + rho <= R, 0.0, K)  # the ball inside the sphere: p is the identity there
    return torch.where((gap > 0) & (nu <= R), K, inf)


def _error_box(nu: Tensor, R: float, a1: Tensor, a2: Tensor, b1: Tensor, b2: Tensor,
               tangential: bool, part: str = "norm") -> Tensor:
    """An upper bound of ‖e(a, b)‖ (or of its part along u or across it, ``part``) over the box
    [a1, a2] × [b1, b2] (b ≥ 0): the largest over the cases the box meets of each case's closed
    form, every one monotone in c = ν + a, b and s = (c² + b²)^½ on the part of the box where the
    case holds (docs/bounds.md §5.1). In every case e = e_u·u + e_⊥ with e_⊥ ⊥ u, and the norm is
    (e_u² + ‖e_⊥‖²)^½ of the two parts' bounds."""
    join = {"norm": torch.hypot, "along": lambda x, y: x, "across": lambda x, y: y}[part]
    c1, c2 = nu + a1, nu + a2
    # |c| over the box, and over its part below the sphere's radius (c ≤ R)
    low = abs_low(c1, c2)
    top_below = torch.maximum(c1.abs(), c2.clamp_max(R).abs())
    s1 = hyp(low, b1)
    zero = torch.zeros_like(s1)
    # the part with c > R: s ≥ (max(c1, R)² + b1²)^½ and R(1 − c/s) = Rb²/(s(s + c)), free of the
    # cancellation of 1 − c/s
    cr = c1.clamp_min(R)
    sr, s_hi = hyp(cr, b1), hyp(c2.abs(), b2)
    eu_above = R * b2.square() / (sr * (sr + cr))
    if not tangential:
        # s ≤ R: e = 0. c ≤ R < s: e = −(1 − R/s)x, ‖e‖ = s − R (|e_u| = (1 − R/s)c, ‖e_⊥‖ = (1 − R/s)b).
        # c > R: ‖e‖² = R²(1 − c/s)² + (1 − R/s)²b²
        sb = hyp(top_below, b2)
        cut = (1 - R / sb).clamp_min(0)
        out = sb - R if part == "norm" else cut * (top_below if part == "along" else b2)
        outside = torch.where((c1 <= R) & (sb > R), out, zero)
        beyond = join(eu_above, (1 - R / s_hi).clamp_min(0) * b2)
        return torch.maximum(outside, torch.where(c2 > R, beyond, zero))
    # s ≥ R: e_⊥ = Rb(1/s − 1/ν), and e_u = R(c/s − 1) (c ≥ R) or c(R/s − 1) (c < R);
    # s < R: e = (1 − R/ν)·b along Δ − au
    perp = lambda lo, hi: R * b2 * torch.maximum((1 / lo - 1 / nu).abs(), (1 / hi - 1 / nu).abs())
    A = join(eu_above, perp(sr.clamp_min(R), s_hi.clamp_min(R)))
    sb_hi = hyp(top_below, b2)  # c < R here
    B = join(top_below * (1 - R / sb_hi).clamp_min(0), perp(s1.clamp_min(R), sb_hi.clamp_min(R)))
    # s < R: b < (R² − c²)^½, and e = (1 − R/ν)Δ_⊥ lies across u
    C = (1 - R / nu).abs() * torch.minimum(b2, (R * R - low.square()).clamp_min(0).sqrt())
    C = torch.zeros_like(C) if part == "along" else C
    A = torch.where((s_hi >= R) & (c2 >= R), A, zero)
    B = torch.where((sb_hi >= R) & (c1 < R), B, zero)
    C = torch.where(s1 < R, C, zero)
    return torch.maximum(torch.maximum(A, B), C)
