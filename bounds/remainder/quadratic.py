"""Attention's Taylor remainder with its second-order term as the quadratic form it is and the third
as the cubic form it is, every other term jointly over heads and rows (docs/bounds.md §2.3.2,
§2.3.4): :func:`quadratic_remainder`. The forms' certified norms are in :mod:`bounds.forms` and
:mod:`bounds.heads`, the rows' statistics in :mod:`bounds.remainder.row_bounds`."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from models import DotMHA

from ..base import radius
from ..certificates import Ledger, book
from ..estimate import Estimate
from ..forms import (
    ROUND_REL,
    Deferred,
    cubic_form_norm,
    form_norm,
    logit_gram,
    nan_inf,
    spectral_spread,
    spread_estimate,
    value_cubic_parts,
    value_form_parts,
    value_pair_norm,
    value_root,
    value_side_below,
    weighted_spread,
)
from ..heads import heads_top_as
from ..lofast import layer_key
from .row_bounds import (
    RowStats,
    Spread,
    assemble_rows,
    curve_g1,
    curve_g2,
    curve_g3,
    curve_g4,
    curve_h2,
    row_stats,
    weighted_x,
)

QUAD_LIMIT = 1536  # h·n² above which the quadratic form's eigenproblem is skipped (§2.3.2)


# the fourth joint cumulant E[ũ³Ỹ] − 3E[ũ²]E[ũỸ] of a row over the ball is at most
# (1 + 3/(2√2))·s·diam(Y)·Var(u) (docs/bounds.md §2.3.2)
CUMULANT4 = 1 + 3 / (2 * math.sqrt(2))


def quadratic_remainder(layer: DotMHA, X: Tensor, eps, cache: dict | None = None,
                        rows: RowStats | None = None, *, ledger: Ledger | None = None) -> Tensor:
    """``‖𝒜‖r² + min(√(cΛ), ‖𝓑‖)r² + the rest`` ≥ ‖R(Γ)‖_F over ‖Γ‖_F ≤ r, [B] (docs/bounds.md
    §2.3.2, §2.3.4): the pure-logit second-order term bounded jointly over heads and rows as the
    quadratic form it is (‖𝒜‖r², :func:`logit_form_norm`), the value term Σ_l dP_l[Γ]ΓC_l by
    Cauchy–Schwarz (√(cΛ) r²) or, on a wide layer, as the bilinear form it is (‖𝓑‖r², or with the
    value side's third order as one pair, :func:`_value_pairs`), and what is
    left (Cov_p(q, Y), the third order and beyond) the smallest of three ways, with the row
    quantities of :func:`row_stats`, v_i = √λ_i‖C_l‖r and g₃(s) = ∫₀¹ ½(1−t)² e^{ts} dt:

    * per head, assembled over rows by :func:`assemble_rows`, with
      α'_i = (7/4) s_i² g₃(s_i) σ_i + g₂(s_i) v_i and β'_i = σ_i (1 + 3s_i/2) + v_i + α'_i;
    * the pure-logit third order jointly over heads and rows, Σ_{l,i} c_li Var_{p_li}(u_li) with
      c_li = (1 + 3/(2√2)) s_li diam(Y_l) g₃(s_li), its δ part a weighted λ_max of the logit Gram
      (:func:`bounds.forms.weighted_spread`) so that heads and rows share Γ's energy; the rest per
      head as above without that term;
    * the third order at the clean point as the form it is and every other term jointly
      (:func:`_cubic_rest`, §2.3.4), which is the smallest almost everywhere; the first two win
      only where e^s is large, where the first-order bound of :func:`remainder` is smaller anyway.

    +inf where h·n² > QUAD_LIMIT. ``cache`` (a dict, empty at first) keeps what depends on the
    clean point alone (:func:`_clean_forms`) for calls at other radii on the same layer and X;
    without it they are kept on ``ledger``'s cache, if any; the certificates of its probabilistic
    value pairs go to ``ledger``. ``rows`` as in :func:`local_remainder`."""
    B, n, _ = X.shape
    ledger = book(ledger)
    r = radius(eps, X)[:, None, None]
    if layer.h * n * n > QUAD_LIMIT:
        return torch.full((B,), torch.inf, dtype=X.dtype, device=X.device)
    rows = row_stats(layer, X, r) if rows is None else rows
    s, sigma = rows.s, rows.sigma
    value = rows.v
    third = 1.75 * s.square() * curve_g3(s) * sigma  # × std(u): the pure-logit third order, per row
    beta = sigma * (1 + 1.5 * s) + value + curve_g2(s) * value  # × std(q)
    per_head = assemble_rows(rows, third + curve_g2(s) * value, beta + third, r, layer.d_h).sum(-1)
    G, P = logit_gram(layer, X, rows.P)
    # jointly: Σ_{l,i} c_li Var(u_li) ≤ (√(Σ c Var δ) + √(Σ c Var q))², Var(q_li) ≤ λ_li‖A_l‖²r²‖Γ_i‖²/d_h
    c = CUMULANT4 * s * rows.diamY[..., None] * curve_g3(s)  # [B, h, n]
    r1 = r[:, 0, 0]
    joint_q = assemble_rows(rows, curve_g2(s) * value, beta, r, layer.d_h).sum(-1)
    if cache is not None:
        if "form" not in cache:
            cache.update(_clean_forms(layer, X, G, P, sigma))
        clean = cache
    else:  # the certify runs ask every ε on one trace, on one ledger's cache
        names, tensors = layer_key(layer)
        clean = ledger.value(("quadratic_parts", names), (*tensors, X),
                             lambda: _clean_forms(layer, X, G, P, sigma))
    spreads = _Spreads(G, P, clean)
    before = len(clean["pairs"])  # the pairs certified by earlier calls (:func:`_record_pairs`)
    # c of the value term, from above (no eigenproblem), from below or certified, each when first asked
    cvs: dict[Estimate, Tensor] = {}
    memo: dict = {}

    def value_c(how: Estimate) -> Tensor:
        if how not in cvs:
            cvs[how] = _value_c(layer, rows, how, memo)
        return cvs[how]

    # the value forms where they can win at this radius, both at once where both can (_value_pairs),
    # judged with c from above
    cs_upper = value_c(Estimate.ABOVE).sqrt() * clean["spread"]  # the value term by Cauchy–Schwarz, √(cΛ)
    shared_upper = _shared_value(layer, rows, spreads.above, r, value_c(Estimate.ABOVE))
    _value_pairs(layer, clean, r1, cs_upper, shared_upper, lazy=False)
    cubic = _cubic_rest(layer, rows, r, clean)
    crude = _cubic_crude(G, clean, spreads)

    def assemble(mode: Estimate, formed: bool, small: Estimate | None = None) -> Tensor:
        # everything but ‖𝒜‖r², a summand of every assembly (below); ``small``: c and the value side's
        # third order's q part from above, from below or certified (rule 4); the assemblies from
        # above and from below take them as they take the spreads
        small = small if mode is Estimate.CERTIFIED else mode
        cv = value_c(small)
        spread = spreads.taken(mode)
        if formed:  # ‖𝒞‖² from above (‖S‖_F), from below, or certified: bounds.forms.Deferred
            cubic_sq = _deferred(cubic_form(layer, X, G, P, clean), mode)
        else:  # its matrix not formed: :func:`_cubic_crude`'s bound, or 0 from below
            cubic_sq = crude if mode is Estimate.ABOVE else torch.zeros_like(crude)
        cubic_sq = cubic_sq.clamp_min(0)
        joint = nan_inf(weighted_x(layer, rows, spread, c, r1).square() + joint_q)
        shared = _shared_value(layer, rows, spread, r, cv)
        # ‖𝓑₂‖ alone in the same choice as the spreads: certified where it can win and no pair
        # bounds it (:func:`_value_pairs`), else from the pairs (+inf without one), or from below
        if mode is Estimate.CERTIFIED:
            _value_pairs(layer, clean, r1, cs_upper, shared_upper, lazy=True)
        bilinear, value3, pair = _pair_values(clean, r1)
        if mode is Estimate.BELOW:
            value3 = torch.where(_covered(clean), value3, clean["value3_below"])
        # the value term: Cauchy–Schwarz (√(cΛ)) or the bilinear form itself (‖𝓑‖), the smaller
        second = torch.minimum(cv.sqrt() * clean["spread"], bilinear) * r1**2
        apart, paired = cubic(spread, shared, cubic_sq.sqrt(), value3, pair, small)
        rest = torch.minimum(torch.minimum(per_head, joint), apart)
        return torch.minimum(nan_inf(second + rest), nan_inf(paired))

    # ‖𝒜‖r², the same in every assembly (rule 4): ‖𝒜‖ without its matrix (bounds.forms.logit_form_cheap)
    # where that alone is within TERM_SLACK of the rest of the remainder from below, else from ‖S‖_F
    # where that is within TERM_SLACK of it above its estimate from below (a Ritz value), else certified
    lower = assemble(Estimate.BELOW, False)
    logit = clean["form"]  # (2‖𝒜‖)², a bounds.forms.Deferred
    above = 0.5 * logit.cheap.clamp_min(0).sqrt()
    if not bool((above * r1**2 <= TERM_SLACK * lower).all()):
        above, below = 0.5 * logit.upper.clamp_min(0).sqrt(), 0.5 * logit.below.clamp_min(0).sqrt()
        if not bool(((above - below) * r1**2 <= TERM_SLACK * (lower + below * r1**2)).all()):
            above = 0.5 * logit.value().clamp_min(0).sqrt()

    def total(rest: Tensor) -> Tensor:
        # a factor that overflowed (e^s at a saturating scale, times a zero) bounds nothing: +inf, so
        # that the smaller of the remainders (:func:`remainder`) never takes a NaN
        return nan_inf((above * r1**2 + rest) * (1 + ROUND_REL))

    # every weighted spread by monotonicity first, and ‖𝒞‖ without its matrix; then with ‖𝒞‖'s matrix
    # formed; certified only where that could cost more than SPREAD_SLACK of the remainder, judged
    # each time against the estimates from below; and in the certified assembly the small terms
    # certified only where they could cost more than TERM_SLACK (rule 4)
    def choose() -> Tensor:
        upper = total(assemble(Estimate.ABOVE, False))
        if bool((upper <= (1 + SPREAD_SLACK) * total(lower)).all()):
            return upper
        upper = torch.minimum(upper, total(assemble(Estimate.ABOVE, True)))
        if bool((upper <= (1 + SPREAD_SLACK) * total(assemble(Estimate.BELOW, True))).all()):
            return upper
        upper = torch.minimum(upper, total(assemble(Estimate.CERTIFIED, True, Estimate.ABOVE)))
        below = total(assemble(Estimate.CERTIFIED, True, Estimate.BELOW))
        if bool((upper <= (1 + TERM_SLACK) * below).all()):
            return upper
        return torch.minimum(upper, total(assemble(Estimate.CERTIFIED, True, Estimate.CERTIFIED)))

    out = choose()
    _record_pairs(clean, before, ledger)
    return out


# the remainder with each weighted spread λ_max(D_w) bounded by max(w)·Λ (no eigenproblem) is kept
# where it is at most this much above the remainder with every spread's estimate from below, itself
# at most the remainder with the spreads certified (the remainder grows with each spread): so it is
# within this of what certifying them all would give (docs/bounds.md §2.3.4, "Eigenproblems left out")
SPREAD_SLACK = 0.01
# the certified assembly with its small terms (the value term's c and the value side's third order's
# q part, each a heads' top) from above is kept where it is at most this much above the same with
# them from below, itself at most the one with them certified (the remainder grows with each): on
# MiniLM they took 90–130 ms of a 0.6 s remainder and moved it by at most 0.07 % (docs/bounds.md
# §2.3.4, "Eigenproblems left out", rule 4; ‖𝒜‖ follows the same slack there)
TERM_SLACK = 1e-3


class _Spreads:
    """λ_max(D_w) = λ_max(diag(√(w∘p)) G diag(√(w∘p))) for the weights w the quadratic remainder asks
    (:func:`bounds.forms.weighted_spread`), three ways (:class:`bounds.estimate.Estimate`), each [B]:

    * ``certified``: an eigenproblem of side h·n² each;
    * ``above``: max(w)·Λ, certified without one: λ_max(D_w) = λ_max(G^½ diag(w∘p) G^½) and
      diag(w∘p) ⪯ max(w)·diag(p), with Λ = λ_max(D_1) as certified for the second-order term;
    * ``below``: an estimate from below (:func:`bounds.forms.spread_estimate`), never a bound of
      anything: it tells whether ``above`` is close enough.

    ``certified`` keeps each value by its weights' bytes: the certified assemblies (rule 4 takes two
    or three) ask the same weights again."""

    def __init__(self, G: Tensor, P: Tensor, clean: dict[str, Tensor]) -> None:
        self.G, self.P, self.top, self.vector = G, P, clean["Lambda"], clean["spread_vector"]
        self._certified: dict[tuple, Tensor] = {}

    def taken(self, how: Estimate) -> Spread:
        """The spread taken ``how``."""
        return {Estimate.CERTIFIED: self.certified, Estimate.ABOVE: self.above,
                Estimate.BELOW: self.below}[how]

    def certified(self, w: Tensor) -> Tensor:
        key = (tuple(w.shape), w.detach().cpu().numpy().tobytes())
        if key not in self._certified:
            self._certified[key] = weighted_spread(self.G, self.P, w)
        return self._certified[key]

    def above(self, w: Tensor) -> Tensor:
        most = w.flatten(1).amax(-1)
        finite = torch.isfinite(w).flatten(1).all(-1)
        value = torch.where(most > 0, most.clamp_min(0) * self.top * (1 + ROUND_REL), torch.zeros_like(most))
        return torch.where(finite, value, torch.full_like(value, torch.inf))

    def below(self, w: Tensor) -> Tensor:
        return spread_estimate(self.G, self.P, w, self.vector)


# ‖𝓑‖ and ‖𝓑₂‖ are n·min(d, h·d_h)-square eigenproblems: computed only on a layer wide for its tokens
# (4·h·n² ≤ n·d, as MiniLM's at sentence length, where they take the value side to 0.2–0.5 of the
# Cauchy–Schwarz bounds) and up to this size; on the zoo's ViTs they cost 3–4× the rest of the
# remainder and were above Cauchy–Schwarz on every block measured (docs/bounds.md §2.3.4)
VALUE_FORM_LIMIT = 2560


def _clean_forms(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, sigma: Tensor) -> dict[str, Tensor]:
    """What the quadratic remainder takes from the clean point alone, [B] or [B, h, n] each: ‖𝒜‖ (as
    (2‖𝒜‖)², a bounds.forms.Deferred: certified only where rule 4 asks), √Λ, ‖𝒞‖ and σ₂
    (bounds.forms), and on a wide layer (up to VALUE_FORM_LIMIT) the value forms'
    parts (``value_parts``), their estimates from below (``bilinear_below``, ``value3_below``: +inf
    elsewhere) with those estimates' Ritz vectors (``value_start``, where the pairs' guesses start)
    and the list of their certified pairs, empty until a radius asks one (:func:`_value_pairs`)."""
    B, n, d = X.shape
    none = torch.full((B,), torch.inf, dtype=X.dtype, device=X.device)
    Lambda, vector = weighted_spread(G, P, vector=True)
    # N^½, which ‖𝒜‖'s and ‖𝒞‖'s matrices share: computed where the first of them is formed
    root = functools.cache(lambda: value_root(layer, X, P))

    out = {"form": form_norm(layer, X, G, P, root, deferred=True), "Lambda": Lambda, "spread": Lambda.sqrt(),
           "spread_vector": vector, "bilinear_below": none, "value3_below": none, "pairs": [],
           "root": root,
           "sigma2": spectral_spread(layer, X, P, sigma)}
    if 4 * layer.h * n * n <= n * d and n * min(d, layer.h * layer.d_h) <= VALUE_FORM_LIMIT:
        parts = (value_form_parts(layer, X, G, P), value_cubic_parts(layer, X, G, P))
        (b1, x1), (b2, x2) = value_side_below(layer, parts[0][0], 2), value_side_below(layer, parts[1][0], 1)
        # the estimates' Ritz vectors and a fixed random column: the pairs' guesses start there
        g = torch.Generator().manual_seed(0)
        extra = torch.randn(x1.shape[-2], 1, generator=g, dtype=torch.float64).to(x1).expand(B, -1, 1)
        out.update(value_parts=parts, bilinear_below=b1, value3_below=b2,
                   value_start=torch.cat([x1, x2, extra], -1))
    return out


def _deferred(form: Deferred, how: Estimate) -> Tensor:
    """A :class:`bounds.forms.Deferred`'s value as the assembly takes it ``how``: certified, from above
    by ‖S‖_F or a Ritz estimate from below."""
    return form.value() if how is Estimate.CERTIFIED else form.upper if how is Estimate.ABOVE else form.below


def cubic_form(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, clean: dict) -> Deferred:
    """‖𝒞‖² as a :class:`bounds.forms.Deferred` (its matrix formed at the first call, kept in
    ``clean``, :func:`_clean_forms`'s)."""
    if "cubic" not in clean:
        clean["cubic"] = cubic_form_norm(layer, X, G, P, deferred=True, root=clean["root"])
    return clean["cubic"]


def _cubic_crude(G: Tensor, clean: dict[str, Tensor], spreads: _Spreads) -> Tensor:
    """‖𝒞‖² from above without its matrix, [B] (docs/bounds.md §2.3.4, "Eigenproblems left out"):
    with m_li = max_k ‖f̂_α‖ ≥ max_k |δ̃_lik| and σ₂ (:func:`bounds.forms.spectral_spread`), each head's
    share of row i is at most a_li std_p(δ_li), a_li = (2/3) m_li² σ₂_li, so ‖C(Γ)‖_F² ≤
    max_i Σ_l a_li · Σ_{l,i} a_li Var(δ_li) ≤ max_i Σ_l a_li · max(a)·Λ. Its root is ten to sixty
    times ‖𝒞‖, and enough wherever ‖𝒞‖r³ is far below the remainder (the margin-trained ViTs)."""
    sigma2 = clean["sigma2"]  # [B, h, n]
    B, h, n = sigma2.shape
    m2 = G.diagonal(dim1=-2, dim2=-1).reshape(B, n, h, n).amax(-1).permute(0, 2, 1).clamp_min(0)
    a = (2 / 3) * m2 * sigma2 * (1 + ROUND_REL)
    return a.sum(1).amax(-1) * (1 + ROUND_REL) * spreads.above(a)


# a certified pair serves another radius whose own weight c on ‖𝓑₂‖ is within this factor of the
# pair's: were the estimates exact, the pair's bound's square would exceed that of ‖𝓑‖r² + ‖𝓑₂‖r³ by
# at most x(ĉ − 1/ĉ)² ≤ 0.0091·x of it, ĉ = √1.1 and x = ‖𝓑₂‖r/‖𝓑‖ (0.04–0.11 on MiniLM), where a
# new pair costs an eigenproblem (docs/bounds.md §2.3.4, "The value forms as one")
PAIR_REUSE = 1.1


def _value_pairs(layer: DotMHA, clean: dict, r: Tensor, cs: Tensor, shared: Tensor, lazy: bool) -> None:
    """Certify the value forms at radius ``r`` [B] where they can win, appending
    (a, c, ‖[√a·𝓑, √c·𝓑₂]‖, its ledger entry or None) to ``clean["pairs"]`` (docs/bounds.md §2.3.4,
    "The value forms as one"; the entry where the pair is probabilistic, bounds.forms.value_pair_norm,
    for :func:`_record_pairs`).

    ‖𝓑‖ can win where its estimate from below is under ``cs`` (√(cΛ)); ‖𝓑₂‖ where its estimate times
    r³ is under ``shared`` (the value side with every weighted spread at its bound from above), as it
    enters min(shared, ‖𝓑₂‖r³ + terms ≥ 0). Where ‖𝓑‖ can win the first call (``lazy`` False, before
    any assembly) certifies a = 1 and, where ‖𝓑₂‖ can win too, c = r‖𝓑‖/‖𝓑₂‖ from the estimates (the
    weight that makes the pair's bound equal ‖𝓑‖r² + ‖𝓑₂‖r³ when the two forms share their top
    direction, and smaller when not), else c = 0: one eigenproblem for both. The second (``lazy``
    True, only where every spread is certified) certifies ‖𝓑₂‖ alone (a = 0, c = 1) where it can win
    and no pair has c > 0. A pair already certified whose a and c serve is reused (PAIR_REUSE). Each
    call certifies the whole batch, so that no element takes a zero matrix."""
    if "value_parts" not in clean:
        return
    b1, b2 = clean["bilinear_below"], clean["value3_below"]
    want2 = b2 * r**3 < shared
    pairs = clean["pairs"]
    if not lazy:
        want1 = b1 < cs
        if not bool(want1.any()):
            return
        t2 = r * b1 / b2
        c = torch.where(want1 & want2 & torch.isfinite(t2) & (t2 > 0), t2, torch.zeros_like(t2))
        a = torch.ones_like(c)
        for pa, pc, *_ in pairs:
            close = (pc <= PAIR_REUSE * c) & (c <= PAIR_REUSE * pc)
            if bool(((pa > 0) & torch.where(c > 0, close, pc == 0)).all()):
                return
    else:
        if not bool((want2 & ~_covered(clean)).any()):
            return
        a, c = torch.zeros_like(b2), torch.ones_like(b2)
    start = time.perf_counter()
    nu, cert = value_pair_norm(layer, *clean["value_parts"], a, c, clean["value_start"])
    # the ledger key of a probabilistic pair: a fresh object, equal to nothing else while it is held
    entry = None if cert is None else (cert, time.perf_counter() - start, ("value_pair", object()))
    pairs.append((a, c, nu, entry))


def _record_pairs(clean: dict, before: int, ledger: Ledger) -> None:
    """Records in ``ledger`` the certificate of every probabilistic
    pair in ``clean`` (:func:`_value_pairs`): each bounds every value taken from this clean point
    since it was certified (:func:`_pair_values` takes the smallest over all of them), the first
    ``before`` of them certified by an earlier call (so reused: their seconds are not this call's)."""
    for k, (*_, entry) in enumerate(clean.get("pairs", ())):
        if entry is not None:
            cert, seconds, key = entry
            ledger.record(cert, seconds, reused=k < before, key=key)


def _covered(clean: dict) -> Tensor:
    """Where a certified pair bounds ‖𝓑₂‖ (c > 0), [B]."""
    out = torch.zeros_like(clean["value3_below"], dtype=torch.bool)
    for _, c, *_ in clean["pairs"]:
        out = out | (c > 0)
    return out


def _pair_values(clean: dict, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(‖𝓑‖, ‖𝓑₂‖, the value pair) from above at radius ``r`` [B], the smallest over the certified
    pairs, +inf where none bounds it, [B] each (docs/bounds.md §2.3.4, "The value forms as one"):
    a pair's norm ν = ‖[√a·𝓑, √c·𝓑₂]‖ bounds ‖𝓑‖ by ν/√a and ‖𝓑₂‖ by ν/√c, and the value term and the
    value side's third order together, ‖𝓑(Γ,Γ) + 𝓑₂(Γ,Γ,Γ)‖_F ≤ ν·(r⁴/a + r⁶/c)^½ over ‖Γ‖_F ≤ r."""
    inf = torch.full_like(r, torch.inf)
    bilinear, value3, pair = inf, inf, inf
    for a, c, nu, _ in clean["pairs"]:
        bilinear = torch.minimum(bilinear, torch.where(a > 0, nu / a.sqrt(), inf))
        value3 = torch.minimum(value3, torch.where(c > 0, nu / c.sqrt(), inf))
        both = (a > 0) & (c > 0)
        wa, wc = torch.where(both, a, 1.0), torch.where(both, c, 1.0)
        pair = torch.minimum(pair, torch.where(both, nu * (r**4 / wa + r**6 / wc).sqrt(), inf))
    return nan_inf(bilinear), nan_inf(value3), nan_inf(pair)


def _cubic_rest(layer: DotMHA, rows: RowStats, r: Tensor,
                clean: dict[str, Tensor]) -> Callable[..., tuple[Tensor, Tensor]]:
    """R − L − V with the third order at the clean point as the form it is, [B] (docs/bounds.md
    §2.3.4): ‖𝒞‖r³ for (1/6)E[δ̃³Ỹ] − ½E[δ̃²]E[δ̃Ỹ], and every other term (Cov_p(q, Y), the third
    order's q and value parts, the fourth order) jointly over heads and rows, in three kinds:

    * weighted second moments of x, Σ_α w_α p_α x_α² (e^x's quartic remainder, the (1/Z − 1)
      products), a weighted λ_max of the logit Gram;
    * Σ_l α_li std(δ_li) (E[δ̃q̃Ỹ]), by Cauchy–Schwarz over heads and rows against the same Gram;
    * Σ_l β_li std(q_li) (Cov_p(q, Y) and the rest of q's terms), by Cauchy–Schwarz over heads
      through ‖Γ_i W^Q_l‖ and the keys' spread ‖Γ W^K_l‖ (:func:`bounds.heads.heads_top`);

    each term of the form ‖E_p[a Ỹ]‖ paid with σ₂ (the values' widest spread) in place of σ. The
    value side's E[(e^x − 1 − x)Z̃] is the smaller of two bounds: with the heads sharing Γ as
    §2.3.2's assembly under the clean row did, or ‖𝓑₂‖r³ for its third order ½E[δ̃²Z̃] and the rest
    (q's part and e^x's cubic remainder) in the two linear kinds above. ``clean`` is
    :func:`_clean_forms`'s. Returned as a function of the weighted spreads, of ``shared``
    (:func:`_shared_value`'s), of ‖𝒞‖, of ‖𝓑₂‖ and of the value pair ν(r⁴/a + r⁶/c)^½
    (:func:`_pair_values`; each +inf where left out, each from above, from below or certified: the
    same choice as the spreads') and of how the q part of the value side's third order is taken
    (``how``, a :class:`bounds.estimate.Estimate`: rule 4 of docs/bounds.md §2.3.4); what does not
    depend on them is computed once. It gives ([B] each) the rest with the value side on its own
    and, with the pair in place of the value term and the value side's third order, the rest without
    them (+inf without a pair), to which the caller adds ‖𝒜‖r² alone."""
    sigma2 = clean["sigma2"]
    s, lam, v = rows.s, rows.lam, rows.v
    r1, rd = r[:, 0, 0], math.sqrt(layer.d_h)
    A = rows.A[None, :, None]  # ‖A_l‖, broadcast [1, h, 1]
    sd = r * (rows.a + lam.sqrt() * rows.Vn) / rd  # ≥ std_p(δ) over the ball
    sq = lam.sqrt() * A * r**2 / rd  # ≥ std_p(q)
    sx = torch.minimum(sd + sq, 0.5 * s)  # ≥ std_p(x): Minkowski, and Popoviciu on the span s
    qm = math.sqrt(2) * A * r**2 / rd  # ≥ |q̃_k| ≤ span(q) ≤ ‖Γ_i‖‖A_l‖ max‖Γ_k − Γ_j‖/√d_h
    h2, g1, g3, g4 = curve_h2(s), curve_g1(s), curve_g3(s), curve_g4(s)
    # weighted second moments of x: E[ρ₄Ỹ] (|ρ₄(x)| ≤ g₄ s² x²), (1/Z − 1)E[(e^x − 1 − x)Ỹ]
    # (≤ h₂m₂·h₂E[x²‖Ỹ‖]), (1/Z − 1 + ½m₂)E[xỸ] (≤ (h₂²m₂ + g₃s)m₂·σ₂ std x) and
    # (1/Z − 1)E[(e^x − 1)Z̃] (≤ h₂m₂·g₁ std(x) v), with m₂ = E_p x² ≤ sx²
    per_row = (h2.square() * sx.square() + g3 * s) * sx * sigma2 + h2 * g1 * sx * v
    w = (g4 * s.square() + h2.square() * sx.square())[..., None] * rows.Yc + per_row[..., None]
    # × std(δ): E[δ̃q̃Ỹ] ≤ σ₂ qm std(δ); over heads and rows Σ_l α std(δ_li) ≤ (Σ_l α_li)^½
    # (Σ_l α_li Var δ_li)^½, and Σ_{l,i} α_li Var(δ_li) ≤ Λ_α r²; or per head (:func:`assemble_rows`)
    def lin_d(spread: Spread, alpha: Tensor) -> Tensor:
        return torch.minimum(alpha.sum(1).amax(-1).sqrt() * spread(alpha).sqrt() * r1,
                             assemble_rows(rows, alpha, torch.zeros_like(alpha), r, layer.d_h).sum(-1))

    factors: dict = {}  # W^Q's and W^K's head factors, for every call of lin_q

    def lin_q(beta: Tensor, how: Estimate = Estimate.CERTIFIED) -> Tensor:
        # std_p(q_li) ≤ ‖Γ_i W^Q_l‖ std_p(Γ W^K_l)/√d_h; Σ_l β ‖Γ_i W^Q_l‖ std(ΓW^K_l) by Cauchy–Schwarz
        # over heads, two ways of splitting β; Var_{p_li}(Γ W^K_l) ≤ λ_li ‖Γ W^K_l‖_F² (fact iv), the
        # keys' factor max over Γ of Σ_l Var_{p_li}(Γ W^K_l)/‖Γ‖², one per row i; the largest row's
        # value certified, or ``how`` ABOVE / BELOW without an eigenproblem (a bound, or an estimate
        # that bounds nothing: bounds.heads.heads_top_as)
        def row(heads: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
            one = heads(layer.W_q, beta.square()) * heads(layer.W_k, lam)
            return torch.minimum(one, heads(layer.W_q, beta) * heads(layer.W_k, lam * beta))

        return torch.minimum(heads_top_as(row, how, factors).sqrt() * r1**2 / rd,
                             assemble_rows(rows, torch.zeros_like(beta), beta, r, layer.d_h).sum(-1))

    # × std(q): Cov_p(q, Y) ≤ σ₂ std q; ½E[q̃²Ỹ] ≤ ½σ₂ qm std q; (1/6)E[(x³ − δ̃³)Ỹ] ≤ ½ s² σ₂ std q
    # (x³ − δ̃³ = q̃(x² + xδ̃ + δ̃²), |x|, |δ̃| ≤ s); ½|m₂E[xỸ] − E[δ̃²]E[δ̃Ỹ]| ≤ ½σ₂((2sd + sq)sx + sd²)
    # std q; E[q̃Z̃] ≤ v std q
    beta = sigma2 * (1 + 0.5 * qm + 0.5 * s.square() + 0.5 * ((2 * sd + sq) * sx + sd.square())) + v
    # E[(e^x − 1 − x)Z̃] ≤ g₂ std(x) std(Z̃), the heads sharing Γ (:func:`_shared_value`), or
    # ½E[δ̃²Z̃] ≤ ‖𝓑₂‖r³ (jointly), ½E[(x² − δ̃²)Z̃] = ½E[q̃(2δ̃ + q̃)Z̃] ≤ ½qm(2 std δ + std q)v and
    # E[ρ₃(x)Z̃] ≤ g₃s² std(x) v (|ρ₃(x)| = |e^x − 1 − x − x²/2| ≤ g₃|x|³ ≤ g₃s²|x|)
    e3 = g3 * s.square()
    q_beta = lin_q(beta)
    # the value side's third order's q part, wide layers only: each way computed once, when first asked
    q_third: dict[Estimate, Tensor] = {}

    def third_q(how: Estimate) -> Tensor:
        if how not in q_third:
            q_third[how] = lin_q((0.5 * qm + e3) * v, how)
        return q_third[how]

    def rest(spread: Spread, shared: Tensor, cubic_norm: Tensor, value3: Tensor, pair: Tensor,
             how: Estimate = Estimate.CERTIFIED) -> tuple[Tensor, Tensor]:
        moments = weighted_x(layer, rows, spread, w, r1).square()
        core = cubic_norm * r1**3 + moments + lin_d(spread, qm * sigma2) + q_beta
        value, paired = nan_inf(shared), torch.full_like(shared, torch.inf)
        if bool(torch.isfinite(value3).any()) or bool(torch.isfinite(pair).any()):
            # its heads' tops from above, from below or certified (``how``; docs/bounds.md §2.3.4,
            # rule 4)
            others = lin_d(spread, (qm + e3) * v) + third_q(how)  # the value side's third order's rest
            value = torch.minimum(value, nan_inf(value3 * r1**3 + others))
            paired = nan_inf(core + pair + others)
        return nan_inf(core + value), paired

    return rest


def _shared_value(layer: DotMHA, rows: RowStats, spread: Spread, r: Tensor, cv: Tensor) -> Tensor:
    """E[(e^x − 1 − x)Z̃] over heads and rows with the heads sharing Γ, [B] (docs/bounds.md §2.3.2):
    over the heads of row i, Σ_l g₂(X_li) std(x_li) std(Z̃_li) ≤ (Σ_l g₂² Var x_li)^½ (Σ_l Var Z_li)^½
    (Cauchy–Schwarz), the second factor ≤ √cv·r (:func:`_value_c`), and over rows by ℓ2,
    √cv·r·(√Λ_{g₂²}·r + (max_i Σ_l g₂² λ_li‖A_l‖²/d_h)^½ r²)."""
    r1 = r[:, 0, 0]
    return cv.sqrt() * r1 * weighted_x(layer, rows, spread, curve_g2(rows.s).square(), r1)


def _value_c(layer: DotMHA, rows: RowStats, how: Estimate = Estimate.CERTIFIED,
             memo: dict | None = None) -> Tensor:
    """c ≥ Σ_l Var_{p_li}(Γ C_l)/‖Γ‖_F² for every row i, [B] (docs/bounds.md §2.3.2, the value term by
    Cauchy–Schwarz over (l, k)): max_{i,k} Σ_l p_lik ‖C_l‖², or, as the rows of dP_l sum to 0 and so
    Γ_k may be centred at γ̄_li = Σ_k p_lik Γ_k (fact iv), max_i Σ_l λ_li ‖C_l‖² (a peaked row's
    λ ≈ 2p(1 − p) is far below its max_k p), or with the heads sharing Γ :func:`_value_gram` (``how``
    and ``memo`` as there: BELOW gives an estimate, never a bound)."""
    C2 = rows.C[None].square()  # [1, h, 1]
    cv = (rows.P * C2[..., None]).sum(1).amax((-1, -2))
    cv = torch.minimum(cv, (rows.lam * C2).sum(1).amax(-1))
    return torch.minimum(cv, _value_gram(layer, rows, how, memo))


def _value_gram(layer: DotMHA, rows: RowStats, how: Estimate = Estimate.CERTIFIED,
                memo: dict | None = None) -> Tensor:
    """max_i λ_max(Σ_l λ_li C_l C_lᵀ), rounded up, [B] (docs/bounds.md §2.3.2, the value term): it
    bounds Σ_l λ_li ‖Γ C_l‖_F² for ‖Γ‖_F = 1 with the heads sharing Γ, where Σ_l λ_li ‖C_l‖² lets each
    head take all of it. Through the d_h-wide factors F_l = W^V_l R_lᵀ (W^O_lᵀ = Q_l R_l, so
    C_l C_lᵀ = F_l F_lᵀ; :func:`bounds.heads.heads_top`); λ and R from :func:`row_stats`. ``how``:
    CERTIFIED (bounds.heads.heads_top_max), or ABOVE / BELOW without an eigenproblem (a bound, or an
    estimate that bounds nothing; bounds.heads.heads_top_as). ``memo``: a dict
    (empty at first) that keeps F and its head factors for calls on the same layer and rows."""
    memo = {} if memo is None else memo
    if "F" not in memo:
        memo.update(F=layer.W_v @ rows.Ro.mT, factors={})
    F, factors = memo["F"], memo["factors"]

    def value(heads: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        return heads(F, rows.lam)

    return heads_top_as(value, how, factors)
