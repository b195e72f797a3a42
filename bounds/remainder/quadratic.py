"""Attention's Taylor remainder with its second-order term as the quadratic form it is and the third
as the cubic form it is, every other term jointly over heads and rows (docs/bounds.md §2.3.2,
§2.3.4): :func:`quadratic_remainder`, assembled by :class:`QuadraticRemainder`. What it takes from the
clean point alone is in :mod:`bounds.remainder.clean_forms`, its terms beyond the second order in
:mod:`bounds.remainder.value_side`, the forms' certified norms in :mod:`bounds.forms` and
:mod:`bounds.heads`, the rows' statistics in :mod:`bounds.remainder.row_bounds`."""

from __future__ import annotations

import torch
from torch import Tensor

from models import DotMHA

from ..base import radius
from ..certificates import Ledger, book
from ..estimate import Estimate
from ..forms import ROUND_REL, Deferred, logit_gram, nan_inf
from ..lofast import layer_key
from .clean_forms import CleanForms, FormCache, Spreads, clean_forms, cubic_crude, value_pairs
from .row_bounds import CUMULANT4, RowStats, assemble_rows, curve_g2, curve_g3, row_stats, weighted_x
from .value_side import CubicRest, ValueFactors, shared_value, value_c

__all__ = ["QUAD_LIMIT", "FormCache", "QuadraticRemainder", "quadratic_remainder"]

QUAD_LIMIT = 1536  # h·n² above which the quadratic form's eigenproblem is skipped (§2.3.2)


def quadratic_remainder(layer: DotMHA, X: Tensor, eps, cache: FormCache | None = None,
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
      (:class:`bounds.remainder.value_side.CubicRest`, §2.3.4), which is the smallest almost
      everywhere; the first two win only where e^s is large, where the first-order bound of
      :func:`bounds.remainder.remainder` is smaller anyway.

    +inf where h·n² > QUAD_LIMIT. ``cache`` (a :class:`FormCache`, empty at first) keeps what depends
    on the clean point alone (:class:`CleanForms`) for calls at other radii on the same layer and X;
    without it they are kept on ``ledger``'s cache, if any; the certificates of its probabilistic
    value pairs go to ``ledger``. ``rows`` as in :func:`local_remainder`."""
    B, n, _ = X.shape
    ledger = book(ledger)
    r = radius(eps, X)[:, None, None]
    if layer.h * n * n > QUAD_LIMIT:
        return torch.full((B,), torch.inf, dtype=X.dtype, device=X.device)
    rows = row_stats(layer, X, r) if rows is None else rows
    G, P = logit_gram(layer, X, rows.P)
    if cache is not None:
        if cache.forms is None:
            cache.forms = clean_forms(layer, X, G, P, rows.sigma)
        clean = cache.forms
    else:  # the certify runs ask every ε on one trace, on one ledger's cache
        names, tensors = layer_key(layer)
        clean = ledger.value(("quadratic_parts", names), (*tensors, X),
                             lambda: clean_forms(layer, X, G, P, rows.sigma))
    before = len(clean.pairs)  # the pairs certified by earlier calls (CleanForms.record_pairs)
    out = QuadraticRemainder(layer, X, r, rows, G, P, clean).choose()
    clean.record_pairs(before, ledger)
    return out


# the remainder with each weighted spread λ_max(D_w) bounded by max(w)·Λ (no eigenproblem) is kept
# where it is at most this much above the remainder with every spread's estimate from below, itself
# at most the remainder with the spreads certified (the remainder grows with each spread): so it is
# within this of what certifying them all would give (docs/bounds.md §2.3.4, "Eigenproblems left out")
SPREAD_SLACK = 0.01
# the certified assembly with its small terms (the value term's c and the value side's third order's
# q part, each a heads' top) from above is kept where it is at most this much above the same with
# them from below, itself at most the one with them certified (the remainder grows with each)
# (docs/bounds.md §2.3.4, "Eigenproblems left out", rule 4; ‖𝒜‖ follows the same slack there)
TERM_SLACK = 1e-3


class QuadraticRemainder:
    """:func:`quadratic_remainder` at one radius r [B, 1, 1]: its assemblies (:meth:`assemble`), each
    with the weighted spreads, ‖𝒞‖, the value forms and the small terms taken from above, from below
    or certified (:class:`bounds.estimate.Estimate`), and the choice among them (:meth:`choose`,
    docs/bounds.md §2.3.4, "Eigenproblems left out"). What every assembly shares is computed here."""

    def __init__(self, layer: DotMHA, X: Tensor, r: Tensor, rows: RowStats, G: Tensor, P: Tensor,
                 clean: CleanForms) -> None:
        self.layer, self.X, self.r, self.rows, self.G, self.P, self.clean = layer, X, r, rows, G, P, clean
        s, sigma, value = rows.s, rows.sigma, rows.v
        third = 1.75 * s.square() * curve_g3(s) * sigma  # × std(u): the pure-logit third order, per row
        beta = sigma * (1 + 1.5 * s) + value + curve_g2(s) * value  # × std(q)
        self.per_head = assemble_rows(rows, third + curve_g2(s) * value, beta + third, r, layer.d_h).sum(-1)
        # jointly: Σ_{l,i} c_li Var(u_li) ≤ (√(Σ c Var δ) + √(Σ c Var q))², Var(q_li) ≤ λ_li‖A_l‖²r²‖Γ_i‖²/d_h
        self.c = CUMULANT4 * s * rows.diamY[..., None] * curve_g3(s)  # [B, h, n]
        self.r1 = r1 = r[:, 0, 0]
        self.joint_q = assemble_rows(rows, curve_g2(s) * value, beta, r, layer.d_h).sum(-1)
        self.spreads = Spreads(G, P, clean.Lambda, clean.spread_vector)
        # c of the value term, from above (no eigenproblem), from below or certified, each when first asked
        self._cvs: dict[Estimate, Tensor] = {}
        self._factors: ValueFactors | None = None
        # the value forms where they can win at this radius, both at once where both can
        # (clean_forms.value_pairs), judged with c from above
        # the value term by Cauchy–Schwarz, √(cΛ)
        self.cs_upper = self.value_c(Estimate.ABOVE).sqrt() * clean.spread
        self.shared_upper = shared_value(layer, rows, self.spreads.above, r, self.value_c(Estimate.ABOVE))
        value_pairs(layer, clean, r1, self.cs_upper, self.shared_upper, lazy=False)
        self.cubic = CubicRest(layer, rows, r, clean)
        self.crude = cubic_crude(G, clean, self.spreads)
        # ‖𝒜‖r², the same in every assembly (rule 4): ‖𝒜‖ without its matrix (bounds.forms.logit_form_cheap)
        # where that alone is within TERM_SLACK of the rest of the remainder from below, else from ‖S‖_F
        # where that is within TERM_SLACK of it above its estimate from below (a Ritz value), else certified
        self.lower = lower = self.assemble(Estimate.BELOW, False)
        logit = clean.form  # (2‖𝒜‖)², a bounds.forms.Deferred
        # each input by its own test (the batch only decides what is computed), so that no input's
        # value depends on the inputs beside it
        above = 0.5 * logit.cheap.clamp_min(0).sqrt()
        done = above * r1**2 <= TERM_SLACK * lower
        if not bool(done.all()):
            upper, below = 0.5 * logit.upper.clamp_min(0).sqrt(), 0.5 * logit.below.clamp_min(0).sqrt()
            close = (upper - below) * r1**2 <= TERM_SLACK * (lower + below * r1**2)
            if not bool((done | close).all()):
                upper = torch.where(close, upper, 0.5 * logit.value().clamp_min(0).sqrt())
            above = torch.where(done, above, upper)
        self.logit = above

    def value_c(self, how: Estimate) -> Tensor:
        """The value term's c taken ``how`` (:func:`bounds.remainder.value_side.value_c`), once each."""
        if how not in self._cvs:
            if self._factors is None:
                self._factors = ValueFactors.of(self.layer, self.rows)
            self._cvs[how] = value_c(self.layer, self.rows, how, self._factors)
        return self._cvs[how]

    def assemble(self, mode: Estimate, formed: bool, small: Estimate | None = None) -> Tensor:
        """Everything but ‖𝒜‖r², a summand of every assembly, [B]: the spreads taken ``mode``, ‖𝒞‖
        with its matrix ``formed`` (else :func:`bounds.remainder.clean_forms.cubic_crude`'s bound, or 0
        from below), and ``small`` (c and the value side's third order's q part) from above, from
        below or certified (rule 4); the assemblies from above and from below take them as they take
        the spreads."""
        layer, rows, clean, r, r1 = self.layer, self.rows, self.clean, self.r, self.r1
        small = small if mode is Estimate.CERTIFIED else mode
        cv = self.value_c(small)
        spread = self.spreads.taken(mode)
        if formed:  # ‖𝒞‖² from above (‖S‖_F), from below, or certified: bounds.forms.Deferred
            cubic_sq = _deferred(clean.cubic_form(layer, self.X, self.G, self.P), mode)
        else:  # its matrix not formed: cubic_crude's bound, or 0 from below
            cubic_sq = self.crude if mode is Estimate.ABOVE else torch.zeros_like(self.crude)
        cubic_sq = cubic_sq.clamp_min(0)
        joint = nan_inf(weighted_x(layer, rows, spread, self.c, r1).square() + self.joint_q)
        shared = shared_value(layer, rows, spread, r, cv)
        # ‖𝓑₂‖ alone in the same choice as the spreads: certified where it can win and no pair
        # bounds it (clean_forms.value_pairs), else from the pairs (+inf without one), or from below
        if mode is Estimate.CERTIFIED:
            value_pairs(layer, clean, r1, self.cs_upper, self.shared_upper, lazy=True)
        bilinear, value3, pair = clean.pair_values(r1)
        if mode is Estimate.BELOW:  # a pair that covers ‖𝓑₂‖ can still be above the form certified
            # alone (the certified assembly's lazy pair): the estimate from below is below either
            value3 = torch.minimum(value3, clean.value3_below)
        # the value term: Cauchy–Schwarz (√(cΛ)) or the bilinear form itself (‖𝓑‖), the smaller
        second = torch.minimum(cv.sqrt() * clean.spread, bilinear) * r1**2
        apart, paired = self.cubic(spread, shared, cubic_sq.sqrt(), value3, pair, small)
        rest = torch.minimum(torch.minimum(self.per_head, joint), apart)
        return torch.minimum(nan_inf(second + rest), nan_inf(paired))

    def total(self, rest: Tensor) -> Tensor:
        """‖𝒜‖r² + ``rest``, rounded up; a factor that overflowed (e^s at a saturating scale, times a
        zero) bounds nothing: +inf, so that the smaller of the remainders never takes a NaN."""
        return nan_inf((self.logit * self.r1**2 + rest) * (1 + ROUND_REL))

    def choose(self) -> Tensor:
        """The remainder, [B]: every weighted spread by monotonicity first, and ‖𝒞‖ without its
        matrix; then with ‖𝒞‖'s matrix formed; certified only where that could cost more than
        SPREAD_SLACK of the remainder, judged each time against the estimates from below; and in the
        certified assembly the small terms certified only where they could cost more than
        TERM_SLACK (rule 4)."""
        total, assemble = self.total, self.assemble
        upper = total(assemble(Estimate.ABOVE, False))
        # an input stops at its own first test it passes: the batch goes on while any input is left,
        # and the later, smaller values reach only those left (each input's value is its own)
        done = upper <= (1 + SPREAD_SLACK) * total(self.lower)
        if bool(done.all()):
            return upper
        upper = torch.where(done, upper, torch.minimum(upper, total(assemble(Estimate.ABOVE, True))))
        done = done | (upper <= (1 + SPREAD_SLACK) * total(assemble(Estimate.BELOW, True)))
        if bool(done.all()):
            return upper
        upper = torch.where(done, upper, torch.minimum(
            upper, total(assemble(Estimate.CERTIFIED, True, Estimate.ABOVE))))
        below = total(assemble(Estimate.CERTIFIED, True, Estimate.BELOW))
        done = done | (upper <= (1 + TERM_SLACK) * below)
        if bool(done.all()):
            return upper
        return torch.where(done, upper, torch.minimum(
            upper, total(assemble(Estimate.CERTIFIED, True, Estimate.CERTIFIED))))


def _deferred(form: Deferred, how: Estimate) -> Tensor:
    """A :class:`bounds.forms.Deferred`'s value as the assembly takes it ``how``: certified, from above
    by ‖S‖_F or a Ritz estimate from below."""
    return form.value() if how is Estimate.CERTIFIED else form.upper if how is Estimate.ABOVE else form.below
