"""LayerProject's charge in the backward pass (bounds.network.stages.project.ProjectRecord): by its
errors' parts along u_t and across it, never below the worst Σ_t Λ_tᵀe_t over errors that respect
the parts' bounds, their ratios to ‖Δ_t‖² and the ball's shared budget; and below the whole-norm
charge where the functionals lie across the tokens' directions."""

from __future__ import annotations

import torch

from bounds.network.stages.project import ProjectRecord

F64 = torch.float64


def record(B: int, n: int, d: int, g: torch.Generator, finite: bool = True) -> ProjectRecord:
    """A record of random parts: errors of bound ‖e_t‖ ≤ (U_t² + P_t²)^½, no ReLU, identity map."""
    r = lambda *s: torch.rand(*s, generator=g, dtype=F64)
    u = torch.randn(B, n, d, generator=g, dtype=F64)
    u = u / u.norm(dim=-1, keepdim=True)
    U, P = r(B, n), 0.3 * r(B, n)
    radii = 0.2 + r(B, n)
    KU, KP = U / radii**2 * (1 + r(B, n)), P / radii**2 * (1 + r(B, n))
    if not finite:
        KP[:, 0] = torch.inf
    whole = (U**2 + P**2).sqrt()
    zero = torch.zeros(B, n, dtype=F64)
    return ProjectRecord("project0", torch.ones(B, n, dtype=F64), zero, u, zero + 1, zero, zero - 1, zero + 1,
                         torch.zeros(B, n, dtype=torch.bool), whole, zero, radii**2,
                         (radii**2).sum(-1) * 0.5, zero, U, KU, P, KP)


def worst(rec: ProjectRecord, Lam: torch.Tensor, g: torch.Generator, draws: int = 4000) -> torch.Tensor:
    """The largest −Σ_t Λ_tᵀe_t [B, C] (what the errors take from a lower bound) over sampled budgets
    s_t = ‖Δ_t‖² (Σ s_t ≤ budget, s_t ≤ r_t²), each token's error at its worst for those budgets:
    e_t = −α_t u_t − β_t w_t, w_t the unit part of Λ_t across u_t, 0 ≤ α_t ≤ min(U_t, K_U s_t) (the
    part along u_t is never outward) and β_t ≤ min(P_t, K_P s_t)."""
    B, C, n, _ = Lam.shape
    along = (Lam * rec.u[:, None]).sum(-1)  # [B, C, n]
    perp = (Lam - along[..., None] * rec.u[:, None]).norm(dim=-1)
    best = torch.full((B, C), -torch.inf, dtype=F64)
    for _ in range(draws // 100):
        w = torch.rand(100, B, n, generator=g, dtype=F64) ** 3
        s = w / w.sum(-1, keepdim=True) * rec.budget[:, None]
        s = torch.minimum(s, rec.caps)  # caps = r_t² here
        a = torch.minimum(rec.along, rec.along_K * s)  # [100, B, n]
        b = torch.minimum(rec.across, torch.where(torch.isfinite(rec.across_K), rec.across_K * s, rec.across))
        total = (along.clamp_min(0)[None] * a[:, :, None] + perp[None] * b[:, :, None]).sum(-1)
        best = torch.maximum(best, total.amax(0))
    return best


def test_the_charge_by_parts_holds_the_worst_sampled_errors():
    g = torch.Generator().manual_seed(0)
    for finite in (True, False):
        rec = record(3, 5, 6, g, finite)
        Lam = torch.randn(3, 4, 5, 6, generator=g, dtype=F64)
        norms = Lam.norm(dim=-1)
        gam = -(Lam * rec.u[:, None]).sum(-1)
        charge = rec._by_parts(Lam, gam, norms)
        assert (worst(rec, Lam, g) <= charge).all()
        # and the step's charge is the smaller of it and the whole errors' at ‖Λ_t‖
        assert torch.equal(rec.step(Lam).charge, torch.minimum(charge, rec.step(Lam).charge))


def test_functionals_across_the_tokens_pay_the_across_part_alone():
    g = torch.Generator().manual_seed(1)
    rec = record(2, 4, 6, g)
    Lam = torch.randn(2, 3, 4, 6, generator=g, dtype=F64)
    Lam = Lam - (Lam * rec.u[:, None]).sum(-1, keepdim=True) * rec.u[:, None]  # across every u_t
    norms = Lam.norm(dim=-1)
    by_parts = rec._by_parts(Lam, -(Lam * rec.u[:, None]).sum(-1), norms)
    whole = (norms * rec.second[:, None]).sum(-1)
    assert (by_parts < whole).all()
    torch.testing.assert_close(rec.step(Lam).charge, by_parts)


def test_functionals_pulling_inward_pay_nothing_along_the_tokens():
    """The part of e_t along u_t is never outward: a functional with Λ_t·u_t ≤ 0 at every token pays
    the across part alone, one with Λ_t·u_t > 0 pays the along part too, and both charges hold the
    sampled worst inward errors."""
    g = torch.Generator().manual_seed(2)
    rec = record(2, 4, 6, g)
    Lam = torch.randn(2, 3, 4, 6, generator=g, dtype=F64)
    along = (Lam * rec.u[:, None]).sum(-1, keepdim=True)
    inward = Lam - (along.abs() + 1.0) * rec.u[:, None] - along * rec.u[:, None]  # Λ_t·u_t = −|·| − 1
    outward = Lam + (along.abs() + 1.0) * rec.u[:, None] - along * rec.u[:, None]
    charge = lambda L: rec._by_parts(L, -(L * rec.u[:, None]).sum(-1), L.norm(dim=-1))
    across = Lam - along * rec.u[:, None]
    torch.testing.assert_close(charge(inward), charge(across))
    assert (charge(outward) > charge(across)).all()
    for L in (inward, outward):
        assert (worst(rec, L, g) <= charge(L)).all()
