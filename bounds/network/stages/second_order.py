"""Attention's remainder per output token from its second-order term on the set, exactly (docs/bounds.md
§5.1, "Attention's second order on the set").

Row i of the remainder is Q₂_i(Γ) + R₃_i(Γ): Q₂ = ½D²F[Γ, Γ], a quadratic form, and the rest, of third
order. On the set's first generator, Γ = Gδ with ‖δ‖ ≤ ε, Q₂_i is a d-vector of quadratic forms
δᵀM_{i,c}δ in P variables, formed here in closed form (:func:`row_forms`): its norm is at most
ε²‖[M_{i,1} … M_{i,d}]‖₂, every head's share in one form, so the heads and the three terms (the pure
logit term, the value term, the logits' own quadratic part) share δ's energy as the truth does. The
set's other parts (symbols, groups, the shift, E) enter through the bilinear cross terms, bounded from
their spread and radii, and the third order through §2.3.2's cumulant bounds on the set's own spread
and span, or under the clean row with each key at its own distance from the row's mean value, the
smaller per head and row. Formed only where the forms are small (:data:`FORM_ENTRIES`): the d·P²
entries per row; the attention stage forms them in its second pass alone."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models import DotMHA

from ...norms import gram_norm
from ...remainder.row_bounds import curve_g2, curve_g3, curve_h2
from ..zonotope import DeviationSet
from .logits import LogitBox, RowReadings

# the most entries h·n·d·P² of one image's forms for which the second order is formed: 2·17·32·64² on
# the digits ViTs (4.5·10⁶); none of the Fashion-MNIST ones (P = 784)
FORM_ENTRIES = 2**23
# the most entries of forms held at once (rows formed a few at a time): 2²⁴ float64 is 128 MiB
FORM_CHUNK = 2**24
# the fourth joint cumulant of a row is at most (1 + 3/(2√2))·s·diam(Y)·Var(u) (docs/bounds.md §2.3.2)
CUMULANT4 = 1 + 3 / (2 * math.sqrt(2))
# the forms' products and the eigenvalue: a relative 1e-10 of the flattening's Frobenius norm covers them
ROUND = 1e-10


def fits(layer: DotMHA, S: DeviationSet, limit: float = FORM_ENTRIES) -> bool:
    """Whether :func:`second_order_rows` forms its forms for this layer and set: their entries
    h·n·d·P·max(P, d) are at most ``limit`` (``math.inf``: always, as a GPU or a patient CPU may)."""
    n, d, P = S.G.shape[1:]
    return layer.h * n * d * P * max(P, d) <= limit


def centred_generators(S: DeviationSet, layer: DotMHA, parts, b: int, rows: slice = slice(None)) -> Tensor:
    """g̃ [h, i, k, P] of image b's rows ``rows``: the linear logit change on the set's first generator,
    δ̃_ik = g̃_ikᵀδ for Γ = Gδ, centred under the clean row p_i (÷√d_h), from √d_h δ_ik = ⟨Γ_i, W^Q_l k_k⟩
    + ⟨W^K_l q_i, Γ_k⟩."""
    G = S.G[b]  # [n, d, P]
    kq = parts.K[b] @ layer.W_q.mT  # [h, k, d]: W^Q_l k_k
    qk = parts.Q[b][:, rows] @ layer.W_k.mT  # [h, i, d]: W^K_l q_i
    g = (torch.einsum("idp,hkd->hikp", G[rows], kq) + torch.einsum("hid,kdp->hikp", qk, G))
    g = g / math.sqrt(layer.d_h)
    return g - (parts.P[b][:, rows][..., None] * g).sum(-2, keepdim=True)


def row_forms(S: DeviationSet, layer: DotMHA, parts, b: int, rows: slice = slice(None)) -> Tensor:
    """M [i, d, P, P] of image b's output tokens ``rows`` (default all n): Q₂_i(Gδ)[c] = δᵀM_{i,c}δ,
    summed over heads, with (docs/bounds.md §2.3.2)

        Q₂_i = Σ_l [ ½Σ_k p_k δ̃_k² Ỹ_k + Σ_k p_k δ̃_k Γ_kC_l + Σ_k p_k q_k Ỹ_k ],

    δ̃_k = g̃_kᵀδ the row's linear logit change centred under p (÷√d_h), Ỹ_k = Y_k − ȳ_i with Y = XC_l,
    q_k = (G_iδ)ᵀA_l(G_kδ)/√d_h with A_l = W^Q_l W^K_lᵀ, and Γ_k = G_kδ. Each row's forms depend on
    that row alone, so a caller short of memory forms them a few rows at a time."""
    G = S.G[b]  # [n, d, P]
    Gi = G[rows]  # [i, d, P]: the rows asked for
    P = parts.P[b][:, rows]  # [h, i, k]
    root = math.sqrt(layer.d_h)
    gt = centred_generators(S, layer, parts, b, rows)  # [h, i, k, P]
    Y = parts.V[b] @ layer.W_o  # [h, k, d]: X C_l (the value bias cancels under centring)
    Yt = Y[:, None] - (P @ Y)[:, :, None]  # [h, i, k, d]
    C = layer.W_v @ layer.W_o  # [h, d, d]
    H = torch.einsum("hec,kep->hkcp", C, G)  # [h, k, c, P]: (Γ_k C_l)[c] = H_k[c]ᵀδ
    w = P[..., None] * Yt  # [h, i, k, c]: p_k Ỹ_k
    M = 0.5 * torch.einsum("hikc,hikp,hikq->icpq", w, gt, gt)
    V = torch.einsum("hik,hikp,hkcq->icpq", P, gt, H)
    A = layer.W_q @ layer.W_k.mT  # [h, d, d]
    K = torch.einsum("hikc,kep->hicep", w, G)  # [h, i, c, e, P]: Σ_k p_k Ỹ_k[c] G_k
    GA = torch.einsum("idp,hde->hiep", Gi, A)  # [h, i, e, P]: A_lᵀG_i, contracted first (the cheap order)
    Qf = torch.einsum("hiep,hiceq->icpq", GA, K) / root
    N = V + Qf
    return M + 0.5 * (N + N.mT)


def flattening_norm(M: Tensor) -> Tensor:
    """An upper bound of sup_{‖w‖ = 1} ‖Σ_c w_c M_c‖₂ ≥ sup_{‖δ‖ = 1} ‖(δᵀM_cδ)_c‖ for M [..., d, P, P]:
    ‖[M_1 … M_d]‖₂, the root of λ_max(Σ_c M_cM_cᵀ), raised by ROUND of the Frobenius norm."""
    F = torch.einsum("...cpq,...crq->...pr", M, M)  # one product over (c, q), no [d, P, P] temporary
    lam = torch.linalg.eigvalsh(F)[..., -1].clamp_min(0)
    return lam.sqrt() + ROUND * M.flatten(-3).norm(dim=-1)


def second_order_rows(S: DeviationSet, layer: DotMHA, parts, eps: float, box: LogitBox,
                      readings: RowReadings, own: Tensor,
                      routes: tuple[str, ...] = ("cumulant", "clean")) -> Tensor:
    """A bound of ‖R_i(Γ)‖ per output token over the set, [B, n] (docs/bounds.md §5.1, "Attention's
    second order on the set"): ε²‖M_i‖ for the G part of Q₂ (:func:`row_forms`), the cross terms of the
    other parts, and the third order by the smaller of its ``routes`` (``cumulant``: the fourth cumulant
    on the rows' spread and span, the keys at the values' diameter; ``clean``: under the clean row, each
    key at its own distance from the row's mean value). ``own`` [B, n]: the set's token radii."""
    if not routes or not set(routes) <= {"cumulant", "clean"}:
        raise ValueError(f"routes must be among 'cumulant' and 'clean', not {routes!r}")
    B, n = S.G.shape[:2]
    root = math.sqrt(layer.d_h)
    P = parts.P  # [B, h, i, k]
    # a few rows' forms at a time: FORM_CHUNK entries at most held at once (one row at least)
    step = max(1, FORM_CHUNK // max(1, S.G.shape[2] * S.G.shape[3] ** 2))
    first = torch.stack([torch.cat([flattening_norm(row_forms(S, layer, parts, b, slice(i, i + step)))
                                    for i in range(0, n, step)]) for b in range(B)]) * eps**2
    # the G part's radius per token and every other part's: ‖c_t‖ + the box + the groups + E
    g_tok = eps * gram_norm(S.token_grams())  # ε‖G_t‖₂
    Qt = S.Q.transpose(2, 3)
    groups = Qt.flatten(-2).norm(dim=-1) if S.Q.shape[-2] else S.Q.new_zeros(B, n, 0)  # ≥ ‖Q_{t,j}‖₂
    o_tok = S.c.norm(dim=-1) + S.box_norms()[0] + S.grouped(groups) + S.token_ball()
    g_tok, o_tok = torch.minimum(g_tok, own), torch.minimum(o_tok, own)
    Y = parts.V @ layer.W_o[None]  # [B, h, k, d]
    Yt = (Y[:, :, None] - (P @ Y)[:, :, :, None]).norm(dim=-1)  # [B, h, i, k]: ‖Y_k − ȳ_i‖
    sigma = (P * Yt.square()).sum(-1).sqrt()
    diam = Yt.amax(-1)  # max_k ‖Y_k − ȳ_i‖ under the clean weights
    diamY = (Y[:, :, :, None] - Y[:, :, None]).norm(dim=-1).amax((-1, -2))[..., None]  # [B, h, 1]
    Cn = layer.C_norm()[None, :, None]
    An = layer.A_norm()[None, :, None]
    keys = lambda r: (P * r[:, None, None].square()).sum(-1).sqrt()  # (Σ_k p_k r_k²)^½, [B, h, i]
    v, v_o, v_g = Cn * keys(own), Cn * keys(o_tok), Cn * keys(g_tok)
    sd, sd_g, sd_o = readings.spread, readings.first, readings.other
    sq = An * own[:, None] * keys(own) / root  # ≥ std_p(q_i)
    # the cross terms: Q₂_i(Γ_G + Γ_o) − Q₂_i(Γ_G) term by term (each |Σ_k p_k a_k b_k x_k| by
    # Cauchy–Schwarz under p); the pure-logit term pays max_k ‖Ỹ_k‖ ≤ diam
    cross = (diam * (sd_g * sd_o + 0.5 * sd_o.square()) + sd_g * v_o + sd_o * torch.minimum(v, v_g + v_o)
             + sigma * An * (o_tok[:, None] * keys(own) + g_tok[:, None] * keys(o_tok)) / root)
    # R − Q₂ per head and row, by two routes (docs/bounds.md §5.1), each a bound: the smaller is paid
    s, su = readings.spans, sd + sq
    q_m = 2 * (box.whole - box.linear).clamp_min(0).amax(-1)  # ≥ max_k |q_k − q̄|
    third = torch.full_like(sigma, math.inf)
    if "cumulant" in routes:  # §2.3.2 on the set's spread and span: the fourth cumulant's integral, the
        # logits' own quadratic part in the third cumulant, the value side's second-order integral, Cov(q, Z)
        zmax = 2 * Cn * own.amax(-1)[:, None, None]  # ≥ max_k ‖Γ_kC_l − z̄_t‖
        third = (CUMULANT4 * s * diamY * curve_g3(s) * su.square()
                 + 0.5 * sigma * torch.minimum(q_m * (2 * sd + sq), 3 * s * sq)
                 + torch.minimum(curve_g2(s) * su * v, curve_h2(s) * su.square() * zmax)
                 + sq * v)
    if "clean" in routes:  # under the clean row: each key's ρ(x_k) weighted by its own ‖Ỹ_k‖
        moment = weighted_moment(S, layer, parts, eps, Yt, sd_o, q_m)
        # g₁(s) = (e^s − 1)/s ≥ (e^x − 1)/x for x ≤ s; below 1e-6, its upper bound e^s
        g1 = torch.where(s < 1e-6, torch.exp(s), torch.expm1(s) / s.clamp_min(1e-6))
        clean = (curve_h2(s) * g1 * su**3 * (sigma + v)
                 + 0.5 * sigma * q_m * (2 * sd + sq) + s * curve_g3(s) * moment
                 + curve_g2(s) * su * v + sq * v)
        third = torch.minimum(third, torch.nan_to_num(clean, nan=math.inf))
    out = first + (cross + third).sum(1)
    return torch.nan_to_num(out * (1 + ROUND), nan=math.inf)


def weighted_moment(S: DeviationSet, layer: DotMHA, parts, eps: float, Yt: Tensor, other: Tensor,
                    q_m: Tensor) -> Tensor:
    """An upper bound of Σ_k p_k‖Ỹ_k‖x_k² over the set, [B, h, n] (docs/bounds.md §5.1): x the row's
    logit change centred under its clean p, Ỹ_k = Y_k − ȳ_i (``Yt`` [B, h, i, k]). With x = x_G + x_o + q̃
    (the first generator's linear part, the other parts', the quadratic part) and Minkowski in the
    p‖Ỹ‖-weighted norm: ε√λ_max(Σ_k p_k‖Ỹ_k‖g̃_kg̃_kᵀ) for x_G (:func:`centred_generators`),
    (max_k‖Ỹ_k‖)^½ times the other parts' spread ``other``, and (Σ_k p_k‖Ỹ_k‖)^½ q_m for q̃ (|q̃_k| ≤ q_m)."""
    B, n = S.G.shape[:2]
    step = max(1, FORM_CHUNK // max(1, layer.h * n * S.G.shape[3] ** 2))  # rows at a time
    lam = []
    for b in range(B):
        chunks = []
        for i in range(0, n, step):
            rows = slice(i, i + step)
            gt = centred_generators(S, layer, parts, b, rows)  # [h, i, k, P]
            w = parts.P[b][:, rows] * Yt[b][:, rows]  # [h, i, k]: p_k‖Ỹ_k‖
            M = torch.einsum("hik,hikp,hikq->hipq", w, gt, gt)
            # its rounding: a relative ROUND of the Frobenius norm, as the forms'
            top = torch.linalg.eigvalsh(M)[..., -1].clamp_min(0)
            chunks.append(top + ROUND * M.flatten(-2).norm(dim=-1))
        lam.append(torch.cat(chunks, dim=-1))
    x_g = eps * torch.stack(lam).sqrt()
    x_o = Yt.amax(-1).sqrt() * other
    x_q = (parts.P * Yt).sum(-1).sqrt() * q_m
    return (x_g + x_o + x_q).square()
