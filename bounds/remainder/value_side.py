"""The remainder's terms beyond the second order and the value term's constant (docs/bounds.md
§2.3.2, §2.3.4): :class:`CubicRest`, everything but ‖𝒜‖r² and the value term with the third order at
the clean point as the form it is; :func:`value_c`, the value term's c by Cauchy–Schwarz; and
:func:`shared_value`, the value side with the heads sharing Γ."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models import DotMHA

from ..estimate import Estimate
from ..forms import nan_inf
from ..heads import heads_top_as
from .clean_forms import CleanForms
from .row_bounds import (
    RowStats,
    Spread,
    assemble_rows,
    curve_g1,
    curve_g2,
    curve_g3,
    curve_g4,
    curve_h2,
    weighted_x,
)


class CubicRest:
    """R − L − V with the third order at the clean point as the form it is, [B] (docs/bounds.md
    §2.3.4): ‖𝒞‖r³ for (1/6)E[δ̃³Ỹ] − ½E[δ̃²]E[δ̃Ỹ], and every other term (Cov_p(q, Y), the third
    order's q and value parts, the fourth order) jointly over heads and rows, in three kinds:

    * weighted second moments of x, Σ_α w_α p_α x_α² (e^x's quartic remainder, the (1/Z − 1)
      products), a weighted λ_max of the logit Gram;
    * Σ_l α_li std(δ_li) (E[δ̃q̃Ỹ]), by Cauchy–Schwarz over heads and rows against the same Gram
      (:meth:`lin_d`);
    * Σ_l β_li std(q_li) (Cov_p(q, Y) and the rest of q's terms), by Cauchy–Schwarz over heads
      through ‖Γ_i W^Q_l‖ and the keys' spread ‖Γ W^K_l‖ (:meth:`lin_q`, :func:`bounds.heads.heads_top`);

    each term of the form ‖E_p[a Ỹ]‖ paid with σ₂ (the values' widest spread) in place of σ. The
    value side's E[(e^x − 1 − x)Z̃] is the smaller of two bounds: with the heads sharing Γ as
    §2.3.2's assembly under the clean row did, or ‖𝓑₂‖r³ for its third order ½E[δ̃²Z̃] and the rest
    (q's part and e^x's cubic remainder) in the two linear kinds above. What does not depend on the
    spreads and forms is computed once, here; :meth:`__call__` takes the rest."""

    def __init__(self, layer: DotMHA, rows: RowStats, r: Tensor, clean: CleanForms) -> None:
        self.layer, self.rows, self.r = layer, rows, r
        sigma2 = self.sigma2 = clean.sigma2
        s, lam, v = rows.s, rows.lam, rows.v
        self.r1, self.rd = r[:, 0, 0], math.sqrt(layer.d_h)
        A = rows.A[None, :, None]  # ‖A_l‖, broadcast [1, h, 1]
        sd = r * (rows.a + lam.sqrt() * rows.Vn) / self.rd  # ≥ std_p(δ) over the ball
        sq = lam.sqrt() * A * r**2 / self.rd  # ≥ std_p(q)
        sx = torch.minimum(sd + sq, 0.5 * s)  # ≥ std_p(x): Minkowski, and Popoviciu on the span s
        # ≥ |q̃_k| ≤ span(q) ≤ ‖Γ_i‖‖A_l‖ max‖Γ_k − Γ_j‖/√d_h
        self.qm = qm = math.sqrt(2) * A * r**2 / self.rd
        h2, g1, g3, g4 = curve_h2(s), curve_g1(s), curve_g3(s), curve_g4(s)
        # weighted second moments of x: E[ρ₄Ỹ] (|ρ₄(x)| ≤ g₄ s² x²), (1/Z − 1)E[(e^x − 1 − x)Ỹ]
        # (≤ h₂m₂·h₂E[x²‖Ỹ‖]), (1/Z − 1 + ½m₂)E[xỸ] (≤ (h₂²m₂ + g₃s)m₂·σ₂ std x) and
        # (1/Z − 1)E[(e^x − 1)Z̃] (≤ h₂m₂·g₁ std(x) v), with m₂ = E_p x² ≤ sx²
        per_row = (h2.square() * sx.square() + g3 * s) * sx * sigma2 + h2 * g1 * sx * v
        self.w = (g4 * s.square() + h2.square() * sx.square())[..., None] * rows.Yc + per_row[..., None]
        self.factors: dict = {}  # W^Q's and W^K's head factors, for every call of lin_q
        # × std(q): Cov_p(q, Y) ≤ σ₂ std q; ½E[q̃²Ỹ] ≤ ½σ₂ qm std q; (1/6)E[(x³ − δ̃³)Ỹ] ≤ ½ s² σ₂ std q
        # (x³ − δ̃³ = q̃(x² + xδ̃ + δ̃²), |x|, |δ̃| ≤ s); ½|m₂E[xỸ] − E[δ̃²]E[δ̃Ỹ]| ≤
        # ½σ₂((2sd + sq)sx + sd²) std q; E[q̃Z̃] ≤ v std q
        beta = sigma2 * (1 + 0.5 * qm + 0.5 * s.square() + 0.5 * ((2 * sd + sq) * sx + sd.square())) + v
        # E[(e^x − 1 − x)Z̃] ≤ g₂ std(x) std(Z̃), the heads sharing Γ (:func:`shared_value`), or
        # ½E[δ̃²Z̃] ≤ ‖𝓑₂‖r³ (jointly), ½E[(x² − δ̃²)Z̃] = ½E[q̃(2δ̃ + q̃)Z̃] ≤ ½qm(2 std δ + std q)v and
        # E[ρ₃(x)Z̃] ≤ g₃s² std(x) v (|ρ₃(x)| = |e^x − 1 − x − x²/2| ≤ g₃|x|³ ≤ g₃s²|x|)
        self.e3 = g3 * s.square()
        self.q_beta = self.lin_q(beta)
        # the value side's third order's q part, wide layers only: each way computed once, when first asked
        self._third_q: dict[Estimate, Tensor] = {}

    def lin_d(self, spread: Spread, alpha: Tensor) -> Tensor:
        """Σ_l α_li std(δ_li) over heads and rows, [B]: (Σ_l α_li)^½ (Σ_l α_li Var δ_li)^½ with
        Σ_{l,i} α_li Var(δ_li) ≤ Λ_α r², or per head (:func:`assemble_rows`)."""
        rows, r = self.rows, self.r
        return torch.minimum(alpha.sum(1).amax(-1).sqrt() * spread(alpha).sqrt() * self.r1,
                             assemble_rows(rows, alpha, torch.zeros_like(alpha), r, self.layer.d_h).sum(-1))

    def lin_q(self, beta: Tensor, how: Estimate = Estimate.CERTIFIED) -> Tensor:
        """Σ_l β_li std(q_li), [B]: std_p(q_li) ≤ ‖Γ_i W^Q_l‖ std_p(Γ W^K_l)/√d_h, by Cauchy–Schwarz
        over heads, two ways of splitting β; Var_{p_li}(Γ W^K_l) ≤ λ_li ‖Γ W^K_l‖_F² (fact iv), the
        keys' factor max over Γ of Σ_l Var_{p_li}(Γ W^K_l)/‖Γ‖², one per row i; the largest row's
        value certified, or ``how`` ABOVE / BELOW without an eigenproblem (a bound, or an estimate
        that bounds nothing: bounds.heads.heads_top_as)."""
        layer, lam = self.layer, self.rows.lam

        def row(heads: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
            one = heads(layer.W_q, beta.square()) * heads(layer.W_k, lam)
            return torch.minimum(one, heads(layer.W_q, beta) * heads(layer.W_k, lam * beta))

        per_head = assemble_rows(self.rows, torch.zeros_like(beta), beta, self.r, layer.d_h).sum(-1)
        return torch.minimum(heads_top_as(row, how, self.factors).sqrt() * self.r1**2 / self.rd, per_head)

    def third_q(self, how: Estimate) -> Tensor:
        """The q part of the value side's third order, taken ``how``, computed once each."""
        if how not in self._third_q:
            self._third_q[how] = self.lin_q((0.5 * self.qm + self.e3) * self.rows.v, how)
        return self._third_q[how]

    def __call__(self, spread: Spread, shared: Tensor, cubic_norm: Tensor, value3: Tensor, pair: Tensor,
                 how: Estimate = Estimate.CERTIFIED) -> tuple[Tensor, Tensor]:
        """The rest given the weighted spreads, ``shared`` (:func:`shared_value`'s), ‖𝒞‖, ‖𝓑₂‖ and the
        value pair ν(r⁴/a + r⁶/c)^½ (bounds.remainder.clean_forms.CleanForms.pair_values; each +inf
        where left out, each from above, from below or certified: the same choice as the spreads')
        and how the q part of the value side's third order is taken (``how``: rule 4 of
        docs/bounds.md §2.3.4). ([B] each) the rest with the value side on its own and, with the
        pair in place of the value term and the value side's third order, the rest without them
        (+inf without a pair), to which the caller adds ‖𝒜‖r² alone."""
        r1, v = self.r1, self.rows.v
        moments = weighted_x(self.layer, self.rows, spread, self.w, r1).square()
        core = cubic_norm * r1**3 + moments + self.lin_d(spread, self.qm * self.sigma2) + self.q_beta
        value, paired = nan_inf(shared), torch.full_like(shared, torch.inf)
        if bool(torch.isfinite(value3).any()) or bool(torch.isfinite(pair).any()):
            # the value side's third order's rest, its heads' tops taken ``how``
            others = self.lin_d(spread, (self.qm + self.e3) * v) + self.third_q(how)
            value = torch.minimum(value, nan_inf(value3 * r1**3 + others))
            paired = nan_inf(core + pair + others)
        return nan_inf(core + value), paired


def shared_value(layer: DotMHA, rows: RowStats, spread: Spread, r: Tensor, cv: Tensor) -> Tensor:
    """E[(e^x − 1 − x)Z̃] over heads and rows with the heads sharing Γ, [B] (docs/bounds.md §2.3.2):
    over the heads of row i, Σ_l g₂(X_li) std(x_li) std(Z̃_li) ≤ (Σ_l g₂² Var x_li)^½ (Σ_l Var Z_li)^½
    (Cauchy–Schwarz), the second factor ≤ √cv·r (:func:`value_c`), and over rows by ℓ2,
    √cv·r·(√Λ_{g₂²}·r + (max_i Σ_l g₂² λ_li‖A_l‖²/d_h)^½ r²)."""
    r1 = r[:, 0, 0]
    return cv.sqrt() * r1 * weighted_x(layer, rows, spread, curve_g2(rows.s).square(), r1)


@dataclass
class ValueFactors:
    """F_l = W^V_l R_lᵀ for the rows R of one :func:`row_stats`, with the head factors
    bounds.heads.heads_top_as keeps of it: for the calls of :func:`value_c` on the same rows."""

    F: Tensor
    heads: dict = field(default_factory=dict)

    @classmethod
    def of(cls, layer: DotMHA, rows: RowStats) -> ValueFactors:
        return cls(layer.W_v @ rows.Ro.mT)


def value_c(layer: DotMHA, rows: RowStats, how: Estimate = Estimate.CERTIFIED,
            factors: ValueFactors | None = None) -> Tensor:
    """c ≥ Σ_l Var_{p_li}(Γ C_l)/‖Γ‖_F² for every row i, [B] (docs/bounds.md §2.3.2, the value term by
    Cauchy–Schwarz over (l, k)): max_{i,k} Σ_l p_lik ‖C_l‖², or, as the rows of dP_l sum to 0 and so
    Γ_k may be centred at γ̄_li = Σ_k p_lik Γ_k (fact iv), max_i Σ_l λ_li ‖C_l‖² (a peaked row's
    λ ≈ 2p(1 − p) is far below its max_k p), or with the heads sharing Γ :func:`value_gram` (``how``
    and ``factors`` as there: BELOW gives an estimate, never a bound)."""
    C2 = rows.C[None].square()  # [1, h, 1]
    cv = (rows.P * C2[..., None]).sum(1).amax((-1, -2))
    cv = torch.minimum(cv, (rows.lam * C2).sum(1).amax(-1))
    return torch.minimum(cv, value_gram(layer, rows, how, factors))


def value_gram(layer: DotMHA, rows: RowStats, how: Estimate = Estimate.CERTIFIED,
               factors: ValueFactors | None = None) -> Tensor:
    """max_i λ_max(Σ_l λ_li C_l C_lᵀ), rounded up, [B] (docs/bounds.md §2.3.2, the value term): it
    bounds Σ_l λ_li ‖Γ C_l‖_F² for ‖Γ‖_F = 1 with the heads sharing Γ, where Σ_l λ_li ‖C_l‖² lets each
    head take all of it. Through the d_h-wide factors F_l = W^V_l R_lᵀ (W^O_lᵀ = Q_l R_l, so
    C_l C_lᵀ = F_l F_lᵀ; :func:`bounds.heads.heads_top`); λ and R from :func:`row_stats`. ``how``:
    CERTIFIED (bounds.heads.heads_top_max), or ABOVE / BELOW without an eigenproblem (a bound, or an
    estimate that bounds nothing; bounds.heads.heads_top_as). ``factors``: a :class:`ValueFactors`
    of the same layer and rows, kept for the other calls (made here where None)."""
    factors = ValueFactors.of(layer, rows) if factors is None else factors

    def value(heads: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        return heads(factors.F, rows.lam)

    return heads_top_as(value, how, factors.heads)
