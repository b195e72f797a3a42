"""What the quadratic remainder takes from the clean point alone (docs/bounds.md §2.3.2, §2.3.4): the
forms ‖𝒜‖, Λ, ‖𝒞‖ and σ₂, and on a wide layer the value forms ‖𝓑‖ and ‖𝓑₂‖ with their certified
pairs (:class:`CleanForms`), and the weighted spreads taken three ways (:class:`Spreads`). Kept for
every radius of the same layer and clean input (:class:`FormCache`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models import DotMHA

from ..certificates import Certificate, Ledger
from ..estimate import Estimate
from ..forms import (
    ROUND_REL,
    Deferred,
    cubic_form_norm,
    form_norm,
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
from .row_bounds import Spread

# ‖𝓑‖ and ‖𝓑₂‖ are n·min(d, h·d_h)-square eigenproblems: computed only on a layer wide for its tokens
# (4·h·n² ≤ n·d, as MiniLM's at sentence length), where they beat Cauchy–Schwarz, and up to this size
# (docs/bounds.md §2.3.4; what they cost and buy: docs/scale.md)
VALUE_FORM_LIMIT = 2560
# a certified pair serves another radius whose own weight c on ‖𝓑₂‖ is within this factor of the
# pair's: were the estimates exact, the pair's bound's square would exceed that of ‖𝓑‖r² + ‖𝓑₂‖r³ by
# at most x(ĉ − 1/ĉ)² ≤ 0.0091·x of it, ĉ = √1.1 and x = ‖𝓑₂‖r/‖𝓑‖ (0.04–0.11 on MiniLM), where a
# new pair costs an eigenproblem (docs/bounds.md §2.3.4, "The value forms as one")
PAIR_REUSE = 1.1


@dataclass(frozen=True)
class ValuePair:
    """One certified ν = ‖[√a·𝓑, √c·𝓑₂]‖, [B] each (docs/bounds.md §2.3.4, "The value forms as one");
    ``certificate`` and ``seconds`` where it is probabilistic (bounds.forms.value_pair_norm), for the
    ledger under ``key``, a fresh object equal to nothing else while it is held."""

    a: Tensor
    c: Tensor
    norm: Tensor
    certificate: Certificate | None = None
    seconds: float = 0.0
    key: tuple = field(default_factory=lambda: ("value_pair", object()))


@dataclass
class CleanForms:
    """What the quadratic remainder takes from the clean point alone, [B] or [B, h, n] each
    (:func:`clean_forms`): ‖𝒜‖ as (2‖𝒜‖)² (``form``, a bounds.forms.Deferred: certified only where
    rule 4 asks), Λ and √Λ with Λ's Ritz vector, σ₂, N^½ (``root``, formed when first asked), ‖𝒞‖²
    (``cubic``, formed when first asked: :meth:`cubic_form`), and on a wide layer (up to
    VALUE_FORM_LIMIT) the value forms' parts, their estimates from below (+inf elsewhere) with
    those estimates' Ritz vectors (``value_start``, where the pairs' guesses start) and the pairs
    certified so far, empty until a radius asks one (:func:`value_pairs`)."""

    form: Deferred
    Lambda: Tensor
    spread: Tensor  # √Λ
    spread_vector: Tensor
    root: Callable[[], Tensor]
    sigma2: Tensor
    bilinear_below: Tensor
    value3_below: Tensor
    value_parts: tuple | None = None
    value_start: Tensor | None = None
    pairs: list[ValuePair] = field(default_factory=list)
    cubic: Deferred | None = None

    def cubic_form(self, layer: DotMHA, X: Tensor, G: Tensor, P: Tensor) -> Deferred:
        """‖𝒞‖² as a :class:`bounds.forms.Deferred`, its matrix formed at the first call."""
        if self.cubic is None:
            self.cubic = cubic_form_norm(layer, X, G, P, deferred=True, root=self.root)
        return self.cubic

    def covered(self) -> Tensor:
        """Where a certified pair bounds ‖𝓑₂‖ (c > 0), [B]."""
        out = torch.zeros_like(self.value3_below, dtype=torch.bool)
        for p in self.pairs:
            out = out | (p.c > 0)
        return out

    def pair_values(self, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(‖𝓑‖, ‖𝓑₂‖, the value pair) from above at radius ``r`` [B], the smallest over the
        certified pairs, +inf where none bounds it, [B] each (docs/bounds.md §2.3.4, "The value
        forms as one"): a pair's norm ν = ‖[√a·𝓑, √c·𝓑₂]‖ bounds ‖𝓑‖ by ν/√a and ‖𝓑₂‖ by ν/√c, and
        the value term and the value side's third order together, ‖𝓑(Γ,Γ) + 𝓑₂(Γ,Γ,Γ)‖_F ≤
        ν·(r⁴/a + r⁶/c)^½ over ‖Γ‖_F ≤ r."""
        inf = torch.full_like(r, torch.inf)
        bilinear, value3, pair = inf, inf, inf
        for p in self.pairs:
            a, c, nu = p.a, p.c, p.norm
            bilinear = torch.minimum(bilinear, torch.where(a > 0, nu / a.sqrt(), inf))
            value3 = torch.minimum(value3, torch.where(c > 0, nu / c.sqrt(), inf))
            both = (a > 0) & (c > 0)
            wa, wc = torch.where(both, a, 1.0), torch.where(both, c, 1.0)
            pair = torch.minimum(pair, torch.where(both, nu * (r**4 / wa + r**6 / wc).sqrt(), inf))
        return nan_inf(bilinear), nan_inf(value3), nan_inf(pair)

    def record_pairs(self, before: int, ledger: Ledger) -> None:
        """Records in ``ledger`` the certificate of every probabilistic pair: each bounds every
        value taken from this clean point since it was certified (:meth:`pair_values` takes the
        smallest over all of them), the first ``before`` of them certified by an earlier call (so
        reused: their seconds are not this call's)."""
        for k, p in enumerate(self.pairs):
            if p.certificate is not None:
                ledger.record(p.certificate, p.seconds, reused=k < before, key=p.key)


@dataclass
class FormCache:
    """The :class:`CleanForms` of one layer at one clean input, kept for the calls at other radii:
    pass the same (empty at first) to each."""

    forms: CleanForms | None = None


def clean_forms(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, sigma: Tensor) -> CleanForms:
    """The :class:`CleanForms` of ``layer`` at X, with G and P of bounds.forms.logit_gram and the
    rows' σ (bounds.remainder.row_bounds.row_stats)."""
    B, n, d = X.shape
    none = torch.full((B,), torch.inf, dtype=X.dtype, device=X.device)
    Lambda, vector = weighted_spread(G, P, vector=True)
    # N^½, which ‖𝒜‖'s and ‖𝒞‖'s matrices share: computed where the first of them is formed
    root = functools.cache(lambda: value_root(layer, X, P))
    out = CleanForms(form_norm(layer, X, G, P, root, deferred=True), Lambda, Lambda.sqrt(), vector, root,
                     spectral_spread(layer, X, P, sigma), none, none)
    if 4 * layer.h * n * n <= n * d and n * min(d, layer.h * layer.d_h) <= VALUE_FORM_LIMIT:
        parts = (value_form_parts(layer, X, G, P), value_cubic_parts(layer, X, G, P))
        (b1, x1), (b2, x2) = value_side_below(layer, parts[0][0], 2), value_side_below(layer, parts[1][0], 1)
        # the estimates' Ritz vectors and a fixed random column: the pairs' guesses start there
        g = torch.Generator().manual_seed(0)
        extra = torch.randn(x1.shape[-2], 1, generator=g, dtype=torch.float64).to(x1).expand(B, -1, 1)
        out.value_parts, out.bilinear_below, out.value3_below = parts, b1, b2
        out.value_start = torch.cat([x1, x2, extra], -1)
    return out


def value_pairs(layer: DotMHA, clean: CleanForms, r: Tensor, cs: Tensor, shared: Tensor, lazy: bool) -> None:
    """Certify the value forms at radius ``r`` [B] where they can win, appending a :class:`ValuePair`
    to ``clean.pairs`` (docs/bounds.md §2.3.4, "The value forms as one").

    ‖𝓑‖ can win where its estimate from below is under ``cs`` (√(cΛ)); ‖𝓑₂‖ where its estimate times
    r³ is under ``shared`` (the value side with every weighted spread at its bound from above), as it
    enters min(shared, ‖𝓑₂‖r³ + terms ≥ 0). Where ‖𝓑‖ can win the first call (``lazy`` False, before
    any assembly) certifies a = 1 and, where ‖𝓑₂‖ can win too, c = r‖𝓑‖/‖𝓑₂‖ from the estimates (the
    weight that makes the pair's bound equal ‖𝓑‖r² + ‖𝓑₂‖r³ when the two forms share their top
    direction, and smaller when not), else c = 0: one eigenproblem for both. The second (``lazy``
    True, only where every spread is certified) certifies ‖𝓑₂‖ alone (a = 0, c = 1) where it can win
    and no pair has c > 0. A pair already certified whose a and c serve is reused (PAIR_REUSE). Each
    call certifies the whole batch, so that no element takes a zero matrix."""
    if clean.value_parts is None:
        return
    b1, b2 = clean.bilinear_below, clean.value3_below
    want2 = b2 * r**3 < shared
    if not lazy:
        want1 = b1 < cs
        if not bool(want1.any()):
            return
        t2 = r * b1 / b2
        c = torch.where(want1 & want2 & torch.isfinite(t2) & (t2 > 0), t2, torch.zeros_like(t2))
        a = torch.ones_like(c)
        for p in clean.pairs:
            close = (p.c <= PAIR_REUSE * c) & (c <= PAIR_REUSE * p.c)
            if bool(((p.a > 0) & torch.where(c > 0, close, p.c == 0)).all()):
                return
    else:
        if not bool((want2 & ~clean.covered()).any()):
            return
        a, c = torch.zeros_like(b2), torch.ones_like(b2)
    start = time.perf_counter()
    nu, cert = value_pair_norm(layer, *clean.value_parts, a, c, clean.value_start)
    clean.pairs.append(ValuePair(a, c, nu, cert, time.perf_counter() - start))


class Spreads:
    """λ_max(D_w) = λ_max(diag(√(w∘p)) G diag(√(w∘p))) for the weights w the quadratic remainder asks
    (:func:`bounds.forms.weighted_spread`), three ways (:class:`bounds.estimate.Estimate`), each [B]:

    * ``certified``: an eigenproblem of side h·n² each;
    * ``above``: max(w)·Λ, certified without one: λ_max(D_w) = λ_max(G^½ diag(w∘p) G^½) and
      diag(w∘p) ⪯ max(w)·diag(p), with Λ = λ_max(D_1) (``top``) as certified for the second-order
      term;
    * ``below``: an estimate from below (:func:`bounds.forms.spread_estimate`, from Λ's Ritz
      ``vector``), never a bound of anything: it tells whether ``above`` is close enough.

    ``certified`` keeps each value by its weights' bytes: the certified assemblies (rule 4 takes two
    or three) ask the same weights again."""

    def __init__(self, G: Tensor, P: Tensor, top: Tensor, vector: Tensor) -> None:
        self.G, self.P, self.top, self.vector = G, P, top, vector
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


def cubic_crude(G: Tensor, clean: CleanForms, spreads: Spreads) -> Tensor:
    """‖𝒞‖² from above without its matrix, [B] (docs/bounds.md §2.3.4, "Eigenproblems left out"):
    with m_li = max_k ‖f̂_α‖ ≥ max_k |δ̃_lik| and σ₂ (:func:`bounds.forms.spectral_spread`), each head's
    share of row i is at most a_li std_p(δ_li), a_li = (2/3) m_li² σ₂_li, so ‖C(Γ)‖_F² ≤
    max_i Σ_l a_li · Σ_{l,i} a_li Var(δ_li) ≤ max_i Σ_l a_li · max(a)·Λ. Its root is ten to sixty
    times ‖𝒞‖, and enough wherever ‖𝒞‖r³ is far below the remainder (the margin-trained ViTs)."""
    sigma2 = clean.sigma2  # [B, h, n]
    B, h, n = sigma2.shape
    m2 = G.diagonal(dim1=-2, dim2=-1).reshape(B, n, h, n).amax(-1).permute(0, 2, 1).clamp_min(0)
    a = (2 / 3) * m2 * sigma2 * (1 + ROUND_REL)
    return a.sum(1).amax(-1) * (1 + ROUND_REL) * spreads.above(a)
