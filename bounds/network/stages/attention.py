"""Attention as a stage of ``taylor_net`` (docs/bounds.md §5.1): its exact Jacobian at the clean input
(dense on small layers, as an operator on large ones, and in one-token closed form), the bound of its
norm that E's radii cross, the Taylor remainder of §2.3 (or LoFAST's split), and its transpose for
the backward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from models import DotMHA
from models.structured import dot_jacobian

from ...certificates import Ledger
from ...lofast import delta2_xi, xi
from ...norms import gram_norm
from ...remainder import (
    FormCache,
    RowFactors,
    RowStats,
    functional_beyond,
    functional_rows,
    remainder,
    row_bound,
    row_factors,
)
from ..record import Step
from ..zonotope import DeviationSet, top_norm
from .curvature import CURVED_MAX, CURVED_ND, negative_curvature
from .logits import logit_box, logit_change, map_logits, set_remainder, set_rows
from .second_order import FORM_ENTRIES, fits, second_order_rows

# the share of the first order (‖J‖·r) below which attention's global remainder is taken as it is,
# without the local and first-order ones (docs/bounds.md §5, "What a network certificate skips")
NEGLIGIBLE = 1e-5
# the largest n·d for which attention's Jacobian is formed densely: applied as one matrix product,
# its norm bounded from its entries too and E kept per token through its d×d blocks. Beyond it the
# Jacobian is applied as an operator (:func:`jacobian_apply`), the faster there (docs/scale.md)
DENSE_J = 256
# the largest n·d for which attention's Jacobian is also formed for its norm alone (applied as an
# operator above DENSE_J): ‖J‖₂ from its Gram's exact float64 eigenvalue, which E's radii and the route
# cross, and its d×d blocks for E's per-token bounds: the bound from factors is about twice ‖J‖₂, and
# E grows by it at every attention (docs/scale.md): formed up to 2048, its norm kept per image
NORM_J = 2048

# how attention is split into a linear part and a remainder (docs/bounds.md §5.1, "what the attention
# bound buys"): ``taylor`` its Jacobian and the Taylor remainder (§2.3); ``lofast`` LoFAST's split,
# Δ₁ (attention frozen at P_l(X)) and δ₂ of eq. 28 (ξ_l: no Lanczos), a first-order remainder;
# ``lofast_half`` the same with softmax ½-Lipschitz (§2.2)
SPLITS = ("taylor", "lofast", "lofast_half")
# the most distinct rows, and multiply-adds, an image's values' supports along a backward step's
# functionals (:func:`value_ranges`) may take: the margins' rows (classes − 1 at each token, 153 and
# up to 1.1·10¹⁰ on the Fashion-MNIST ViTs, whose sets carry thousands of symbols) and the rows of a
# block's units right after the attention, one per neuron (on the digits ViTs 90–128 and 10⁸), not the
# units' rows further back, where every token's row is its own (19,328 at the 2-block q2 model's block
# 0: the image's time twice over for a hundredth of a margin), nor the Fashion-MNIST ViTs' units (512
# neurons); the work limit keeps a wide set's supports from the margins of larger models
VALUE_ROWS = 256
VALUE_WORK = 2**36
# the most entries the supports of a chunk of those functionals hold at once (1 GiB of float64)
VALUE_CHUNK = 2**27
# ``best``: each margin takes the better of these splits' sound bounds (docs/bounds.md §5.1, "The
# best split"); the second runs only on the images the first leaves uncertified. Each certifies
# images the other does not (docs/scale.md); δ₂ itself is never below its half, so it is not tried
BEST = "best"
BEST_OF = ("taylor", "lofast_half")


def attention(S: DeviationSet, layer: DotMHA, X: Tensor, k: int, log: list | None = None,
              split: str = "taylor", quadratic: bool | None = None,
              cache: AttentionCache | None = None, eps: float | None = None,
              ledger: Ledger | None = None, form_entries: float = FORM_ENTRIES) -> DeviationSet:
    """Attention at its clean input X [B, n, d]: Δ ↦ J[Δ] + R(Δ) with J the exact Jacobian
    (:func:`jacobian_apply`) and ‖R‖_F ≤ the Taylor remainder of docs/bounds.md §2.3 at the set's
    radius (or, with ``split`` lofast, LoFAST's Δ₁ and δ₂); E's radii and the route grow by
    :func:`jacobian_bound`. ``quadratic`` as in ``bounds.remainder.remainder`` (the second pass asks
    for the quadratic form, docs/bounds.md §2.3.2); ``cache`` keeps its parts that depend on X alone
    (:class:`AttentionCache`); ``ledger`` records the certificates of the
    remainder's norms. Given ``eps`` (the set is then known), the remainder reads the logits on the
    set (:mod:`.logits`: the linear change's norm, each row's span, the rows' bound from softmax's
    box) and is bounded per output token as well (``bounds.remainder.row_remainders``), which the
    backward pass and E's per-token bounds take (docs/bounds.md §5.1). With ``quadratic``, the second
    order on the set's first generator is formed where its forms have at most ``form_entries`` entries
    (:func:`.second_order.fits`)."""
    r = S.route  # the radius LayerProject left (bounds.network.zonotope.DeviationSet.radius)
    rows = None  # the remainder per output token, where the set is known (eps)
    rowwise = None  # [B]: the images whose remainder the rows bound (the others' rows are the whole)
    along = None  # its rows' factors, for the remainder along a backward pass's functionals
    parts = attention_parts(layer, X)
    N = X.shape[-2] * X.shape[-1]
    J = None
    if split != "taylor":
        out = S.mixed(lambda T: jacobian_apply(layer, parts, T, logits=False),
                      lambda g, t: sparse_apply(layer, parts, g, t, logits=False))
        rest = delta2_xi(layer, X, r, factor=0.5 if split == "lofast_half" else 1.0)
    else:
        if N <= DENSE_J:  # small layers: one matrix product with the dense Jacobian is faster
            J = dot_jacobian(layer, X)
            out = S.mixed(lambda T: (J @ T.flatten(1, 2)).reshape(T.shape))
        else:
            out = S.mixed(lambda T: jacobian_apply(layer, parts, T),
                          lambda g, t: sparse_apply(layer, parts, g, t))
        parts.xi = xi(layer, X)  # ξ_l: the remainder's core and the Jacobian bound's, formed once
    # for the norm alone between DENSE_J and NORM_J (the pass still applies the operator); formed only
    # where something not yet kept in ``cache`` reads it (0.1 s an image and block at n·d 2,048)
    full = J

    def dense() -> Tensor | None:
        nonlocal full
        if full is None and split == "taylor" and N <= NORM_J:
            full = dot_jacobian(layer, X)
        return full

    if split == "taylor" and cache is not None:  # of the clean input alone: once per image and block
        if cache.jacobian_bound is None:  # its Gram's eigenvalue: the costliest part at large n·d
            cache.jacobian_bound = jacobian_bound(layer, X, parts, dense())
        bound = cache.jacobian_bound
    else:
        bound = jacobian_bound(layer, X, parts, dense() if split == "taylor" else None,
                               logits=split == "taylor")
    if split == "taylor":
        core, box = parts.xi, None
        if eps is not None:  # ξ_l·r bounds the linear logit change over the ball; the set's own is smaller
            mapped = map_logits(S, layer, parts)
            tiny = torch.finfo(r.dtype).tiny
            on_set = logit_change(S, layer, parts, eps, mapped) / r.clamp_min(tiny)[:, None]
            core = torch.minimum(core, on_set)
            own = S.token_radii(eps)  # each token's radius: the box's quadratic part, the rows' bounds
            box = logit_box(S, layer, parts, eps, r, mapped, own)
            readings = set_rows(S, layer, parts, eps, box, mapped)
            spread, spans = readings.spread, readings.spans
        enough = NEGLIGIBLE * bound * r
        rest = remainder(layer, X, r, core=core, quadratic=quadratic,
                         cache=None if cache is None else cache.forms, enough=enough,
                         ledger=ledger, spans=None if box is None else spans)
        if box is not None and bool((rest > enough).any()):  # the rows' own bound on the set (§5.1)
            # on the images whose remainder is above negligible alone: an image below it keeps its
            # remainder whole, as it would in a batch of its own, so that no bound depends on its batch
            rowwise = rest > enough  # [B]
            plain = rest
            whole, rows = set_remainder(layer, parts, box, r, own, spread, spans)
            rest = torch.minimum(rest, whole)
            # each output token's share, for functionals that read a few tokens (§5.1)
            stats, factors, v_rows = row_factors(layer, X, r, spans, own, spread,
                                                 keyed=(readings.excess, readings.moved))
            own_rows = row_bound(stats, factors, v_rows)
            along = (stats, factors)  # the same rows along each functional of the backward pass (§5.1)
            rows = torch.minimum(torch.minimum(own_rows, rows), rest[:, None])
            # the second order exactly on the set's first generator (§5.1): d·P² a row, the second pass
            # only (3/5 of a first pass's time on the digits ViTs, where the first certifies most)
            if quadratic and fits(layer, S, form_entries):
                rows = torch.minimum(rows, second_order_rows(S, layer, parts, eps, box, readings, own))
            # ‖R‖_F² = Σ_t ‖R_t‖²: the rows' bounds bound the whole too (their root's rounding: 1e-12)
            rest = torch.minimum(rest, rows.norm(dim=-1) * (1 + 1e-12))
            rest = torch.where(rowwise, rest, plain)
            rows = torch.where(rowwise[:, None], rows, plain[:, None])  # a whole remainder at every token
    blocks = None  # the d×d blocks' norms, which E's per-token bounds cross (of X alone: kept)
    if S.tok is not None and split == "taylor" and N <= NORM_J:
        if cache is None:
            blocks = block_norms(dense(), X.shape[-2])
        else:
            if cache.blocks is None:
                cache.blocks = block_norms(dense(), X.shape[-2])
            blocks = cache.blocks
    out = replace(out, rho=S.rho * bound[:, None], route=bound * r + rest,
                  tok=mix_tokens(layer, parts, blocks, S.tok, split))
    if log is not None:
        log.append(AttentionRecord(f"attention{k}", layer, X, J, rest, parts, split, rows, along, r,
                                   rowwise=rowwise, reach=S if along is not None and quadratic else None,
                                   eps=0.0 if eps is None else eps))
    return out.add_ball(f"attention{k}", rest, rows)


def mix_tokens(layer: DotMHA, parts: AttentionParts, blocks: Tensor | None, tok: Tensor | None,
               split: str) -> Tensor | None:
    """E's per-token bounds after attention's linear part, [B, n]: ‖(ME)_t‖ ≤ Σ_s ‖M_ts‖ ‖E_s‖ with
    M_ts the d×d block of the linear part from token s to token t: ``blocks`` [B, n, n] bounds
    ‖M_ts‖₂ for the Jacobian (:func:`block_norms`), ‖H‖δ_ts + Σ_l p_lts‖C_l‖ bounds it for LoFAST's
    Δ₁; None where neither is at hand (attention's Jacobian as an operator)."""
    if tok is None or (split == "taylor" and blocks is None):
        return None
    n = tok.shape[1]
    if split != "taylor":
        blocks = torch.einsum("bhts,h->bts", parts.P, layer.C_norm())
        blocks = blocks + layer.H_norm * torch.eye(n, dtype=tok.dtype, device=tok.device)
    return torch.einsum("bts,bs->bt", blocks, tok) * (1 + 1e-12)  # the sums' own rounding


def block_norms(J: Tensor, n: int) -> Tensor:
    """Upper bounds of ‖J_ts‖₂ for the d×d blocks of a dense Jacobian J [B, n·d, n·d], [B, n, n]: each
    block's exact norm from its Gram's float64 eigenvalue (rounded up, as ``gram_norm``), or its
    Frobenius norm where that is smaller. The spectral norm is what E's per-token bound needs; the
    Frobenius norm it replaces is 4–6× larger on the d = 64–128 ViTs of the zoo (docs/bounds.md §5.1,
    "E across attention"). n² eigenproblems of size d, once per image and block."""
    B, N = J.shape[:2]
    d = N // n
    Jb = J.reshape(B, n, d, n, d).transpose(2, 3)  # [B, t, s, d, d]
    fro = Jb.square().sum((-1, -2)).sqrt() * (1 + 1e-12)
    return torch.minimum(fro, gram_norm(Jb.mT @ Jb))


@dataclass
class AttentionParts:
    """What J_F(X) is made of, per head: P [B, h, n, n], the queries and keys (biases included) and
    X W^V [B, h, n, d_h] each, and the weights stacked for one product ([W^Q | W^K | W^V] as
    [d, 3·h·d_h], W^O as [h·d_h, d]); ``xi`` the ξ_l [B, h] where :func:`attention` formed it."""

    P: Tensor
    Q: Tensor
    K: Tensor
    V: Tensor
    W: Tensor
    W_o: Tensor
    xi: Tensor | None = None


def attention_parts(layer: DotMHA, X: Tensor) -> AttentionParts:
    """The :class:`AttentionParts` of ``layer`` at X."""
    Q, K = layer.queries_keys(X)
    stacked, W_o = layer.stacked_weights()
    return AttentionParts(layer.attention(X), Q, K, torch.einsum("bnd,hde->bhne", X, layer.W_v), stacked, W_o)


@dataclass
class AttentionCache:
    """What :func:`attention` keeps of one block's clean input for every ε: its Jacobian's bound, its
    blocks' norms and the remainder's clean forms (bounds.remainder.FormCache). Pass the same (empty
    at first)."""

    jacobian_bound: Tensor | None = None
    blocks: Tensor | None = None  # block_norms of the dense Jacobian
    forms: FormCache = field(default_factory=FormCache)


def jacobian_apply(layer: DotMHA, parts: AttentionParts, T: Tensor, logits: bool = True) -> Tensor:
    """J_F(X)[Γ] for K directions Γ at once, stored as columns: T [B, n, d, K] → [B, n, d, K]
    (docs/bounds.md §2.3): ``HΓ + Σ_l (P_l Γ W^V_l + dP_l[Γ] X W^V_l) W^O_l``, dP_l[Γ] row i
    = (diag p_i − p_i p_iᵀ) dS_i, dS_l = (Γ W^Q_l K_lᵀ + Q_l (Γ W^K_l)ᵀ)/√d_h. A value bias cancels
    (rows of dP_l sum to 0). It costs O(h(n d d_h + n² d_h) + n d²) a direction where the dense
    Jacobian costs n²d²; every step is a batched matrix product with the K directions as its columns
    (as rows they would be copied into place at every step). Without ``logits`` it is LoFAST's Δ₁ (P_l held
    at P_l(X)): ``HΓ + Σ_l P_l Γ C_l``."""
    B, n, _, K = T.shape
    h, e = layer.h, layer.d_h
    P, Qx, Kx, V = parts.P, parts.Q, parts.K, parts.V  # [B, h, n, n], [B, h, n, e] ×3
    W = parts.W if logits else parts.W[:, 2 * h * e:]  # [W^Q | W^K | W^V], or W^V alone
    moved = (W.mT @ T).reshape(B, n, -1, h, e, K)  # per token [3he, d] @ [d, K]
    # P_l (Γ W^V): P [n, n] on every direction's [n, e]
    dV = moved[:, :, -1].permute(0, 2, 1, 3, 4)  # [B, h, n, e, K]
    out = (P @ dV.reshape(B, h, n, e * K)).reshape(B, h, n, e, K)
    if logits:
        dQ, dK = (moved[:, :, i].permute(0, 2, 1, 3, 4) for i in range(2))
        out = out + _logit_part(P, Qx, Kx, V, dQ, dK)
    out = parts.W_o.mT @ out.permute(0, 2, 1, 3, 4).reshape(B, n, h * e, K)
    return out + layer.H_norm * T if layer.H_norm else out


def sparse_apply(layer: DotMHA, parts: AttentionParts, gamma: Tensor, tokens: Tensor,
                 logits: bool = True) -> Tensor:
    """J_F(X)[Γ] for K directions that each move one token: Γ_k = e_t γ_kᵀ with t = tokens[:, k] and
    γ = gamma [B, d, K]; returns [B, n, d, K] as :func:`jacobian_apply` does (docs/bounds.md §5.1,
    "Directions in one token"). Only row t of ΓW moves, so per head l, with q = Q_l W^K_lᵀ/√d_h,
    u = K_l W^Q_lᵀ/√d_h, V = X W^V_l, v̄ = P_l V and Y = V W^O_l, Ȳ = v̄ W^O_l (a value bias cancels):

        row i:  p_it (γᵀC_l + (q_i·γ)(Y_t − Ȳ_i))  +  δ_it Σ_j p_tj (u_j·γ)(Y_j − Ȳ_t)

    summed over heads, plus Hγ at row t. O(h n d K) where :func:`jacobian_apply` costs
    O(h(n d d_h + n² d_h) + n d²) a direction: the pixels' directions, a ReLU's symbol and a
    LayerProject error are in one token until attention mixes them. Without ``logits``, Δ₁: the first
    term's γᵀC_l alone."""
    P, V = parts.P, parts.V  # [B, h, n, n], [B, h, n, e]
    B, h, n, _ = P.shape
    K = tokens.shape[1]
    Pt = P.gather(-1, tokens[:, None, None, :].expand(B, h, n, K))  # [B, h, i, k]: p_it
    # the result is built in its own layout [B, i, f, k] by one multiply-add per head and term: a
    # contraction over the h heads as one einsum is a batch of tiny products and a copy into this
    # layout, the slower on the sets' few hundred columns
    CT = layer.C().mT @ gamma[:, None]  # [B, h, f, k]: γᵀC_l
    out = Pt[:, 0, :, None, :] * CT[:, 0, None]
    for head in range(1, h):
        out.addcmul_(Pt[:, head, :, None, :], CT[:, head, None])
    if logits:
        root = math.sqrt(layer.d_h)
        q = (parts.Q @ layer.W_k.mT / root) @ gamma[:, None]  # [B, h, i, k]: q_i·γ
        u = (parts.K @ layer.W_q.mT / root) @ gamma[:, None]  # [B, h, j, k]: u_j·γ
        Y = V @ layer.W_o  # [B, h, n, d]
        Ybar = P @ Y  # v̄ W^O = P_l (V W^O)
        rows = lambda M: M.gather(2, tokens[:, None, :, None].expand(B, h, K, M.shape[-1]))  # rows t
        w = Pt * q  # [B, h, i, k]: p_it (q_i·γ)
        Yt = rows(Y).mT.contiguous()  # [B, h, f, k]: Y_t
        for head in range(h):  # + p_it (q_i·γ)(Y_t − Ȳ_i)
            out.addcmul_(w[:, head, :, None, :], Yt[:, head, None])
            out.addcmul_(w[:, head, :, None, :], Ybar[:, head, :, :, None], value=-1)
        r = rows(P).mT * u  # [B, h, j, k]: p_tj (u_j·γ)
        own = (Y.mT @ r).sum(1) - (r.sum(2)[..., None] * rows(Ybar)).sum(1).mT  # [B, f, k]
    else:
        own = torch.zeros_like(gamma)
    own = own + layer.H_norm * gamma  # at row t: H = I moves token t by γ
    return out.scatter_add_(1, tokens[:, None, None, :].expand(B, 1, *own.shape[1:]), own[:, None])


def _logit_part(P: Tensor, Qx: Tensor, Kx: Tensor, V: Tensor, dQ: Tensor, dK: Tensor) -> Tensor:
    """dP_l[Γ] X W^V_l for K directions, [B, h, n, e, K], from dQ = Γ W^Q and dK = Γ W^K as
    [B, h, n, e, K] (:func:`jacobian_apply`)."""
    dS = Kx[:, :, None] @ dQ  # [B, h, i, j, K]: Σ_e (K_l)_je (Γ W^Q)_iek
    dS = dS + (Qx[:, :, None] @ dK).transpose(2, 3)  # Σ_e (Q_l)_ie (Γ W^K)_jek, as rows i
    dS = dS / math.sqrt(Qx.shape[-1])
    Pk = P[..., None]
    dP = Pk * (dS - (Pk * dS).sum(3, keepdim=True))  # [B, h, i, j, K]
    return V.mT[:, :, None] @ dP  # Σ_j (X W^V_l)_je dP_ijk


def jacobian_bound(layer: DotMHA, X: Tensor, parts: AttentionParts, J: Tensor | None = None,
                   logits: bool = True) -> Tensor:
    """A deterministic upper bound of ‖J_F(X)‖ from exact factors (and, given the dense J, the smaller
    of that and (‖J‖₁‖J‖_∞)^½), [B]:
    ``‖H‖ + Σ_l ‖P_l‖‖C_l‖ + Σ_l ½ ξ_l ‖X C_l‖/√d_h`` (‖P_l Γ C_l‖_F ≤ ‖P_l‖‖Γ‖_F‖C_l‖; softmax's Jacobian
    is ½-bounded row by row, §2.2, so ‖dP_l[Γ]‖_F ≤ ½‖dS_l‖_F ≤ ½ξ_l‖Γ‖_F/√d_h). ξ_l is ``parts.xi``
    where :func:`attention` formed it."""
    P = gram_norm(parts.P.mT @ parts.P)  # [B, h]
    bound = layer.H_norm + (P * layer.C_norm()).sum(-1)  # ≥ ‖Δ₁‖ (LoFAST eq. 12), all of it without logits
    if logits:
        core = parts.xi if parts.xi is not None else xi(layer, X)
        bound = bound + (0.5 * core * layer.XC_norm(X)).sum(-1) / math.sqrt(layer.d_h)
    if J is not None:  # the sum above is loose on saturated heads; (‖J‖₁‖J‖_∞)^½ ≥ ‖J‖₂ is not, and
        # ‖J‖₂ itself is its Gram's top eigenvalue (§2.4: certified by Cholesky where large)
        N = J.shape[-1]
        holder = (J.abs().sum(-2).amax(-1) * J.abs().sum(-1).amax(-1)).sqrt() * (1 + N * 2.3e-16)
        bound = torch.minimum(bound, torch.minimum(holder, top_norm(J.mT @ J)))
    return bound



def transpose_apply(layer: DotMHA, X: Tensor, J: Tensor | None, Lam: Tensor,
                    parts: AttentionParts | None = None) -> Tensor:
    """J_F(X)ᵀΛ for Λ [B, C, n, d]: with the dense J where it was formed, else in closed form
    (docs/bounds.md §5.1): with Y_l = ΛW^O_lᵀ, Z_l = Y_l V_lᵀ (V_l = X W^V_l) and G_l row i
    = (diag p_i − p_i p_iᵀ) Z_l[i],
    ``JᵀΛ = HΛ + Σ_l [P_lᵀY_l W^V_lᵀ + (G_l K_l W^Q_lᵀ + G_lᵀQ_l W^K_lᵀ)/√d_h]``."""
    if J is not None:
        return (Lam.flatten(2) @ J).reshape(Lam.shape)
    parts = attention_parts(layer, X) if parts is None else parts
    P, Qx, Kx, V = (t[:, None] for t in (parts.P, parts.Q, parts.K, parts.V))  # [B, 1, h, n, ·]
    B, C, n, _ = Lam.shape
    h, e = layer.h, layer.d_h
    Y = (Lam @ parts.W_o.mT).reshape(B, C, n, h, e).transpose(2, 3)  # [B, C, h, n, e]: Λ W^O_lᵀ
    Z = Y @ V.mT  # [B, C, h, n, n]
    G = P * (Z - (P * Z).sum(-1, keepdim=True))
    root = math.sqrt(e)
    # the coefficients of Γ W^Q, Γ W^K and Γ W^V, through every head's weights in one product
    # ([W^Q | W^K | W^V] stacked as [d, 3·h·d_h], attention_parts)
    coef = torch.stack([G @ Kx / root, G.mT @ Qx / root, P.mT @ Y], 2)  # [B, C, 3, h, n, e]
    out = coef.permute(0, 1, 4, 2, 3, 5).reshape(B, C, n, 3 * h * e) @ parts.W.mT
    return out + layer.H_norm * Lam if layer.H_norm else out


def delta1_transpose(layer: DotMHA, parts: AttentionParts, Lam: Tensor) -> Tensor:
    """Δ₁ᵀΛ = HΛ + Σ_l P_lᵀ Λ C_lᵀ for Λ [B, C, n, d] (LoFAST's linear part, attention frozen)."""
    Y = torch.einsum("bcnf,hef->bchne", Lam, layer.W_o)  # Λ W^O_lᵀ
    Y = torch.einsum("bhkn,bchke->bchne", parts.P, Y)  # P_lᵀ ·
    out = torch.einsum("bchne,hde->bcnd", Y, layer.W_v)  # · W^V_lᵀ
    return out + layer.H_norm * Lam if layer.H_norm else out



@dataclass(frozen=True)
class AttentionRecord:
    """Attention for the backward pass: the layer at its clean input X, its dense Jacobian where it was
    formed, its parts, the split, and its remainder's radius ``rho`` [B]."""

    name: str
    layer: DotMHA
    X: Tensor
    J: Tensor | None
    rho: Tensor
    parts: AttentionParts
    split: str
    rows: Tensor | None = None  # [B, n]: the remainder's bound per output token, where known
    # the rows' statistics and factors that bound the remainder along a functional, where known
    along: tuple[RowStats, RowFactors] | None = None
    radius: Tensor | None = None  # [B]: the ball ‖Γ‖_F ≤ r that holds the set the remainder was read on
    # the second order exactly along each functional (curvature.py): asked by :func:`curved_log` for the
    # second pass's margins that its backward pass leaves short, as a Hessian per functional costs more
    # than the rest of a backward step
    curved: bool = False
    # [B]: the images whose remainder the rows bound; ``along`` serves those alone (None: every image)
    rowwise: Tensor | None = None
    # the set entering the stage at radius ``eps``, where its rows are known, in the second pass: the
    # values' deviations along each functional are read off it (:func:`value_ranges`), where their
    # supports cost at most :data:`VALUE_WORK` (the first pass decides most images without them)
    reach: DeviationSet | None = None
    eps: float = 0.0

    def step(self, Lam: Tensor) -> Step:
        """Λ ↦ JᵀΛ (or Δ₁ᵀΛ for LoFAST's split), the remainder charged at ‖Λ‖_F·ρ, or at Σ_t ‖Λ_t‖ρ_t
        with the rows' own bounds where that is smaller (⟨Λ, R⟩ ≤ Σ_t ‖Λ_t‖‖R_t‖), or along Λ
        (``bounds.remainder.functional_rows``) where that is smaller still."""
        charge = Lam.flatten(2).norm(dim=-1) * self.rho[:, None]
        if self.rows is not None:
            charge = torch.minimum(charge, (Lam.norm(dim=-1) * self.rows[:, None]).sum(-1) * (1 + 1e-12))
        if self.along is not None:  # each row's bound along its own Λ_i (docs/bounds.md §5.1)
            # on the images the rows bound (an image alone in its batch would have none)
            mine = (lambda v: v) if self.rowwise is None else (
                lambda v: torch.where(self.rowwise[:, None], v, torch.inf))
            values = None
            if self.reach is not None:
                values = value_ranges(self.layer, self.reach, self.eps, self.along[0].P, Lam)
            rows = functional_rows(self.layer, self.X, *self.along, Lam, values)
            charge = torch.minimum(charge, mine(rows.sum(-1) * (1 + 1e-12)))
            if self.curved and Lam.shape[1] <= CURVED_MAX:
                # the second order exactly along Λ, the rest row by row (docs/bounds.md §5.1)
                second = 0.5 * negative_curvature(self.layer, self.X, Lam) * self.radius[:, None] ** 2
                beyond = functional_beyond(self.layer, self.X, *self.along, Lam, values).sum(-1)
                charge = torch.minimum(charge, mine((second + beyond) * (1 + 1e-12)))
        if self.split == "taylor":
            moved = transpose_apply(self.layer, self.X, self.J, Lam, self.parts)
        else:
            moved = delta1_transpose(self.layer, self.parts, Lam)
        return Step(moved, charge=charge)


def value_ranges(layer: DotMHA, S: DeviationSet, eps: float, P: Tensor, Lam: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """Upper bounds of std_{p_i}(z) and of max_k z_k − min_k z_k for the values' deviations along each
    functional, z_k = Γ_kC_lΛ_i over the keys k, for every Γ of the set ``S`` (at radius ``eps``), each
    [B, C, h, n], and each key's range itself, its middle and half-width [B, C, h, n, k] (a row Λ_i = 0:
    0 and 0; an image over the limits: 0 and ∞) (docs/bounds.md §5.1, "The values along a functional,
    on the set"): each key's range of
    ⟨C_lΛ_i, Γ_k⟩ is the set's support along that d-vector at token k (``DeviationSet.ranges``), so
    the span is the largest top less the least bottom, and Var_p(z) ≤ Σ_k p_k (z_k − c)² with c the
    p-weighted centre of the ranges. ``P`` [B, h, n, n]: the clean rows.

    The supports are read once per distinct row Λ_i ≠ 0 of an image: a unit's functional reads one
    token, and a block's units of one neuron read the same row at every token. A row Λ_i = 0 pays
    nothing (0 here); an image with more than :data:`VALUE_ROWS` distinct rows, or whose supports
    would cost more than :data:`VALUE_WORK` multiply-adds, keeps the keys' radii's forms (∞ here), each
    image on its own rows, so that no image's bound depends on the others in its batch; None where no
    image's fit."""
    B, C, n, d = Lam.shape
    h = layer.h
    live = (Lam != 0).any(-1)  # [B, C, n]
    width = S.support_width()
    rows = [_distinct(Lam[b][live[b]]) for b in range(B)]
    fits = [0 < len(u) <= VALUE_ROWS and len(u) * h * n * d * width <= VALUE_WORK for u, _ in rows]
    if not any(fits):
        return None
    U = max(len(u) for (u, _), fit in zip(rows, fits, strict=True) if fit)
    lam = Lam.new_zeros(B, U, d)  # each image's distinct rows, padded with zeros
    for b, ((u, _), fit) in enumerate(zip(rows, fits, strict=True)):
        if fit:
            lam[b, :len(u)] = u
    w = torch.einsum("hde,hef,buf->buhd", layer.W_v, layer.W_o, lam)  # C_lΛ_i: [B, U, h, d]
    V = w.reshape(B, U * h, 1, d).expand(-1, -1, n, -1)  # the same vector at every key
    mid, half = (t.reshape(B, U, h, n) for t in S.ranges(V, eps, chunk=VALUE_CHUNK))  # [B, U, h, k]
    # the supports' rounding (a few ulps of each norm and sum), and C_lΛ_i's own: its entries are off
    # by at most a relative d·u of ‖C_l‖‖Λ_i‖ each, so ⟨w − w_exact, Γ_k⟩ ≤ 1e-12·‖C_l‖‖Λ_i‖ times
    # the key's radius
    pad = 1e-12 * layer.C_norm()[None, None, :, None] * lam.norm(dim=-1)[:, :, None, None]
    half = half * (1 + 1e-12) + pad * S.token_radii(eps)[:, None, None, :]
    spread, span = Lam.new_zeros(B, C, h, n), Lam.new_zeros(B, C, h, n)
    middles, halves = Lam.new_zeros(B, C, h, n, n), Lam.new_zeros(B, C, h, n, n)
    for b, ((_, inverse), fit) in enumerate(zip(rows, fits, strict=True)):
        if not fit:
            spread[b], span[b], halves[b] = torch.inf, torch.inf, torch.inf
            continue
        c, i = live[b].nonzero().unbind(-1)
        m, r = mid[b, inverse], half[b, inverse]  # [L, h, k]
        p = P[b][:, i].transpose(0, 1)  # [L, h, k]: row i's clean weights
        centre = (p * m).sum(-1, keepdim=True)
        spread[b, c, :, i] = (p * ((m - centre).abs() + r).square()).sum(-1).sqrt() * (1 + 1e-12)
        span[b, c, :, i] = ((m + r).amax(-1) - (m - r).amin(-1)) * (1 + 1e-12)
        middles[b, c, :, i], halves[b, c, :, i] = m, r
    return spread, span, middles, halves


def _distinct(rows: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct rows of ``rows`` [L, d] and each row's index among them, [L]. torch.unique has no
    derivative, so the rows are found on a detached copy and taken from ``rows`` itself at each one's
    first place: the same values, through autograd where the slopes' tuning differentiates Λ."""
    unique, inverse = torch.unique(rows.detach(), dim=0, return_inverse=True)
    at = torch.arange(len(rows), device=rows.device)
    first = torch.full((len(unique),), len(rows), dtype=at.dtype, device=rows.device)
    first = first.scatter_reduce(0, inverse, at, "amin")
    return rows[first], inverse


def curved_log(log: list) -> list | None:
    """``log`` with every attention record that can take the second order exactly along its functionals
    (:class:`AttentionRecord`'s ``curved``: the set's rows known, n·d at most CURVED_ND) set to take it;
    None where no record can."""
    can = lambda r: (isinstance(r, AttentionRecord) and r.along is not None and r.radius is not None
                     and r.X.shape[-2] * r.X.shape[-1] <= CURVED_ND)
    if not any(can(r) for r in log):
        return None
    return [replace(r, curved=True) if can(r) else r for r in log]
