"""LayerProject as a stage of ``taylor_net`` (docs/bounds.md §5.1): its radial and tangential forms per
token, the ReLU of a token's radial change, and the second-order errors as groups of their own, each
bounded by the closed forms or through the map's symmetry (:mod:`.projection_error`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...norms import gram_norm
from ..budget import shared
from ..record import Step
from ..zonotope import DeviationSet, columns, relu_relaxation, symbols
from .ffn import Refine, relu_bounds
from .projection_error import exact_error
from .symmetric import across_corners, charge_by_parts, norm_range

# A straddling token needs its radius below its clean norm (the decomposition's remainder blows up at
# the origin); beyond it the token is bounded by LayerProject's 1-Lipschitz property alone.
SAFE = 0.999


def project(S: DeviationSet, raw: Tensor, R: float, eps: float, k: int,
            log: list | None = None, refine: Refine | None = None,
            every: bool = False, radii: tuple[Tensor, Tensor] | None = None,
            span: Tensor | None = None) -> tuple[DeviationSet, Tensor]:
    """LayerProject p(x) = x·min(1, R/‖x‖) on the set (docs/bounds.md §5.1), per token with clean
    input x₀ = ν·u, radial change a = uᵀΔ and radius r ≥ ‖Δ‖:

    * the identity where ν + r ≤ R (the ball stays inside);
    * the *radial* form, from p(x) = x − relu(‖x‖ − R)·x/‖x‖: Δp = Δ − (w − w₀)u + e, w = relu(ν − R + a),
      ‖e‖ ≤ K_in r² + (ν − R)⁺ r/R';
    * the *tangential* form, from p(x) = Rx/‖x‖ − relu(R − ‖x‖)·x/‖x‖ (ν > R): Δp = (R/ν)(I − uuᵀ)Δ −
      v·u + e, v = relu(R − ν − a), ‖e‖ ≤ K_out r²;

    each token taking the form with the smaller error; w and v are ReLUs of a, relaxed as any ReLU
    (:func:`relu_relaxation`: no symbol where the ball stays on one side of the sphere). A token with
    r ≥ ν is bounded by LayerProject's 1-Lipschitz property alone (Δp = e, ‖e‖ ≤ r). Straddling
    tokens' errors (with ``every``, every token's outside the sphere) are groups of their own sharing
    the ball's budget (:meth:`DeviationSet.grouped`), the other tokens' one Frobenius ball. Returns the
    set and the straddling tokens per image. ``radii``: the set's token radii [B, n] and radius [B]
    where the caller has them (the first block's input set is the same for every image). ``span``
    [n, d, m]: where each token's deviation lies in the range of these columns (the first block's,
    the patch's pixels through the embedding), each error lies in span{u_t} + that range and its group
    has m + 1 columns in place of d (:func:`error_frame`)."""
    r, whole = radii if radii is not None else (S.token_radii(eps), None)  # [B, n]
    whole = S.radius(eps, r) if whole is None else whole
    nu = raw.norm(dim=-1)  # [B, n]
    u = raw / nu.clamp_min(torch.finfo(raw.dtype).tiny)[..., None]
    inside = nu + r <= R
    wild = ~inside & (r >= SAFE * nu)  # the decomposition needs r < ν
    a_mid, a_half = S.along_range(u, eps)
    a_lo, a_hi = a_mid - a_half, a_mid + a_half
    n, d = raw.shape[1:]
    if refine is not None:  # the backward pass over the stages before gives its own range of a
        units = torch.eye(n, dtype=raw.dtype, device=raw.device)[None, :, :, None] * u[:, None]
        a_lo, a_hi = refine(units, a_lo, a_hi)
    gap = (nu - r).clamp_min(torch.finfo(raw.dtype).tiny)
    # radial form: z = ν − R + a; tangential: z = R − ν − a (z − z₀ = ±a)
    radial_lo, tangential_lo = nu - R + a_lo, R - nu - a_hi
    radial_hi, tangential_hi = nu - R + a_hi, R - nu - a_lo
    radial = relu_relaxation(nu - R, radial_lo, radial_hi)
    tangential = relu_relaxation(R - nu, tangential_lo, tangential_hi)
    # ‖e‖ ≤ b²/D + |a|b/R' (+ (ν − R)⁺ b/R') with a² + b² = ‖Δ‖², whose largest value on the unit circle
    # is (1/D + (1/D² + 1/R'²)^½)/2: D = max(R + ν − r, 2(ν − r)), R' = max(R, ν − r)
    D = torch.maximum(R + gap, 2 * gap)
    Rp = gap.clamp_min(R)
    err_radial = (1 / D + (1 / D**2 + 1 / Rp**2).sqrt()) / 2 * r**2 + (nu - R).clamp_min(0) * r / Rp
    # Rx/‖x‖'s second derivative is ≤ (2/√3)R/‖x‖² (docs), and where v can be nonzero
    # b²/(2g) + |a|b/g ≤ 0.809‖Δ‖²/g (g = ν − r)
    err_tangential = (R / (math.sqrt(3) * gap**2)
                      + torch.where(tangential[2] > 0, (0.25 + math.sqrt(5) / 4) / gap, 0.0)) * r**2
    # each form's error bounded through its symmetry on the ball, cut to a's range (exact_error): up to
    # 2.6× below the closed forms above on the digits ViTs' straddling tokens (docs/bounds.md §5.1)
    off = inside | wild
    exact_r, K_r = _exact_on(~off, nu, R, r, a_lo, a_hi, tangential=False)
    exact_t, K_t = _exact_on(~off & (nu > R), nu, R, r, a_lo, a_hi, tangential=True)
    use_t = (nu > R) & (torch.minimum(err_tangential, exact_t) < torch.minimum(err_radial, exact_r))
    lam, beta, half = (torch.where(use_t, t, q) for t, q in zip(tangential, radial, strict=True))
    err = torch.where(use_t, err_tangential, err_radial)
    exact, K_exact = torch.where(use_t, exact_t, exact_r), torch.where(use_t, K_t, K_r)
    symmetric = (exact < err) & ~off  # the token takes its error's bounds through the symmetry
    # the closed form's quadratic constant is a second K where it has no first-order part (the
    # tangential form, and the radial one inside the sphere: there err/r² is exactly that constant)
    closed_K = err / r.clamp_min(torch.finfo(r.dtype).tiny) ** 2
    K_exact = torch.minimum(K_exact, torch.where(use_t | (nu <= R), closed_K, torch.inf))
    err = torch.minimum(err, exact)
    # the error's parts along u and across it, each at most ‖e‖ (docs/bounds.md §5.1, "LayerProject's
    # error along the token"): the backward pass may charge them at |Λ_t·u_t| and ‖Λ_t − (Λ_t·u_t)u_t‖
    # where ‖e‖ is charged at ‖Λ_t‖, and the error of a token near its clean norm lies mostly along u
    parts = [_parts(~off, use_t, nu, R, r, a_lo, a_hi, part, err, K_exact) for part in ("along", "across")]
    lam, beta, half, err = (torch.where(off, 0.0, t) for t in (lam, beta, half, err))
    straddle = half > 0
    # linear part per token: scale·I + coef·uuᵀ; the radial form's w − w₀ ∈ λa + β + μζ enters as −u·(…),
    # the tangential form's v − v₀ ∈ −λa + β + μζ as −u·(…) too
    scale = torch.where(use_t, R / nu, 1.0)
    coef = torch.where(use_t, -R / nu + lam, -lam)
    scale, coef = torch.where(wild, 0.0, scale), torch.where(wild, 0.0, coef)

    # L_t = scale·I + coef·uuᵀ; the Gram is not carried: attention, next, mixes the tokens
    out = replace(S, gram=None).rank_one(scale, coef, u, -beta[..., None] * u)
    idx, mu = symbols(straddle, half)
    along = u.gather(1, idx[..., None].expand(-1, -1, d))
    out = out.with_symbols(columns(idx, -mu[..., None] * along, n, d))
    # the budget is shared by the second-order part only: the first-order (ν − R)⁺ r/R' is ≤ 1e-3 of it
    # on the zoo's tokens, and is kept apart from it in the smooth ball below
    first = torch.where(use_t | off, 0.0, (nu - R).clamp_min(0) * r / Rp)
    # each token's error ≤ its level while ‖e_t‖ ≤ (level/cap)·‖Δ_t‖², so that the levels share the
    # ball's budget Σ_t ‖Δ_t‖² ≤ whole² through the caps (DeviationSet.grouped): the closed forms'
    # second-order part at cap r², or a bound through the symmetry, E at cap E/K (K ≥ ‖e‖/‖Δ‖²,
    # exact_error). Where K is infinite (a first-order part, ν > R in the radial form) E is the token's
    # own ball, its budget not shared (kept with the first-order parts)
    shares = symmetric & torch.isfinite(K_exact) & (K_exact > 0)
    first = torch.where(symmetric, torch.where(shares, 0.0, err), first)
    level = torch.where(off, 0.0, err - first)
    cap = torch.where(shares, err / torch.where(shares, K_exact, 1.0), r**2)
    grouped = ~off if every else straddle
    # each group's error ball in its frame's columns (R^d, or the first block's span), and the part of
    # the error the frame can miss by rounding (κ of its size), which joins the smooth ball below
    frame, kappa = error_frame(u, span, grouped | wild)
    pick = lambda idx: frame.gather(1, idx[..., None, None].expand(-1, -1, *frame.shape[2:]))
    idx, radius = symbols(grouped, level)
    _, caps = symbols(grouped, cap)
    out = out.with_groups(f"project{k}", columns(idx, radius[..., None, None] * pick(idx), n, d),
                          torch.where(caps > 0, caps, 1.0), whole**2)
    idx, radius = symbols(wild, r)
    out = out.with_groups(f"project{k}_wild", columns(idx, radius[..., None, None] * pick(idx), n, d),
                          torch.ones_like(radius))
    # a grouped token's first-order part (ν − R)⁺‖Δ_t‖/R' is linear in ‖Δ_t‖, so it cannot share the
    # second-order budget: a group of its own with no budget, which later stages cross at their exact
    # linear parts. As a Frobenius ball it crossed each block at ‖J‖·Lip(FFN) (≈ 5 a block on the
    # Fashion-MNIST models) and reached every token of the next block's input
    carried = grouped & (first > 0)
    idx, radius = symbols(carried, first)
    out = out.with_groups(f"project{k}_first", columns(idx, radius[..., None, None] * pick(idx), n, d),
                          torch.ones_like(radius))
    miss = kappa * torch.where(wild, r, torch.where(grouped, err, 0.0))  # [B, n]
    order1, first = first, torch.where(carried, 0.0, first)  # what stays in the ball below
    # the other tokens: ‖e‖_F ≤ (Σ_t K_t² ‖Δ_t‖⁴)^½ ≤ max_t K_t · ‖Δ‖_F² (they share the ball's budget),
    # and ≤ ‖(level_t)‖ at every token's own radius
    K = torch.where(grouped | off, 0.0, level / cap.clamp_min(torch.finfo(raw.dtype).tiny))
    # and ≤ (Σ_t level_t²·‖Δ_t‖²/cap_t)^½ under the same budget (docs/bounds.md §5.1, "The budget, exactly")
    alone = torch.where(grouped | off, 0.0, level)
    smooth = (torch.minimum(torch.minimum(alone.norm(dim=-1), K.amax(-1) * whole**2),
                            shared(alone.square(), cap, whole**2).sqrt())
              + first.norm(dim=-1) + miss.norm(dim=-1))
    if log is not None:  # what the backward pass needs (:func:`backward`)
        sign = torch.where(use_t, -1.0, 1.0).to(raw.dtype)
        lo = torch.where(use_t, tangential_lo, radial_lo)
        hi = torch.where(use_t, tangential_hi, radial_hi)
        # the linear part L_t = base_t·(I − [tangential]·u_tu_tᵀ) (0 at a wild token), symmetric, kept
        # as its two scalars: the backward pass applies it through u_tᵀΛ_t, O(d) a functional
        base = torch.where(wild, 0.0, torch.where(use_t, R / nu, 1.0))
        # φ(s) = min(1, R/s) at s = ‖x₀ + Δ‖, which the part across u of either form's error takes
        s_lo, s_hi = norm_range(nu, r, torch.maximum(a_lo, -r), a_hi)
        phi_lo = torch.clamp(R / s_hi * (1 - 1e-12), max=1.0)
        phi_hi = torch.where(s_lo > 0, torch.clamp(R / s_lo.clamp_min(torch.finfo(raw.dtype).tiny)
                                                   * (1 + 1e-12), max=1.0), 1.0)
        log.append(ProjectRecord(f"project{k}", base, use_t.to(raw.dtype), u, sign, sign * (nu - R), lo, hi,
                                 ~off, torch.where(off, 0.0, err - order1), order1,
                                 torch.where(off, 1.0, cap), whole**2, torch.where(wild, r, 0.0),
                                 *parts[0], *parts[1], S, eps, r, phi_lo, phi_hi))
    # LayerProject is 1-Lipschitz per token: the projected set's radius is at most the input's
    # per token, a smooth token's error is its own err (a grouped token's error, both its parts, and a
    # wild token's are groups); E crosses the
    # linear part at ‖L_t‖ ≤ 1 as it does in norm
    own = torch.where(grouped | off, first, err) + miss
    out = out.add_ball(f"project{k}", smooth, own)
    # attention reads its input's radius off the route: the projected set's own radius where it is
    # smaller (a token outside the sphere contracts by R/ν along the sphere, which ``whole`` ignores)
    return replace(out, route=torch.minimum(whole, out.radius(eps))), straddle.sum(-1)


# the largest κ (the rounding part of an error a frame can miss, relative to the error) for which the
# first block's groups take their span's frame; beyond it (u nearly in the patch's range, a zero token)
# the whole batch keeps R^d. On the zoo's digits models κ is 3e-13 to 2e-12
FRAME_KAPPA = 1e-8


def error_frame(u: Tensor, span: Tensor | None, need: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, columns F_t [B, n, d, g] and κ_t [B, n] such that every error e of LayerProject at
    that token is F_t η + m with ‖η‖ ≤ ‖e‖ and ‖m‖ ≤ κ_t‖e‖ (docs/bounds.md §5.1, "The first block's
    errors in their span"): the identity (κ = 0) without ``span``; with it, the error lies in
    V_t = span{u_t} + range(span_t), since p(x) − p(x₀), the linear part and the ReLU's term all lie in
    span{u, Δ}, and F_t = ‖Bᵀ_t‖·B_t with B_t an orthonormal basis of V_t from a QR (m + 1 columns in
    place of d). Rounding makes range(B_t) miss V_t slightly: κ_t ≥ ‖(I − BBᵀ)A‖_F/σ_min(A) for A =
    [u | span_t], with both sides' rounding bounded. Where a token of ``need`` [B, n] has κ_t above
    :data:`FRAME_KAPPA` (A nearly singular) every token takes the identity."""
    B, n, d = u.shape
    eye = torch.eye(d, dtype=u.dtype, device=u.device).expand(B, n, d, d)
    if span is None or not bool(need.any()):
        return eye, u.new_zeros(B, n)
    A = torch.cat([u[..., None], span.expand(B, n, d, -1)], -1)  # [B, n, d, m]
    m = A.shape[-1]
    basis = torch.linalg.qr(A).Q
    unit = torch.finfo(u.dtype).eps / 2
    grow = gram_norm(basis.mT @ basis)  # ≥ ‖B_t‖₂
    fro = A.square().sum((-2, -1)).sqrt()
    # (I − BBᵀ)A as computed, and a bound of its rounding: each entry of BᵀA and B(BᵀA) is a dot product
    # of ≤ d terms, off by ≤ d·u times the sum of its terms' magnitudes (Higham, Thm 3.5)
    miss = (A - basis @ (basis.mT @ A)).square().sum((-2, -1)).sqrt()
    miss = (miss + 4 * (d + m) * unit * (1 + m * grow**2) * fro) * (1 + 2 * (d * m + 2) * unit)
    # σ_min(A)² from below: the Gram's rounding (≤ d·u‖A‖_F² entrywise sum) and eigvalsh's backward error
    low = torch.linalg.eigvalsh(A.mT @ A)[..., 0] - 16 * (d + m) * unit * fro**2
    kappa = torch.where(low > 0, miss / low.clamp_min(torch.finfo(u.dtype).tiny).sqrt(), math.inf)
    if bool((need & ~(kappa <= FRAME_KAPPA)).any()):
        return eye, u.new_zeros(B, n)
    return basis * grow[..., None, None], kappa



@dataclass(frozen=True)
class ProjectRecord:
    """LayerProject for the backward pass, per token [B, n]: the linear part L_t = base_t·(I −
    [tangential]·u_tu_tᵀ) as its two scalars and u_t [B, n, d], the radial change's ReLU (its sign,
    clean value, range, and whether it is relaxed at all), and the errors: second-order (sharing the
    ball's budget over caps: r², or E/K where the error is bounded through the symmetry), first-order
    (and a symmetric bound with no quadratic constant) and a wild token's; and the whole error's parts
    along u_t and across it (bounds and ratios to ‖Δ_t‖², +inf where none), which the charge may take
    instead (:meth:`_by_parts`); and for the part across u_t along a functional, the set entering the
    stage with φ's range on each token's ball (:meth:`_across`)."""

    name: str
    base: Tensor
    tangent: Tensor
    u: Tensor
    sign: Tensor
    z0: Tensor
    lo: Tensor
    hi: Tensor
    relu: Tensor
    second: Tensor
    first: Tensor
    caps: Tensor
    budget: Tensor
    wild: Tensor
    along: Tensor
    along_K: Tensor
    across: Tensor
    across_K: Tensor
    # the part across u_t along a functional (docs/bounds.md §5.1, "Across, by the functional's range"):
    # e_⊥ = (φ − base_t)Δ_⊥ with φ = min(1, R/‖x₀ + Δ‖) in [phi_lo, phi_hi], and ⟨Λ_⊥, Δ_t⟩'s range
    # read off ``reach``, the set entering the stage at radius ``eps`` (None: not taken); radius r_t
    reach: DeviationSet | None = None
    eps: float = 0.0
    radius: Tensor | None = None
    phi_lo: Tensor | None = None
    phi_hi: Tensor | None = None

    def step(self, Lam: Tensor, alpha: Tensor | None = None, phase: Tensor | None = None) -> Step:
        """Λ_t ↦ L_tᵀΛ_t plus the radial ReLU's slope along u_t (CROWN's per sign, or the lower slopes
        ``alpha`` [B, C, n]; held on one side of 0 by ``phase`` [B, C, n]), its offset gained and every
        error charged at ‖Λ_t‖."""
        u = self.u[:, None]  # [B, 1, n, d]
        gam = -(Lam * u).sum(-1)  # the coefficient of q − q₀ (q = w or v), [B, C, n]
        s, b = relu_bounds(gam, self.z0[:, None], self.lo[:, None], self.hi[:, None], alpha, phase)
        on = self.relu[:, None]
        s, b = torch.where(on, s, 0.0), torch.where(on, b, 0.0)
        norms = Lam.norm(dim=-1)  # ‖Λ_t‖
        second = norms * self.second[:, None]
        # the tokens' second-order errors share the ball's budget (docs/bounds.md §5.1, "The budget, exactly")
        whole = (shared(second, self.caps[:, None], self.budget[:, None])
                 + (norms * self.first[:, None]).sum(-1))
        charge = torch.minimum(whole, self._by_parts(Lam, gam, norms)) + (norms * self.wild[:, None]).sum(-1)
        radial = (gam * s * self.sign[:, None])[..., None] * u
        # L_tᵀΛ_t = base_t·(Λ_t − [tangential]·u_t(u_tᵀΛ_t)), and u_tᵀΛ_t = −γ_t
        along = (self.tangent[:, None] * gam)[..., None] * u
        moved = self.base[:, None, :, None] * (Lam + along) + radial
        return Step(moved, (gam * b).sum(-1), (gam * b).abs().sum(-1), charge, units=gam * b)

    def _by_parts(self, Lam: Tensor, gam: Tensor, norms: Tensor) -> Tensor:
        """The errors' charge [B, C] from their parts: Λ_tᵀe_t = (Λ_t·u_t)(u_tᵀe_t) + Λ_⊥ᵀe_⊥ with
        Λ_⊥ = Λ_t − (Λ_t·u_t)u_t. The part along u_t never points outward (−U_t ≤ u_tᵀe_t ≤ 0 in both
        forms: the sphere bends the token inward), so −Λ_tᵀe_t ≤ (Λ_t·u_t)⁺·U_t + ‖Λ_⊥‖·P_t, and ≤
        ((Λ_t·u_t)⁺·K_U + ‖Λ_⊥‖·K_P)‖Δ_t‖² where both ratios are finite: those tokens share the ball's
        budget as above, the others pay their bound (docs/bounds.md §5.1, "LayerProject's error along
        the token", "Inward only")."""
        u = self.u[:, None]
        # rounding: u is a unit vector to a few ulps, and Λ_⊥ is computed; 4d·u_r of ‖Λ_t‖ covers both
        pad = 4 * Lam.shape[-1] * torch.finfo(Lam.dtype).eps * norms
        # the lower bound pays for −Λ_tᵀe_t alone, and −(Λ_t·u_t)(u_tᵀe_t) ≤ (Λ_t·u_t)⁺U_t as u_tᵀe_t ≤ 0:
        # a functional that pulls the token inward (Λ_t·u_t = −γ_t < 0) gains from that part, never loses
        g = (-gam).clamp_min(0) + pad
        lp = Lam + gam[..., None] * u  # Λ_⊥ = Λ − (Λ·u)u, as u·Λ = −γ
        perp = lp.norm(dim=-1) + pad
        return charge_by_parts(g, perp, self.along, self.along_K, self.across, self.across_K, self.budget,
                               self._across(lp, pad))

    def _across(self, lp: Tensor, pad: Tensor) -> Tensor | None:
        """Upper bounds [B, C, n] of −⟨Λ_⊥, e_⊥⟩ for the functionals' parts across the tokens, lp [B, C, n,
        d] (``pad`` [B, C, n] of rounding in each): e_⊥ = (φ − κ_t)Δ_⊥ with κ_t = base_t, and ⟨Λ_⊥, Δ_⊥⟩ =
        ⟨Λ_⊥, Δ_t⟩, so −⟨Λ_⊥, e_⊥⟩ = (κ_t − φ)·⟨Λ_⊥, Δ_t⟩ with κ_t − φ ∈ [κ_t − φ_hi, κ_t − φ_lo]
        (:func:`.symmetric.across_corners`; docs/bounds.md §5.1, "Across, by the functional's range")."""
        if self.reach is None:  # no set kept (and no φ range): the charge by parts alone
            return None
        out = across_corners(self.reach, lp, self.eps, self.base - self.phi_hi, self.base - self.phi_lo, pad,
                             self.radius)
        return None if out is None else torch.where(self.relu[:, None], out, 0.0)


def _parts(keep: Tensor, use_t: Tensor, nu: Tensor, R: float, r: Tensor, a_lo: Tensor, a_hi: Tensor,
           part: str, err: Tensor, K: Tensor) -> tuple[Tensor, Tensor]:
    """One part of each token's error (``"along"`` or ``"across"`` u), in the form the token takes
    (tangential where ``use_t``): its bound over the ball and its ratio to ‖Δ_t‖², each at most the
    whole error's (``err``, ``K``: the part is at most ‖e‖); 0 where a token is not ``keep``."""
    radial = _exact_on(keep & ~use_t, nu, R, r, a_lo, a_hi, tangential=False, part=part)
    tangential = _exact_on(keep & use_t, nu, R, r, a_lo, a_hi, tangential=True, part=part)
    E, P = (torch.where(use_t, t, q) for t, q in zip(tangential, radial, strict=True))
    return torch.where(keep, torch.minimum(E, err), 0.0), torch.where(keep, torch.minimum(P, K), 0.0)


def _exact_on(keep: Tensor, nu: Tensor, R: float, r: Tensor, a_lo: Tensor, a_hi: Tensor,
              tangential: bool, part: str = "norm") -> tuple[Tensor, Tensor]:
    """:func:`exact_error` on the tokens ``keep`` [B, n] alone (2·CELLS² cells a token; the
    others' bounds are masked anyway), +inf elsewhere."""
    E, K = torch.full_like(nu, torch.inf), torch.full_like(nu, torch.inf)
    if bool(keep.any()):
        E_kept, K_kept = exact_error(nu[keep][None], R, r[keep][None], a_lo[keep][None],
                                     a_hi[keep][None], tangential, part=part)
        E[keep], K[keep] = E_kept[0], K_kept[0]
    return E, K
