"""Attention's logits on the deviation set, and the remainder they give (docs/bounds.md §5.1,
"Attention's logits on the set" and "Attention's remainder on the set").

The remainders of §2.3 are bounds over the whole Frobenius ball ‖Γ‖_F ≤ r. The set a network stage
sees is far thinner: here the linear logit map L_l(Γ) = Γ W^Q_l K_lᵀ + Q_l (Γ W^K_l)ᵀ is applied to
each part of the set, and read as a norm per head (:func:`logit_change`), as an interval per logit
(:func:`logit_box`), and, through softmax's monotonicity, as an interval per attention weight, from
which :func:`set_remainder` bounds attention's remainder row by row."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from models import DotMHA

from ...norms import gram_norm
from ...remainder.row_bounds import key_reach
from ..zonotope import DeviationSet, box_norms

# each norm's own rounding: a relative 1e-12 covers products of a few hundred terms in float64
ROUND = 1e-12
# the most entries :func:`pair_spans` holds at once (2²⁴ float64: 128 MiB), rows formed a few at a time
PAIR_CHUNK = 2**24


@dataclass(frozen=True)
class MappedLogits:
    """L_l applied to each part of a set, per head: ``shift`` L(c) [B, h, n, n], ``G`` [B, h, n, n, P],
    ``A`` [B, h, n, n, m], ``Q`` [B, h, n, n, k, g], ``W`` [B, h, n, n, K] or None (E's columns)."""

    shift: Tensor
    G: Tensor
    A: Tensor
    Q: Tensor
    W: Tensor | None


def map_logits(S: DeviationSet, layer: DotMHA, parts) -> MappedLogits:
    """:class:`MappedLogits` of the set ``S`` at the clean point ``parts`` (``AttentionParts``: the
    queries and keys with their biases)."""
    Q, K = parts.Q, parts.K  # [B, h, n, e]

    def L(T: Tensor) -> Tensor:  # T [B, n, d, *cols] → [B, h, n, n, *cols], one contraction at a time
        TQ = torch.einsum("bnd...,hde->bhne...", T, layer.W_q)
        TK = torch.einsum("bmd...,hde->bhme...", T, layer.W_k)
        return torch.einsum("bhne...,bhme->bhnm...", TQ, K) + torch.einsum("bhne,bhme...->bhnm...", Q, TK)

    B, n, d, k, g = S.Q.shape
    W = L(S.W) if S.W is not None and S.W.shape[-1] else None
    groups = L(S.Q.reshape(B, n, d, k * g)).reshape(B, layer.h, n, n, k, g)
    return MappedLogits(L(S.c), L(S.G), L(S.A), groups, W)


def logit_change(S: DeviationSet, layer: DotMHA, parts, eps: float,
                 mapped: MappedLogits | None = None) -> Tensor:
    """An upper bound of ‖Γ W^Q_l K_lᵀ + Q_l (Γ W^K_l)ᵀ‖_F over the deviations Γ of the set ``S`` at the
    clean point ``parts`` (with ``xi``: ξ_l), per head [B, h] (docs/bounds.md §5.1, "Attention's
    logits on the set"): the linear logit map L_l applied to each part, ‖L(c)‖ + ε‖L(G)‖₂ + max over
    the box of ‖L(A)ζ‖ + the groups' ‖L(Q_j)‖_F under their budget + ξ_l Σρ for E. The remainder's
    ξ_l·r bounds the same over the whole ball of radius r; the set is often far smaller in the
    directions the logits read. ``mapped``: :func:`map_logits`, if at hand."""
    M = map_logits(S, layer, parts) if mapped is None else mapped
    B, h, n = M.shift.shape[:3]
    LG = M.G.reshape(B, h, n * n, -1)
    first = eps * gram_norm(LG.mT @ LG if LG.shape[-1] <= n * n else LG @ LG.mT)
    shift = M.shift.flatten(2).norm(dim=-1)
    if M.A.shape[-1]:
        symbols = box_norms(M.A.reshape(B * h, n, n, -1))[1].reshape(B, h)
    else:
        symbols = torch.zeros_like(shift)
    if M.Q.shape[-2]:
        groups = M.Q.square().sum((2, 3, 5)).sqrt()  # [B, h, k]
        grouped = torch.stack([S.grouped(groups[:, i]) for i in range(h)], 1)
    else:
        grouped = torch.zeros_like(shift)
    # Σρ, not S.ball()'s ‖W‖₂ where the columns are carried: ‖L(W)‖₂ ≤ ξ_l‖W‖₂ already (ξ_l bounds L_l
    # in the Frobenius norm), so that n·d-wide Gram would buy nothing but rounding
    ball = parts.xi * S.rho.sum(-1)[:, None]
    if M.W is not None:  # E as columns: ‖L(W)‖₂ per head where it is smaller
        LW = M.W.reshape(B, h, n * n, -1)
        ball = torch.minimum(ball, gram_norm(LW @ LW.mT if n * n <= LW.shape[-1] else LW.mT @ LW))
    return (shift + first + symbols + grouped + ball) * (1 + ROUND)


@dataclass(frozen=True)
class LogitBox:
    """Every logit's change over the set, in the softmax's own units (÷√d_h), [B, h, n, n]: the linear
    part within ``centre ± linear`` and the whole change (the quadratic part Γ A_l Γᵀ/√d_h included)
    within ``centre ± whole``."""

    centre: Tensor
    linear: Tensor
    whole: Tensor

    def spread(self, P: Tensor) -> Tensor:
        """An upper bound of std_{p_i}(δ_i) of the linear change over the box for rows P [B, h, n, n],
        [B, h, n]: half the row's span (Popoviciu), and the root of Σ_j p_ij max((lo_j − μ)², (hi_j − μ)²)
        about the box's p-weighted centre μ (Var_p ≤ E_p(δ − μ)² for any μ)."""
        lo, hi = self.centre - self.linear, self.centre + self.linear
        mid = (P * (lo + hi)).sum(-1, keepdim=True) / 2
        var = (P * torch.maximum((lo - mid).square(), (hi - mid).square())).sum(-1)
        return torch.minimum(var.sqrt(), (hi.amax(-1) - lo.amin(-1)) / 2) * (1 + ROUND)

    def spans(self) -> Tensor:
        """An upper bound of each row's span max_j δ_ij − min_j δ_ij of the whole change, [B, h, n]."""
        return ((self.centre + self.whole).amax(-1) - (self.centre - self.whole).amin(-1)) * (1 + ROUND)


def e_entries(S: DeviationSet, layer: DotMHA, parts, M: MappedLogits) -> tuple[Tensor, Tensor, Tensor]:
    """E's share of every linear logit change, L(E)_ij = ⟨E_i, a_j⟩ + ⟨b_i, E_j⟩ with a_j = W^Q_l k_j and
    b_i = W^K_l q_i: its entry bound ‖a_j‖‖E_i‖ + ‖b_i‖‖E_j‖ (E's per-token bounds), or the columns'
    exact ‖L(W)_ij‖ where smaller, [B, h, n, n] (before ÷√d_h); with a [B, h, n, d] and ‖b_i‖ [B, h, n]."""
    tb = S.token_ball()  # [B, n]
    a = parts.K @ layer.W_q.mT[None]  # [B, h, n, d]: W^Q_l k_j
    qk = (parts.Q @ layer.W_k.mT[None]).norm(dim=-1)  # ‖W^K_l q_i‖
    ball = tb[:, None, :, None] * a.norm(dim=-1)[:, :, None, :] + qk[..., None] * tb[:, None, None, :]
    if M.W is not None:
        ball = torch.minimum(ball, M.W.norm(dim=-1))
    return ball, a, qk


def logit_box(S: DeviationSet, layer: DotMHA, parts, eps: float, r: Tensor,
              mapped: MappedLogits | None = None, own: Tensor | None = None) -> LogitBox:
    """The :class:`LogitBox` of the set ``S`` (radius ``r`` [B]) at the clean point ``parts``
    (docs/bounds.md §5.1, "Attention's remainder on the set"): logit (i, j)'s linear change is at most
    the support of the set along L_l's functional (i, j), part by part as :func:`logit_change` sums
    its norms (E's per token, ‖W^Q_l k_j‖‖E_i‖ + ‖W^K_l q_i‖‖E_j‖, or the columns' exact support);
    the quadratic part is at most ‖A_l‖‖Γ_i‖‖Γ_j‖ with ‖Γ_i‖‖Γ_j‖ ≤ min(r_i r_j, ½r²) off the diagonal
    and ≤ min(r_i², r²) on it (r_t the set's token radii: ``own`` [B, n] where the caller has them)."""
    M = map_logits(S, layer, parts) if mapped is None else mapped
    B, n = M.shift.shape[0], M.shift.shape[2]
    width = eps * M.G.norm(dim=-1) + M.A.abs().sum(-1)
    if M.Q.shape[-2]:
        width = width + S.grouped(M.Q.norm(dim=-1))
    # E per token: L(E)_ij = ⟨E_i, W^Q_l k_j⟩ + ⟨E_j, W^K_l q_i⟩
    ball = e_entries(S, layer, parts, M)[0]
    root = math.sqrt(layer.d_h)
    # L(c)'s own rounding is relative to its terms, which |L(c)| may not be: covered with the widths'
    linear = (width + ball + ROUND * M.shift.abs()) * (1 + ROUND) / root
    t = S.token_radii(eps) if own is None else own  # [B, n]
    pair = t[:, :, None] * t[:, None, :]
    whole_ball = (0.5 * r.square())[:, None, None].expand(B, n, n).clone()
    whole_ball.diagonal(dim1=-2, dim2=-1).mul_(2)
    pair = torch.minimum(pair, whole_ball)
    quad = layer.A_norm()[None, :, None, None] * pair[:, None] * (1 + ROUND) / root
    return LogitBox(M.shift / root, linear, linear + quad)


@dataclass(frozen=True)
class RowReadings:
    """:func:`set_rows`' bounds per head and row, [B, h, n]: ``spread`` and ``spans`` (each no larger
    than the box's), and the spread's two shares before that minimum, ``first`` (the G part's) and
    ``other`` (every other part's), whose sum bounds it too."""

    spread: Tensor
    spans: Tensor
    first: Tensor
    other: Tensor
    # [B, h, n, n] each, or None (docs/bounds.md §5.1, "The logits' part per key"): ``excess`` ≥
    # p_ijφ(w_ij), φ(w) = e^w − 1 − w, and ``moved`` ≥ |p'_ij − p_ij|, w_ij = log(p'_ij/p_ij) over the set
    excess: Tensor | None = None
    moved: Tensor | None = None


def set_rows(S: DeviationSet, layer: DotMHA, parts, eps: float, box: LogitBox,
             mapped: MappedLogits | None = None) -> RowReadings:
    """Two bounds per row of the logits over the set ``S`` (docs/bounds.md §5.1, "The logits' rows on
    the set"):

    * ``spread``: std_{p_i}(δ_i) of the linear change under the clean weights p_i, the norm of
      diag(√p_i)(I − 1p_iᵀ)δ_i, a seminorm, so the parts add: the shift's own, ε‖·‖₂ of the centred and
      weighted L(G)_i, the box's bound of L(A)_i's, the groups' Frobenius norms under their budget, and
      E's (Var_p ≤ E_p of its entries' squared bounds, or its columns' centred spectral norm);
    * ``spans``: max_{j,k} (u_ij − u_ik) of the whole change u (the quadratic part included): the G part
      pair by pair, ε‖L(G)_ij − L(G)_ik‖, from each row's Gram; the shift's exactly; every other part
      at most twice its largest entry bound in the row.

    Both see what the box cannot: a peaked row, and logits that move together (a shift of a whole row
    leaves its softmax unchanged)."""
    M = map_logits(S, layer, parts) if mapped is None else mapped
    P = parts.P  # [B, h, n, n]
    B, h, n = P.shape[:3]
    u = torch.finfo(P.dtype).eps / 2
    root = math.sqrt(layer.d_h)

    def centred(T: Tensor) -> Tensor:  # [B, h, n, n, cols]: T_i − 1p_iᵀT_i, row by row
        return T - (P[..., None] * T).sum(-2, keepdim=True)

    w = P.sqrt()
    TG = centred(M.G)  # [B, h, i, j, P]
    gram = TG @ TG.mT  # [B, h, i, j, k]: ⟨TG_ij, TG_ik⟩
    # each computed entry is off by at most γ‖TG_ij‖‖TG_ik‖ (Higham, Thm 3.5): the eigenvalue by at most
    # γ·trace, each squared distance by at most 2γ(‖TG_ij‖ + ‖TG_ik‖)²
    gamma = (TG.shape[-1] + n + 4) * u / (1 - (TG.shape[-1] + n + 4) * u)
    diag = gram.diagonal(dim1=-2, dim2=-1).clamp_min(0)  # [B, h, i, j]
    weighted = w[..., :, None] * gram * w[..., None, :]
    lam = torch.linalg.eigvalsh(weighted)[..., -1] + gamma * (P * diag).sum(-1)
    first = eps * lam.clamp_min(0).sqrt()
    spread = (P * centred(M.shift[..., None])[..., 0].square()).sum(-1).sqrt()
    dist = diag[..., :, None] + diag[..., None, :] - 2 * gram
    dist = dist + 2 * gamma * (diag.sqrt()[..., :, None] + diag.sqrt()[..., None, :]).square()
    # [B, h, i, j, k]: a bound of u_ij − u_ik from the G part and the shift
    pairs = eps * dist.clamp_min(0).sqrt() + (M.shift[..., :, None] - M.shift[..., None, :])
    entry = torch.zeros_like(P)  # [B, h, i, j]: a bound of every other part's |change| at logit (i, j)
    if M.A.shape[-1]:  # max over ζ ∈ [−1, 1]^m of ‖TAζ‖ weighted: box_norms with rows as its tokens
        TA = centred(M.A)
        spread = spread + box_norms((TA * w[..., None]).reshape(B * h, n, n, -1))[0].reshape(B, h, n)
        entry = entry + TA.abs().sum(-1)
    if M.Q.shape[-2]:
        k, g = M.Q.shape[-2:]
        TQ = centred(M.Q.reshape(B, h, n, n, k * g)).reshape(B, h, n, n, k, g)
        spread = spread + S.grouped((TQ * w[..., None, None]).square().sum((3, 5)).sqrt())
        entry = entry + S.grouped(TQ.norm(dim=-1))
    # E: entry (i, j) of L(E) is ⟨E_i, a_j⟩ + ⟨b_i, E_j⟩ with a_j = W^Q_l k_j, b_i = W^K_l q_i, so it is at
    # most ‖a_j‖‖E_i‖ + ‖b_i‖‖E_j‖ (or its columns' norm), and Var_p ≤ E_p of its square; or, the query's
    # own share varying with j through a_j alone, std_p ≤ ‖E_i‖·‖Cov_{p_i}(a)‖^½ + ‖b_i‖(Σ_j p_ij‖E_j‖²)^½;
    # or the columns' centred spectral norm
    ball, a, qk = e_entries(S, layer, parts, M)
    tb = S.token_ball()
    ball_spread = (P * ball.square()).sum(-1).sqrt()
    ac = (a[:, :, None] - (P @ a)[:, :, :, None]) * w[..., None]  # [B, h, i, j, d]: √p_ij (a_j − ā_i)
    cov = ac.mT @ ac  # [B, h, i, d, d]
    own_cov = (torch.linalg.eigvalsh(cov)[..., -1]
               + gamma * cov.diagonal(dim1=-2, dim2=-1).sum(-1)).clamp_min(0).sqrt()
    keys = qk * (P * tb[:, None, None].square()).sum(-1).sqrt()
    ball_spread = torch.minimum(ball_spread, tb[:, None] * own_cov + keys)
    if M.W is not None:
        TW = centred(M.W) * w[..., None]
        ball_spread = torch.minimum(ball_spread, gram_norm(TW @ TW.mT if n <= TW.shape[-1] else TW.mT @ TW))
    spread = spread + ball_spread
    # E's share of a span: ⟨E_i, a_j − a_k⟩ + ⟨b_i, E_j − E_k⟩ ≤ ‖E_i‖·diam(a) + 2‖b_i‖ max_j ‖E_j‖
    diam_a = (a[:, :, :, None] - a[:, :, None]).norm(dim=-1).amax((-1, -2))  # [B, h]
    ball_span = torch.minimum(2 * ball.amax(-1), tb[:, None] * diam_a[..., None]
                              + 2 * qk * tb.amax(-1)[:, None, None])
    # the centred parts' rounding is at most a relative 1e-10 of the uncentred change, whose
    # p-weighted root mean square the box's widths bound (Var_p ≤ E_p δ²)
    slack = 1e-10 * (P * (box.linear.square() + box.centre.square())).sum(-1).sqrt()
    first, spread = first * (1 + ROUND) / root + slack, spread * (1 + ROUND) / root + slack
    # the span: the G part and the shift pair by pair, the rest (the quadratic part with it) at twice
    # its largest entry; ROUND covers the sums, a relative 1e-10 of the row's largest entry the centring
    quad = (box.whole - box.linear).clamp_min(0)
    rest = 2 * (entry / root + quad).amax(-1) + ball_span / root
    # or every part pair by pair (§5.1, "The logits' rows on the set"): the symbols' and the groups'
    # differences between keys j and k, the quadratic part at its two entries; the smaller is kept
    slack = 2e-10 * (box.linear + box.centre.abs()).amax(-1)
    paired, lo, hi = pair_spans(S, M, pairs, quad, root, P=P, extra=ball_span / root,
                                plain=(rest, slack))
    paired = torch.minimum(pairs.amax((-1, -2)) / root + rest, paired + ball_span / root)
    spans = paired * (1 + ROUND) + slack
    excess, moved = key_excess(P, lo, hi, box)
    return RowReadings(torch.minimum(first + spread, box.spread(P)), torch.minimum(spans, box.spans()),
                       first, spread, excess, moved)


def key_excess(P: Tensor, lo: Tensor, hi: Tensor, box: LogitBox) -> tuple[Tensor, Tensor]:
    """Upper bounds of p_kφ(w_k) (φ(w) = e^w − 1 − w) and of |p'_k − p_k| = p_k|e^{w_k} − 1| for every
    key of every row P [B, h, n, n], with w_k = log(p'_k/p_k) within [``lo``, ``hi``] (:func:`log_ratios`)
    and within softmax's box of ``box`` (docs/bounds.md §5.1, "The logits' part per key"). φ is convex
    with its least value 0 at w = 0, so it is greatest at an end; e^w − 1 likewise. A weight that
    underflowed to 0 pays the box's bound of p'_k, as p_kφ(w_k) ≤ p'_k + p_k|w_k| and p_k|w_k| is below
    1e-290 there (p_k < 2⁻¹⁰²² and |w_k| below the few hundred units of a finite logit's change)."""
    low, high = softmax_box(P, box.centre - box.whole, box.centre + box.whole)
    live = P > 0
    logp = P.log()
    tol = 1e-12 * (1 + logp.abs())
    lo = torch.where(live, torch.maximum(lo, low.log() - logp - tol), 0.0)
    hi = torch.where(live, torch.minimum(hi, high.log() - logp + tol), 0.0)
    phi = lambda w: torch.expm1(w) - w
    # expm1 and the products: a relative 1e-12 covers their few ulps; 1e-300 the weights' underflow
    excess = P * torch.maximum(phi(lo), phi(hi)) * (1 + 1e-12)
    excess = torch.where(live, excess, high + 1e-290)
    tiny = 4 * torch.finfo(P.dtype).eps  # as set_remainder: each weight's rounding
    box_moved = torch.maximum(high - P, P - low).clamp_min(0) + tiny
    moved = P * torch.maximum(-torch.expm1(lo), torch.expm1(hi)) * (1 + 1e-12) + 1e-300
    moved = torch.where(live, torch.minimum(moved, box_moved), box_moved)
    return excess, moved


def log_ratios(P: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """Bounds of w_k = log(p'_k/p_k) for rows P [..., n] (keys k) whose logits' change u obeys
    u_j − u_k ≤ D[..., j, k] for every pair, [..., n] each (docs/bounds.md §5.1, "The logits' part per
    key"): w_k = −log Σ_j p_j e^{u_j − u_k}, which falls as each u_j − u_k grows, so it lies in
    [−log Σ_j p_j e^{D_jk}, −log Σ_j p_j e^{−D_kj}] (D_kk read as 0: u_k − u_k is); each end is widened
    by a relative 1e-12 (and an absolute 1e-12) for logsumexp's rounding."""
    logp = P.log()
    n = D.shape[-1]
    D = D.masked_fill(torch.eye(n, dtype=torch.bool, device=D.device), 0.0)
    lo = -(logp[..., :, None] + D).logsumexp(-2)
    hi = -(logp[..., None, :] - D).logsumexp(-1)
    return lo - 1e-12 * (1 + lo.abs()), hi + 1e-12 * (1 + hi.abs())


def pair_spans(S: DeviationSet, M: MappedLogits, pairs: Tensor, quad: Tensor, root: float,
               P: Tensor | None = None, extra: Tensor | None = None,
               plain: tuple[Tensor, Tensor] | None = None) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """max over keys j, k of an upper bound of u_ij − u_ik for every row, [B, h, n], E's share left out
    (docs/bounds.md §5.1, "The logits' rows on the set"): ``pairs`` [B, h, i, j, k] (the G part's and the
    shift's, before ÷√d_h) plus the symbols' Σ_m |L(A)_ij,m − L(A)_ik,m|, the groups' ‖L(Q)_ij − L(Q)_ik‖
    under their budget (both ÷√d_h) and the quadratic part's bound at both entries, ``quad`` [B, h, i, j].
    A shared move of the two keys' logits cancels here, where the sum of each one's largest bound pays
    it twice. Formed a few rows at a time (:data:`PAIR_CHUNK` entries).

    Given the clean rows ``P`` [B, h, n, n], E's share ``extra`` [B, h, n] and ``plain`` (rest, slack),
    each [B, h, n] (``pairs``/√d_h + rest bounds every pair as well; slack the rows' absolute rounding),
    it also returns :func:`log_ratios` of each pair's smaller bound, [B, h, n, n] each: (spans, lo, hi)."""
    B, h, n = pairs.shape[:3]
    wide = max(1, M.A.shape[-1], M.Q.shape[-2] * M.Q.shape[-1])
    step = max(1, PAIR_CHUNK // (B * h * n * n * wide))
    out, los, his = [], [], []
    for i in range(0, n, step):
        rows = slice(i, i + step)
        diff = pairs[:, :, rows]
        if M.A.shape[-1]:
            A = M.A[:, :, rows]  # [B, h, i, j, m]
            diff = diff + (A[..., :, None, :] - A[..., None, :, :]).abs().sum(-1)
        if M.Q.shape[-2]:
            Q = M.Q[:, :, rows]  # [B, h, i, j, k, g]
            diff = diff + S.grouped((Q[..., :, None, :, :] - Q[..., None, :, :, :]).norm(dim=-1))
        q = quad[:, :, rows]
        D = diff / root + q[..., :, None] + q[..., None, :]
        out.append(D.amax((-1, -2)))
        if P is not None:
            rest, slack = (t[:, :, rows, None, None] for t in plain)
            D = torch.minimum(D + extra[:, :, rows, None, None], pairs[:, :, rows] / root + rest)
            lo, hi = log_ratios(P[:, :, rows], D * (1 + ROUND) + slack)
            los.append(lo)
            his.append(hi)
    if P is None:
        return torch.cat(out, 2)
    return torch.cat(out, 2), torch.cat(los, 2), torch.cat(his, 2)


def softmax_box(P: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Entrywise bounds of softmax(s + δ) over lo ≤ δ ≤ hi for rows P = softmax(s), [..., n] each:
    p'_j = p_j e^{δ_j}/Σ_k p_k e^{δ_k} increases with δ_j and decreases with every other δ_k, so it is
    least at δ_j = lo_j with every other δ_k = hi_k, σ(log p_j + lo_j − log Σ_{k≠j} p_k e^{hi_k}), and
    greatest at the opposite corner."""
    logp = P.log()
    n = P.shape[-1]
    off = torch.eye(n, dtype=torch.bool, device=P.device)

    def others(v: Tensor) -> Tensor:  # log Σ_{k≠j} e^{v_k} for every j, [..., n]
        return v[..., None, :].masked_fill(off, -math.inf).logsumexp(-1)

    low = torch.sigmoid(logp + lo - others(logp + hi))
    high = torch.sigmoid(logp + hi - others(logp + lo))
    return low, high


def set_remainder(layer: DotMHA, parts, box: LogitBox, r: Tensor,
                  own: Tensor | None = None, spread: Tensor | None = None,
                  spans: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Bounds of ‖F(X + Γ) − F(X) − J_F(X)[Γ]‖ over the set whose logits lie in ``box``, whose radius is
    at most ``r`` [B] and whose tokens' radii are at most ``own`` [B, n] (default r): the whole [B] and
    each output token's row [B, n] (docs/bounds.md §5.1, "Attention's remainder on the set"). With P'
    the weights at X + Γ, Y_l = X C_l, ȳ_i = p_iᵀY_l and δ the linear logit change, each head's
    R_l = (P'_l − P_l)Y_l + (P'_l − P_l)ΓC_l − dP_l[Γ]Y_l, bounded row by row:

    * ‖(p'_i − p_i)ᵀY‖ ≤ min(Σ_j u_ij‖Y_j − ȳ_i‖, m_i·diam(Y)), u_ij ≥ |p'_ij − p_ij| from
      :func:`softmax_box` and m_i ≥ the mass p' moves: the box's, or tanh(s_i/4) where ``spans``
      [B, h, n] bounds the rows' logit spans s_i (docs/bounds.md §5.1, "At large logit spans");
    * ‖(p'_i − p_i)ᵀΓC_l‖ ≤ min(‖u_i‖·r, Σ_j u_ij·own_j, m_i·reach)·‖C_l‖ (over rows, the first or the
      third), reach ≥ max_{j≠k} ‖Γ_j‖ + ‖Γ_k‖;
    * ‖dP[Γ]_iᵀY‖ = ‖Cov_{p_i}(δ_i, Y)‖ ≤ std_{p_i}(δ_i)·σ_i, σ_i² = Σ_j p_ij‖Y_j − ȳ_i‖², the std
      at most ``spread`` [B, h, n] (:func:`set_rows`), or that of the box about its p_i-weighted
      centre and half the row's span.

    Heads add; the whole takes each part's Frobenius norm over rows."""
    P = parts.P  # [B, h, n, n]
    lo, hi = softmax_box(P, box.centre - box.whole, box.centre + box.whole)
    tiny = 4 * torch.finfo(P.dtype).eps  # each weight's rounding (the weights are at most 1)
    up, down = (hi - P).clamp_min(0) + tiny, (P - lo).clamp_min(0) + tiny
    u = torch.maximum(up, down)
    Y = parts.V @ layer.W_o[None]  # [B, h, n, d]: X C_l, the value bias left out (it cancels)
    Ybar = P @ Y
    Yc = (Y[:, :, None] - Ybar[:, :, :, None]).norm(dim=-1)  # [B, h, i, j]: ‖Y_j − ȳ_i‖
    diam = (Y[:, :, :, None] - Y[:, :, None]).norm(dim=-1).amax((-1, -2))  # [B, h]
    mass = torch.minimum(up.sum(-1), down.sum(-1))
    if spans is not None:  # ½‖p' − p‖₁ ≤ tanh(s/4) where the row's logits span at most s
        mass = torch.minimum(mass, torch.tanh(spans / 4) * (1 + 1e-12))
    first = torch.minimum((u * Yc).sum(-1), mass * diam[..., None])  # [B, h, n]
    C = layer.C_norm()[None, :, None]
    norm = lambda t: t.square().sum(-1).sqrt()  # over rows
    second = u.norm(dim=-1) * r[:, None, None] * C  # [B, h, n]; over rows ‖U‖_F·r·‖C_l‖
    # the moved mass times the span of Γ_kC_l over the keys
    second = torch.minimum(second, mass * key_reach(r, own)[:, None, None] * C)
    whole_second = norm(second)
    if own is not None:
        second = torch.minimum(second, (u * own[:, None, None]).sum(-1) * C)
    spread = box.spread(P) if spread is None else spread
    third = spread * (P * Yc.square()).sum(-1).sqrt()  # [B, h, n]
    whole = (norm(first) + whole_second + norm(third)).sum(-1)
    rows = (first + second + third).sum(1)
    return whole * (1 + 1e-10), rows * (1 + 1e-10)
