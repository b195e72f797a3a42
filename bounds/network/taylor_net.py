"""``taylor_net``: a whole-network certificate of a lofast ViT that is exact to first order
(docs/bounds.md §5.1; this suite's, after SPEC §5.1).

For an image x and a perturbation δ (‖δ‖₂ ≤ ε) every intermediate deviation Δ = T(x + δ) − T(x) is
held in one set, pushed forward stage by stage from the pixels to the margins:

    Δ = G δ + A ζ + c + E,    ‖δ‖₂ ≤ ε,   ζ ∈ [−1, 1]^m,   ‖E‖_F ≤ Σ_s ρ_s,

with G the exact first-order part (the product of every smooth stage's Jacobian at the clean image,
and of each kink's slope), A one column per unit that can cross a kink (a ReLU neuron, a token whose
ball straddles LayerProject's sphere: a zonotope's symbols, shared by every later stage so that their
signs cancel), c the constant shifts of those relaxations, and E the Taylor remainders of the smooth
stages, one Frobenius ball per source s (each block's attention and LayerProject). Each stage:

* LayerProject, per token (docs/bounds.md §5.1, "a token of LayerProject"): the identity where the
  token's ball stays inside the sphere; (R/ν)(I − uuᵀ) with a second-order remainder where it stays
  outside; where it straddles, the exact decomposition Δp = LΔ − w·u + e with w a ReLU of the radial
  change a = uᵀΔ (relaxed as any ReLU) and ‖e‖ ≤ K‖Δ‖²;
* attention: its Jacobian J at the clean input (``models.structured.dot_jacobian``) and the Taylor
  remainder of docs/bounds.md §2.3 (``bounds.taylor.remainder``) at the radius of its input set;
* the FFN x + W₂ relu(W₁x + b₁) + b₂: linear, but for the neurons whose range (from the set itself,
  so first-order exact) contains 0, relaxed by the parallelogram of least area (DeepZ, Singh et al.
  2018) with a symbol of their own;
* mean pooling and the head: linear.

A margin m_j = (e_y − e_j)ᵀ logits then changes by at least
``cᵀc_vec − ε‖Gᵀc‖₂ − ‖Aᵀc‖₁ − ‖c‖_F Σ_s ρ_s`` for its functional c, and the image is certified when
every m_j(x) beats that loss with room for float64 rounding. Every norm in it is computed exactly
(an SVD of a d×d Gram, or a Frobenius norm ≥ the spectral norm): the certificate is ``deterministic``.
Built on torch alone (no auto_LiRPA), batched over images and classes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from models import InputError
from models.structured import dot_jacobian
from models.vit import ViT

from ..certificates import exact_norm
from ..taylor import remainder
from .propagated import check_certifiable

# Room for float64 rounding, relative to the magnitudes of the margin and of every term of its loss:
# the set is pushed through ≤ a few dozen products of inner size ≤ 10⁴ (each off by ≤ 10⁴·u relative to
# the product of magnitudes, u = 1.1e-16), so 1e-9 leaves three orders of magnitude to spare.
ROUND = 1e-9
# A straddling token needs its radius below its clean norm (the decomposition's remainder blows up at
# the origin); beyond it the token is bounded by LayerProject's 1-Lipschitz property alone.
SAFE = 0.999


@dataclass
class DeviationSet:
    """``Δ = G δ + A ζ + Σ_j Q_j η_j + c + E`` over tokens: G [B, n, d, P] (‖δ‖₂ ≤ ε), A [B, n, d, m]
    (ζ ∈ [−1, 1]^m), Q [B, n, d, k, g] (k groups of g columns, each η_j in the unit ℓ2 ball: a
    token's own error ball, docs/bounds.md §5.1), c [B, n, d], and the Frobenius radii of E per
    source, ρ [B, S]. ``sources`` names E's radii, ``groups`` the source of each group."""

    G: Tensor
    A: Tensor
    Q: Tensor
    c: Tensor
    rho: Tensor
    sources: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    # group j's radius is K_j‖Δ_j‖² ≤ K_j·caps[:, j] with Σ_j ‖Δ_j‖² ≤ budgets[source]: LayerProject's
    # errors of one block share the budget of the ball they come from (docs/bounds.md §5.1)
    caps: Tensor | None = None
    budgets: dict[str, Tensor] = field(default_factory=dict)

    def grouped(self, v: Tensor) -> Tensor:
        """The largest Σ_j (s_j/caps_j)·v_j over the groups' radii, from their supports v [B, ..., k]
        (each at the group's largest radius): per source the smaller of Σ_j v_j and, where its groups
        share a budget, budget·max_j v_j/caps_j (all of the budget on the best group)."""
        if not self.groups:
            return v.sum(-1)
        shape = (v.shape[0],) + (1,) * (v.dim() - 2) + (v.shape[-1],)
        caps = self.caps.reshape(shape)
        total = 0
        for name in dict.fromkeys(self.groups):
            idx = [j for j, g in enumerate(self.groups) if g == name]
            plain = v[..., idx].sum(-1)
            if name in self.budgets:
                budget = self.budgets[name].reshape(shape[:-1])
                plain = torch.minimum(plain, budget * (v[..., idx] / caps[..., idx]).amax(-1))
            total = total + plain
        return total

    def linear(self, fn) -> DeviationSet:
        """The image of the set under a linear map ``fn`` of [B, K, n, d] (K sets of tokens: the
        columns of G, A and Q, and c); E's radii are left to the caller."""
        move = lambda T: fn(T.movedim(-1, 1)).movedim(1, -1)
        B, n, d, k, g = self.Q.shape
        Q = move(self.Q.reshape(B, n, d, k * g)).reshape(B, n, d, k, g)
        return replace(self, G=move(self.G), A=move(self.A), Q=Q, c=fn(self.c[:, None])[:, 0])

    def ball(self) -> Tensor:
        """Σ_s ρ_s ≥ ‖E‖_F, [B]."""
        return self.rho.sum(-1)

    def token_radii(self, eps: float) -> Tensor:
        """An upper bound of ‖Δ_t‖ per token, [B, n]:
        ‖c_t‖ + ε‖G_t‖₂ + Σ_i ‖A_t[:, i]‖ + Σ_j ‖Q_{t,j}‖₂ + ‖E‖_F."""
        return (self.c.norm(dim=-1) + eps * exact_norm(self.G) + self.A.norm(dim=-2).sum(-1)
                + self.grouped(exact_norm(self.Q.transpose(2, 3))) + self.ball()[:, None])

    def radius(self, eps: float) -> Tensor:
        """An upper bound of ‖Δ‖_F, [B]: the smaller of the norm of the parts and √Σ_t r_t²."""
        B, n, d, m = self.A.shape
        k, g = self.Q.shape[-2:]
        whole = (self.c.reshape(B, -1).norm(dim=-1) + eps * exact_norm(self.G.reshape(B, n * d, -1))
                 + self.A.reshape(B, n * d, m).norm(dim=-2).sum(-1)
                 + self.grouped(exact_norm(self.Q.permute(0, 3, 1, 2, 4).reshape(B, k, n * d, g)))
                 + self.ball())
        return torch.minimum(whole, self.token_radii(eps).norm(dim=-1))

    def support(self, c: Tensor, eps: float) -> Tensor:
        """An upper bound of ⟨c, Δ⟩ over the set for c [B, n, d], [B]."""
        return ((c * self.c).sum((-1, -2)) + eps * torch.einsum("bnd,bndp->bp", c, self.G).norm(dim=-1)
                + torch.einsum("bnd,bndm->bm", c, self.A).abs().sum(-1)
                + self.grouped(torch.einsum("bnd,bndkg->bkg", c, self.Q).norm(dim=-1))
                + c.flatten(1).norm(dim=-1) * self.ball())

    def with_symbols(self, columns: Tensor, shift: Tensor) -> DeviationSet:
        """The set plus new symbol columns [B, n, d, k] and a constant shift [B, n, d]."""
        return replace(self, A=torch.cat([self.A, columns], -1), c=self.c + shift)

    def with_groups(self, name: str, columns: Tensor, caps: Tensor,
                    budget: Tensor | None = None) -> DeviationSet:
        """The set plus new groups [B, n, d, k, g] from source ``name``, their caps [B, k] and, if they
        share one, their budget [B] (:meth:`grouped`)."""
        old = self.caps if self.caps is not None else caps.new_ones(caps.shape[0], 0)
        budgets = self.budgets | ({name: budget} if budget is not None else {})
        return replace(self, Q=torch.cat([self.Q, columns], -2), caps=torch.cat([old, caps], -1),
                       groups=[*self.groups, *[name] * columns.shape[-2]], budgets=budgets)

    def add_ball(self, name: str, rho: Tensor) -> DeviationSet:
        return replace(self, rho=torch.cat([self.rho, rho[:, None]], -1), sources=[*self.sources, name])


def relu_relaxation(z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) with ``relu(z) − relu(z0) ∈ λ(z − z0) + β + μ[−1, 1]`` for every z ∈ [lo, hi] (z0 in
    it): 1, 0, 0 where lo ≥ 0; 0, 0, 0 where hi ≤ 0; else the parallelogram of least area between
    λz and λz − λ·lo, λ = hi/(hi − lo) (docs/bounds.md §5.1)."""
    unstable = (lo < 0) & (hi > 0)
    lam = torch.where(hi <= 0, 0.0, torch.where(unstable, hi / torch.where(unstable, hi - lo, 1.0), 1.0))
    half = torch.where(unstable, -lam * lo / 2, 0.0)
    beta = torch.where(unstable, lam * z0 - torch.relu(z0) + half, 0.0)
    return lam.to(z0.dtype), beta, half


def _symbols(mask: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """The units of ``mask`` [B, U] as columns: indices [B, k] (k the largest count in the batch) and
    their ``values`` [B, k], 0 where an image has fewer units (a zero column is no symbol)."""
    k = int(mask.sum(-1).max()) if mask.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[:, :k]
    return order, values.gather(-1, order) * mask.gather(-1, order)


def _columns(idx: Tensor, coef: Tensor, n: int, d: int) -> Tensor:
    """Symbol columns [B, n, d, k, ...] from per-unit token indices ``idx`` [B, k] and blocks ``coef``
    [B, k, d, ...] (unit j's block is coef[:, j] in token idx[:, j], zero elsewhere)."""
    B, k = idx.shape
    rest = coef.shape[3:]
    out = coef.new_zeros(B, n, k, d, *rest)
    index = idx.reshape(B, 1, k, *([1] * (1 + len(rest)))).expand(B, 1, k, d, *rest)
    out.scatter_(1, index, coef[:, None])
    return out.transpose(2, 3)


@dataclass
class Diagnostics:
    """Per image, at the class j whose test is closest to failing: the clean margin, and what the
    certificate charges against it (first order, kinks, and each source's remainder), and per block
    the number of unstable neurons and of straddling tokens."""

    margin: Tensor
    first_order: Tensor
    kinks: Tensor
    remainders: dict[str, Tensor]
    unstable: list[Tensor]
    straddling: list[Tensor]

    def columns(self) -> dict[str, Tensor]:
        """Flat per-sample columns: ``margin``, ``first_order``, ``kinks``, ``remainder_<source>`` and
        per block ``unstable_<k>`` and ``straddling_<k>``."""
        out = {"margin": self.margin, "first_order": self.first_order, "kinks": self.kinks}
        out |= {f"remainder_{s}": v for s, v in self.remainders.items()}
        out |= {f"unstable_{k}": u for k, u in enumerate(self.unstable)}
        return out | {f"straddling_{k}": s for k, s in enumerate(self.straddling)}


@dataclass
class NetCertificate:
    lower: Tensor  # [B, C]: lower bounds of every margin change over the ball (+inf at j = y)
    certified: Tensor  # [B] bool
    diagnostics: Diagnostics
    seconds: float


def project(S: DeviationSet, raw: Tensor, R: float, eps: float, k: int) -> tuple[DeviationSet, Tensor]:
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
    tokens' errors are groups of their own sharing the ball's budget (:meth:`DeviationSet.grouped`),
    the other tokens' one Frobenius ball. Returns the set and the straddling tokens per image."""
    r = S.token_radii(eps)  # [B, n]
    nu = raw.norm(dim=-1)  # [B, n]
    u = raw / nu.clamp_min(torch.finfo(raw.dtype).tiny)[..., None]
    inside = nu + r <= R
    wild = ~inside & (r >= SAFE * nu)  # the decomposition needs r < ν
    a_G = torch.einsum("bnd,bndp->bnp", u, S.G)
    a_A = torch.einsum("bnd,bndm->bnm", u, S.A)
    a_Q = torch.einsum("bnd,bndkg->bnkg", u, S.Q)
    a_mid = (u * S.c).sum(-1)
    a_half = eps * a_G.norm(dim=-1) + a_A.abs().sum(-1) + S.grouped(a_Q.norm(dim=-1)) + S.ball()[:, None]
    gap = (nu - r).clamp_min(torch.finfo(raw.dtype).tiny)
    # radial form: z = ν − R + a; tangential: z = R − ν − a (z − z₀ = ±a)
    radial = relu_relaxation(nu - R, nu - R + a_mid - a_half, nu - R + a_mid + a_half)
    tangential = relu_relaxation(R - nu, R - nu - a_mid - a_half, R - nu - a_mid + a_half)
    # ‖e‖ ≤ b²/D + |a|b/R' (+ (ν − R)⁺ b/R') with a² + b² = ‖Δ‖², whose largest value on the unit circle
    # is (1/D + (1/D² + 1/R'²)^½)/2: D = max(R + ν − r, 2(ν − r)), R' = max(R, ν − r)
    D = torch.maximum(R + gap, 2 * gap)
    Rp = gap.clamp_min(R)
    err_radial = (1 / D + (1 / D**2 + 1 / Rp**2).sqrt()) / 2 * r**2 + (nu - R).clamp_min(0) * r / Rp
    # Rx/‖x‖'s second derivative is ≤ (2/√3)R/‖x‖² (docs), and where v can be nonzero
    # b²/(2g) + |a|b/g ≤ 0.809‖Δ‖²/g (g = ν − r)
    err_tangential = (R / (math.sqrt(3) * gap**2)
                      + torch.where(tangential[2] > 0, (0.25 + math.sqrt(5) / 4) / gap, 0.0)) * r**2
    use_t = (nu > R) & (err_tangential < err_radial)
    lam, beta, half = (torch.where(use_t, t, q) for t, q in zip(tangential, radial, strict=True))
    err = torch.where(use_t, err_tangential, err_radial)
    off = inside | wild
    lam, beta, half, err = (torch.where(off, 0.0, t) for t in (lam, beta, half, err))
    straddle = half > 0
    # linear part per token: scale·I + coef·uuᵀ; the radial form's w − w₀ ∈ λa + β + μζ enters as −u·(…),
    # the tangential form's v − v₀ ∈ −λa + β + μζ as −u·(…) too
    scale = torch.where(use_t, R / nu, 1.0)
    coef = torch.where(use_t, -R / nu + lam, -lam)
    scale, coef = torch.where(wild, 0.0, scale), torch.where(wild, 0.0, coef)

    def lin(T: Tensor) -> Tensor:  # [B, K, n, d]
        along = (u[:, None] * T).sum(-1, keepdim=True)
        return scale[:, None, :, None] * T + coef[:, None, :, None] * along * u[:, None]

    out = S.linear(lin)
    n, d = raw.shape[1:]
    idx, mu = _symbols(straddle, half)
    cols = _columns(idx, -mu[..., None] * u.gather(1, idx[..., None].expand(-1, -1, d)), n, d)
    out = out.with_symbols(cols, -beta[..., None] * u)
    whole = S.radius(eps)
    eye = torch.eye(d, dtype=raw.dtype, device=raw.device)
    # the budget is shared by the second-order part only: the first-order (ν − R)⁺ r/R' is ≤ 1e-3 of it
    # on the zoo's tokens, and is kept apart from it in the smooth ball below
    first = torch.where(use_t | off, 0.0, (nu - R).clamp_min(0) * r / Rp)
    idx, radius = _symbols(straddle, err - first)
    _, caps = _symbols(straddle, r**2)
    out = out.with_groups(f"project{k}", _columns(idx, radius[..., None, None] * eye, n, d),
                          torch.where(caps > 0, caps, 1.0), whole**2)
    idx, radius = _symbols(wild, r)
    out = out.with_groups(f"project{k}_wild", _columns(idx, radius[..., None, None] * eye, n, d),
                          torch.ones_like(radius))
    # the other tokens: ‖e‖_F ≤ (Σ_t K_t² ‖Δ_t‖⁴)^½ ≤ max_t K_t · ‖Δ‖_F² (they share the ball's budget)
    K = torch.where(straddle | off, 0.0, (err - first) / r.clamp_min(torch.finfo(raw.dtype).tiny) ** 2)
    smooth = torch.minimum((K * r**2).norm(dim=-1), K.amax(-1) * whole**2) + first.norm(dim=-1)
    return out.add_ball(f"project{k}", smooth), straddle.sum(-1)


def attention(S: DeviationSet, layer, X: Tensor, eps: float, k: int) -> DeviationSet:
    """Attention at its clean input X [B, n, d]: Δ ↦ JΔ + R(Δ), ‖R‖_F ≤ the Taylor remainder of
    docs/bounds.md §2.3 at the set's radius; E's radii grow by a deterministic bound of ‖J‖."""
    r = S.radius(eps)
    J = dot_jacobian(layer, X)  # [B, nd, nd]
    out = S.linear(lambda T: _apply(J, T))
    J_norm = _norm_bound(J)
    out.rho = S.rho * J_norm[:, None]
    return out.add_ball(f"attention{k}", remainder(layer, X, r))


def _apply(J: Tensor, T: Tensor) -> Tensor:
    """J [B, N, N] applied to T [B, K, n, d] (K sets of tokens)."""
    B, K, n, d = T.shape
    return (T.reshape(B, K, n * d) @ J.mT).reshape(B, K, n, d)


def _norm_bound(J: Tensor) -> Tensor:
    """A deterministic upper bound of ‖J‖₂ per batch element: the exact norm (a float64 Gram
    eigenvalue, rounded up) up to nd = 1024, else min(‖J‖_F, √(‖J‖₁‖J‖_∞))."""
    if J.shape[-1] <= 1024:
        return exact_norm(J)
    fro = torch.linalg.matrix_norm(J)
    holder = (J.abs().sum(-2).amax(-1) * J.abs().sum(-1).amax(-1)).sqrt()
    return torch.minimum(fro, holder) * (1 + 1e-12)


def ffn(S: DeviationSet, block, Y: Tensor, lipschitz: float, eps: float) -> tuple[DeviationSet, Tensor]:
    """``x + W₂ relu(W₁x + b₁) + b₂`` at its clean input Y: each neuron's range from the set, the
    unstable ones relaxed with a symbol each (:func:`relu_relaxation`); E's radii times Lip(FFN)
    (every relaxed slope is in [0, 1]). Returns the set and the unstable neurons per image."""
    W1 = block.ffn.up.weight.detach().double()
    b1 = block.ffn.up.bias.detach().double()
    W2 = block.ffn.down.weight.detach().double()
    z0 = Y @ W1.T + b1  # [B, n, w]
    zG = torch.einsum("wd,bndp->bnwp", W1, S.G)
    zA = torch.einsum("wd,bndm->bnwm", W1, S.A)
    zc = S.c @ W1.T
    zQ = torch.einsum("wd,bndkg->bnwkg", W1, S.Q)
    half = (eps * zG.norm(dim=-1) + zA.abs().sum(-1) + S.grouped(zQ.norm(dim=-1))
            + W1.norm(dim=-1) * S.ball()[:, None, None])
    lam, beta, mu = relu_relaxation(z0, z0 + zc - half, z0 + zc + half)
    h = lambda T, lead: torch.einsum("ew,bnw...->bne...", W2, lam.reshape(*lam.shape, *([1] * lead)) * T)
    G = S.G + h(zG, 1)
    A = S.A + h(zA, 1)
    Q = S.Q + h(zQ, 2)
    c = S.c + (lam * zc + beta) @ W2.T
    B, n, w = z0.shape
    unstable = mu > 0
    idx, coef = _symbols(unstable.reshape(B, -1), mu.reshape(B, -1))
    tokens, neurons = idx // w, idx % w
    cols = _columns(tokens, coef[..., None] * W2.T[neurons], n, Y.shape[-1])
    out = replace(S, G=G, A=torch.cat([A, cols], -1), Q=Q, c=c, rho=S.rho * lipschitz)
    return out, unstable.reshape(B, -1).sum(-1)


def _only(S: DeviationSet, name: str) -> DeviationSet:
    """S with only the groups of source ``name`` (their Q left out: :meth:`DeviationSet.grouped` reads
    names, caps and budgets only)."""
    keep = [j for j, g in enumerate(S.groups) if g == name]
    return replace(S, groups=[name] * len(keep), caps=S.caps[:, keep])


class TaylorNet:
    """The network's clean trace at a batch of images, and its certificate at any ε."""

    def __init__(self, net: ViT, images: Tensor, labels: Tensor):
        check_certifiable(net)
        if net.head.weight.dtype != torch.float64:
            raise InputError("certify a float64 network (models.load_vit loads one)")
        self.net, self.labels = net, labels
        x = images.to(torch.float64)
        with torch.no_grad():
            X = net.tokens(x)
            self.raw, self.inputs, self.mids = [], [], []
            for block in net.blocks:
                self.raw.append(X)
                Xp = block.prepare(X)
                self.inputs.append(Xp)
                Y = block.attn(Xp)
                self.mids.append(Y)
                X = block.ffn(Y)
            self.features = X.mean(-2)
            self.logits = net.head(self.features)
        self.layers = net.attention_layers()
        self.lip = net.ffn_lipschitz()
        pixels = net.cfg.image ** 2
        basis = torch.eye(pixels, dtype=torch.float64).reshape(pixels, net.cfg.image, net.cfg.image)
        with torch.no_grad():
            M = net.patches(basis) @ net.embedding_matrix()  # [P, n, d]: pixel p's change of each token
        self.embed = M.permute(1, 2, 0).contiguous()  # [n, d, P]

    def certify(self, eps: float) -> NetCertificate:
        """The certificate at image radius ``eps`` for every image of the batch."""
        start = time.perf_counter()
        with torch.no_grad():
            stages = self.stages(eps)
            S = stages[-1][1]
            unstable = [count for name, _, count in stages if name.startswith("ffn")]
            straddling = [count for name, _, count in stages if name.startswith("project")]
            lower, cert, diag = self._margins(S, eps, unstable, straddling)
        return NetCertificate(lower, cert, diag, time.perf_counter() - start)

    def stages(self, eps: float) -> list[tuple[str, DeviationSet, Tensor | None]]:
        """The deviation set after every stage (``project<k>``, ``attention<k>``, ``ffn<k>``) with the
        stage's count of relaxed units (straddling tokens, unstable neurons; None for attention)."""
        B = len(self.labels)
        n, d, P = self.embed.shape
        like = self.logits
        S = DeviationSet(self.embed.expand(B, n, d, P), like.new_zeros(B, n, d, 0),
                         like.new_zeros(B, n, d, 0, d), like.new_zeros(B, n, d), like.new_zeros(B, 0))
        out = []
        for k, block in enumerate(self.net.blocks):
            S, s = project(S, self.raw[k], self.net.cfg.R, eps, k)
            out.append((f"project{k}", S, s))
            S = attention(S, self.layers[k], self.inputs[k], eps, k)
            out.append((f"attention{k}", S, None))
            S, u = ffn(S, block, self.mids[k], self.lip[k], eps)
            out.append((f"ffn{k}", S, u))
        return out

    def _margins(self, S: DeviationSet, eps: float, unstable, straddling):
        W = self.net.head_matrix()
        n = S.c.shape[1]
        y = self.labels
        rows = (W[y][:, None, :] - W[None]) / n  # [B, C, d]: the functional per token of m_j
        first = eps * torch.einsum("bcd,bndp->bcp", rows, S.G).norm(dim=-1)
        kinks = torch.einsum("bcd,bndm->bcm", rows, S.A).abs().sum(-1)
        shift = torch.einsum("bcd,bnd->bc", rows, S.c)
        fro = rows.norm(dim=-1) * math.sqrt(n)  # ‖c_j‖_F over the n tokens
        balls = fro[..., None] * S.rho[:, None, :]  # [B, C, S]
        groups = torch.einsum("bcd,bndkg->bckg", rows, S.Q).norm(dim=-1)  # [B, C, k]
        names = list(dict.fromkeys(S.sources + S.groups))
        of = lambda name: [j for j, s in enumerate(S.groups) if s == name]
        balls = torch.stack([balls[..., [i for i, s in enumerate(S.sources) if s == name]].sum(-1)
                             + _only(S, name).grouped(groups[..., of(name)]) for name in names], -1) \
            if names else balls
        lower = shift - first - kinks - balls.sum(-1)
        own = self.logits.gather(-1, y[:, None])
        margins = own - self.logits
        total = margins + lower
        slack = ROUND * (own.abs() + self.logits.abs() + first + kinks + shift.abs() + balls.sum(-1))
        ok = (total > slack).scatter(-1, y[:, None], True)
        certified = ok.all(-1) & (self.logits.argmax(-1) == y)
        worst = (total - slack).scatter(-1, y[:, None], math.inf).argmin(-1, keepdim=True)
        pick = lambda T: T.gather(-1, worst)[:, 0]
        diag = Diagnostics(pick(margins), pick(first), pick(kinks - shift),
                           {s: pick(balls[..., i]) for i, s in enumerate(names)}, unstable, straddling)
        return lower.scatter(-1, y[:, None], math.inf), certified, diag
