"""``taylor_net``: a whole-network certificate of a lofast ViT that is exact to first order
(docs/bounds.md §5.1; this suite's, after SPEC §5.1).

For an image x and a perturbation δ (‖δ‖₂ ≤ ε) every intermediate deviation Δ = T(x + δ) − T(x) is
held in one set (:class:`bounds.network.zonotope.DeviationSet`), pushed forward stage by stage from
the pixels to the margins:

    Δ = G δ + A ζ + Σ_j Q_j η_j + c + E,    ‖δ‖₂ ≤ ε,   ζ ∈ [−1, 1]^m,   ‖η_j‖₂ ≤ 1,   ‖E‖_F ≤ Σ_s ρ_s,

with G the exact first-order part (the product of every smooth stage's Jacobian at the clean image,
and of each kink's slope), A one column per unit that can cross a kink (a ReLU neuron, a token whose
ball straddles LayerProject's sphere: a zonotope's symbols, shared by every later stage so that their
signs cancel), Q_j a straddling token's own error ball, c the constant shifts of the relaxations, and
E the remainders of the smooth stages, one Frobenius ball per source s. Each stage:

* LayerProject, per token (:func:`project`): the identity where the token's ball stays inside the
  sphere; else the radial or tangential form of docs/bounds.md §5.1, a linear part, a ReLU of the
  radial change a = uᵀΔ (relaxed as any ReLU) and a second-order error;
* attention (:func:`attention`): its exact Jacobian at the clean input, applied densely on small
  layers and as an operator on large ones, and the Taylor remainder of docs/bounds.md §2.3
  (``bounds.remainder.remainder``) at the radius of its input set — or LoFAST's Δ₁ and δ₂ (``split``);
* the FFN x + W₂ relu(W₁x + b₁) + b₂ (:func:`ffn`): linear, but for the neurons whose range contains
  0, relaxed by the parallelogram of least area (DeepZ, Singh et al. 2018) with a symbol of their own;
* mean pooling and the head: linear.

Each margin m_j = (e_y − e_j)ᵀ logits is then bounded from below twice, by the set's support and by
one pass back through the stages (:func:`backward`, CROWN's slopes on the set's ranges), and takes
the better; images left uncertified get a second pass with every unit's range refined by the backward
pass. An image is certified when every m_j(x) beats its bound's loss with room for float64 rounding.
Every norm in it is an exact float64 Gram eigenvalue rounded up or a deterministic upper bound from
exact factors: the certificate is ``deterministic``. Built on torch alone (no auto_LiRPA).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from models import DotMHA, InputError
from models.structured import dot_jacobian
from models.vit import ViT

from ..certificates import gram_norm
from ..lofast import delta2_xi, xi
from ..remainder import remainder
from .activations import gelu_bounds, relaxation
from .constants import net_constants
from .layernorm import NormRecord, layer_norm
from .propagated import check_stages
from .zonotope import DeviationSet, along_u, columns, relu_relaxation, symbols

# Room for float64 rounding, relative to the magnitudes of the margin and of every term of its loss:
# the set is pushed through ≤ a few dozen products of inner size ≤ 10⁴ (each off by ≤ 10⁴·u relative to
# the product of magnitudes, u = 1.1e-16), so 1e-9 leaves three orders of magnitude to spare.
ROUND = 1e-9
# A straddling token needs its radius below its clean norm (the decomposition's remainder blows up at
# the origin); beyond it the token is bounded by LayerProject's 1-Lipschitz property alone.
SAFE = 0.999
# the share of the first order (‖J‖·r) below which attention's global remainder is taken as it is,
# without the local and first-order ones (docs/bounds.md §5, "What a network certificate skips"): on
# the margin-trained digits models it is 2e-6 of it at ε 0.02, the local one 6× smaller still
NEGLIGIBLE = 1e-5
# the largest n·d for which attention's Jacobian is formed densely: applied as one matrix product,
# its norm bounded from its entries too and E kept per token through its d×d blocks. Beyond it the
# Jacobian is applied as an operator (:func:`jacobian_apply`): at n·d = 512 (the digits models) that is
# 1.2–1.3× faster an image with the same verdicts on 750 image-ε pairs; at 128 (the tests' random
# ViTs) the dense form is 1.35× faster and its bounds tighter
DENSE_J = 256
# the largest n·d for which attention's Jacobian is also formed for its norm alone (applied as an
# operator above DENSE_J): ‖J‖₂ from its Gram's exact float64 eigenvalue, which E's radii and the route
# cross, and its d×d blocks for E's per-token bounds. On the digits models (n·d = 512) the bound from
# factors was 2.2× ‖J‖₂ a block, and E grew by that at every attention
NORM_J = 1024


@dataclass
class Diagnostics:
    """Per image, at the class j whose test is closest to failing: the clean margin, the split of the
    bound that margin took (first order, kinks, and each source's remainder: the backward pass's where
    ``backward`` says its bound was the better one, else the forward set's; they add up to what
    ``lower`` lost), and per block the number of unstable neurons and of straddling tokens."""

    margin: Tensor
    first_order: Tensor
    kinks: Tensor
    remainders: dict[str, Tensor]
    unstable: list[Tensor]
    straddling: list[Tensor]
    backward: Tensor | None = None

    @staticmethod
    def cat(parts: list[Diagnostics]) -> Diagnostics:
        """The diagnostics of consecutive batches as one (a source missing in a batch counts 0)."""
        names = list(dict.fromkeys(k for p in parts for k in p.remainders))
        zero = lambda p: torch.zeros_like(p.margin)
        join = lambda f: torch.cat([f(p) for p in parts])
        return Diagnostics(join(lambda p: p.margin), join(lambda p: p.first_order), join(lambda p: p.kinks),
                           {k: join(lambda p, k=k: p.remainders.get(k, zero(p))) for k in names},
                           [torch.cat(u) for u in zip(*(p.unstable for p in parts), strict=True)],
                           [torch.cat(s) for s in zip(*(p.straddling for p in parts), strict=True)],
                           join(lambda p: p.backward))

    def columns(self) -> dict[str, Tensor]:
        """Flat per-sample columns: ``margin``, ``first_order``, ``kinks``, ``remainder_<source>`` and
        per block ``unstable_<k>`` and ``straddling_<k>``."""
        out = {"margin": self.margin, "first_order": self.first_order, "kinks": self.kinks,
               "backward": self.backward}
        out |= {f"remainder_{s}": v for s, v in self.remainders.items()}
        out |= {f"unstable_{k}": u for k, u in enumerate(self.unstable)}
        return out | {f"straddling_{k}": s for k, s in enumerate(self.straddling)}

    def scattered(self, rows: Tensor, base: Diagnostics) -> Diagnostics:
        """``base`` with its rows ``rows`` [k] replaced by these diagnostics (of k images); a source
        missing from one counts 0."""
        return base._merged(self, lambda b, v: b.index_put((rows,), v))

    def where(self, mask: Tensor, other: Diagnostics) -> Diagnostics:
        """Per image, these diagnostics where ``mask`` [B] holds, ``other``'s elsewhere (a source
        missing from one counts 0)."""
        return self._merged(other, lambda a, b: torch.where(mask, a, b))

    def _merged(self, other: Diagnostics, f: Callable[[Tensor, Tensor], Tensor]) -> Diagnostics:
        """``f`` of these diagnostics' and ``other``'s, field by field (a source missing from one counts
        0 there; ``backward`` None where either has none)."""
        rem = lambda d, k: d.remainders.get(k, torch.zeros_like(d.margin))
        names = list(dict.fromkeys([*self.remainders, *other.remainders]))
        both = self.backward is not None and other.backward is not None
        return Diagnostics(f(self.margin, other.margin), f(self.first_order, other.first_order),
                           f(self.kinks, other.kinks), {k: f(rem(self, k), rem(other, k)) for k in names},
                           [f(a, b) for a, b in zip(self.unstable, other.unstable, strict=True)],
                           [f(a, b) for a, b in zip(self.straddling, other.straddling, strict=True)],
                           f(self.backward, other.backward) if both else None)


@dataclass
class NetCertificate:
    lower: Tensor  # [B, C]: lower bounds of every margin change over the ball (+inf at j = y)
    certified: Tensor  # [B] bool
    diagnostics: Diagnostics
    seconds: float
    verified: Tensor  # [B, C] bool: margin j proved positive with its rounding slack (True at j = y)
    image_seconds: Tensor  # [B]: each image's share of ``seconds`` (its own on a CPU)


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
    a_G = along_u(u, S.G)
    a_A = torch.einsum("bnd,bndm->bnm", u, S.A)
    a_Q = torch.einsum("bnd,bndkg->bnkg", u, S.Q)
    a_mid = (u * S.c).sum(-1)
    a_half = eps * a_G.norm(dim=-1) + a_A.abs().sum(-1) + S.grouped(a_Q.norm(dim=-1)) + S.token_ball()
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

    # L_t = scale·I + coef·uuᵀ; the Gram is not carried: attention, next, mixes the tokens
    out = replace(S, gram=None).rank_one(scale, coef, u, -beta[..., None] * u)
    idx, mu = symbols(straddle, half)
    along = u.gather(1, idx[..., None].expand(-1, -1, d))
    out = out.with_symbols(columns(idx, -mu[..., None] * along, n, d))
    # the budget is shared by the second-order part only: the first-order (ν − R)⁺ r/R' is ≤ 1e-3 of it
    # on the zoo's tokens, and is kept apart from it in the smooth ball below
    first = torch.where(use_t | off, 0.0, (nu - R).clamp_min(0) * r / Rp)
    grouped = ~off if every else straddle
    # each group's error ball in its frame's columns (R^d, or the first block's span), and the part of
    # the error the frame can miss by rounding (κ of its size), which joins the smooth ball below
    frame, kappa = error_frame(u, span, grouped | wild)
    pick = lambda idx: frame.gather(1, idx[..., None, None].expand(-1, -1, *frame.shape[2:]))
    idx, radius = symbols(grouped, err - first)
    _, caps = symbols(grouped, r**2)
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
    # the other tokens: ‖e‖_F ≤ (Σ_t K_t² ‖Δ_t‖⁴)^½ ≤ max_t K_t · ‖Δ‖_F² (they share the ball's budget)
    K = torch.where(grouped | off, 0.0, (err - first) / r.clamp_min(torch.finfo(raw.dtype).tiny) ** 2)
    smooth = (torch.minimum((K * r**2).norm(dim=-1), K.amax(-1) * whole**2) + first.norm(dim=-1)
              + miss.norm(dim=-1))
    if log is not None:  # what the backward pass needs (:func:`backward`)
        sign = torch.where(use_t, -1.0, 1.0).to(raw.dtype)
        lo = torch.where(use_t, tangential_lo, radial_lo)
        hi = torch.where(use_t, tangential_hi, radial_hi)
        # the linear part L_t = base_t·(I − [tangential]·u_tu_tᵀ) (0 at a wild token), symmetric, kept
        # as its two scalars: the backward pass applies it through u_tᵀΛ_t, O(d) a functional
        base = torch.where(wild, 0.0, torch.where(use_t, R / nu, 1.0))
        log.append({"kind": "project", "name": f"project{k}", "base": base, "tangent": use_t.to(raw.dtype),
                    "u": u, "sign": sign,
                    "z0": sign * (nu - R),
                    "lo": lo, "hi": hi, "relu": ~off,
                    "second": torch.where(off, 0.0, err - order1),
                    "first": order1, "caps": torch.where(off, 1.0, r**2), "budget": whole**2,
                    "wild": torch.where(wild, r, 0.0)})
    # LayerProject is 1-Lipschitz per token: the projected set's radius is at most the input's
    # per token, a smooth token's error is its own err (a grouped token's error, both its parts, and a
    # wild token's are groups); E crosses the
    # linear part at ‖L_t‖ ≤ 1 as it does in norm
    own = torch.where(grouped | off, first, err) + miss
    return replace(out.add_ball(f"project{k}", smooth, own), route=whole), straddle.sum(-1)


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


# how attention is split into a linear part and a remainder (docs/bounds.md §5.1, "what the attention
# bound buys"): ``taylor`` its Jacobian and the Taylor remainder (§2.3); ``lofast`` LoFAST's split,
# Δ₁ (attention frozen at P_l(X)) and δ₂ of eq. 28 (ξ_l: no Lanczos), a first-order remainder;
# ``lofast_half`` the same with softmax ½-Lipschitz (§2.2)
SPLITS = ("taylor", "lofast", "lofast_half")
# ``best``: each margin takes the better of these splits' sound bounds (docs/bounds.md §5.1, "The
# best split"); the second runs only on the images the first leaves uncertified. Measured on the
# Fashion-MNIST models at ε ≥ 0.05 the halved δ₂ certifies images the Taylor split does not, and at
# ε ≤ 0.02 the reverse; δ₂ itself is never below its half, so it is not tried
BEST = "best"
BEST_OF = ("taylor", "lofast_half")


def attention(S: DeviationSet, layer: DotMHA, X: Tensor, k: int, log: list | None = None,
              split: str = "taylor", quadratic: bool | None = None,
              cache: dict | None = None) -> DeviationSet:
    """Attention at its clean input X [B, n, d]: Δ ↦ J[Δ] + R(Δ) with J the exact Jacobian
    (:func:`jacobian_apply`) and ‖R‖_F ≤ the Taylor remainder of docs/bounds.md §2.3 at the set's
    radius (or, with ``split`` lofast, LoFAST's Δ₁ and δ₂); E's radii and the route grow by
    :func:`jacobian_bound`. ``quadratic`` as in ``bounds.remainder.remainder`` (the second pass asks
    for the quadratic form, docs/bounds.md §2.3.2); ``cache`` keeps its parts that depend on X alone
    (``bounds.remainder.quadratic_remainder``)."""
    r = S.route  # the radius LayerProject left (bounds.network.zonotope.DeviationSet.radius)
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
        parts["xi"] = xi(layer, X)  # ξ_l: the remainder's core and the Jacobian bound's, formed once
    # for the norm alone between DENSE_J and NORM_J (the pass still applies the operator)
    dense = J if J is not None or split != "taylor" or N > NORM_J else dot_jacobian(layer, X)
    bound = jacobian_bound(layer, X, parts, dense, logits=split == "taylor")
    if split == "taylor":
        rest = remainder(layer, X, r, core=parts["xi"], quadratic=quadratic, cache=cache,
                         enough=NEGLIGIBLE * bound * r)
    out = replace(out, rho=S.rho * bound[:, None], route=bound * r + rest,
                  tok=_mix_tokens(layer, parts, dense, S.tok, split))
    if log is not None:
        log.append({"kind": "attention", "name": f"attention{k}", "layer": layer, "X": X, "J": J,
                    "rho": rest, "parts": parts, "split": split})
    return out.add_ball(f"attention{k}", rest)


def _mix_tokens(layer: DotMHA, parts: dict[str, Tensor], J: Tensor | None, tok: Tensor | None,
                split: str) -> Tensor | None:
    """E's per-token bounds after attention's linear part, [B, n]: ‖(ME)_t‖ ≤ Σ_s ‖M_ts‖ ‖E_s‖ with
    M_ts the d×d block of the linear part from token s to token t, ‖M_ts‖₂ ≤ ‖M_ts‖_F for the dense
    Jacobian, ≤ ‖H‖δ_ts + Σ_l p_lts‖C_l‖ for LoFAST's Δ₁; None where neither is at hand (attention's
    Jacobian as an operator)."""
    if tok is None or (split == "taylor" and J is None):
        return None
    B, n = tok.shape
    if split == "taylor":
        blocks = J.reshape(B, n, -1, n, J.shape[-1] // n).square().sum((2, 4)).sqrt()
    else:
        blocks = torch.einsum("bhts,h->bts", parts["P"], layer.C_norm())
        blocks = blocks + layer.H_norm * torch.eye(n, dtype=tok.dtype, device=tok.device)
    return torch.einsum("bts,bs->bt", blocks, tok) * (1 + 1e-12)  # the sums' own rounding


def attention_parts(layer: DotMHA, X: Tensor) -> dict[str, Tensor]:
    """What J_F(X) is made of, per head: P, the queries and keys (biases included), X W^V, and the
    weights stacked for one product ([W^Q | W^K | W^V] as [d, 3·h·d_h], W^O as [h·d_h, d])."""
    Q, K = layer.queries_keys(X)
    stacked, W_o = layer.stacked_weights()
    return {"P": layer.attention(X), "Q": Q, "K": K, "V": torch.einsum("bnd,hde->bhne", X, layer.W_v),
            "W": stacked, "W_o": W_o}


def jacobian_apply(layer: DotMHA, parts: dict[str, Tensor], T: Tensor, logits: bool = True) -> Tensor:
    """J_F(X)[Γ] for K directions Γ at once, stored as columns: T [B, n, d, K] → [B, n, d, K]
    (docs/bounds.md §2.3): ``HΓ + Σ_l (P_l Γ W^V_l + dP_l[Γ] X W^V_l) W^O_l``, dP_l[Γ] row i
    = (diag p_i − p_i p_iᵀ) dS_i, dS_l = (Γ W^Q_l K_lᵀ + Q_l (Γ W^K_l)ᵀ)/√d_h. A value bias cancels
    (rows of dP_l sum to 0). It costs O(h(n d d_h + n² d_h) + n d²) a direction where the dense
    Jacobian costs n²d²; every step is a batched matrix product with the K directions as its columns
    (1.5× faster than with them as rows, which had to be copied into place at every step: 77 against
    113 ms for K = 800 on the Fashion-MNIST layers). Without ``logits`` it is LoFAST's Δ₁ (P_l held
    at P_l(X)): ``HΓ + Σ_l P_l Γ C_l``."""
    B, n, _, K = T.shape
    h, e = layer.h, layer.d_h
    P, Qx, Kx, V = parts["P"], parts["Q"], parts["K"], parts["V"]  # [B, h, n, n], [B, h, n, e] ×3
    W = parts["W"] if logits else parts["W"][:, 2 * h * e:]  # [W^Q | W^K | W^V], or W^V alone
    moved = (W.mT @ T).reshape(B, n, -1, h, e, K)  # per token [3he, d] @ [d, K]
    # P_l (Γ W^V): P [n, n] on every direction's [n, e]
    dV = moved[:, :, -1].permute(0, 2, 1, 3, 4)  # [B, h, n, e, K]
    out = (P @ dV.reshape(B, h, n, e * K)).reshape(B, h, n, e, K)
    if logits:
        dQ, dK = (moved[:, :, i].permute(0, 2, 1, 3, 4) for i in range(2))
        out = out + _logit_part(P, Qx, Kx, V, dQ, dK)
    out = parts["W_o"].mT @ out.permute(0, 2, 1, 3, 4).reshape(B, n, h * e, K)
    return out + layer.H_norm * T if layer.H_norm else out


def sparse_apply(layer: DotMHA, parts: dict[str, Tensor], gamma: Tensor, tokens: Tensor,
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
    P, V = parts["P"], parts["V"]  # [B, h, n, n], [B, h, n, e]
    B, h, n, _ = P.shape
    K = tokens.shape[1]
    Pt = P.gather(-1, tokens[:, None, None, :].expand(B, h, n, K))  # [B, h, i, k]: p_it
    # the result is built in its own layout [B, i, f, k] by one multiply-add per head and term: a
    # contraction over the h heads as one einsum was a batch of tiny products and a copy into this
    # layout, 3× slower on the digits models' sets (K ≈ 200 columns)
    CT = layer.C().mT @ gamma[:, None]  # [B, h, f, k]: γᵀC_l
    out = Pt[:, 0, :, None, :] * CT[:, 0, None]
    for head in range(1, h):
        out.addcmul_(Pt[:, head, :, None, :], CT[:, head, None])
    if logits:
        root = math.sqrt(layer.d_h)
        q = (parts["Q"] @ layer.W_k.mT / root) @ gamma[:, None]  # [B, h, i, k]: q_i·γ
        u = (parts["K"] @ layer.W_q.mT / root) @ gamma[:, None]  # [B, h, j, k]: u_j·γ
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


def jacobian_bound(layer: DotMHA, X: Tensor, parts: dict[str, Tensor], J: Tensor | None = None,
                   logits: bool = True) -> Tensor:
    """A deterministic upper bound of ‖J_F(X)‖ from exact factors (and, given the dense J, the smaller
    of that and (‖J‖₁‖J‖_∞)^½), [B]:
    ``‖H‖ + Σ_l ‖P_l‖‖C_l‖ + Σ_l ½ ξ_l ‖X C_l‖/√d_h`` (‖P_l Γ C_l‖_F ≤ ‖P_l‖‖Γ‖_F‖C_l‖; softmax's Jacobian
    is ½-bounded row by row, §2.2, so ‖dP_l[Γ]‖_F ≤ ½‖dS_l‖_F ≤ ½ξ_l‖Γ‖_F/√d_h). ξ_l is ``parts["xi"]``
    where :func:`attention` formed it."""
    P = gram_norm(parts["P"].mT @ parts["P"])  # [B, h]
    bound = layer.H_norm + (P * layer.C_norm()).sum(-1)  # ≥ ‖Δ₁‖ (LoFAST eq. 12), all of it without logits
    if logits:
        core = parts["xi"] if "xi" in parts else xi(layer, X)
        bound = bound + (0.5 * core * layer.XC_norm(X)).sum(-1) / math.sqrt(layer.d_h)
    if J is not None:  # the sum above is loose on saturated heads; (‖J‖₁‖J‖_∞)^½ ≥ ‖J‖₂ is not, and
        # ‖J‖₂ itself is its Gram's top eigenvalue (§2.4, exact)
        N = J.shape[-1]
        holder = (J.abs().sum(-2).amax(-1) * J.abs().sum(-1).amax(-1)).sqrt() * (1 + N * 2.3e-16)
        bound = torch.minimum(bound, torch.minimum(holder, gram_norm(J.mT @ J)))
    return bound


@dataclass
class Mapped:
    """A set under a per-token map Δ_t ↦ L_tΔ_t + shift_t not yet applied, with symbol columns ``new``
    added after it: the last FFN's, which only the margins read, as functionals pulled back through
    L (:meth:`TaylorNet._margins`), so that the set itself is never mapped (a quarter of a first
    pass's products on the 1-block digits model). ``S`` holds the set before the map with E's radii,
    route and per-token bounds of after it; L_t = I + W₂ diag(λ_t) W₁, formed for its norm (which E
    crosses, :func:`ffn`), is applied to the functionals through its factors (:meth:`pull`) and to the
    set only by :meth:`formed`, the set after the map."""

    S: DeviationSet
    W1: Tensor  # [w, d]
    W2: Tensor  # [d, w]
    lam: Tensor  # [B, n, w]: the neurons' slopes
    shift: Tensor  # [B, n, d]
    new: Tensor  # [B, n, d, m']
    L: Tensor  # [B, n, d, d]: I + W₂ diag(λ_t) W₁ per token

    def pull(self, c: Tensor) -> Tensor:
        """L_tᵀc at every token for functionals c [B, C, d]: c + W₁ᵀ diag(λ_t) W₂ᵀc, [B, C, n, d]."""
        return c[:, :, None, :] + ((c @ self.W2)[:, :, None, :] * self.lam[:, None]) @ self.W1

    def formed(self) -> DeviationSet:
        return self.S.per_token(self.L, self.shift).with_symbols(self.new)


def ffn(S: DeviationSet, block, Y: Tensor, lipschitz: float, eps: float,
        log: list | None = None, refine: Refine | None = None,
        form: bool = True, residual: bool = True) -> tuple[DeviationSet | Mapped, Tensor]:
    """``x + W₂ relu(W₁x + b₁) + b₂`` at its clean input Y: each neuron's range from the set (the
    first-order part through the token Grams, ‖(W₁G_t)_i‖² = w_iᵀ G_tG_tᵀ w_i), the unstable ones
    relaxed with a symbol each (:func:`relu_relaxation`); the rest as the per-token map
    L_t = I + W₂ diag(λ_t) W₁, which E's radii cross at max_t ‖L_t‖₂ (per token where E is kept per
    token) and the route at Lip(FFN) (every slope is in [0, 1]).
    Returns the set (without ``form``, as :class:`Mapped`) and the unstable neurons per image."""
    W1 = block.ffn.up.weight.detach().double()
    b1 = block.ffn.up.bias.detach().double()
    W2 = block.ffn.down.weight.detach().double()
    z0 = Y @ W1.T + b1  # [B, n, w]
    if form or S.gram is not None:  # the Gram per token is kept for the next block's radii
        first = torch.einsum("wd,bnde,we->bnw", W1, S.token_grams(), W1).clamp_min(0).sqrt()
    else:  # the last block: ‖(W₁G_t)_i‖ from W₁G_t itself, 2/3 of the Gram's products
        first = torch.linalg.vector_norm(torch.einsum("wd,bndp->bnwp", W1, S.G), dim=-1)
    zA = torch.einsum("wd,bndm->bnwm", W1, S.A)
    zQ = torch.einsum("wd,bndkg->bnwkg", W1, S.Q)
    zc = S.c @ W1.T
    half = (eps * first + zA.abs().sum(-1) + S.grouped(zQ.norm(dim=-1))
            + W1.norm(dim=-1) * S.token_ball()[..., None])
    # the Gram's square root carries its own rounding: widen each range by a relative 1e-12
    half = half * (1 + 1e-12)
    B, n, w = z0.shape
    d = Y.shape[-1]
    lo, hi = z0 + zc - half, z0 + zc + half
    if refine is not None:  # the neurons that can cross 0, again by the backward pass
        lo, hi = _refine_neurons(refine, W1, z0, lo, hi)
    act = block.ffn.activation
    lam, beta, mu = relaxation(act, z0, lo, hi)
    if log is not None:
        log.append({"kind": "ffn", "act": act, "W1": W1, "W2": W2, "z0": z0, "lo": lo, "hi": hi,
                    "residual": residual})
    unstable = mu > 0
    idx, coef = symbols(unstable.reshape(B, -1), mu.reshape(B, -1))
    # E enters the relaxed neurons through z − z₀ = W₁Δ, so it leaves as L_tE_t, L_t = I + W₂ diag(λ_t) W₁:
    # ‖L_t‖₂ per token (exact float64 Gram eigenvalues, d×d), never above Lip(FFN). The route is a
    # bound of the true deviation, which the relaxation's shifts and symbols add to: it keeps Lip(FFN)
    L = torch.einsum("dw,bnw,we->bnde", W2, lam, W1)
    if residual:  # without it, the branch a standard block's residual adds (Mapped is for the residual)
        L = L + torch.eye(d, dtype=W1.dtype, device=W1.device)
    own = torch.minimum(gram_norm(L.mT @ L), torch.as_tensor(lipschitz, dtype=W1.dtype))  # [B, n]
    tok = None if S.tok is None else S.tok * own  # the FFN acts per token
    out = Mapped(replace(S, rho=S.rho * own.amax(-1)[:, None], route=S.route * lipschitz, tok=tok), W1, W2,
                 lam, beta @ W2.T, columns(idx // w, coef[..., None] * W2.T[idx % w], n, d), L)
    return out.formed() if form else out, unstable.reshape(B, -1).sum(-1)


# a callable (functionals [B, C, n, d], their forward ranges lo, hi [B, C]) → tighter (lo, hi): the
# backward pass over the stages so far (:meth:`TaylorNet.stages`)
Refine = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
# the most neurons of one FFN whose ranges the backward pass refines (those nearest to stable first):
# each costs two functionals through every stage before it
REFINE_LIMIT = 1024


def _refine_neurons(refine: Refine, W1: Tensor, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """lo, hi [B, n, w] of z = W₁x + b₁ with the unstable neurons' ranges intersected with the
    backward pass's (at most :data:`REFINE_LIMIT` an image, those nearest to stable)."""
    B, n, w = z0.shape
    unstable = ((lo < 0) & (hi > 0)).reshape(B, -1)
    if not unstable.any():
        return lo, hi
    near = torch.minimum(-lo, hi).reshape(B, -1).masked_fill(~unstable, math.inf)
    k = min(int(unstable.sum(-1).max()), REFINE_LIMIT)
    idx = near.topk(k, dim=-1, largest=False).indices  # [B, k]
    valid = unstable.gather(-1, idx)
    units = columns(idx // w, W1[idx % w], n, W1.shape[-1]).movedim(-1, 1)  # [B, k, n, d]
    flat_lo, flat_hi = lo.reshape(B, -1).clone(), hi.reshape(B, -1).clone()
    base, old_lo, old_hi = (t.gather(-1, idx) for t in (z0.reshape(B, -1), flat_lo, flat_hi))
    new_lo, new_hi = refine(units, old_lo - base, old_hi - base)  # of the deviation z − z₀
    flat_lo.scatter_(-1, idx, torch.where(valid, base + new_lo, old_lo))
    flat_hi.scatter_(-1, idx, torch.where(valid, base + new_hi, old_hi))
    return flat_lo.reshape(B, n, w), flat_hi.reshape(B, n, w)


def relu_bounds(g: Tensor, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(s, b) with ``g·(relu(z) − relu(z0)) ≥ g·s·(z − z0) + g·b`` for every z ∈ [lo, hi] (CROWN's
    relaxation, Zhang et al. 2018, chosen per sign of the coefficient g): where g ≥ 0 the lower line
    αz (α = 1 if hi ≥ −lo, else 0), where g < 0 the chord λ(z − lo), λ = hi/(hi − lo); exact where
    the unit is stable (docs/bounds.md §5.1)."""
    active, dead = lo >= 0, hi <= 0
    unstable = ~active & ~dead
    lam = hi / torch.where(unstable, hi - lo, 1.0)
    alpha = (hi >= -lo).to(g.dtype)
    up = g < 0
    s = torch.where(active, 1.0, torch.where(dead, 0.0, torch.where(up, lam, alpha)))
    b = torch.where(unstable, torch.where(up, lam * (z0 - lo), alpha * z0) - torch.relu(z0), 0.0)
    return s.to(g.dtype), b


def backward(log: list[dict], Lam: Tensor, embed: Tensor, eps: float,
             split: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Lower bounds of ⟨Λ_j, Δ_N⟩ for C functionals Λ [B, C, n, d] on the last tokens, by one pass
    back through the stages of ``log`` (docs/bounds.md §5.1, "the backward pass"): every smooth stage
    by its exact Jacobian (transposed) with its remainder charged at its own coefficients, every
    kink by :func:`relu_bounds` on the ranges of the forward set. Returns (bounds [B, C], the sum
    of the magnitudes of their terms, for the rounding slack); ``split`` (a dict) receives what the
    bound loses where: ``first_order``, ``kinks`` (net of the relaxations' offsets) and each stage's
    remainder by its source's name, each [B, C] (the diagnostics where this bound is the better)."""
    B, C = Lam.shape[:2]
    const = Lam.new_zeros(B, C)
    mag = Lam.new_zeros(B, C)
    if split is not None:
        split["kinks"] = Lam.new_zeros(B, C)
    skips: list[Tensor] = []  # the functionals on a residual's input, from its join to its fork
    for rec in reversed(log):
        if isinstance(rec, dict) and rec["kind"] == "join":  # out = x + branch(x): Λ reaches x both ways
            skips.append(Lam)
        elif isinstance(rec, dict) and rec["kind"] == "fork":
            # a fork whose join is not in the log (a unit inside the branch, refined) has no skip
            Lam = Lam + skips.pop() if skips else Lam
        elif isinstance(rec, NormRecord):
            Lam, charge = rec.step(Lam)
            const, mag = const - charge, mag + charge
            if split is not None:
                split[rec.name] = charge
        elif rec["kind"] == "ffn":
            g = Lam @ rec["W2"]  # [B, C, n, w]
            bounds_of = relu_bounds if rec["act"] == "relu" else gelu_bounds
            s, b = bounds_of(g, *(rec[f][:, None] for f in ("z0", "lo", "hi")))
            const = const + (g * b).sum((-1, -2))
            if split is not None:
                split["kinks"] = split["kinks"] - (g * b).sum((-1, -2))
            mag = mag + (g * b).abs().sum((-1, -2))
            Lam = Lam + (g * s) @ rec["W1"] if rec["residual"] else (g * s) @ rec["W1"]
        elif rec["kind"] == "attention":
            charge = Lam.flatten(2).norm(dim=-1) * rec["rho"][:, None]
            const, mag = const - charge, mag + charge
            if split is not None:
                split[rec["name"]] = charge
            if rec["split"] == "taylor":
                Lam = transpose_apply(rec["layer"], rec["X"], rec["J"], Lam, rec["parts"])
            else:
                Lam = delta1_transpose(rec["layer"], rec["parts"], Lam)
        elif rec["kind"] == "project":
            u = rec["u"][:, None]  # [B, 1, n, d]
            gam = -(Lam * u).sum(-1)  # the coefficient of q − q₀ (q = w or v), [B, C, n]
            s, b = relu_bounds(gam, *(rec[f][:, None] for f in ("z0", "lo", "hi")))
            on = rec["relu"][:, None]
            s, b = torch.where(on, s, 0.0), torch.where(on, b, 0.0)
            norms = Lam.norm(dim=-1)  # ‖Λ_t‖
            second = norms * rec["second"][:, None]
            # the tokens' second-order errors share the ball's budget (DeviationSet.grouped's argument)
            shared = torch.minimum(second.sum(-1), rec["budget"][:, None]
                                   * (second / rec["caps"][:, None]).amax(-1))
            charge = shared + (norms * (rec["first"] + rec["wild"])[:, None]).sum(-1)
            const = const + (gam * b).sum(-1) - charge
            if split is not None:
                split["kinks"] = split["kinks"] - (gam * b).sum(-1)
                split[rec["name"]] = charge
            mag = mag + (gam * b).abs().sum(-1) + charge
            radial = (gam * s * rec["sign"][:, None])[..., None] * u
            # L_tᵀΛ_t = base_t·(Λ_t − [tangential]·u_t(u_tᵀΛ_t)), and u_tᵀΛ_t = −γ_t
            along = (rec["tangent"][:, None] * gam)[..., None] * u
            Lam = rec["base"][:, None, :, None] * (Lam + along) + radial
        else:  # a stage this pass does not know has no backward step: crossing it as another would be unsound
            kind = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"backward: unknown stage record {kind!r}")
    first = eps * torch.einsum("bcnd,ndp->bcp", Lam, embed).norm(dim=-1)
    if split is not None:
        split["first_order"] = first
    return const - first, mag + first


def transpose_apply(layer: DotMHA, X: Tensor, J: Tensor | None, Lam: Tensor,
                    parts: dict[str, Tensor] | None = None) -> Tensor:
    """J_F(X)ᵀΛ for Λ [B, C, n, d]: with the dense J where it was formed, else in closed form
    (docs/bounds.md §5.1): with Y_l = ΛW^O_lᵀ, Z_l = Y_l V_lᵀ (V_l = X W^V_l) and G_l row i
    = (diag p_i − p_i p_iᵀ) Z_l[i],
    ``JᵀΛ = HΛ + Σ_l [P_lᵀY_l W^V_lᵀ + (G_l K_l W^Q_lᵀ + G_lᵀQ_l W^K_lᵀ)/√d_h]``."""
    if J is not None:
        return (Lam.flatten(2) @ J).reshape(Lam.shape)
    parts = attention_parts(layer, X) if parts is None else parts
    P, Qx, Kx, V = (parts[k][:, None] for k in ("P", "Q", "K", "V"))  # [B, 1, h, n, ·]
    B, C, n, _ = Lam.shape
    h, e = layer.h, layer.d_h
    Y = (Lam @ parts["W_o"].mT).reshape(B, C, n, h, e).transpose(2, 3)  # [B, C, h, n, e]: Λ W^O_lᵀ
    Z = Y @ V.mT  # [B, C, h, n, n]
    G = P * (Z - (P * Z).sum(-1, keepdim=True))
    root = math.sqrt(e)
    # the coefficients of Γ W^Q, Γ W^K and Γ W^V, through every head's weights in one product
    # ([W^Q | W^K | W^V] stacked as [d, 3·h·d_h], attention_parts)
    coef = torch.stack([G @ Kx / root, G.mT @ Qx / root, P.mT @ Y], 2)  # [B, C, 3, h, n, e]
    out = coef.permute(0, 1, 4, 2, 3, 5).reshape(B, C, n, 3 * h * e) @ parts["W"].mT
    return out + layer.H_norm * Lam if layer.H_norm else out


def delta1_transpose(layer: DotMHA, parts: dict[str, Tensor], Lam: Tensor) -> Tensor:
    """Δ₁ᵀΛ = HΛ + Σ_l P_lᵀ Λ C_lᵀ for Λ [B, C, n, d] (LoFAST's linear part, attention frozen)."""
    Y = torch.einsum("bcnf,hef->bchne", Lam, layer.W_o)  # Λ W^O_lᵀ
    Y = torch.einsum("bhkn,bchke->bchne", parts["P"], Y)  # P_lᵀ ·
    out = torch.einsum("bchne,hde->bcnd", Y, layer.W_v)  # · W^V_lᵀ
    return out + layer.H_norm * Lam if layer.H_norm else out


# A first pass on a CPU takes CPU_CHUNK images at once where a block's tokens are small (n·d ≤
# CPU_CHUNK_ND), one at a time elsewhere: a chunk pads every image's symbols to the largest count in
# it, which costs little on the digits models (a few symbols an image; a pass there is hundreds of
# small torch calls, whose overhead a chunk shares) and much on the Fashion-MNIST ones (hundreds of
# unstable neurons an image, their counts far apart). Measured (docs/bounds.md §5.1, "Chunks"):
CPU_CHUNK = 8
CPU_CHUNK_ND = 512
# ... and while the sets stay small: once a chunk's first pass made more symbols than this in one
# image (LoFAST's uncapped recipe model, ≈ 2,050 at ε 0.02, where a chunk was 1.1–1.5× slower; the
# margin models' 30–480 at ε ≤ 0.05, where it was 1.0–1.4× faster), the rest go one at a time
CHUNK_SYMBOLS = 1024
# The second pass (refined ranges, the quadratic remainder) certifies images whose first pass falls far
# short: on the models trained without a margin, where the forward set's ranges widen block by block, it
# won images short by up to 31 margins (Fashion-MNIST 3-block, ε 0.02, first 20 images) and 15.5 (digits
# 3-block q2, ε 0.02, first 40), and none short by more than 32 (docs/results.md, "Accurate ViTs"). An
# image short by more than HOPELESS margins at some class is left to its first pass (docs/bounds.md
# §5.1, "Refined ranges"): it can cost a verdict, never soundness. LoFAST's recipe model (about 1,000
# unstable neurons a block) is short by 10³–10⁶ margins on every image, where the second pass would cost
# 47 s on 50 images for nothing
HOPELESS = 100.0


def hopeless(low: Tensor, logits: Tensor, y: Tensor) -> Tensor:
    """[B] bool: images whose first-pass bound ``low`` [B, C] (+∞ at y) of the margins' change falls
    short of some clean margin m_j by more than :data:`HOPELESS` × m_j; a bound that is not finite
    (no range came out of the first pass) is never called hopeless."""
    margins = logits.gather(-1, y[:, None]) - logits
    other = ~F.one_hot(y, logits.shape[-1]).bool()  # j = y has nothing to bound
    short = torch.where(other, -(margins + low) / margins.clamp_min(torch.finfo(low.dtype).tiny), -math.inf)
    finite = torch.where(other, torch.isfinite(low), True).all(-1)
    return finite & (short.amax(-1) > HOPELESS)


def _key(images: slice | Tensor) -> tuple:
    """A hashable name of a selection of the batch's images (a slice, or their indices)."""
    return (images.start, images.stop) if isinstance(images, slice) else tuple(images.tolist())


class TaylorNet:
    """The network's clean trace at a batch of images, and its certificate at any ε."""

    def __init__(self, net: ViT, images: Tensor, labels: Tensor):
        check_stages(net)
        if net.head.weight.dtype != torch.float64:
            raise InputError("certify a float64 network (models.load_vit loads one)")
        if net.head.weight.shape[0] < 2:
            raise InputError("a network with one class has no margin to certify")
        self.net, self.labels = net, labels
        x = images.to(torch.float64)
        # inference mode, here and in the passes: no autograd bookkeeping on each of a pass's
        # thousands of small torch calls (7 % of a pass on the 1-block digits model, 8 images)
        with torch.inference_mode():
            X = net.tokens(x)
            self.raw, self.inputs, self.mids, self.mid_norms = [], [], [], []
            for block in net.blocks:
                self.raw.append(X)
                Xp = block.prepare(X)
                self.inputs.append(Xp)
                if block.standard:  # X + A(LN₁X), then + M(LN₂·): the FFN branch's input is LN₂'s output
                    Y = X + block.attn(Xp)
                    self.mid_norms.append(block.norm2(Y))
                    X = Y + block.ffn.branch(self.mid_norms[-1])
                else:
                    Y = block.attn(Xp)
                    X = block.ffn(Y)
                self.mids.append(Y)
            self.last = X
            self.features = net.pool(X)
            self.logits = net.head(self.features)
        self.correct = self.logits.argmax(-1) == labels  # a misclassified image gets no pass
        # the weights' own constants (norms, G₀ and its patch columns), kept per network (.constants)
        const = net_constants(net)
        self.layers, self.lip, self.embed = const.layers, const.lip, const.embed
        self.embed_norm, self.patch, self.span = const.embed_norm, const.patch, const.span
        # per block and batch slice, the remainder's parts that depend on the clean tokens alone
        # (two eigenproblems of four): computed at the first ε that needs them, reused at the others
        self.clean_parts: dict[tuple, dict] = {}
        self.done: dict[tuple[float, str], NetCertificate] = {}  # the certificates made, per (ε, split)
        self.entry: dict[float, tuple[Tensor, Tensor]] = {}  # per ε, :meth:`_entry_radii`
        n, d = X.shape[-2:]
        self.chunk = max(1, len(labels)) if self.logits.is_cuda else CPU_CHUNK if n * d <= CPU_CHUNK_ND else 1

    def certify(self, eps: float, split: str = "taylor") -> NetCertificate:
        """The certificate at image radius ``eps`` for every image of the batch, attention split as
        ``split`` says (:data:`SPLITS`, or :data:`BEST`): one image at a time on a CPU (a batch pads
        every image's symbols to the largest count in it: 3.7× slower measured on the Fashion-MNIST
        3-block model at 8 images), the whole batch at once on a GPU. Kept per (ε, split), so a
        ``best`` after its splits (or the reverse) reuses them; its seconds are still its own."""
        if split not in (*SPLITS, BEST):
            raise InputError(f"unknown attention split {split!r}; expected one of "
                             f"{', '.join((*SPLITS, BEST))}")
        key = (float(eps), split)
        if key not in self.done:
            self.done[key] = self._best(eps) if split == BEST else self._split(eps, split)
        return self.done[key]

    def _split(self, eps: float, split: str, which: Tensor | None = None) -> NetCertificate:
        """One split's certificate on the images ``which`` [B] bool (all by default) that the network
        classifies right; an image left out gets no bound (−∞, not certified), no diagnostics but its
        clean margin (:meth:`_nothing`) and no seconds. A misclassified image is certified by nothing
        (its margin is negative at the image itself), so no pass is spent on it: on the Fashion-MNIST
        one-epoch models, 39–43 % of the test images, each a first pass of up to 10 s at ε = 0.1.

        The first pass runs on :attr:`chunk` images at a time; the images it leaves uncertified get the
        second pass, one at a time on a CPU, together on a GPU. Each image's seconds are its share of
        its chunk's first pass plus its own second pass."""
        B = len(self.labels)
        which = self.correct if which is None else which & self.correct
        todo = which.nonzero()[:, 0]
        lower = torch.full_like(self.logits, -math.inf)
        verified = torch.zeros_like(lower, dtype=torch.bool)
        diags, done = [], []
        per = torch.zeros(B, dtype=torch.float64)
        with torch.inference_mode():
            size, at = self.chunk, 0
            while at < len(todo):
                images = todo[at:at + size]
                at += len(images)
                start = time.perf_counter()
                # first without the remainder's quadratic form (its eigenproblems are 3–5× the rest
                # of a pass on the Fashion-MNIST models, and it changed no verdict of this pass on
                # the 3-block one; docs/bounds.md §5.1, "Refined ranges")
                low, ok, certified, diag = self._once(eps, images, split, refine=False)
                per[images.cpu()] = (time.perf_counter() - start) / len(images)
                if size > 1 and int((sum(diag.unstable) + sum(diag.straddling)).max()) > CHUNK_SYMBOLS:
                    size = 1  # a large set: the rest one image at a time (CPU_CHUNK)
                # images left uncertified again, with the quadratic form and every unit's range refined
                # by the backward pass: it costs two functionals per unstable unit through every stage
                # before it, so only where the cheap pass did not suffice, and not where it fell short
                # by more than HOPELESS margins. Each margin takes the better of the passes' sound bounds
                left = ~certified & ~hopeless(low, self.logits[images], self.labels[images])
                left = left.nonzero()[:, 0]
                for part in left.split(len(left) if self.logits.is_cuda else 1):
                    if not len(part):
                        continue
                    start = time.perf_counter()
                    again = self._once(eps, images[part], split, refine=True)
                    low[part] = torch.maximum(low[part], again[0])
                    ok[part] = ok[part] | again[1]
                    diag = again[3].scattered(part, diag)
                    per[images[part].cpu()] += (time.perf_counter() - start) / len(part)
                lower[images], verified[images] = low, ok
                diags.append(diag)
                done.append(images)
        lower = lower.scatter(-1, self.labels[:, None], math.inf)
        verified = verified | F.one_hot(self.labels, lower.shape[-1]).bool()
        certified = verified.all(-1) & which
        diag = self._nothing(slice(None))[3]
        if done:
            diag = Diagnostics.cat(diags).scattered(torch.cat(done), diag)
        return NetCertificate(lower, certified, diag, float(per.sum()), verified, per)

    def _nothing(self, images: slice):
        """What :meth:`_once` returns for images that were not certified: no bound, no verdict, and
        of the diagnostics the clean margin to the closest class alone (the losses NaN: not computed;
        no unit counted)."""
        logits, y = self.logits[images], self.labels[images]
        lower = torch.full_like(logits, -math.inf).scatter(-1, y[:, None], math.inf)
        verified = F.one_hot(y, logits.shape[-1]).bool()
        closest = (logits.gather(-1, y[:, None]) - logits).scatter(-1, y[:, None], math.inf).amin(-1)
        unknown = torch.full((len(y),), math.nan, dtype=logits.dtype, device=logits.device)
        none = torch.zeros(len(y), dtype=torch.long, device=logits.device)
        no = torch.zeros(len(y), dtype=torch.bool, device=logits.device)
        counts = [none] * len(self.layers)
        diag = Diagnostics(closest, unknown, unknown, {}, counts, counts, no)
        return lower, verified, torch.zeros_like(y, dtype=torch.bool), diag

    def _best(self, eps: float) -> NetCertificate:
        """:data:`BEST`: every margin the better of the :data:`BEST_OF` splits' bounds, each sound
        (docs/bounds.md §5.1, "The best split"); the second split only on the images the first leaves
        uncertified and classified right. Its diagnostics are those of the split that certified the
        image, the first's where neither did; its seconds the first's plus the second's on the images
        it ran on."""
        first = self.certify(eps, BEST_OF[0])
        rest = ~first.certified & self.correct
        key = (float(eps), BEST_OF[1])
        second = self.done[key] if key in self.done else self._split(eps, BEST_OF[1], rest)
        lower = torch.where(rest[:, None], torch.maximum(first.lower, second.lower), first.lower)
        verified = first.verified | (second.verified & rest[:, None])
        certified = first.certified | (verified.all(-1) & rest)
        per = first.image_seconds + torch.where(rest.cpu(), second.image_seconds, 0.0)  # seconds: on the CPU
        diag = second.diagnostics.where(certified & ~first.certified, first.diagnostics)
        return NetCertificate(lower, certified, diag, float(per.sum()), verified, per)

    def _once(self, eps: float, images: slice | Tensor, split: str, refine: bool):
        log: list = []
        stages = self.stages(eps, images, log, refine, split, form=False)
        unstable = [count for name, _, count in stages if name.startswith("ffn")]
        straddling = [count for name, _, count in stages if re.fullmatch(r"(project|norm)\d+", name)]
        return self._margins(stages[-1][1], eps, unstable, straddling, images, log)

    def stages(self, eps: float, images: slice | Tensor = slice(None), log: list | None = None,
               refine: bool = False, split: str = "taylor",
               form: bool = True) -> list[tuple[str, DeviationSet | Mapped, Tensor | None]]:
        """The deviation set after every stage (``project<k>``, ``attention<k>``, ``ffn<k>``) with the
        stage's count of relaxed units (straddling tokens, unstable neurons; None for attention), for
        the ``images`` of the batch; ``log`` (a list) receives what :func:`backward` needs, and with
        ``refine`` the ranges of the units that can cross a kink are intersected with the backward
        pass's over the stages before them (docs/bounds.md §5.1); attention's remainder takes its
        quadratic form (``bounds.remainder.remainder``) with ``refine`` only. Without ``form`` the
        last FFN's set is left :class:`Mapped` (what :meth:`_margins` reads)."""
        B = len(self.labels[images])
        n, d, P = self.embed.shape
        like = self.logits[images]
        S = DeviationSet.ball_of(self.embed.expand(B, n, d, P), like.new_full((B,), self.embed_norm * eps))
        out = []
        refine = self._refiner(log, eps) if log is not None and refine else None
        for k, block in enumerate(self.net.blocks):
            entry = tuple(t.expand(B, *t.shape[1:]) for t in self._entry_radii(eps)) if k == 0 else None
            if block.standard:
                S = self._standard_block(S, k, block, eps, images, log, refine, split, entry, out)
                continue
            if block.norm is not None:  # the vanilla variant: LayerNorm where LayerProject is
                S, s = layer_norm(S, self.raw[k][images], block.norm, eps, k, log, radii=entry)
                out.append((f"norm{k}", S, s))
            else:
                S, s = project(S, self.raw[k][images], self.net.cfg.R, eps, k, log, refine if k else None,
                               every=refine is not None, radii=entry, span=self.span if k == 0 else None)
                out.append((f"project{k}", S, s))
            # the quadratic form of the remainder costs h·n²-wide eigenproblems: the second pass only
            S = attention(S, self.layers[k], self.inputs[k][images], k, log, split,
                          quadratic=refine is not None,
                          cache=self.clean_parts.setdefault((k, *_key(images)), {}))
            out.append((f"attention{k}", S, None))
            last = k == len(self.net.blocks) - 1
            S, u = ffn(S, block, self.mids[k][images], self.lip[k], eps, log, refine, form or not last)
            out.append((f"ffn{k}", S, u))
        if self.net.standard:  # the final LayerNorm before the head (on every token; the margins read one)
            S, s = layer_norm(S, self.last[images], self.net.norm, eps, "_out", log)
            out.append(("norm_out", S, s))
        return out

    def _standard_block(self, S: DeviationSet, k: int, block, eps: float, images: slice | Tensor,
                        log: list | None, refine: Refine | None, split: str,
                        entry: tuple[Tensor, Tensor] | None, out: list) -> DeviationSet:
        """A standard pre-LayerNorm block: X + A(LN₁X), then + M(LN₂·), each residual the sum of the
        set and its branch's (:meth:`DeviationSet.plus`), marked by a fork and a join in ``log`` for
        the backward pass (docs/bounds.md §5.1, "Residual branches")."""
        mark = (lambda kind: log.append({"kind": kind})) if log is not None else (lambda kind: None)
        mark("fork")
        S1, s = layer_norm(S, self.raw[k][images], block.norm, eps, k, log, radii=entry)
        out.append((f"norm{k}", S1, s))
        branch = attention(S1, self.layers[k], self.inputs[k][images], k, log, split,
                           quadratic=refine is not None,
                           cache=self.clean_parts.setdefault((k, *_key(images)), {}))
        mark("join")
        S = S.plus(branch)
        out.append((f"attention{k}", S, None))
        mark("fork")
        S2, s = layer_norm(S, self.mids[k][images], block.norm2, eps, f"{k}b", log)
        out.append((f"norm{k}b", S2, s))
        branch, u = ffn(S2, block, self.mid_norms[k][images], self.lip[k] - 1.0, eps, log, refine,
                        residual=False)
        mark("join")
        S = S.plus(branch)
        out.append((f"ffn{k}", S, u))
        return S

    def _entry_radii(self, eps: float) -> tuple[Tensor, Tensor]:
        """The first block's input set's token radii [1, n] and radius [1] at ``eps``: that set, the
        pixels' ball through the embedding, is the same for every image, so its Grams and their
        eigenvalues are computed once per ε, not per image. Where every pixel moves one token
        (``constants.patch_columns``) G₀ᵀG₀ is block diagonal by token, so ‖G₀‖ = max_t ‖G_t‖ and each ‖G_t‖
        is the norm of its m nonzero columns: m×m Grams in place of d×d and P×P ones."""
        key = float(eps)
        if key not in self.entry:
            route = self.logits.new_full((1,), self.embed_norm * eps)
            cols = self.patch
            if cols is None:
                S = DeviationSet.ball_of(self.embed[None], route)
                r = S.token_radii(eps)
                self.entry[key] = (r, S.radius(eps, r))
            else:
                r = eps * gram_norm(cols.mT @ cols)[None]  # [1, n]
                self.entry[key] = (r, torch.minimum(route, torch.minimum(r.norm(dim=-1), r.amax(-1))))
        return self.entry[key]

    def _refiner(self, log: list, eps: float) -> Refine:
        """:data:`Refine` over the stages logged so far: each functional's range of ⟨c, Δ⟩ from the
        backward pass in both directions (with its rounding slack), intersected with the forward one."""
        def refine(units: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
            both, mag = backward(log, torch.cat([units, -units], 1), self.embed, eps)
            both = both - ROUND * mag
            k = units.shape[1]
            return torch.maximum(lo, both[:, :k]), torch.minimum(hi, -both[:, k:])
        return refine

    def _margins(self, S: DeviationSet | Mapped, eps: float, unstable, straddling, images: slice | Tensor,
                 log: list):
        W = self.net.head_matrix()
        y = self.labels[images]
        logits = self.logits[images]
        mapped = S if isinstance(S, Mapped) else None
        S = S.S if mapped else S
        N = S.c.shape[1]  # every token; the standard variant's head reads the class token alone
        S = S.token(0) if self.net.standard else S
        n = S.c.shape[1]
        # the classes j ≠ y alone (m_y ≡ 0 needs no bound): [B, C − 1], each image's in order
        at = torch.arange(W.shape[0] - 1, device=y.device)[None]
        others = at + (at >= y[:, None])
        rows = (W[y][:, None, :] - W[others]) / n  # [B, C − 1, d]: the functional per token of m_j
        fro = rows.norm(dim=-1) * math.sqrt(n)  # ‖c_j‖_F over the n tokens
        balls = fro[..., None] * S.rho[:, None, :]  # [B, C, S]
        if mapped is None:
            first = eps * torch.einsum("bcd,bndp->bcp", rows, S.G).norm(dim=-1)
            kinks = torch.einsum("bcd,bndm->bcm", rows, S.A).abs().sum(-1)
            shift = torch.einsum("bcd,bnd->bc", rows, S.c)
            groups = torch.einsum("bcd,bndkg->bckg", rows, S.Q).norm(dim=-1)  # [B, C, k]
        else:  # ⟨c, L_tΔ_t + shift_t⟩ = ⟨L_tᵀc, Δ_t⟩ + ⟨c, shift_t⟩: per token, through the map
            F = mapped.pull(rows)  # [B, C, n, d]
            B, C = F.shape[:2]  # one product of [C, n·d] and [n·d, P] (an einsum copied G first)
            first = eps * (F.reshape(B, C, -1) @ S.G.reshape(B, -1, S.G.shape[-1])).norm(dim=-1)
            kinks = (torch.einsum("bcnd,bndm->bcm", F, S.A).abs().sum(-1)
                     + torch.einsum("bcd,bndm->bcm", rows, mapped.new).abs().sum(-1))
            shift = torch.einsum("bcnd,bnd->bc", F, S.c) + torch.einsum("bcd,bnd->bc", rows, mapped.shift)
            groups = torch.einsum("bcnd,bndkg->bckg", F, S.Q).norm(dim=-1)
        names = list(dict.fromkeys(S.sources + S.groups))
        of = lambda name: [j for j, s in enumerate(S.groups) if s == name]
        balls = torch.stack([balls[..., [i for i, s in enumerate(S.sources) if s == name]].sum(-1)
                             + S.only(name).grouped(groups[..., of(name)]) for name in names], -1) \
            if names else balls
        lower = shift - first - kinks - balls.sum(-1)
        own = logits.gather(-1, y[:, None])
        logits_j = logits.gather(-1, others)
        margins = own - logits_j
        slack = ROUND * (own.abs() + logits_j.abs() + first + kinks + shift.abs() + balls.sum(-1))
        # the backward pass over the same ranges: CROWN's slopes per sign, remainders at their own
        # coefficients; each margin takes the better of the two sound bounds
        split: dict[str, Tensor] = {}
        Lam = rows[:, :, None, :].expand(-1, -1, n, -1)
        if N != n:  # the class token's functional, zero at every other token
            Lam = torch.cat([Lam, Lam.new_zeros(*Lam.shape[:2], N - n, Lam.shape[-1])], 2)
        back, mag = backward(log, Lam, self.embed, eps, split)
        back_slack = ROUND * (own.abs() + logits_j.abs() + mag)
        better = back - back_slack > lower - slack
        lower, slack = torch.where(better, back, lower), torch.where(better, back_slack, slack)
        if S.void is not None:  # a stage undefined in the image's ball: nothing is certified there
            lower = lower.masked_fill(S.void[:, None], -math.inf)
        total = margins + lower
        verified = total > slack
        ok = torch.ones_like(logits, dtype=torch.bool).scatter(-1, others, verified)  # True at j = y
        certified = verified.all(-1) & (logits.argmax(-1) == y)
        worst = (total - slack).argmin(-1, keepdim=True)
        pick = lambda T: T.gather(-1, worst)[:, 0]
        # the split of the bound each margin took: the forward set's or the backward pass's
        take = lambda b, f: pick(torch.where(better, b, f))
        zero = torch.zeros_like(lower)
        forward = {s: balls[..., i] for i, s in enumerate(names)}
        sources = dict.fromkeys([*names, *(k for k in split if k not in ("first_order", "kinks"))])
        diag = Diagnostics(pick(margins), take(split["first_order"], first),
                           take(split["kinks"], kinks - shift),
                           {s: take(split.get(s, zero), forward.get(s, zero)) for s in sources},
                           unstable, straddling, pick(better))
        return torch.full_like(logits, math.inf).scatter(-1, others, lower), ok, certified, diag
