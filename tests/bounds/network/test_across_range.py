"""LayerProject's and LayerNorm's errors across the tokens, charged through the functional's range
(``across_corners``; docs/bounds.md §5.1, "Across, by the functional's range"): each record's charge
is never below −Σ_t ⟨Λ_t, e_t⟩ for deviations of the set, sampled and attacked, with e_t formed from
the map itself (p; nn.LayerNorm with torch.func's Jacobian); it is below the charge without that range
where the set is thin across the tokens; and ``DeviationSet.ranges`` holds the supports of the set's
parts, formed densely."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from bounds.network.stages.layernorm import layer_norm
from bounds.network.stages.project import ProjectRecord, project
from bounds.network.zonotope import DeviationSet

F64 = torch.float64
R = 1.0


def the_set(seed: int, P: int, m: int, eps: float, wide: float) -> tuple[DeviationSet, torch.Tensor]:
    """A set of B = 2 images, n = 5 tokens in R^6 (G of P columns, m symbols, a shift) and clean tokens
    of norms 0.55–1.6 R: inside the sphere, straddling it and outside; ``wide`` scales G."""
    g = torch.Generator().manual_seed(seed)
    B, n, d = 2, 5, 6
    u = torch.randn(B, n, d, generator=g, dtype=F64)
    u = u / u.norm(dim=-1, keepdim=True)
    nu = R * (0.55 + 1.05 * torch.rand(B, n, generator=g, dtype=F64))
    G = wide * torch.randn(B, n, d, P, generator=g, dtype=F64)
    S = DeviationSet.ball_of(G, torch.full((B,), math.inf, dtype=F64))
    S = S.with_symbols(0.02 * torch.randn(B, n, d, m, generator=g, dtype=F64))
    S = replace(S, c=0.01 * torch.randn(B, n, d, generator=g, dtype=F64))
    return S, nu[..., None] * u


def points(S: DeviationSet, eps: float, N: int, g: torch.Generator) -> torch.Tensor:
    """N deviations of the set per image [N, B, n, d]: δ on the sphere of radius ε (and some inside),
    ζ at the box's corners (and some inside)."""
    B, P = S.G.shape[0], S.G.shape[-1]
    delta = torch.randn(N, B, P, generator=g, dtype=F64)
    inside = torch.rand(N, B, 1, generator=g, dtype=F64) ** 0.1
    delta = eps * delta / delta.norm(dim=-1, keepdim=True) * inside
    zeta = torch.rand(N, B, S.A.shape[-1], generator=g, dtype=F64) * 2 - 1
    zeta = torch.where(torch.rand_like(zeta) < 0.7, zeta.sign(), zeta)
    return (torch.einsum("bndp,Nbp->Nbnd", S.G, delta) + torch.einsum("bndm,Nbm->Nbnd", S.A, zeta)
            + S.c[None])


def errors(rec: ProjectRecord, raw: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """e_t = Δp − L_tΔ + (relu(z) − relu(z₀))u_t, z = z₀ + sign·a, at deviations D [N, B, n, d] (zero
    where a token's ball stays inside the sphere): from p(x) = x·min(1, R/‖x‖) itself."""
    p = lambda x: x * (R / x.norm(dim=-1, keepdim=True)).clamp_max(1)
    u = rec.u
    a = (D * u).sum(-1)
    lin = rec.base[..., None] * (D - rec.tangent[..., None] * a[..., None] * u)
    z = rec.z0 + rec.sign * a
    kink = (torch.relu(z) - torch.relu(rec.z0))[..., None] * u
    e = p(raw + D) - p(raw) - lin + torch.where(rec.relu[..., None], kink, 0.0)
    return torch.where(rec.relu[..., None], e, 0.0)


def attacked(rec: ProjectRecord, raw: torch.Tensor, S: DeviationSet, Lam: torch.Tensor, eps: float,
             g: torch.Generator, starts: int = 8, steps: int = 60) -> torch.Tensor:
    """The largest −Σ_t ⟨Λ_t, e_t⟩ [B, C] that projected gradient ascent reaches over the set's δ and ζ."""
    B, P = S.G.shape[0], S.G.shape[-1]
    C = Lam.shape[1]
    best = torch.full((B, C), -math.inf, dtype=F64)
    for _ in range(starts):
        delta = eps * torch.randn(B, C, P, generator=g, dtype=F64) / math.sqrt(P)
        delta = (delta * (eps / delta.norm(dim=-1, keepdim=True).clamp_min(eps))).requires_grad_()
        zeta = (torch.rand(B, C, S.A.shape[-1], generator=g, dtype=F64) * 2 - 1).requires_grad_()
        for _ in range(steps):
            D = (torch.einsum("bndp,bcp->cbnd", S.G, delta) + torch.einsum("bndm,bcm->cbnd", S.A, zeta)
                 + S.c[None])
            value = -(errors(rec, raw, D) * Lam.transpose(0, 1)).sum((-1, -2))  # [C, B]
            gd, gz = torch.autograd.grad(value.sum(), (delta, zeta))
            with torch.no_grad():
                best = torch.maximum(best, value.T)
                delta += 0.1 * eps * gd / gd.norm(dim=-1, keepdim=True).clamp_min(1e-300)
                delta *= (eps / delta.norm(dim=-1, keepdim=True).clamp_min(eps))
                zeta += 0.2 * gz.sign()
                zeta.clamp_(-1, 1)
    return best


@pytest.mark.parametrize("seed,P,m,eps,wide", [(0, 2, 3, 0.15, 0.6), (1, 3, 0, 0.2, 0.6),
                                               (2, 1, 4, 0.25, 0.6),
                                               (3, 6, 2, 0.1, 0.6), (4, 2, 2, 0.3, 0.5), (6, 2, 2, 1.0, 0.5)])
def test_the_charge_holds_the_errors_of_the_sets_deviations(seed, P, m, eps, wide):
    """Two functionals across the tokens (the part this charge serves; the attack reaches 0.2–0.8 of
    the charge on them) and two at random, on tokens inside, straddling, outside and (the last case)
    beyond the decomposition's reach."""
    S, raw = the_set(seed, P, m, eps, wide)
    log: list = []
    project(S, raw, R, eps, 1, log)
    rec = log[0]
    g = torch.Generator().manual_seed(100 + seed)
    Lam = 3 * torch.randn(2, 4, 5, 6, generator=g, dtype=F64)
    Lam[:, :2] -= (Lam[:, :2] * rec.u[:, None]).sum(-1, keepdim=True) * rec.u[:, None]
    charge = rec.step(Lam).charge  # [B, C]
    D = points(S, eps, 20000, g)
    sampled = -(errors(rec, raw, D)[:, :, None] * Lam[None]).sum((-1, -2)).amax(0)  # [B, C]
    assert (sampled <= charge * (1 + 1e-9) + 1e-12).all()
    assert (attacked(rec, raw, S, Lam, eps, g) <= charge * (1 + 1e-9) + 1e-12).all()


def test_a_thin_set_pays_less_across_the_tokens():
    """Where the set moves each token in one direction, ⟨Λ_⊥, Δ_t⟩ ranges far below ‖Λ_⊥‖·r_t: for
    functionals across the tokens the charge with the functional's range is below 0.7 of the one
    without it (0.17–0.60 here), and still holds the attacked errors."""
    S, raw = the_set(5, 1, 0, 0.2, 0.6)
    log: list = []
    project(S, raw, R, 0.2, 1, log)
    rec = log[0]
    assert bool((rec.relu & (rec.wild == 0)).sum() >= 8)  # tokens that straddle or lie outside
    g = torch.Generator().manual_seed(7)
    Lam = 3 * torch.randn(2, 4, 5, 6, generator=g, dtype=F64)
    Lam = Lam - (Lam * rec.u[:, None]).sum(-1, keepdim=True) * rec.u[:, None]
    new, old = rec.step(Lam).charge, replace(rec, reach=None).step(Lam).charge
    assert (new < 0.7 * old).all()
    assert (attacked(rec, raw, S, Lam, 0.2, g) <= new * (1 + 1e-9) + 1e-12).all()


def test_the_ranges_are_the_supports_of_the_sets_parts():
    """DeviationSet.ranges against the exact support of a set of G, symbols and a shift (ε‖G_tᵀv‖ +
    ‖A_tᵀv‖₁ around ⟨v, c_t⟩, formed per token and functional in float64), and against sampled points:
    every point inside, the ends reached within 1e-9 by the maximizing δ and ζ."""
    S, _ = the_set(6, 3, 4, 0.4, 1.0)
    g = torch.Generator().manual_seed(8)
    V = torch.randn(2, 3, 5, 6, generator=g, dtype=F64)
    mid, half = S.ranges(V, 0.4)
    for b in range(2):
        for c in range(3):
            for t in range(5):
                v = V[b, c, t]
                want = 0.4 * torch.linalg.vector_norm(S.G[b, t].T @ v) + (S.A[b, t].T @ v).abs().sum()
                torch.testing.assert_close(half[b, c, t], want, rtol=1e-12, atol=0)
                torch.testing.assert_close(mid[b, c, t], v @ S.c[b, t], rtol=1e-12, atol=1e-15)
    D = points(S, 0.4, 4000, g)  # [N, B, n, d]
    w = torch.einsum("Nbnd,bcnd->Nbcn", D, V)
    assert ((w >= mid - half - 1e-12) & (w <= mid + half + 1e-12)).all()
    with pytest.raises(AssertionError):  # the ranges are not loose by construction: a tenth less fails
        assert ((w >= mid - 0.9 * half - 1e-12) & (w <= mid + 0.9 * half + 1e-12)).all()


def test_a_token_pulled_inward_pays_the_corner_of_its_inward_end():
    """One token outside the sphere (the tangential form, κ = R/ν), moved mostly inward along a
    direction that also moves it across u: inward, φ = R/s > κ and w < 0 together, so the charge's
    largest corner is (κ − φ_hi)·w_lo; the exact maximum of −⟨Λ, e⟩ over the segment is below it,
    and above 0.7 of it (φ's range takes the token's ends apart)."""
    nu, eps = 1.3, 0.25
    u = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    step = torch.tensor([-0.6, 0.8, 0.0], dtype=F64)
    S = DeviationSet.ball_of(step.reshape(1, 1, 3, 1).clone(), torch.full((1,), math.inf, dtype=F64))
    S = replace(S, c=0.6 * eps * step.reshape(1, 1, 3))  # Δ = (δ + 0.6ε)·step, δ ∈ [−ε, ε]
    raw = (nu * u).reshape(1, 1, 3)
    log: list = []
    project(S, raw, R, eps, 1, log)
    rec = log[0]
    assert bool(rec.tangent[0, 0] == 1) and bool(rec.relu[0, 0])
    Lam = torch.tensor([0.0, -2.0, 0.0], dtype=F64).reshape(1, 1, 1, 3)  # across u: w = ⟨Λ, Δ⟩
    lp = Lam.clone()
    corner = rec._across(lp, torch.zeros(1, 1, 1, dtype=F64))[0, 0, 0]
    k_lo = rec.base[0, 0] - rec.phi_hi[0, 0]
    assert k_lo < 0  # inward, the sphere's R/s is above κ
    mid, half = S.ranges(lp, eps)
    torch.testing.assert_close(corner, k_lo * (mid - half)[0, 0, 0] * (1 + 1e-12), rtol=1e-12, atol=0)
    deltas = torch.linspace(-eps, eps, 20001, dtype=F64)
    D = (deltas[:, None] + 0.6 * eps) * step  # [N, 3]
    e = errors(rec, raw, D[:, None, None, :])
    exact = (-(e * Lam[0]).sum((-1, -2))).amax()
    assert exact <= corner and exact >= 0.7 * corner  # 0.0857 of 0.1115: φ_hi takes b = 0


def norm_errors(norm: nn.LayerNorm, raw: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """e = LN(x₀ + Δ) − LN(x₀) − J_tΔ per token at deviations D [N, B, n, d], J_t torch.func's Jacobian."""
    J = torch.vmap(torch.vmap(torch.func.jacrev(norm)))(raw)  # [B, n, d, d]
    return norm(raw + D) - norm(raw) - torch.einsum("bnde,Nbne->Nbnd", J, D)


@pytest.mark.parametrize("seed,P,eps,shift,thin", [(0, 1, 0.3, 0.01, True), (1, 2, 0.5, 0.01, False),
                                                   (2, 6, 0.4, 0.01, False), (3, 1, 1.5, 0.01, True),
                                                   (4, 1, 0.3, 0.2, False), (5, 1, 0.2, 0.3, False)])
def test_layernorms_charge_holds_the_errors_of_the_sets_deviations(seed, P, eps, shift, thin):
    """Tokens of centred norm 0.3–2.5 (the fourth case's balls reaching σ = 0), random γ: the charge
    holds −Σ_t ⟨Λ_t, e_t⟩ of 20,000 sampled deviations of the set and an ascent over its δ (the last two
    cases' sets shifted off centre, where the sign of 1/ρ₀ − 1/ρ decides the corner); on a thin set
    (P < d) the charge of functionals across the tokens is below the one without the range."""
    g = torch.Generator().manual_seed(seed)
    B, n, d = 2, 4, 6
    norm = nn.LayerNorm(d).double().requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(d, generator=g, dtype=F64))
        norm.bias.copy_(torch.randn(d, generator=g, dtype=F64))
    raw = torch.randn(B, n, d, generator=g, dtype=F64)
    raw = raw / raw.norm(dim=-1, keepdim=True) * (0.3 + 2.2 * torch.rand(B, n, 1, generator=g, dtype=F64))
    G = torch.randn(B, n, d, P, generator=g, dtype=F64) / math.sqrt(P)
    S = DeviationSet.ball_of(G, torch.full((B,), math.inf, dtype=F64))
    S = replace(S, c=shift * torch.randn(B, n, d, generator=g, dtype=F64))
    log: list = []
    layer_norm(S, raw, norm, eps, 0, log, refuse=False)
    rec = log[-1]
    Lam = 3 * torch.randn(B, 4, n, d, generator=g, dtype=F64)
    zhat = rec.zhat[:, None]
    Lam[:, :2] -= (Lam[:, :2] * zhat).sum(-1, keepdim=True) * zhat  # across ẑ₀ (λ then is too, for γ ≡ 1)
    charge = rec.charge(Lam)
    assert not charge.isnan().any()
    finite = torch.isfinite(charge)
    D = points(S, eps, 20000, g)
    sampled = -(norm_errors(norm, raw, D)[:, :, None] * Lam[None]).sum((-1, -2)).amax(0)
    assert (sampled[finite] <= charge[finite] * (1 + 1e-9) + 1e-12).all()
    delta = (eps * torch.randn(B, 4, P, generator=g, dtype=F64) / math.sqrt(P))
    delta = (delta * (eps / delta.norm(dim=-1, keepdim=True).clamp_min(eps))).requires_grad_()
    best = torch.full((B, 4), -math.inf, dtype=F64)
    for _ in range(100):
        D = torch.einsum("bndp,bcp->cbnd", S.G, delta) + S.c[None]
        value = -(norm_errors(norm, raw, D) * Lam.transpose(0, 1)).sum((-1, -2))
        (grad,) = torch.autograd.grad(value.sum(), delta)
        with torch.no_grad():
            best = torch.maximum(best, value.T)
            delta += 0.05 * eps * grad / grad.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            delta *= eps / delta.norm(dim=-1, keepdim=True).clamp_min(eps)
    assert (best[finite] <= charge[finite] * (1 + 1e-9) + 1e-12).all()
    if thin:
        old = replace(rec, reach=None).charge(Lam)
        assert (charge <= old).all() and (charge[:, :2] < 0.9 * old[:, :2]).any()


def test_chunks_of_functionals_give_the_same_charge(monkeypatch):
    """across_corners takes its functionals a few at a time where their supports would hold more than
    ACROSS_CHUNK entries: the charge is the same, bit for bit, and a step over ACROSS_WORK keeps the
    charge without the range."""
    import bounds.network.stages.symmetric as symmetric

    S, raw = the_set(0, 2, 3, 0.15, 0.6)
    log: list = []
    project(S, raw, R, 0.15, 1, log)
    rec = log[0]
    Lam = torch.randn(2, 7, 5, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    whole = rec.step(Lam).charge
    monkeypatch.setattr(symmetric, "ACROSS_CHUNK", 1)
    assert torch.equal(rec.step(Lam).charge, whole)
    monkeypatch.setattr(symmetric, "ACROSS_WORK", 1)
    torch.testing.assert_close(rec.step(Lam).charge, replace(rec, reach=None).step(Lam).charge)
