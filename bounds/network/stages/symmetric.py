"""The error of a map that commutes with the rotations about the clean token's direction u, bounded on
the token's ball (docs/bounds.md §5.1, "LayerProject's error on the token's ball"): its norm depends
only on a = uᵀΔ and b = ‖Δ − au‖, so its largest value, and its largest ratio to ‖Δ‖², are maxima
over a half-disc in the (a, b) plane, cut to the range of a. Both are bounded cell by cell from the
error's closed forms, which the caller gives (LayerProject's and LayerNorm's stages)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..budget import shared

# the most multiply-adds (functionals × tokens × d × the set's columns) a backward step spends on the
# ranges of the functionals' parts across the tokens (:func:`across_corners`): every pass over the
# margins and the units' ranges of the zoo's ViTs (at most 1.5·10¹⁰ on the Fashion-MNIST ones, 1–3 s on
# one core); far above it a range is skipped, never wrong
ACROSS_WORK = 2**37
# the most entries the supports of a chunk of functionals hold at once (1 GiB of float64)
ACROSS_CHUNK = 2**27
# rings and sectors of the (a, b) half-disc: the bound's excess over the true maximum is about the
# error's change across a cell, measured against a fine grid in the tests
CELLS = 48
# the ratio of consecutive rings' radii: ‖Δ‖² changes by at most 1/RING² across a ring, and the
# inner disc (RING^(CELLS − 1)·r: 0.09·r) takes the closed forms' quadratic constant
RING = 0.95
# the most cells bounded at once (B·n·CELLS² of them, two dozen float64 tensors of that size)
CHUNK = 1 << 21

# box(ν, a1, a2, b1, b2) → an upper bound of ‖e‖ on each box [a1, a2] × [b1, b2] (b ≥ 0)
Box = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# closed(ν, ρ, below, simple) → ‖e‖/‖Δ‖² ≤ it on the ball of radius ρ, nondecreasing in ρ (+inf where
# none holds); ``below`` a lower bound of a on the part bounded, ``simple`` the part with ‖Δ‖ < r_v
Closed = Callable[[Tensor, Tensor, Tensor, bool], Tensor]


def on_half_disc(box: Box, closed: Closed, nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor,
                 rv: Tensor, scale: Tensor, cells: int = CELLS) -> tuple[Tensor, Tensor]:
    """Upper bounds of sup ‖e‖ and sup ‖e‖/‖Δ‖² over {0 < ‖Δ‖ ≤ r, a_lo ≤ a ≤ a_hi}, per token.

    Args:
        box: the error's bound on a box of (a, b).
        closed: the closed forms' quadratic constant on a ball (for the cells near the origin).
        nu: the clean tokens' norms, [B, n].
        r: the tokens' radii, [B, n].
        a_lo, a_hi: bounds of a = uᵀΔ, [B, n].
        rv: the radius below which ``closed(…, simple=True)`` holds, [B, n] (0: none).
        scale: the size of the quantities each closed form is built from (their rounding is 64u of
            it), [B, n].
        cells: rings and sectors (and columns and rows).

    Returns:
        E [B, n] and K [B, n], rounding included.
    """
    shape = nu.shape
    flat = [t.reshape(-1) for t in (nu, r, a_lo, a_hi, rv, scale)]
    rows = max(1, CHUNK // (cells * cells))
    out = [(_largest(box, *(t[i:i + rows] for t in flat), cells),
            _ratio(box, closed, *(t[i:i + rows] for t in flat), cells))
           for i in range(0, flat[0].numel(), rows)]
    if not out:
        return nu.new_zeros(shape), nu.new_zeros(shape)
    return tuple(torch.cat(part).reshape(shape) for part in zip(*out, strict=True))


def charge_by_parts(along: Tensor, perp: Tensor, U: Tensor, K_U: Tensor, P: Tensor, K_P: Tensor,
                    budget: Tensor, across: Tensor | None = None) -> Tensor:
    """An upper bound of Σ_t |⟨Λ_t, e_t⟩| [B, C] (of −Σ_t ⟨Λ_t, e_t⟩ alone where ``along`` or
    ``across`` below is one-sided, as the backward pass needs) from each token's error parts
    (docs/bounds.md §5.1, "LayerProject's error along the token"): |⟨Λ_t, e_t⟩| ≤ along_t·U_t + perp_t·P_t and
    ≤ (along_t·K_U + perp_t·K_P)‖Δ_t‖², with ``along`` ≥ |Λ_t·u_t| and ``perp`` ≥ ‖Λ_t − (Λ_t·u_t)u_t‖
    [B, C, n] (rounding included by the caller), the parts' bounds and ratios [B, n]; or of Σ_t
    −⟨Λ_t, e_t⟩ alone with ``along`` ≥ (Λ_t·u_t)⁺ where the part along u_t is never positive (as
    LayerProject's). Tokens whose ratios are both finite share the ball's budget [B] (Σ_t ‖Δ_t‖² ≤
    budget), the others pay their bound. ``across`` [B, C, n]: another bound of what the part across u_t
    of each token's error takes along its functional (of −⟨Λ_⊥, e_⊥⟩ in the one-sided case), taken
    where smaller than perp_t·P_t."""
    side = perp * P[:, None]
    level = along * U[:, None] + (side if across is None else torch.minimum(side, across))
    finite = torch.isfinite(K_U) & torch.isfinite(K_P)
    kU, kP = (torch.where(finite, k, 0.0)[:, None] for k in (K_U, K_P))
    on = finite[:, None].expand_as(level)
    # each token pays min(level_t, k_t‖Δ_t‖²): all of it from ‖Δ_t‖² = level_t/k_t on (a token with
    # k_t = 0 pays nothing), the tokens sharing the budget (docs/bounds.md §5.1, "The budget, exactly")
    k = torch.where(on, along * kU + perp * kP, 0.0)
    level_on = torch.where(on & (k > 0), level, 0.0)
    caps = torch.where(k > 0, level_on / k.clamp_min(torch.finfo(k.dtype).tiny), 0.0)
    return shared(level_on, caps, budget[:, None]) + torch.where(on, 0.0, level).sum(-1)


def norm_range(nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, c: float = 0.0) -> tuple[Tensor, Tensor]:
    """Bounds [B, n] of (‖x₀ + v‖² + c)^½ over the token's ball ‖v‖ ≤ r cut to a = uᵀv ∈ [a_lo, a_hi]
    (‖x₀‖ = ν, u = x₀/ν; c ≥ 0), each widened by 1e-12 for its rounding: ‖x₀ + v‖² = ν² + 2νa + ‖v‖² ≤
    ν² + 2ν·min(a_hi, r) + r², and ≥ (ν + a)², whose least over a's range is max(ν + a_lo, −(ν + a_hi),
    0)² (docs/bounds.md §5.1, "Across, by the functional's range")."""
    low = torch.maximum(torch.maximum(nu + a_lo, -(nu + a_hi)), torch.zeros_like(nu))
    lo = (low.square() + c).sqrt() * (1 - 1e-12)
    hi = (nu.square() + 2 * nu * torch.minimum(a_hi, r) + r.square() + c).clamp_min(0).sqrt() * (1 + 1e-12)
    return lo, hi


def across_corners(reach, V: Tensor, eps: float, k_lo: Tensor, k_hi: Tensor, pad: Tensor,
                   radius: Tensor) -> Tensor | None:
    """Upper bounds [B, C, n] of k·⟨v, Δ_t⟩ over every k ∈ [k_lo, k_hi] [B, n] and every deviation Δ of
    the set ``reach`` (a :class:`~bounds.network.zonotope.DeviationSet`), for functionals V [B, C, n, d]
    known to ``pad`` [B, C, n] (the exact ones within pad of them in norm; ‖Δ_t‖ ≤ ``radius`` [B, n]):
    a bilinear form is largest at a corner of the box of k and ⟨v, Δ_t⟩'s range over the set
    (docs/bounds.md §5.1, "Across, by the functional's range"). None where ``reach`` is None or its
    supports would cost more than :data:`ACROSS_WORK` multiply-adds; +inf where k is not finite."""
    if reach is None:
        return None
    _, C, n, d = V.shape
    if C * n * d * reach.support_width() > ACROSS_WORK:
        return None
    mid, half = reach.ranges(V, eps, chunk=ACROSS_CHUNK)
    half = half * (1 + 1e-12)  # the supports' rounding, a few ulps of each norm and sum
    w_lo, w_hi = mid - half, mid + half
    finite = (torch.isfinite(k_lo) & torch.isfinite(k_hi))[:, None]
    k_lo, k_hi = (torch.where(finite, k[:, None], 0.0) for k in (k_lo, k_hi))
    corner = torch.stack([k_lo * w_lo, k_lo * w_hi, k_hi * w_lo, k_hi * w_hi]).amax(0)
    # the products' rounding (relative), and V's own: |⟨v − v_exact, Δ_t⟩| ≤ pad·r_t, at most |k| times
    corner = corner.clamp_min(0) * (1 + 1e-12) + pad * radius[:, None] * torch.maximum(k_lo.abs(), k_hi.abs())
    return torch.where(finite, corner, torch.inf)


def abs_low(x1: Tensor, x2: Tensor) -> Tensor:
    """min |x| over [x1, x2] (x1 ≤ x2): 0 where the interval holds 0, else the end nearer 0."""
    return torch.where((x1 <= 0) & (x2 >= 0), 0.0, torch.minimum(x1.abs(), x2.abs()))


def hyp(x: Tensor, y: Tensor) -> Tensor:
    """(x² + y²)^½, nondecreasing in |x| and |y|, as the boxes' closed forms use it."""
    return (x.square() + y.square()).sqrt()


def _slack(U: Tensor, scale: Tensor) -> Tensor:
    """U with the rounding of its closed forms: every operation is monotone in the cell's corners, and
    its rounding, a few ulps of the quantities each is built from, is covered by 64u of their size
    ``scale`` (and 64u of U itself)."""
    u = torch.finfo(U.dtype).eps / 2
    return U * (1 + 64 * u) + 64 * u * scale[:, None, None]


def _largest(box: Box, nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, rv: Tensor, scale: Tensor,
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
    near = abs_low(a1, a2).square()
    top = (r[:, None].square() - near).clamp_min(0).sqrt() * (1 + 4 * u)  # b's top, rounded up
    b = top[..., None] * k  # [m, K, K+1]
    b1, b2 = b[..., :-1], b[..., 1:]
    a1, a2 = a1[..., None].expand_as(b1), a2[..., None].expand_as(b1)
    U = _slack(box(nu[:, None, None], a1, a2, b1, b2), scale)
    return U.flatten(1).amax(-1)


def _ratio(box: Box, closed: Closed, nu: Tensor, r: Tensor, a_lo: Tensor, a_hi: Tensor, rv: Tensor,
           scale: Tensor, cells: int) -> Tensor:
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
    U = _slack(box(nu[:, None, None], a1, a2, b1, b2), scale)
    # a cell's ratio: its bound U over its inner radius², or the closed forms at its outer radius (the
    # inner disc, where the first is 0/0; they are exact there to first order), or, split at the
    # radius rv below which the form is simpler, the simpler closed form below it and U/rv² beyond it
    tiny = torch.finfo(dtype).tiny
    N, outer = nu[:, None, None].expand_as(U), p2.expand_as(U)
    inner = (p1 * (1 - 4 * u)).square().expand_as(U)
    ratio = torch.where(inner > 0, U / inner.clamp_min(tiny), torch.inf)
    ratio = torch.minimum(ratio, closed(N, outer, a1, False))
    rv = (rv * (1 - 4 * u))[:, None, None].expand_as(U)
    simple = closed(N, outer, a1, True)
    far = torch.maximum(inner, rv.square())
    split = torch.maximum(simple, torch.where(outer >= rv, U / far.clamp_min(tiny), 0.0))
    ratio = torch.minimum(ratio, torch.where(far > 0, split, torch.inf))
    return torch.where(empty, 0.0, ratio).flatten(1).amax(-1)
