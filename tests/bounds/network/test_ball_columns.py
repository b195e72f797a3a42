"""E as columns (docs/bounds.md §5.1, "The balls as columns"): the merged columns hold every sum of
the two ellipsoids they merge (checked against a dense float64 solve, not the same code path), and
with them every stage of the second pass still holds the sampled deviations, its whole radius
included, on random ViTs whose remainders are large (sharp attention, wide ε)."""

from __future__ import annotations

import pytest
import torch
from test_taylor_net import perturbations, random_vit, true_stages

from bounds.network.taylor_net import TaylorNet
from bounds.network.zonotope import merge_balls


def ellipsoid_gauge(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """min ‖v‖₂ with Wv = x for W [N, K] of full row rank and points x [N, S], by a dense float64
    least-norm solve (pseudo-inverse through an SVD): ≤ 1 iff x is in {Wv : ‖v‖ ≤ 1}."""
    return (torch.linalg.pinv(W) @ x).norm(dim=0)


@pytest.mark.parametrize("n,d,k1,k2,seed", [(2, 3, 4, 6, 0), (3, 4, 12, 12, 1), (4, 2, 1, 8, 2),
                                            (2, 5, 10, 3, 3)])
def test_merged_columns_hold_every_sum(n, d, k1, k2, seed):
    gen = torch.Generator().manual_seed(seed)
    W1 = torch.randn(1, n, d, k1, generator=gen, dtype=torch.float64)
    W2 = torch.randn(1, n, d, k2, generator=gen, dtype=torch.float64) * 10 ** (seed - 2)
    W = merge_balls(W1, W2)
    N = n * d
    assert W.shape[-1] <= max(N, k1 + k2)
    # points of the sum: both parts on their spheres (the hardest), in random and in top directions
    v1 = torch.randn(k1, 400, generator=gen, dtype=torch.float64)
    v2 = torch.randn(k2, 400, generator=gen, dtype=torch.float64)
    v1, v2 = v1 / v1.norm(dim=0), v2 / v2.norm(dim=0)
    u1, u2 = (torch.linalg.svd(M.reshape(N, -1)).Vh[0] for M in (W1, W2))
    v1 = torch.cat([v1, u1[:, None], -u1[:, None]], 1)
    v2 = torch.cat([v2, u2[:, None], u2[:, None]], 1)
    x = W1.reshape(N, k1) @ v1 + W2.reshape(N, k2) @ v2
    assert (ellipsoid_gauge(W.reshape(N, -1), x) <= 1 + 1e-9).all()


@pytest.mark.parametrize("n,d,k1,seed", [(2, 3, 4, 0), (3, 4, 20, 1), (4, 2, 1, 2), (2, 5, 10, 3)])
def test_a_merged_ball_holds_every_sum(n, d, k1, seed):
    # W₂ = ρ·I given by its radius alone (a remainder's ball), ρ per image from 0 (nothing added) up
    gen = torch.Generator().manual_seed(seed)
    N = n * d
    W1 = torch.randn(3, n, d, k1, generator=gen, dtype=torch.float64)
    rho = torch.tensor([0.0, 0.3, 30.0], dtype=torch.float64) * 10 ** (seed - 2)
    W = merge_balls(W1, rho=rho)
    assert W.shape[-1] == N
    for i in range(3):
        v1 = torch.randn(k1, 400, generator=gen, dtype=torch.float64)
        v1 = torch.cat([v1 / v1.norm(dim=0), torch.linalg.svd(W1[i].reshape(N, k1)).Vh[:1].mT], 1)
        e = torch.randn(N, 401, generator=gen, dtype=torch.float64)
        x = W1[i].reshape(N, k1) @ v1 + rho[i] * e / e.norm(dim=0)
        assert (ellipsoid_gauge(W[i].reshape(N, -1), x) <= 1 + 1e-9).all()


def test_a_merge_with_a_zero_part_keeps_the_other():
    W1 = torch.randn(1, 2, 3, 2, dtype=torch.float64)  # 4 columns of 6 rows: side by side
    assert torch.equal(merge_balls(W1, torch.zeros(1, 2, 3, 2, dtype=torch.float64))[..., :2], W1)
    assert torch.equal(merge_balls(W1[..., :0], W1), W1)
    rho = torch.tensor([2.0], dtype=torch.float64)
    assert torch.equal(merge_balls(W1[..., :0], rho=rho).reshape(6, 6), 2 * torch.eye(6, dtype=torch.float64))


@pytest.mark.parametrize("seed,qk,eps", [(0, 4.0, 0.1), (1, 20.0, 0.3), (2, 1.0, 0.5)])
def test_the_second_pass_holds_the_sampled_deviations_and_its_radii(seed, qk, eps):
    net = random_vit(seed, depth=3, qk=qk)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.arange(3) % 4
    tn = TaylorNet(net, x, y)
    with torch.no_grad():
        stages = tn.stages(eps, log=[], refine=True, refuse=False)
        assert all(S.W is not None for _, S, _ in stages)  # E is carried as columns
        # somewhere the columns are tighter than the radii: the test exercises them
        assert any(bool((S.ball() < S.rho.sum(-1) * (1 - 1e-6)).any()) for _, S, _ in stages)
        clean = true_stages(net, x)
        for delta in perturbations(x, eps, 24, gen):
            moved = true_stages(net, x + delta)
            for (name, S, _), a, b in zip(stages, clean, moved, strict=True):
                dev = b - a
                assert (dev.flatten(1).norm(dim=-1) <= S.radius(eps) * (1 + 1e-9)).all(), (name, "radius")
                assert (dev.norm(dim=-1) <= S.token_radii(eps) * (1 + 1e-9) + 1e-12).all(), (name, "token")
                unit = dev / dev.flatten(1).norm(dim=-1).clamp_min(1e-300)[:, None, None]
                for c in (unit, -unit):
                    support = S.support(c, eps)
                    assert ((c * dev).sum((-1, -2)) <= support + 1e-9 * (1 + support.abs())).all(), name
