"""Attention's Taylor remainder from the rows' own statistics (docs/bounds.md §2.3, §2.3.1, §2.3.3):
:func:`global_remainder` (softmax's global constants), :func:`local_remainder` (the clean point's row
probabilities) and :func:`first_order_remainder` (of order r), with the row statistics they share
(:class:`RowStats`, :func:`row_stats`) and their assembly over rows. :mod:`bounds.remainder` takes the
smallest of them and of :mod:`bounds.remainder.quadratic`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models import DotMHA
from models.spectral import product_norm

from ..base import radius
from ..forms import (
    ROUND_REL,
    nan_inf,
)
from ..lofast import xi

# an absolute slack for float64 rounding in units of the global bound (a scale of the magnitudes),
# beside forms.ROUND_REL's relative one (docs/bounds.md §2.3.1)
ROUND_ABS = 1e-12


def global_remainder(layer: DotMHA, X: Tensor, eps, core: Tensor | None = None) -> Tensor:
    """``(½m_l² + ½r²a_l/√d_h)‖XC_l‖ + ½ m_l r ‖C_l‖`` per head, [B, h] (docs/bounds.md §2.3), with
    a_l = ‖A_l‖ and m_l = r(core_l + r a_l)/√d_h. ``core`` [B, h] bounds the linear logit map's norm
    (‖M_l‖ or ξ_l; default ξ_l, which is deterministic)."""
    e = radius(eps, X)[:, None]  # [B, 1]
    core = xi(layer, X) if core is None else core
    rd = math.sqrt(layer.d_h)
    a = layer.A_norm()  # [h]
    m = e * (core + e * a) / rd  # [B, h]
    return (0.5 * m**2 + 0.5 * e**2 * a / rd) * layer.XC_norm(X) + 0.5 * m * e * layer.C_norm()


def first_order_remainder(layer: DotMHA, X: Tensor, eps, core: Tensor | None = None,
                          rows: RowStats | None = None) -> Tensor:
    """A bound of each head's share of ‖R(Γ)‖_F over ‖Γ‖_F ≤ r that is of order r, [B, h]
    (docs/bounds.md §2.3.3): R_l = (P_l' − P_l)(X + Γ)C_l − dP_l[Γ] X C_l, each part on its own,

    * ‖(P' − P)XC‖ ≤ min(e_l ‖X̃C_l‖, diam(XC_l)·(Σ_i min(s_i/(2√2), √2)²)^½),
    * ‖dP[Γ]XC‖ ≤ min(½ r core_l ‖X̃C_l‖/√d_h, the local spread of §2.3.1 with α = σ, β = 0),
    * ‖(P' − P)ΓC‖ ≤ e_l r ‖C_l‖,

    with X̃ = X less its mean row (the rows of P' − P and dP sum to 0), e_l = min(½m_l, √(2n)) ≥
    ‖P' − P‖_F, m_l = r(core_l + r a_l)/√d_h as in :func:`global_remainder`, and s_i ≥ the span of row
    i's logit change (:func:`row_stats`). ``core`` as in :func:`global_remainder`; ``rows`` as in
    :func:`local_remainder`."""
    n = X.shape[-2]
    e = radius(eps, X)[:, None]  # [B, 1]
    core = xi(layer, X) if core is None else core
    rd = math.sqrt(layer.d_h)
    m = e * (core + e * layer.A_norm()) / rd
    change = torch.minimum(0.5 * m, torch.full_like(m, math.sqrt(2 * n)))  # ≥ ‖P' − P‖_F
    Xc = X - X.mean(-2, keepdim=True)  # the rows of P' − P and dP sum to 0
    centred = product_norm(torch.einsum("bnd,hde->bhne", Xc, layer.W_v), layer.W_o)
    rows = row_stats(layer, X, e[..., None]) if rows is None else rows
    cap = torch.minimum(rows.s / (2 * math.sqrt(2)), torch.full_like(rows.s, math.sqrt(2)))
    moved = torch.minimum(change * centred, rows.diamY * cap.square().sum(-1).sqrt())
    sigma = rows.sigma  # ‖Cov_p(δ_i, Y)‖ ≤ std_p(δ_i)·σ_i, summed over rows as §2.3.1 does
    linear = torch.minimum(0.5 * e * core * centred / rd,
                           assemble_rows(rows, sigma, torch.zeros_like(sigma), e[..., None], layer.d_h))
    return (moved + linear + change * e * layer.C_norm()) * (1 + ROUND_REL)


def pair_sq(Z: Tensor) -> Tensor:
    """‖Z_k − Z_j‖² for every pair of rows, [..., n, n], from the differences themselves (no
    cancellation: every term is a square)."""
    return (Z[..., :, None, :] - Z[..., None, :, :]).square().sum(-1)


def curve_g1(s: Tensor) -> Tensor:
    """∫₀¹ e^{ts} dt = (e^s − 1)/s (1 at s = 0)."""
    return torch.where(s > 1e-8, torch.expm1(s) / s.clamp_min(1e-8), 1 + s)


def curve_g2(s: Tensor) -> Tensor:
    """s·∫₀¹ (1 − t) e^{ts} dt = (e^s − 1 − s)/s; below 1e-4, its upper bound ½ s e^s (each term
    s^k/(k+1)! of the series is ≤ ½ s^k/k!), which the difference would lose to cancellation."""
    small = 0.5 * s * torch.exp(s)
    big = (torch.expm1(s) - s) / s.clamp_min(1e-4)
    return torch.where(s < 1e-4, small, big)


def curve_h2(s: Tensor) -> Tensor:
    """∫₀¹ (1 − t) e^{ts} dt = (e^s − 1 − s)/s² (½ at s = 0), which bounds (e^x − 1 − x)/x² for every
    x ≤ s (it increases with x); below 1e-4, its upper bound ½e^s (each term s^k/(k+2)! of the series is
    ≤ ½ s^k/k!), which the difference would lose to cancellation."""
    big = (torch.expm1(s) - s) / s.clamp_min(1e-4).square()
    return torch.where(s < 1e-4, 0.5 * torch.exp(s), big)


def curve_g4(s: Tensor) -> Tensor:
    """∫₀¹ (1 − t)³/6 e^{ts} dt = (e^s − 1 − s − s²/2 − s³/6)/s⁴ (1/24 at s = 0), which bounds
    (e^x − 1 − x − x²/2 − x³/6)/x⁴ for every x ≤ s (it increases with x); below 0.1, its upper bound
    e^s/24 (each term s^k/(k+4)! of the series is ≤ s^k/(24·k!)), which the difference would lose to
    cancellation."""
    big = (torch.expm1(s) - s - 0.5 * s.square() - s**3 / 6) / s.clamp_min(0.1) ** 4
    return torch.where(s < 0.1, torch.exp(s) / 24, big)


def curve_g3(s: Tensor) -> Tensor:
    """∫₀¹ ½(1 − t)² e^{ts} dt = (e^s − 1 − s − s²/2)/s³ (1/6 at s = 0); below 1e-2, its upper bound
    e^s/6, which the difference would lose to cancellation."""
    big = (torch.expm1(s) - s - 0.5 * s.square()) / s.clamp_min(1e-2) ** 3
    return torch.where(s < 1e-2, torch.exp(s) / 6, big)


@dataclass(frozen=True)
class RowStats:
    """The clean point's per-row quantities the local bounds are made of (docs/bounds.md §2.3.1), each
    [B, h, n] unless said: σ_i = std_{p_i}(X C_l), a_i = ‖diag(√p_i)(U − 1ū_iᵀ)‖, λ_i ≥ λ_max(diag p_i −
    p_i p_iᵀ), ‖V_i‖, s_i ≥ the span of row i's logit change over the ball, ‖A_l‖ [h], ‖C_l‖ [h, 1],
    P [B, h, n, n], v_i ≥ std_{p_i}(Γ C_l) over the ball, diamY [B, h] the diameter of X C_l's rows,
    Yc [B, h, n, n] = ‖Y_k − ȳ_i‖, and Ro [h, d_h, d_h] (W^O's triangular factor)."""

    sigma: Tensor
    a: Tensor
    lam: Tensor
    Vn: Tensor
    s: Tensor
    A: Tensor
    C: Tensor
    P: Tensor
    v: Tensor
    diamY: Tensor
    Yc: Tensor
    Ro: Tensor


def softmax_jacobian_norm(lo: Tensor, hi: Tensor) -> Tensor:
    """An upper bound of ‖diag(p) − ppᵀ‖ over every row p with ``lo ≤ p ≤ hi`` entrywise.

    ``diag(p) − ppᵀ ≼ diag(p)`` gives max_j p_j; its rows' absolute sums are 2p_j(1 − p_j), which
    bound the norm of the symmetric matrix (docs/bounds.md §2.3.1, §3.6). Each is maximised over the
    box; at a point (``lo = hi = p``) it is min(max_j p_j, max_j 2p_j(1 − p_j)).

    Args:
      lo, hi: the entrywise bounds of the rows, [..., n].

    Returns:
      the bound for each row, [...].
    """
    c = torch.minimum(torch.maximum(lo, torch.full_like(lo, 0.5)), hi)  # 2p(1 − p) peaks at ½
    return torch.minimum(hi.amax(-1), (2 * c * (1 - c)).amax(-1))


def row_stats(layer: DotMHA, X: Tensor, r: Tensor) -> RowStats:
    """The clean point's :class:`RowStats` at the ball's radius r (docs/bounds.md §2.3.1)."""
    P = layer.attention(X)  # [B, h, n, n]
    Q, K = layer.queries_keys(X)  # [B, h, n, d_h]
    # the d_h-wide factors: ‖z W_qᵀ‖ = ‖z R_qᵀ‖ with W_q = Q_q R_q (orthonormal Q_q), and likewise
    # for W_k and W_oᵀ, so every spread below is computed on d_h columns, never on d
    Rq = torch.linalg.qr(layer.W_q, mode="r").R  # [h, d_h, d_h]
    Rk = torch.linalg.qr(layer.W_k, mode="r").R
    Ro = torch.linalg.qr(layer.W_o.mT, mode="r").R
    U = K @ Rq.mT  # [B, h, n, d_h]: the rows of U = K W_qᵀ in Q_q's coordinates
    Vn = (Q @ Rk.mT).norm(dim=-1)  # [B, h, n]: ‖V_i‖
    Y = torch.einsum("bnd,hde->bhne", X, layer.W_v) @ Ro.mT  # rows of X C_l in Q_o's coordinates
    Ysq = pair_sq(Y)
    sigma = (0.5 * torch.einsum("bhik,bhkj,bhij->bhi", P, Ysq, P)).clamp_min(0).sqrt()
    diam = pair_sq(U).amax((-1, -2)).sqrt()  # [B, h]
    Uc = (U[..., None, :, :] - (P @ U)[..., :, None, :]) * P[..., None].sqrt()  # [B, h, i, k, d_h]
    a = torch.linalg.eigvalsh(Uc.mT @ Uc)[..., -1].clamp_min(0).sqrt()  # [B, h, n]
    lam = softmax_jacobian_norm(P, P)  # ≥ λ_max(diag p_i − p_i p_iᵀ)
    A = layer.A_norm()[:, None]  # [h, 1]
    s = r * (diam[..., None] + math.sqrt(2) * (Vn + r * A)) / math.sqrt(layer.d_h)
    Yc = (Y[..., None, :, :] - (P @ Y)[..., :, None, :]).norm(dim=-1)  # [B, h, i, k]: ‖Y_k − ȳ_i‖
    C = layer.C_norm()[:, None]
    return RowStats(sigma=sigma, a=a, lam=lam, Vn=Vn, s=s, A=A[:, 0], C=C, P=P,
                    v=lam.sqrt() * C * r,  # ≥ std_{p_i}(Γ C_l) over the ball (fact iv)
                    diamY=Ysq.amax((-1, -2)).sqrt(), Yc=Yc, Ro=Ro)


def assemble_rows(rows: RowStats, alpha: Tensor, beta: Tensor, r: Tensor, d_h: int) -> Tensor:
    """``(r/√d_h)·[max_i α_i a_i + (Σ_i α_i² λ_i ‖V_i‖²)^½ + r‖A_l‖ max_i β_i √λ_i]`` per head, [B, h]:
    Σ_i (α_i std(δ_i) + β_i std(q_i))² summed over rows by Minkowski, with std(δ_i) ≤ (‖Γ_i‖a_i +
    √λ_i‖V_i‖r)/√d_h and std(q_i) ≤ √λ_i‖A_l‖r‖Γ_i‖/√d_h (docs/bounds.md §2.3.1)."""
    lam, r = rows.lam, r[..., 0]  # r: [B, 1]
    return (r / math.sqrt(d_h)) * ((alpha * rows.a).amax(-1)
                                   + (alpha.square() * lam * rows.Vn.square()).sum(-1).sqrt()
                                   + r * rows.A * (beta * lam.sqrt()).amax(-1))


# λ_max(D_w) of bounds.forms.weighted_spread for weights w, [B]: one of _Spreads' three
Spread = Callable[[Tensor], Tensor]


def weighted_x(layer: DotMHA, rows: RowStats, spread: Spread, w: Tensor, r: Tensor) -> Tensor:
    """√Λ_w·r + (max_i Σ_l max_k w λ_li ‖A_l‖²/d_h)^½·r² ≥ (Σ_{l,i,k} w p x²)^½ over the ball, [B]
    (docs/bounds.md §2.3.2): x = δ̃ + q̃ split by Minkowski, the δ part a weighted λ_max of the logit
    Gram (:func:`bounds.forms.weighted_spread`, through ``spread``), the q part through
    Var_p(q_li) ≤ λ_li‖A_l‖²r²‖Γ_i‖²/d_h. ``w`` [B, h, n] per (head, row) or [B, h, n, n] per key;
    ``r`` [B]."""
    per_row = w.amax(-1) if w.dim() == 4 else w
    var_q = (per_row * rows.lam * rows.A[None, :, None].square()).sum(1).amax(-1) / layer.d_h
    return spread(w).sqrt() * r + var_q.sqrt() * r**2


@dataclass(frozen=True)
class RowFactors:
    """What :func:`row_remainders` bounds each row with, apart from the values' spread (docs/bounds.md
    §5.1, "Attention's remainder along a functional"), each [B, h, n]: ``s`` ≥ the span of the row's
    logit change, ``sq`` ≥ std_p(q_i), ``su`` ≥ std_p(u_i) (u = δ + q), ``keys`` with
    std_{p_i}(Γ_k w) ≤ keys_i·‖w‖ over the deviations considered, for every fixed d-vector w, and
    ``reach`` ≥ max_{j≠k} ‖Γ_j‖ + ‖Γ_k‖ over them (the same at every head and row)."""

    s: Tensor
    sq: Tensor
    su: Tensor
    keys: Tensor
    reach: Tensor
    # per key, [B, h, n, n], where the set's pairs are known (docs/bounds.md §5.1, "The logits' part per
    # key"): ``excess`` ≥ p_kφ(w_k) and ``moved`` ≥ |p'_k − p_k|; ``radii`` [B, n] ≥ each token's ‖Γ_k‖
    excess: Tensor | None = None
    moved: Tensor | None = None
    radii: Tensor | None = None


def row_factors(layer: DotMHA, X: Tensor, r: Tensor, spans: Tensor | None = None,
                own: Tensor | None = None, spread: Tensor | None = None,
                keyed: tuple[Tensor, Tensor] | None = None) -> tuple[RowStats, RowFactors, Tensor]:
    """:func:`row_remainders`' parts: the clean point's :class:`RowStats` at radius ``r`` [B], the rows'
    :class:`RowFactors`, and v [B, h, n] ≥ std_{p_i}(Γ C_l) over the deviations considered. ``keyed``:
    (excess, moved) per key (``RowReadings``), for the functionals' per-key forms."""
    rr = r[:, None, None]
    rows = row_stats(layer, X, rr)
    s = rows.s if spans is None else torch.minimum(rows.s, spans)
    v, own_keys = rows.v, None
    radii = None if own is None else torch.minimum(own, r[:, None])  # [B, n]: ‖Γ_k‖, each at most r
    if own is not None:  # (Σ_k p_k own_k²)^½ ≥ std_p of what each key moves within its own radius
        own_keys = (rows.P * radii.square()[:, None, None]).sum(-1).sqrt()
        v = torch.minimum(v, own_keys * rows.C * (1 + ROUND_REL))  # std_p(ΓC) ≤ (Σ_k p_k ‖Γ_k C‖²)^½
    g = rr if own is None else radii[:, None]  # [B, 1, n]: ‖Γ_i‖
    lam = rows.lam.sqrt()
    sd = (g * rows.a + lam * rows.Vn * rr) / math.sqrt(layer.d_h)  # ≥ std_p(δ) over the ball
    if spread is not None:
        sd = torch.minimum(sd, spread)
    # std_p(q_i) ≤ ‖A_l‖‖Γ_i‖·std_p(Γ_k) with std_p(Γ_k) ≤ √λ_i r (fact iv), or ≤ (Σ_k p_k‖Γ_k‖²)^½
    keys = lam * rr
    if own is not None:
        keys = torch.minimum(keys, own_keys * (1 + ROUND_REL))
    sq = rows.A[None, :, None] * g * keys / math.sqrt(layer.d_h)
    su = sd + sq  # ≥ std_p(u), u = δ + q
    reach = key_reach(r, own)[:, None, None].expand_as(su)  # [B, h, n]
    excess, moved = (None, None) if keyed is None else keyed
    return rows, RowFactors(s, sq, su, keys.expand_as(su), reach, excess, moved, radii), v


def key_reach(r: Tensor, own: Tensor | None = None) -> Tensor:
    """An upper bound of max_{j≠k} ‖Γ_j‖ + ‖Γ_k‖ over ‖Γ‖_F ≤ r [B], [B]: √2·r (‖Γ_j‖² + ‖Γ_k‖² ≤ r²),
    or the two largest token radii ``own`` [B, n] (each at most r) where smaller; the span of Γ_k w
    over the keys is at most it times ‖w‖."""
    reach = math.sqrt(2) * r
    if own is None:
        return reach
    top = torch.minimum(own, r[:, None]).topk(min(2, own.shape[-1]), dim=-1).values.sum(-1)
    return torch.minimum(reach, top)


def row_remainders(layer: DotMHA, X: Tensor, r: Tensor, spans: Tensor | None = None,
                   own: Tensor | None = None, spread: Tensor | None = None) -> Tensor:
    """A bound of each output row's ‖R(Γ)_i‖ over ‖Γ‖_F ≤ r, summed over heads, [B, n] (docs/bounds.md
    §5.1, "Attention's remainder per token"): §2.3.1's row bound α_i std_p(δ) + β_i std_p(q) with
    ‖Γ_i‖ ≤ ``own`` [B, n] (the token's own radius; default r) where the assembly over rows took
    Σ_i ‖Γ_i‖² ≤ r², and std_p(ΓC_l) ≤ ‖C_l‖(Σ_k p_ik own_k²)^½ where it is below √λ_i‖C_l‖r.
    ``spans`` [B, h, n] as in :func:`bounds.remainder.remainder`; ``spread`` [B, h, n] an upper bound
    of std_{p_i}(δ_i) over the deviations considered, where it is below the ball's. A functional that
    reads one token (a class token's head) pays that token's row alone."""
    return row_bound(*row_factors(layer, X, r, spans, own, spread))


def row_bound(rows: RowStats, f: RowFactors, v: Tensor) -> Tensor:
    """:func:`row_remainders` from its parts (:func:`row_factors`), [B, n]."""
    s, sq, su = f.s, f.sq, f.su
    # the logits' second-order integral two ways: span·std_{p_t}(u)·std_{p_t}(Y) (g₂(s)·std(u)·σ), or
    # Var_{p_t}(u)·max_k ‖Y_k − ȳ_t‖ ≤ e^{ts}Var_p(u)·diam(Y) (h₂(s)·Var(u)·diam), the smaller where the
    # row's spread is well below its span
    logits = torch.minimum(rows.sigma * curve_g2(s) * su, curve_h2(s) * rows.diamY[..., None] * su.square())
    logits = rows.sigma * sq + logits
    valued = v * curve_g1(s) * su
    if f.excess is not None:  # each key on its own (docs/bounds.md §5.1, "The logits' part per key"):
        # ‖Σ_k p_kφ(w_k)(Y_k − ȳ)‖ ≤ Σ_k p_kφ(w_k)‖Y_k − ȳ‖ under κ ≤ s²/8, and ‖(p' − p)ᵀΓC_l‖ ≤
        # ‖C_l‖Σ_k |p'_k − p_k|‖Γ_k‖ under the moved mass 2tanh(s/4)
        kappa = s.square() / 8 * (1 + 1e-12)
        keyed = knapsack(rows.Yc, f.excess, kappa) * (1 + 1e-12)
        logits = torch.fmin(logits, rows.sigma * sq + keyed)
        if f.radii is not None:
            mass = 2 * torch.tanh(s / 4) * (1 + 1e-12)
            moved = rows.C * knapsack(f.radii[:, None, None, :].expand_as(f.moved), f.moved, mass)
            valued = torch.fmin(valued, moved * (1 + 1e-12))
    per = logits + valued
    # where e^s overflows a product may be ∞·0: NaN read as ∞ (no bound there)
    return nan_inf(per.sum(1) * (1 + ROUND_REL))


# the most functionals :func:`functional_rows` reads at once ([B, C, h, n, n] and [B, C, h, n, d_h] each)
FUNCTIONALS = 2048


def functional_rows(layer: DotMHA, X: Tensor, rows: RowStats, f: RowFactors, Lam: Tensor,
                    values: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A bound of |⟨Λ_i, R(Γ)_i⟩| for functionals Λ [B, C, n, d] on attention's output, per functional
    and output row, summed over heads, [B, C, n] (docs/bounds.md §5.1, "Attention's remainder along a
    functional"): :func:`row_remainders`' row bound with the values X C_l read along Λ_i, σ_i(Λ_i) =
    std_{p_i}(X C_l Λ_i) and diam(X C_l Λ_i) in place of σ_i‖Λ_i‖ and diam(X C_l)‖Λ_i‖, and keys_i‖C_lΛ_i‖
    in place of v_i‖Λ_i‖. Each is at most its counterpart, so the bound never exceeds ‖Λ_i‖ times the
    row's; it is far below where Λ_i reads directions the values barely spread along. Each head and
    row pays, for its logits' part and its values' part apart, the smaller of that form's and the
    first-order form's (docs/bounds.md §5.1, "At large logit spans"): tanh(s/4)·span(X C_l Λ_i) +
    std(u)·σ_i(Λ_i) and tanh(s/4)·reach·‖C_lΛ_i‖, which do not grow with e^s. ``values`` (spread, span,
    middles, halves), the first two [B, C, h, n]: upper bounds of std_{p_i}(ΓC_lΛ_i) and of the span
    of ΓC_lΛ_i over the keys, read on the set (:func:`bounds.network.stages.attention.value_ranges`),
    taken where they are below keys_i‖C_lΛ_i‖ and reach·‖C_lΛ_i‖; the last two each key's range
    [B, C, h, n, k]. Where the factors carry each key's excess and moved weight (``RowFactors``), each
    part also takes its per-key form (docs/bounds.md §5.1, "The logits' part per key": the logits'
    Σ_k p_kφ(w_k)ỹ_k plus σ_i(Λ_i)·std(q), the values' Σ_k |p'_k − p_k|·|z_k − c|)."""
    V = torch.einsum("bnd,hde->bhne", X, layer.W_v)  # [B, h, k, e]
    # ‖C_l Λ_i‖ = ‖W^V_l (W^O_l Λ_i)‖ = ‖R_l W^O_l Λ_i‖ with W^V_l = Q_l R_l: d_h-wide
    Rv = torch.linalg.qr(layer.W_v, mode="r").R  # [h, e, e]
    # its tensors are a few times Λ's: at most so many functionals at once
    return torch.cat([_along(layer, rows, f, V, Rv, part, values=_part(values, at, part))
                      for at, part in _parts(Lam)], 1)


def _parts(Lam: Tensor):
    """(first index, functionals) of Λ's chunks of :data:`FUNCTIONALS`."""
    return ((at, Lam[:, at:at + FUNCTIONALS]) for at in range(0, Lam.shape[1], FUNCTIONALS))


def _part(values: tuple[Tensor, Tensor] | None, at: int, part: Tensor) -> tuple[Tensor, Tensor] | None:
    """The chunk of ``values`` that goes with the functionals ``part`` from index ``at``."""
    return None if values is None else tuple(v[:, at:at + part.shape[1]] for v in values)


# the fourth joint cumulant E[ũ³Ỹ] − 3E[ũ²]E[ũỸ] of a row over the ball is at most
# (1 + 3/(2√2))·s·diam(Y)·Var(u) (docs/bounds.md §2.3.2)
CUMULANT4 = 1 + 3 / (2 * math.sqrt(2))


def functional_beyond(layer: DotMHA, X: Tensor, rows: RowStats, f: RowFactors, Lam: Tensor,
                      values: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A bound of |⟨Λ_i, (R − Q₂)(Γ)_i⟩| for functionals Λ [B, C, n, d] on attention's output, per
    functional and output row, summed over heads, [B, C, n], where Q₂ = ½D²F(X)[Γ, Γ] is the whole
    second-order term (docs/bounds.md §5.1, "Attention's remainder along a functional, its second order
    exact"): with the values read along Λ_i as in :func:`functional_rows` (y = X C_l Λ_i, σ_i(Λ_i), its
    diameter, and keys_i‖C_lΛ_i‖ ≥ std_p(Γ C_l Λ_i)), each row and head pays

        (3/2)s·σ_i(Λ_i)·sq + min((7/4)s²g₃(s)σ_i(Λ_i)su, (1 + 3/(2√2))s·diam·g₃(s)su²)
        + keys_i‖C_lΛ_i‖·(sq + g₂(s)su),

    the change of the logits' third cumulant from δ to u, the fourth cumulant's integral, and the value
    side's terms beyond Cov_p(δ, ΓC_l). Every term is of order r³."""
    V = torch.einsum("bnd,hde->bhne", X, layer.W_v)
    Rv = torch.linalg.qr(layer.W_v, mode="r").R
    return torch.cat([_along(layer, rows, f, V, Rv, part, beyond=True, values=_part(values, at, part))
                      for at, part in _parts(Lam)], 1)


def _along(layer: DotMHA, rows: RowStats, f: RowFactors, V: Tensor, Rv: Tensor, Lam: Tensor,
           beyond: bool = False, values: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """:func:`functional_rows` on a few functionals, with X W^V_l (``V``) and W^V_l's R factor (``Rv``);
    with ``beyond``, :func:`functional_beyond`; ``values`` as there."""
    w = torch.einsum("hef,bcif->bchie", layer.W_o, Lam)  # W^O_l Λ_i: [B, C, h, i, e]
    y = torch.einsum("bhke,bchie->bchik", V, w)  # (X C_l Λ_i)_k
    P = rows.P[:, None]  # [B, 1, h, i, k]
    centred = y - (P * y).sum(-1, keepdim=True)
    sigma = (P * centred.square()).sum(-1).clamp_min(0).sqrt()  # [B, C, h, i]
    diam = y.amax(-1) - y.amin(-1)
    along = torch.einsum("hfe,bchie->bchif", Rv, w).norm(dim=-1)
    s, sq, su = (t[:, None] for t in (f.s, f.sq, f.su))
    # std_p(ΓC_lΛ_i) and the span of ΓC_lΛ_i over the keys: from the keys' radii, or read on the set
    spread, span = f.keys[:, None] * along, f.reach[:, None] * along
    if values is not None:
        spread, span = torch.minimum(spread, values[0]), torch.minimum(span, values[1])
    if beyond:
        g3 = curve_g3(s)
        logits = torch.minimum(1.75 * s.square() * g3 * sigma * su, CUMULANT4 * s * diam * g3 * su.square())
        per = 1.5 * s * sigma * sq + logits + spread * (sq + curve_g2(s) * su)
    else:
        # the row is its logits' part, (p' − p)·Yλ − Cov_p(δ, Yλ), plus its values' part, (p' − p)·ΓC_lλ,
        # and each takes the smaller of its two forms: the second-order one above, or the first-order
        # one, in which p' − p holds the span of Yλ and of ΓC_lλ to ½‖p' − p‖₁ ≤ tanh(s/4) times it.
        # Where s is a few units, e^s makes the second-order form the larger (the BatchNorm ViT's
        # block 1); where e^s overflowed (∞·0: NaN), fmin takes the first-order form alone
        tv = torch.tanh(s / 4)
        logits = torch.minimum(sigma * curve_g2(s) * su, curve_h2(s) * diam * su.square())
        logits = torch.fmin(sigma * sq + logits, tv * diam + su * sigma)
        valued = torch.fmin(spread * curve_g1(s) * su, tv * span)
        if f.excess is not None:  # each key on its own (docs/bounds.md §5.1, "The logits' part per key")
            # Σ_k p_kφ(w_k) = κ ≤ s²/8 and Σ_k |p'_k − p_k| ≤ 2tanh(s/4): budgets over the keys
            kappa = (s.square() / 8 * (1 + 1e-12)).expand_as(sigma)
            logits = torch.fmin(logits, sigma * sq + keyed_logits(f.excess[:, None], centred, kappa))
            valued = torch.fmin(valued, keyed_values(f.moved[:, None], along, f.radii, values,
                                                     (2 * tv * (1 + 1e-12)).expand_as(sigma)))
        per = logits + valued
    # a row Λ_i = 0 reads nothing, even where e^s overflowed (0·∞ would be NaN, read as ∞)
    per = torch.where((Lam != 0).any(-1)[:, :, None], per, 0.0)
    return nan_inf(per.sum(2) * (1 + ROUND_REL))


def knapsack(gain: Tensor, cap: Tensor, budget: Tensor | None) -> Tensor:
    """max Σ_k x_k·gain_k over 0 ≤ x_k ≤ cap_k with Σ_k x_k ≤ ``budget``, [...] for gain, cap ≥ 0 [..., k]
    and budget [...] (None: no budget, Σ_k cap_k·gain_k): the largest gains filled first. ∞·0 is 0."""
    if budget is None:
        return torch.where(gain > 0, cap * gain, 0.0).sum(-1)
    g, at = gain.sort(-1, descending=True)
    c = cap.expand_as(gain).gather(-1, at)
    # what the larger gains took, an exclusive sum (c.cumsum − c would be ∞ − ∞ at an ∞ cap)
    before = torch.cat([torch.zeros_like(c[..., :1]), c[..., :-1].cumsum(-1)], -1)
    x = torch.minimum(c, (budget[..., None] - before).clamp_min(0))
    return torch.where((g > 0) & (x > 0), x * g, 0.0).sum(-1)


def keyed_logits(excess: Tensor, centred: Tensor, budget: Tensor | None = None) -> Tensor:
    """|Σ_k p_kφ(w_k)ỹ_k| ≤ max(Σ_k x_kỹ_k⁺, Σ_k x_kỹ_k⁻) at most, over 0 ≤ x_k ≤ excess_k with Σ_k x_k ≤
    ``budget`` (:func:`knapsack`), the logits' part of a row less Cov_p(q, y), [...] (docs/bounds.md
    §5.1, "The logits' part per key"): ``excess`` [..., k] ≥ p_kφ(w_k) ≥ 0, whose sum is κ = log E_p
    e^{u − ū} ≤ s²/8 (``budget`` [...], Hoeffding's lemma), and ``centred`` [..., k] the values along
    the row's functional less their p-weighted mean, ỹ_k. The centring's rounding, a relative 1e-13 of
    the values' largest, is paid on every key's excess."""
    pos, neg = centred.clamp_min(0), (-centred).clamp_min(0)
    pad = 1e-13 * centred.abs().amax(-1) * excess.sum(-1)
    return torch.maximum(knapsack(pos, excess, budget), knapsack(neg, excess, budget)) * (1 + 1e-12) + pad


def keyed_values(moved: Tensor, along: Tensor, radii: Tensor | None,
                 values: tuple[Tensor, ...] | None, budget: Tensor | None = None) -> Tensor:
    """|(p' − p)·z| ≤ Σ_k |p'_k − p_k|·max|z_k − c| with c the weighted median of the ranges' middles
    (p' − p sums to 0), for z_k = ⟨C_lλ, Γ_k⟩, [B, C, h, i] (docs/bounds.md §5.1, "The logits' part per
    key"): ``moved`` [B, 1, h, i, k] ≥ |p'_k − p_k|; each key's range is that read on the set
    (``values``' third and fourth: middles and half-widths, [B, C, h, i, k]) or, without it, within
    ±radii_k·‖C_lλ‖ (``along`` [B, C, h, i]; ``radii`` [B, k]); ∞ where neither is known. As
    Σ_k |p'_k − p_k| ≤ 2tanh(s/4), ``budget`` [B, C, h, i] (that bound) caps the moved weight in all:
    the keys farthest from c take it first (:func:`knapsack`)."""
    if radii is None and (values is None or len(values) < 4):
        return torch.full_like(along, torch.inf)
    lo = hi = None
    if radii is not None:
        hi = radii[:, None, None, None, :] * along[..., None] * (1 + 1e-12)
        lo = -hi
    if values is not None and len(values) > 2:  # the set's range, within the radius's where both known
        vlo, vhi = values[2] - values[3], values[2] + values[3]
        lo, hi = (vlo, vhi) if lo is None else (torch.maximum(lo, vlo), torch.minimum(hi, vhi))
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    w = moved.expand_as(mid)
    order = mid.argsort(-1)
    m, ww = mid.gather(-1, order), w.gather(-1, order)
    cum = ww.cumsum(-1)
    at = (cum < 0.5 * cum[..., -1:]).sum(-1, keepdim=True).clamp_max(mid.shape[-1] - 1)
    c = m.gather(-1, at)  # a weighted median: Σ_k w_k|m_k − c| is least there
    dev = (mid - c).abs() + half
    return knapsack(dev, w, budget) * (1 + 1e-12)


def local_remainder(layer: DotMHA, X: Tensor, eps, rows: RowStats | None = None) -> Tensor:
    """A bound on each head's share of ‖R(Γ)‖_F over ‖Γ‖_F ≤ r from the clean row probabilities,
    [B, h] (docs/bounds.md §2.3.1): with the row quantities of :func:`row_stats`,

        α_i = σ_i g₂(s_i) + √λ_i‖C_l‖ r g₁(s_i),  β_i = σ_i + α_i,

    assembled over rows by :func:`assemble_rows`. ``rows``: :func:`row_stats` at this radius, if at hand.
    """
    r = radius(eps, X)[:, None, None]  # [B, 1, 1]: broadcasts over heads and rows
    rows = row_stats(layer, X, r) if rows is None else rows
    s, sigma = rows.s, rows.sigma
    alpha = sigma * curve_g2(s) + rows.v * curve_g1(s)
    return assemble_rows(rows, alpha, sigma + alpha, r, layer.d_h) * (1 + ROUND_REL)
