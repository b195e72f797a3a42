"""LayerNorm as a stage of ``taylor_net`` (docs/bounds.md §5.1, "LayerNorm"): its exact Jacobian at
the clean token and a second-order remainder on the token's ball.

LayerNorm(x) = γ ⊙ √d·h(Cx) + β with C = I − 11ᵀ/d (centring, a projection) and
h(z) = z/ρ(z), ρ(z) = (‖z‖² + d·e)^½ (e: the module's eps). At the clean token x₀ (z₀ = Cx₀,
ρ₀ = ρ(z₀)) the Jacobian is

    L = diag(γ)·(√d/ρ₀)·(I − z₀z₀ᵀ/ρ₀²)·C,

and for a deviation Δ with ‖Δ‖ ≤ r (so ‖CΔ‖ ≤ r) the error e = LN(x₀ + Δ) − LN(x₀) − LΔ obeys

    ‖e‖ ≤ max|γ|·√d·min( r²/(√3·ρ_min²),  min(2, r/ρ_min) + r/ρ₀ ),   ρ_min² = (‖z₀‖ − r)₊² + d·e,

the first from ‖D²h(z)[v, v]‖ ≤ (2/√3)‖v‖²/ρ(z)² (docs/bounds.md §5.1), the second from
‖Dh(z)‖ ≤ 1/ρ(z) and ‖h‖ < 1. Where e = 0 and the ball reaches z = 0 (σ = 0) LayerNorm is undefined
at a point of the ball: the bound is +inf there, and the image is not certified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ...norms import gram_norm
from ..budget import shared
from ..record import Step
from ..zonotope import DeviationSet
from .ffn import Refine
from .symmetric import abs_low, across_corners, charge_by_parts, hyp, norm_range, on_half_disc

# rings and sectors of LayerNorm's half-disc (:func:`norm_error`): its error changes along a and b alike,
# so its bound converges as 1/cells (48: 10 % above a fine grid at r = ‖z₀‖/2, 96: 5 %, 192: 2.5 %)
NORM_CELLS = 96

__all__ = ["NormRecord", "layer_norm", "margin_sign", "norm_jacobian", "norm_remainder"]


def _gamma(norm: nn.LayerNorm, like: Tensor) -> Tensor:
    d = like.shape[-1]
    if norm.weight is None:
        return like.new_ones(d)
    return norm.weight.detach().to(like)


def norm_jacobian(norm: nn.LayerNorm, X: Tensor) -> Tensor:
    """LayerNorm's Jacobian at every clean token of X [..., n, d], [..., n, d, d] (float64 as X)."""
    d = X.shape[-1]
    z = X - X.mean(-1, keepdim=True)
    rho0 = ((z * z).sum(-1) + d * norm.eps).sqrt()  # [..., n]
    eye = torch.eye(d, dtype=X.dtype, device=X.device)
    M = eye - z[..., :, None] * z[..., None, :] / rho0[..., None, None] ** 2
    C = eye - 1.0 / d
    return _gamma(norm, X)[:, None] * (math.sqrt(d) / rho0)[..., None, None] * (M @ C)


def norm_remainder(norm: nn.LayerNorm, X: Tensor, r: Tensor, a_lo: Tensor | None = None,
                   a_hi: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per token of X [B, n, d] with deviation radius r [B, n]: (the error bound of the module
    docstring, or through h's symmetry where smaller (:func:`norm_error`, on the ball cut to
    a = ẑ₀ᵀΔ ∈ [a_lo, a_hi] where given), [B, n]; whether it is a second-order form [B, n] bool; the
    Lipschitz constant max|γ|·√d/ρ_min of LayerNorm on the token's ball [B, n]; each second-order
    token's cap in the shared budget [B, n]: r², or E/K)."""
    d = X.shape[-1]
    z = X - X.mean(-1, keepdim=True)
    nu = z.norm(dim=-1)
    c = d * norm.eps
    rho0 = (nu**2 + c).sqrt()
    rho_min2 = (nu - r).clamp_min(0) ** 2 + c
    g = float(_gamma(norm, X).abs().max()) * math.sqrt(d)
    # where e = 0 and the ball reaches the origin ρ_min = 0: both forms are +inf (0 at r = 0)
    second = g * r**2 / (math.sqrt(3) * rho_min2)
    lip = g * (torch.clamp(r / rho_min2.sqrt(), max=2.0) + r / rho0)  # h maps into the unit ball
    lip = torch.where(rho_min2 > 0, lip, math.inf)
    second = torch.where(r > 0, second, 0.0)
    lip = torch.where(r > 0, lip, 0.0)
    caps = torch.where(r > 0, r**2, 1.0)
    # through h's symmetry about z₀ (docs/bounds.md §5.1): E, shared at cap E/K, where smaller
    E, K = norm_error(nu, c, g, r, a_lo, a_hi)
    exact = (E < second) & (K > 0) & torch.isfinite(K)
    second = torch.where(exact, E, second)
    caps = torch.where(exact, E / torch.where(exact, K, 1.0), caps)
    use2 = second <= lip
    return torch.where(use2, second, lip), use2, g / rho_min2.sqrt(), caps


def norm_error(m: Tensor, c: float, g: float, r: Tensor, a_lo: Tensor | None = None,
               a_hi: Tensor | None = None, part: str = "norm",
               cells: int = NORM_CELLS) -> tuple[Tensor, Tensor]:
    """LayerNorm's error on each token's ball through the symmetry of h(z) = z/(‖z‖² + c)^½ about the
    clean centred token z₀ (docs/bounds.md §5.1, "LayerNorm's error on the token's ball").

    Args:
        m: ‖z₀‖ per token, [B, n].
        c: d·eps.
        g: max|γ|·√d (1 bounds h's own error e_h, e = √d·γ ⊙ e_h).
        r: the tokens' radii, [B, n] (‖CΔ‖ ≤ ‖Δ‖ ≤ r).
        a_lo, a_hi: bounds of a = ẑ₀ᵀΔ [B, n] (default ±r).
        part: ``"norm"`` bounds g·‖e_h‖; ``"along"`` g·|ẑ₀ᵀe_h| and ``"across"`` g·‖e_h − (ẑ₀ᵀe_h)ẑ₀‖
            (each at most the norm, so the closed form still bounds them near the origin).
        cells: as :func:`.symmetric.on_half_disc`'s.

    Returns:
        E ≥ sup ‖e‖ (or its part) and K ≥ sup ‖e‖/‖Δ‖² (the same) over the ball, [B, n] each.
    """
    if part not in ("norm", "along", "across"):
        raise ValueError(f"unknown part {part!r} of LayerNorm's error; expected norm, along or across")
    rho0 = (m.square() + c).sqrt()
    a_lo = -r if a_lo is None else torch.maximum(a_lo, -r)
    a_hi = r if a_hi is None else torch.minimum(a_hi, r)

    def box(m_: Tensor, a1: Tensor, a2: Tensor, b1: Tensor, b2: Tensor) -> Tensor:
        # with t = m + a, ρ = (t² + b² + c)^½, ρ_a = (t² + c)^½: e_ẑ = t(1/ρ − 1/ρ_a) + [ψ(t) − ψ(m) −
        # aψ'(m)] (ψ(t) = t/(t² + c)^½, ψ'' = −3ct/(t² + c)^{5/2}) and e_w = b(1/ρ − 1/ρ₀)
        r0 = (m_.square() + c).sqrt()
        t1, t2 = m_ + a1, m_ + a2
        lo = abs_low(t1, t2)
        hi = torch.maximum(t1.abs(), t2.abs())
        rho_lo = (lo.square() + b1.square() + c).sqrt()
        rho_hi = (hi.square() + b2.square() + c).sqrt()
        ra_lo = (lo.square() + c).sqrt()
        bend = hi * b2.square() / (rho_lo * ra_lo * (rho_lo + ra_lo))  # |t|·b²/(ρρ_a(ρ + ρ_a))
        # ξ between m and m + a: |ψ''(ξ)| ≤ 3c·|ξ|_max/(ξ²_min + c)^{5/2}
        x1, x2 = torch.minimum(t1, m_), torch.maximum(t2, m_)
        xlo = abs_low(x1, x2)
        xhi = torch.maximum(x1.abs(), x2.abs())
        amax = torch.maximum(a1.abs(), a2.abs())
        curve = 1.5 * c * xhi * amax.square() / (xlo.square() + c) ** 2.5 if c > 0 else torch.zeros_like(xhi)
        ew = b2 * torch.maximum((1 / rho_lo - 1 / r0).abs(), (1 / rho_hi - 1 / r0).abs())
        if part == "along":
            return g * (bend + curve)
        return g * (ew if part == "across" else hyp(bend + curve, ew))

    def closed(m_: Tensor, rho: Tensor, below: Tensor, simple: bool) -> Tensor:
        # ‖D²h‖ ≤ (2/√3)/ρ(z)² on the ball of radius ρ (docs/bounds.md §5.1, LayerNorm)
        return g / (3**0.5 * ((m_ - rho).clamp_min(0).square() + c))

    # the rounding: every quantity is h's (norm below 1) or its change, relative to ρ over the ball
    scale = g * (1 + r / ((m - r).clamp_min(0).square() + c).sqrt().clamp_min(torch.finfo(m.dtype).tiny))
    zero = torch.zeros_like(m)
    E, K = on_half_disc(box, closed, m, r, a_lo, torch.maximum(a_hi, a_lo), zero, scale, cells)
    E = torch.where(r > 0, E, 0.0)
    return torch.where(rho0 > 0, E, torch.inf), K


@dataclass(frozen=True)
class NormRecord:
    """What the backward pass needs of one LayerNorm stage: the per-token Jacobian L [B, n, d, d], each
    token's error bound err [B, n] (second-order tokens' ones share the ball's budget: err_t ≤
    K_t‖Δ_t‖² with K_t = err_t/caps_t and Σ_t ‖Δ_t‖² ≤ budget), which tokens took the second-order
    form [B, n], caps = r² [B, n], budget [B]."""

    name: str
    L: Tensor
    err: Tensor
    second: Tensor
    caps: Tensor
    budget: Tensor
    radii: Tensor  # each token's deviation radius r [B, n] (:func:`margin_sign` reads it)
    weights: Tensor  # √d·γ [d]: e = √d·γ ⊙ e_h, e_h = h(z₀ + CΔ) − h(z₀) − Dh·CΔ
    g: float  # max|γ|·√d, the factor err carries
    zhat: Tensor  # ẑ₀ [B, n, d], the clean centred token's direction
    along: Tensor  # |ẑ₀ᵀe_h| ≤ along and ≤ along_K·‖Δ_t‖², [B, n] (+inf: no such ratio)
    along_K: Tensor
    across: Tensor  # ‖e_h − (ẑ₀ᵀe_h)ẑ₀‖ ≤ across and ≤ across_K·‖Δ_t‖²
    across_K: Tensor
    # the part across ẑ₀ along a functional (docs/bounds.md §5.1, "Across, by the functional's range"):
    # e_h's is (1/ρ − 1/ρ₀)·(CΔ)_⊥ with 1/ρ₀ − 1/ρ in [k_lo, k_hi] [B, n] on each token's ball, and
    # ⟨λ_⊥, Δ_t⟩'s range read off ``reach``, the set entering the stage at radius ``eps`` (None: not taken)
    reach: DeviationSet | None = None
    eps: float = 0.0
    k_lo: Tensor | None = None
    k_hi: Tensor | None = None

    def charge(self, Lam: Tensor) -> Tensor:
        """An upper bound of −Σ_t ⟨Λ_t, e_t⟩ (what the errors take from a lower bound) for functionals Λ
        [B, C, n, d], [B, C] (docs/bounds.md §5.1, "LayerNorm's charge"): ⟨Λ_t, e_t⟩ = ⟨λ_t, e_h⟩ with
        λ_t = C(√d·γ ⊙ Λ_t) (e_h is centred), so each token's error is charged at ‖λ_t‖/g ≤ ‖Λ_t‖ times
        err_t, or by its parts along ẑ₀ and across it, at |λ_t·ẑ₀| and ‖λ_t − (λ_t·ẑ₀)ẑ₀‖ (the part across
        one-sided where the functional's range says less: "Across, by the functional's range"),
        whichever is smaller in all. One-sided: an upper bound of +Σ_t ⟨Λ_t, e_t⟩ is this charge of −Λ."""
        lam = Lam * self.weights
        lam = lam - lam.mean(-1, keepdim=True)
        # rounding: λ_t and its parts are computed; 4d·u of ‖λ_t‖ covers them (ẑ₀ a unit vector to ulps)
        norms = lam.norm(dim=-1)
        pad = 4 * Lam.shape[-1] * torch.finfo(Lam.dtype).eps * norms
        two = (norms + pad) / self.g * torch.where(self.second, self.err, 0.0)[:, None]
        one = (norms + pad) / self.g * torch.where(self.second, 0.0, self.err)[:, None]
        whole = shared(two, self.caps[:, None], self.budget[:, None]) + one.sum(-1)
        alpha = (lam * self.zhat[:, None]).sum(-1)
        lp = lam - alpha[..., None] * self.zhat[:, None]  # λ_⊥: centred, so ⟨λ_⊥, CΔ⟩ = ⟨λ_⊥, Δ⟩
        perp = lp.norm(dim=-1) + pad
        alpha = alpha.abs() + pad
        # −⟨λ_⊥, e_h⟩ = (1/ρ₀ − 1/ρ)·⟨λ_⊥, Δ_t⟩ (docs/bounds.md §5.1, "Across, by the functional's range")
        across = across_corners(self.reach, lp, self.eps, self.k_lo, self.k_hi, pad, self.radii)
        parts = charge_by_parts(alpha, perp, self.along, self.along_K, self.across, self.across_K,
                                self.budget, across)
        return torch.minimum(whole, parts)

    def step(self, Lam: Tensor) -> Step:
        """L_tᵀΛ_t per token for functionals Λ [B, C, n, d], the remainder charged."""
        return Step(torch.einsum("bcnd,bnde->bcne", Lam, self.L), charge=self.charge(Lam))


def layer_norm(S: DeviationSet, raw: Tensor, norm: nn.LayerNorm, eps: float, k: int | str,
               log: list | None = None, radii: tuple[Tensor, Tensor] | None = None,
               refuse: bool = True, refine: Refine | None = None) -> tuple[DeviationSet, Tensor]:
    """The set after LayerNorm at the clean tokens ``raw`` [B, n, d]: its per-token Jacobian applied
    (exactly, to every part of the set), E crossing it at ‖L_t‖₂, and the tokens' errors as a
    Frobenius ball of source ``norm<k>`` (second-order ones sharing the input ball's budget, as
    LayerProject's do). ``radii``: the set's token radii [B, n] and radius [B] where the caller has
    them. ``refuse``: an image whose every token's bound exceeds LayerNorm's range, 2√d·max|γ|, is
    refused (its set emptied and marked void; the final norm does not refuse, as the margins read it
    through their sign, :func:`margin_sign`, and a class token's head reads no other token). ``refine``:
    the backward pass over the stages before, which cuts each token's range of a = ẑ₀ᵀΔ further than
    the set's support does. Returns the set and the count 0 per image (LayerNorm has no kink)."""
    r, whole = radii if radii is not None else (S.token_radii(eps), None)
    whole = S.radius(eps, r) if whole is None else whole
    L = norm_jacobian(norm, raw)
    n, d = raw.shape[-2:]
    z = raw - raw.mean(-1, keepdim=True)
    nu = z.norm(dim=-1)
    zhat = z / nu.clamp_min(torch.finfo(raw.dtype).tiny)[..., None]
    # a = ẑ₀ᵀΔ's range (the error's symmetry is about ẑ₀: docs/bounds.md §5.1): from the set, then the
    # backward pass; ±r where the clean token has no direction
    mid, half = S.along_range(zhat, eps)
    a_lo, a_hi = mid - half, mid + half
    if refine is not None:
        units = torch.eye(n, dtype=raw.dtype, device=raw.device)[None, :, :, None] * zhat[:, None]
        a_lo, a_hi = refine(units, a_lo, a_hi)
    a_lo, a_hi = torch.where(nu > 0, a_lo, -r), torch.where(nu > 0, a_hi, r)
    err, use2, lip, caps = norm_remainder(norm, raw, r, a_lo, a_hi)
    g = float(_gamma(norm, raw).abs().max()) * math.sqrt(d)
    rho0 = (nu**2 + d * norm.eps).sqrt()
    own = torch.minimum(gram_norm(L @ L.mT), g / rho0)  # ‖L_t‖₂ per token, [B, n]
    tok = None if S.tok is None else S.tok * own
    # the route: ‖LN(x + Δ) − LN(x)‖_F ≤ max_t Lip_t·‖Δ‖_F, LayerNorm's constant on each token's ball
    route = torch.minimum(S.route, whole) * lip.amax(-1)
    fresh = None if S.fresh is None else S.fresh * own
    out = replace(S.per_token(L), rho=S.rho * own.amax(-1)[:, None], tok=tok, route=route, fresh=fresh)
    two = torch.where(use2, err, 0.0)
    one = torch.where(use2, 0.0, err)
    # ‖e‖_F² ≤ Σ_t two_t²·‖Δ_t‖²/cap_t under the budget (docs/bounds.md §5.1, "The budget, exactly")
    smooth = (torch.minimum(torch.minimum(two.norm(dim=-1), (two / caps).amax(-1) * whole**2),
                            shared(two.square(), caps, whole**2).sqrt()) + one.norm(dim=-1))
    out = out.add_ball(f"norm{k}", smooth, err)
    # [B]: LayerNorm is undefined at a point of the ball (e = 0), or every token's bound says less than
    # its range does: ‖LN(x) − LN(x₀)‖ = ‖γ ⊙ (u − u₀)‖ ≤ 2√d·max|γ| (‖u‖ ≤ √d), so the set carries
    # no information past this norm (docs/bounds.md §5.1, "LayerNorm"): refused, as every later stage
    # would cost its share of a pass for nothing. One such token alone is not refused: attention may
    # weigh it little (the q1 GELU digits ViT at ε 0.01 certifies such images)
    vacuous = (own * r + err > 2 * g) & refuse
    void = ~torch.isfinite(err).all(-1) | vacuous.all(-1)
    if void.any():  # emptied (later stages stay finite), and bounded by −∞ at the margins
        keep = lambda t: None if t is None else torch.where(void.reshape(-1, *[1] * (t.dim() - 1)), 0.0, t)
        out = replace(out, G=keep(out.G), A=keep(out.A), Q=keep(out.Q), c=keep(out.c), rho=keep(out.rho),
                      route=keep(out.route), gram=keep(out.gram), tok=keep(out.tok), W=keep(out.W),
                      void=void if S.void is None else S.void | void)
        err, smooth = keep(err), keep(smooth)
    # attention reads its input's radius off the route: the set's own radius where it is smaller (its
    # first order through the exact Jacobians, where the route charges every token LayerNorm's worst
    # constant)
    out = replace(out, route=out.radius(eps))
    if log is not None:
        # e_h's parts along ẑ₀ and across it (each at most ‖e_h‖ ≤ err/g), for the charge by parts
        g = max(g, torch.finfo(raw.dtype).tiny)  # γ ≡ 0 (LayerNorm constant, err = 0): no 0/0 below
        whole_K = torch.where(use2, err / caps, torch.inf) / g
        parts = []
        for part in ("along", "across"):
            E, K = norm_error(nu, d * norm.eps, 1.0, r, a_lo, a_hi, part)
            E, K = (torch.where(t.isnan(), torch.inf, t) for t in (E, K))  # a ball reaching z = 0
            parts += [torch.minimum(E, err / g), torch.minimum(K, whole_K)]
        # 1/ρ₀ − 1/ρ on the cut ball, which e_h's part across ẑ₀ takes: ρ² = ‖z₀ + CΔ‖² + d·e
        rho_lo, rho_hi = norm_range(nu, r, a_lo, a_hi, d * norm.eps)
        inv0 = 1 / rho0
        # a ball reaching z = 0 with c = 0 has 1/ρ unbounded: k_lo = −inf (or NaN), and no bound is taken
        k_lo = (inv0 - 1 / rho_lo) - 1e-12 * (inv0 + 1 / rho_lo)
        k_hi = (inv0 - 1 / rho_hi) + 1e-12 * (inv0 + 1 / rho_hi)
        log.append(NormRecord(f"norm{k}", L, err, use2, caps, whole**2, r,
                              math.sqrt(d) * _gamma(norm, raw), g, zhat, *parts, S, eps, k_lo, k_hi))
    return out, torch.zeros(len(raw), dtype=torch.long, device=raw.device)


def margin_sign(norm: nn.LayerNorm, x0: Tensor, rows: Tensor, k: Tensor,
                r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A head's margins on one token after LayerNorm, read through their sign (docs/bounds.md §5.1,
    "The final LayerNorm through the margins' sign"). m_j = ⟨rows_j, LN(x)⟩ + k_j = √d⟨a_j, z⟩/ρ(z) + k_j
    (a_j = γ ⊙ rows_j, z = Cx) has the sign of m̃_j = m_j·ρ(z)/ρ₀ = (√d⟨a_j, z⟩ + k_j ρ(z))/ρ₀, equal to
    m_j at x₀, and m̃_j(x₀ + Δ) − m_j(x₀) = ⟨g_j, Δ⟩ + (k_j/ρ₀)·B(Δ) with ρ's tangent gap
    0 ≤ B ≤ min(‖CΔ‖²/(2ρ₀), 2‖CΔ‖): no remainder where k_j ≥ 0, as ρ is convex.

    Args:
        norm: the final LayerNorm.
        x0: the clean token, [B, d].
        rows: the head's row differences w_y − w_j, [B, C, d].
        k: the margins' constant parts ⟨rows_j, β⟩ + b_y − b_j, [B, C].
        r: a bound of the token's deviation ‖Δ‖ over the set, [B].

    Returns:
        g = C(√d·a_j + k_j z₀/ρ₀)/ρ₀ [B, C, d]; the charge max(0, −k_j)·min(r²/(2ρ₀), 2r)/ρ₀ [B, C];
        ρ₀/ρ_max, ρ's largest value on the ball [B] (a bound m̃_j ≥ μ > 0 gives m_j ≥ μ·ρ₀/ρ_max).
    """
    d = x0.shape[-1]
    z = x0 - x0.mean(-1, keepdim=True)
    nu = z.norm(dim=-1)
    rho0 = (nu.square() + d * norm.eps).sqrt()  # [B]
    a = _gamma(norm, x0) * rows
    g = (math.sqrt(d) * a + k[..., None] * (z / rho0[:, None])[:, None]) / rho0[:, None, None]
    g = g - g.mean(-1, keepdim=True)  # C is symmetric: ⟨g, CΔ⟩ = ⟨Cg, Δ⟩
    gap = torch.minimum(r.square() / (2 * rho0), 2 * r)
    charge = (-k).clamp_min(0) * (gap / rho0)[:, None]
    rho_max = ((nu + r).square() + d * norm.eps).sqrt()
    return g, charge, rho0 / rho_max
