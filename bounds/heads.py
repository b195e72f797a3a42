"""The heads sharing Γ in attention's Taylor remainder (docs/bounds.md §2.3.2): :func:`heads_top`,
λ_max(Σ_l w_li F_l F_lᵀ) per row, certified by Cholesky; :func:`heads_top_max`, its largest row with
only the rows that can be the largest certified; :func:`heads_top_as`, the same taken as a
:class:`bounds.estimate.Estimate` says; and :func:`heads_below`, an estimate from below that never
enters a bound."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .estimate import Estimate
from .forms import ROUND_REL, nan_inf, ritz_below, top_eig
from .norms import gram_norm, verified_gram_norm

_TINY = torch.finfo(torch.float64).tiny  # the smallest normal float64


def head_factors(F: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(‖F̄‖², ‖F_l‖² [h], an approximate top right singular vector of F̄ as [h, e], F̄ᵀF̄) for
    F [h, d, e], F̄ = [F_1 … F_h]: the norms rounded up (bounds.norms.gram_norm), the vector
    (a few power steps) for estimates from below only."""
    h, d, e = F.shape
    Fb = F.permute(1, 0, 2).reshape(d, h * e)
    K = Fb.mT @ Fb
    whole = gram_norm(K).square() * (1 + ROUND_REL)
    each = gram_norm(F.mT @ F).square() * (1 + ROUND_REL)  # [h]
    u = torch.ones(h * e, dtype=K.dtype, device=K.device)
    for _ in range(8):  # power steps: only a direction for a start
        u = K @ u
        u = u / u.norm().clamp_min(1e-300)
    return whole, each, u.reshape(h, e), K


def heads_above(factors: tuple[Tensor, ...], w: Tensor) -> Tensor:
    """:func:`heads_top` from above without an eigenproblem, [B, n]: by monotonicity in w ≥ 0,
    λ_max(Σ_l w_li F_l F_lᵀ) ≤ min(max_l w_li·‖F̄‖², Σ_l w_li‖F_l‖²); ``factors`` of
    :func:`head_factors`. +inf where a weight is."""
    whole, each = factors[:2]
    finite = torch.isfinite(w).all(1)
    w = torch.where(finite[:, None], w, torch.zeros_like(w)).clamp_min(0)
    top = torch.minimum(w.amax(1) * whole, (w * each[None, :, None]).sum(1)) * (1 + ROUND_REL)
    return torch.where(finite, top, torch.full_like(top, torch.inf))


def heads_below(F: Tensor, factors: tuple[Tensor, ...], w: Tensor) -> Tensor:
    """:func:`heads_top` from *below*, [B, n], without an eigenproblem a row: the top Ritz value of
    two block Krylov steps (:func:`ritz_below`) on D_i^½ F̄ᵀF̄ D_i^½ from D_i^½u, u, the heaviest
    head's block of u and D_i u, with u F̄'s top direction (``factors``, :func:`head_factors`). An
    estimate, never a bound; +inf where a weight is."""
    h, _, e = F.shape
    B, _, n = w.shape
    finite = torch.isfinite(w).all(1)
    w = torch.where(finite[:, None], w, torch.zeros_like(w)).clamp_min(0)
    K = factors[3]
    root = w.sqrt().repeat_interleave(e, 1).mT.reshape(B * n, h * e)  # D_i^½ on the diagonal
    start = _heads_start(factors, w, root)
    top = ritz_below(lambda Q: root[..., None] * (K @ (root[..., None] * Q)), start, 2).reshape(B, n)
    return torch.where(finite, top, torch.full_like(top, torch.inf))


def _heads_start(factors: tuple[Tensor, ...], w: Tensor, root: Tensor) -> Tensor:
    """D_i^½u, u, the heaviest head's block of u and D_i u per row, [B·n, h·e, 4]: u F̄'s top direction
    (:func:`head_factors`), w [B, h, n] ≥ 0 and finite, root [B·n, h·e] the caller's D_i^½."""
    u = factors[2]
    h, e = u.shape
    B, _, n = w.shape
    u = u.reshape(h * e)
    heavy = torch.nn.functional.one_hot(w.argmax(1).reshape(B * n), h).to(u.dtype).repeat_interleave(e, 1)
    return torch.stack([root * u, u.expand(B * n, -1), heavy * u, root.square() * u], -1)


def heads_top_max(value: Callable[[Callable[[Tensor, Tensor], Tensor]], Tensor],
                  factors: dict | None = None) -> Tensor:
    """max over rows of ``value(heads)`` [B, n] → [B], where ``value`` combines :func:`heads_top`
    values (``heads(F, w)``, [B, n]) monotonically, each certified only on the rows that can attain
    the maximum: every row's value from above (:func:`heads_above`) and from below
    (:func:`heads_below`), then :func:`heads_top` on the rows whose value from above reaches the
    largest from below; the others keep their bound from above, which is below that maximum.

    Where the rows' weights are (nearly) proportional, as on the margin-trained ViTs, one row serves
    them all: λ_max is monotone in w ≥ 0 and homogeneous, so w_i ≤ ρ_i·w_* (ρ_i = max_l w_li/w_*l)
    gives λ_i ≤ ρ_i·λ_*. The row * likeliest to be the largest (from below) is certified first,
    every other row takes ρ_i·λ_*, and only the rows whose value with it is more than HEADS_TAU above
    row *'s are certified too; the maximum is then at most HEADS_TAU (relative) above that of every
    row certified, as each certified row already is. This path is taken where the estimates from
    below predict that at most half the other rows that can attain the maximum need certifying;
    elsewhere (MiniLM: rows far from proportional) they are all certified at once. Certified
    wherever.
    ``value`` must make the same calls in the same order each time it is called (lin_q's and
    _value_gram's do): each call's estimates and certified row are matched to it by position.
    ``factors``: a dict (empty at first) that keeps :func:`head_factors` for calls on the same F."""
    of = _factors_of({} if factors is None else factors)
    above = value(lambda F, w: heads_above(of(F), w))
    lows: list[Tensor] = []  # each call's heads_below, in value's order of calls

    def low(F: Tensor, w: Tensor) -> Tensor:
        lows.append(heads_below(F, of(F), w))
        return lows[-1]

    below = value(low)
    rows = ~(above < below.amax(-1, keepdim=True))  # [B, n]; NaN-safe: a NaN row is computed
    ref = below.nan_to_num(-torch.inf).argmax(-1, keepdim=True)  # [B, 1]
    others = rows.clone()
    others.scatter_(1, ref, False)

    def at_ref(w: Tensor) -> Tensor:  # row *'s weights, [B, h, 1]
        return w.gather(2, ref[:, None].expand(-1, w.shape[1], 1))

    def scaled(F: Tensor, w: Tensor, top: Tensor) -> Tensor:  # min(above, ρ_i·top_*), [B, n]
        # ρ_i = max_l w_li/w_*l, with ∞ where w_li > 0 and row *'s weight is not > 0 (heads_top takes
        # 0, −0.0 and anything below as 0) or the ratio leaves float64's normal range (its rounding
        # is then not relative); a product below that range is raised to it for the same reason
        wr = at_ref(w)
        ratio = w / torch.where(wr > 0, wr, torch.ones_like(wr))
        exact = (wr > 0) & (ratio >= _TINY)
        ratio = torch.where(w > 0, torch.where(exact, ratio, torch.full_like(ratio, torch.inf)), 0.0)
        bound = nan_inf(ratio.amax(1) * top.gather(1, ref) * (1 + ROUND_REL)).clamp_min(4 * _TINY)
        bound = torch.where(torch.isfinite(w).all(1), bound, torch.full_like(bound, torch.inf))
        return torch.minimum(heads_above(of(F), w), bound)

    calls = iter(lows)
    predicted = value(lambda F, w: scaled(F, w, next(calls)))
    need = others & (predicted > below.gather(1, ref) * (1 + HEADS_TAU))  # predicted, from below
    if bool(others.any()) and 2 * int(need.sum()) <= int(others.sum()):
        tops: list[Tensor] = []  # row *'s certified value in each call, as a [B, n] row vector

        def certify_ref(F: Tensor, w: Tensor) -> Tensor:
            top = torch.zeros_like(w[:, 0])
            top.scatter_(1, ref, heads_top(F, at_ref(w), of(F)))
            tops.append(top)
            return scaled(F, w, top)

        first = value(certify_ref)
        rows = others & ~(first <= first.gather(1, ref) * (1 + HEADS_TAU))
        if not bool(rows.any()):
            return first.amax(-1)
        calls = iter(tops)
        base = lambda F, w: scaled(F, w, next(calls))
    else:
        base = lambda F, w: heads_above(of(F), w)

    def certified(F: Tensor, w: Tensor) -> Tensor:
        out = base(F, w)
        if bool(rows.any()):
            out = out.clone()
            out[rows] = heads_top(F, w.permute(0, 2, 1)[rows].mT[None], of(F))[0]
        return out

    return value(certified).amax(-1)


def heads_top_as(value: Callable[[Callable[[Tensor, Tensor], Tensor]], Tensor], how: Estimate,
                 factors: dict | None = None) -> Tensor:
    """max over rows of ``value(heads)`` [B], its :func:`heads_top` values taken ``how``: certified
    (:func:`heads_top_max`), or without an eigenproblem from above (every row's :func:`heads_above`:
    a bound) or from below (every row's :func:`heads_below`: an estimate, never a bound). ``factors``
    as in :func:`heads_top_max`."""
    if not isinstance(how, Estimate):
        raise TypeError(f"how must be a bounds.estimate.Estimate, got {how!r}")
    if how is Estimate.CERTIFIED:
        return heads_top_max(value, factors)
    of = _factors_of({} if factors is None else factors)
    if how is Estimate.ABOVE:
        return value(lambda F, w: heads_above(of(F), w)).amax(-1)
    return value(lambda F, w: heads_below(F, of(F), w)).amax(-1)


def _factors_of(factors: dict) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """:func:`head_factors` of F, kept in ``factors`` (by F's identity, F kept beside them so that the
    identity is not reused)."""
    def of(F: Tensor) -> tuple[Tensor, ...]:
        if id(F) not in factors:
            factors[id(F)] = (F, head_factors(F))
        return factors[id(F)][1]

    return of


# heads_top's check: its guess (bounds.certificates' block Krylov run, every row at once through
# the one F̄ᵀF̄, started where heads_below starts, stopped once it moves by ≤ HEADS_TAU/4) raised by
# HEADS_TAU before the Cholesky check confirms it, above side HEADS_EIGH_MAX; a row's value is then
# at most 1e-4 above its λ_max. One thread, the remainder's calls (5–9 a layer): on the benchmark's
# d 384 cells the guess stopped within 6.4e-5 of λ_max (no check failed) in half the time a stop at
# 1e-6 took; on the digits ViTs' side 32 an eigendecomposition a row is faster
HEADS_TAU = 1e-4
HEADS_EIGH_MAX = 64


def heads_top(F: Tensor, w: Tensor, factors: tuple[Tensor, ...] | None = None) -> Tensor:
    """λ_max(Σ_l w_li F_l F_lᵀ) for every row i, rounded up, [B, n]: F [h, d, e] per head, w [B, h, n]
    ≥ 0. Through F̄ = [F_1 … F_h] (d × h·e): the top eigenvalue of D_i^½ F̄ᵀF̄ D_i^½, D_i = w_li on
    head l's e columns, certified by Cholesky (docs/bounds.md §2.3.2): above side HEADS_EIGH_MAX the
    guess's products with F̄ᵀF̄ are one matrix product a step for every row (a row whose check fails
    takes an eigendecomposition, bounds.norms.verified_gram_norm); with ``factors``
    (:func:`head_factors`'s) the guess starts where :func:`heads_below` does. +inf where a weight is."""
    h, d, e = F.shape
    m = h * e
    Fb = F.permute(1, 0, 2).reshape(d, m)
    K = Fb.mT @ Fb
    finite = torch.isfinite(w).all(1)  # [B, n]
    w = torch.where(finite[:, None], w, torch.zeros_like(w))
    root = w.clamp_min(0).sqrt().repeat_interleave(e, 1).mT  # [B, n, h·e]
    S = root[..., :, None] * K * root[..., None, :]
    if m <= HEADS_EIGH_MAX:
        top = top_eig(S.flatten(0, 1))
    else:
        rt = root.reshape(-1, m, 1)

        def apply(Q: Tensor) -> Tensor:  # [rows, m, k] → S_i Q_i: one product with K for every row
            Z = (rt * Q).permute(1, 0, 2).reshape(m, -1)
            return rt * (K @ Z).reshape(m, Q.shape[0], -1).permute(1, 0, 2)

        start = None if factors is None else _heads_start(factors, w.clamp_min(0), rt[..., 0])
        top = verified_gram_norm(S.flatten(0, 1), HEADS_TAU, apply=apply, start=start,
                                 rtol=HEADS_TAU / 4)[0].square()
    top = top.reshape(S.shape[:2])
    # rounding: far below 1e-10 of ‖S‖_F ≥ λ_max (sums of h·e products, each exact to 1e-16)
    top = top * (1 + ROUND_REL) + 1e-10 * S.flatten(-2).norm(dim=-1)
    return torch.where(finite, top, torch.full_like(top, torch.inf))
