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

# rings and sectors of the (a, b) half-disc: the bound's excess over the true maximum is about the
# error's change across a cell, measured against a fine grid in the tests
CELLS = 48
# the ratio of consecutive rings' radii: ‖Δ‖² changes by at most 1/RING² across a ring, and the
# inner disc (RING^(CELLS − 1)·r: 0.09·r) takes the closed forms' quadratic constant
RING = 0.95
# the most cells bounded at once (B·n·CELLS² of them, two dozen float64 tensors of that size)
CHUNK = 1 << 21


def exact_error(nu: Tensor, R: float, r: Tensor, a_lo: Tensor, a_hi: Tensor, tangential: bool,
                cells: int = CELLS) -> tuple[Tensor, Tensor]:
    """Upper bounds of ‖e‖ and of ‖e‖/‖Δ‖² over the token's ball for one of LayerProject's forms.

    Args:
        nu: the clean tokens' norms ν, [B, n].
        R: the sphere's radius.
        r: the tokens' radii (upper bounds of ‖Δ_t‖), [B, n].
        a_lo, a_hi: bounds of the radial change a = uᵀΔ, [B, n].
        tangential: the tangential form (linear part (R/ν)(I − uuᵀ), ReLU v = relu(R − ν − a); meant
            for ν > R) rather than the radial one (linear part I, ReLU w = relu(ν − R + a)).
        cells: cells per axis.

    Returns:
        E [B, n] ≥ sup ‖e‖ and K [B, n] ≥ sup ‖e‖/‖Δ‖² over {0 < ‖Δ‖ ≤ r, a_lo ≤ uᵀΔ ≤ a_hi}, rounding
        included; K is +inf where e has a first-order part (the radial form outside the sphere).
    """
    shape = nu.shape
    flat = [t.reshape(-1) for t in (nu, r, a_lo, a_hi)]
    rows = max(1, CHUNK // (cells * cells))
    out = [_bound(*(t[i:i + rows] for t in flat), R, tangential, cells)
           for i in range(0, flat[0].numel(), rows)]
    if not out:
        return nu.new_zeros(shape), nu.new_zeros(shape)
    return tuple(torch.cat(part).reshape(shape) for part in zip(*out, strict=True))


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


def _bound(nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, R: float, tangential: bool,
           cells: int) -> tuple[Tensor, Tensor]:
    """:func:`exact_error` on flat [m] inputs: E over boxes in (a, b), K over polar cells."""
    return _largest(nu, r, a_lo, a_hi, R, tangential, cells), _ratio(nu, r, a_lo, a_hi, R, tangential, cells)


def _slack(U: Tensor, nu: Tensor, r: Tensor, R: float) -> Tensor:
    """U with the rounding of its closed forms: every operation is monotone in the cell's corners, and
    its rounding, a few ulps of the quantities ν, R and r that each is built from, is covered by 64u of
    their sum (and 64u of U itself)."""
    u = torch.finfo(U.dtype).eps / 2
    return U * (1 + 64 * u) + 64 * u * (nu + r + R)[:, None, None]


def _largest(nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, R: float, tangential: bool,
             cells: int) -> Tensor:
    """sup ‖e‖ over boxes: ``cells`` columns across a's range [a_lo, a_hi] ∩ [−r, r] (narrow: the
    error changes fastest along a), each cut into ``cells`` rows from b = 0 to its top on the disc."""
    dtype = nu.dtype
    u = torch.finfo(dtype).eps / 2
    lo, hi = torch.maximum(a_lo, -r), torch.minimum(a_hi, r)
    hi = torch.maximum(hi, lo)  # an empty cut (never met: a = 0 is in the range) stays one point
    k = torch.arange(cells + 1, dtype=dtype, device=nu.device) / cells
    edges = lo[:, None] + (hi - lo)[:, None] * k  # [m, K+1], the last edge set to hi exactly
    edges = torch.cat([edges[:, :-1], hi[:, None]], -1)
    a1, a2 = edges[:, :-1], edges[:, 1:]  # [m, K]: consecutive cells share their computed edge
    near = torch.where((a1 <= 0) & (a2 >= 0), 0.0, torch.minimum(a1.square(), a2.square()))
    top = (r[:, None].square() - near).clamp_min(0).sqrt() * (1 + 4 * u)  # b's top, rounded up
    b = top[..., None] * k  # [m, K, K+1]
    b1, b2 = b[..., :-1], b[..., 1:]
    a1, a2 = a1[..., None].expand_as(b1), a2[..., None].expand_as(b1)
    U = _slack(_error_box(nu[:, None, None], R, a1, a2, b1, b2, tangential), nu, r, R)
    return U.flatten(1).amax(-1)


def _ratio(nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, R: float, tangential: bool,
           cells: int) -> Tensor:
    """sup ‖e‖/‖Δ‖² over polar cells of the half-disc: ``cells`` rings whose radii grow by 1/RING (so
    that ‖Δ‖² changes by at most 1/RING² across one) around an inner disc, times ``cells`` sectors,
    each cell's (a, b) box cut to a's range."""
    dtype, device = nu.dtype, nu.device
    u = torch.finfo(dtype).eps / 2
    rings = r[:, None] * RING ** torch.arange(cells - 1, -1, -1, dtype=dtype, device=device)  # [m, K]
    rings = torch.cat([torch.zeros_like(r)[:, None], rings[:, :-1], (r * (1 + 4 * u))[:, None]], -1)
    p1, p2 = rings[:, :-1, None], rings[:, 1:, None]  # [m, K, 1]: the inner disc is the first ring
    th = torch.arange(cells + 1, dtype=dtype, device=device) * (torch.pi / cells)
    cos, sin = th.cos(), th.sin()
    c1, c2 = cos[1:], cos[:-1]  # cos falls on [0, π]: the sector's cos in [c1, c2]
    s_lo = torch.minimum(sin[1:], sin[:-1]).clamp_min(0)
    s_hi = torch.where((th[:-1] <= torch.pi / 2) & (th[1:] >= torch.pi / 2), 1.0,
                       torch.maximum(sin[1:], sin[:-1]))
    pad = 4 * u * p2  # each box widened by the rounding of its corners, so that the boxes cover
    a1 = torch.minimum(p1 * c1, p2 * c1) - pad
    a2 = torch.maximum(p1 * c2, p2 * c2) + pad
    b1 = (p1 * s_lo - pad).clamp_min(0)
    b2 = p2 * s_hi + pad  # [m, K, K]
    a1, a2 = torch.maximum(a1, a_lo[:, None, None]), torch.minimum(a2, a_hi[:, None, None])
    empty = a1 > a2  # the cell misses a's range
    a2 = torch.maximum(a1, a2)
    U = _slack(_error_box(nu[:, None, None], R, a1, a2, b1, b2, tangential), nu, r, R)
    # a cell's ratio: its bound U over its inner radius², or the closed forms at its outer radius (the
    # inner disc, where the first is 0/0; they are exact there to first order), or, split at the
    # radius rv below which the form is simpler (tangential: no v, as a ≥ −‖Δ‖ > R − ν; radial with
    # ν ≤ R: e = 0 inside the sphere), the simpler closed form below it and U/rv² beyond it
    tiny = torch.finfo(dtype).tiny
    N, outer = nu[:, None, None].expand_as(U), p2.expand_as(U)
    inner = (p1 * (1 - 4 * u)).square().expand_as(U)
    ratio = torch.where(inner > 0, U / inner.clamp_min(tiny), torch.inf)
    ratio = torch.minimum(ratio, closed_form(N, R, outer, tangential, below=a1))
    rv = ((N - R) if tangential else (R - N)).clamp_min(0) * (1 - 4 * u)
    simple = (closed_form(N, R, outer, tangential, below=torch.full_like(U, torch.inf)) if tangential
              else torch.zeros_like(U))
    far = torch.maximum(inner, rv.square())
    split = torch.maximum(simple, torch.where(outer >= rv, U / far.clamp_min(tiny), 0.0))
    ratio = torch.minimum(ratio, torch.where(far > 0, split, torch.inf))
    return torch.where(empty, 0.0, ratio).flatten(1).amax(-1)


def _error_box(nu: Tensor, R: float, a1: Tensor, a2: Tensor, b1: Tensor, b2: Tensor,
               tangential: bool) -> Tensor:
    """An upper bound of ‖e(a, b)‖ over the box [a1, a2] × [b1, b2] (b ≥ 0): the largest over the
    cases the box meets of each case's closed form, every one monotone in c = ν + a, b and
    s = (c² + b²)^½ on the part of the box where the case holds (docs/bounds.md §5.1)."""
    c1, c2 = nu + a1, nu + a2
    hyp = lambda x, y: (x.square() + y.square()).sqrt()
    # |c| over the box, and over its part below the sphere's radius (c ≤ R)
    low = torch.where((c1 <= 0) & (c2 >= 0), 0.0, torch.minimum(c1.abs(), c2.abs()))
    top_below = torch.maximum(c1.abs(), c2.clamp_max(R).abs())
    s1 = hyp(low, b1)
    zero = torch.zeros_like(s1)
    # the part with c > R: s ≥ (max(c1, R)² + b1²)^½ and R(1 − c/s) = Rb²/(s(s + c)), free of the
    # cancellation of 1 − c/s
    cr = c1.clamp_min(R)
    sr, s_hi = hyp(cr, b1), hyp(c2.abs(), b2)
    eu_above = R * b2.square() / (sr * (sr + cr))
    if not tangential:
        # s ≤ R: e = 0. c ≤ R < s: ‖e‖ = s − R. c > R: ‖e‖² = R²(1 − c/s)² + (1 − R/s)²b²
        outside = torch.where((c1 <= R) & (hyp(top_below, b2) > R), hyp(top_below, b2) - R, zero)
        beyond = torch.hypot(eu_above, (1 - R / s_hi).clamp_min(0) * b2)
        return torch.maximum(outside, torch.where(c2 > R, beyond, zero))
    # s ≥ R: e_⊥ = Rb(1/s − 1/ν), and e_u = R(c/s − 1) (c ≥ R) or c(R/s − 1) (c < R);
    # s < R: e = (1 − R/ν)·b along Δ − au
    perp = lambda lo, hi: R * b2 * torch.maximum((1 / lo - 1 / nu).abs(), (1 / hi - 1 / nu).abs())
    A = torch.hypot(eu_above, perp(sr.clamp_min(R), s_hi.clamp_min(R)))
    sb_hi = hyp(top_below, b2)  # c < R here
    B = torch.hypot(top_below * (1 - R / sb_hi).clamp_min(0), perp(s1.clamp_min(R), sb_hi.clamp_min(R)))
    # s < R: b < (R² − c²)^½
    C = (1 - R / nu).abs() * torch.minimum(b2, (R * R - low.square()).clamp_min(0).sqrt())
    A = torch.where((s_hi >= R) & (c2 >= R), A, zero)
    B = torch.where((sb_hi >= R) & (c1 < R), B, zero)
    C = torch.where(s1 < R, C, zero)
    return torch.maximum(torch.maximum(A, B), C)
