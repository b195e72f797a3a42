"""GELU in the FFN, as taylor_net relaxes it (#56, docs/bounds.md §5.1 "GELU"): the relaxation holds
every point of a neuron's range (ranges near 0, around the critical points ±√2 and ±2, far out
where GELU saturates, and wide), its slope is autograd's derivative, the second derivative's range is
that of a dense grid; on GELU ViTs (pre-LayerNorm and LayerProject) every stage holds the sampled
deviations and no certified image is broken by an independent attack, for taylor_net and CROWN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_taylor_net import check_stages, survives_attack

from bounds.network.stages.activations import gelu_bounds, gelu_relaxation, gelu_second, gelu_second_range
from bounds.network.taylor_net import TaylorNet
from models import InputError
from models.vit import ViT, ViTConfig


def ranges() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z₀, lo, hi): ranges of widths 1e-6 to 20 around clean points from −8 to 8."""
    gen = torch.Generator().manual_seed(0)
    z0 = torch.cat([torch.linspace(-8, 8, 161, dtype=torch.float64),
                    torch.tensor([-2.0, -2**0.5, 0.0, 2**0.5, 2.0], dtype=torch.float64)])
    width = torch.logspace(-6, 1.3, 12, dtype=torch.float64)
    z0, width = (t.flatten() for t in torch.meshgrid(z0, width, indexing="ij"))
    share = torch.rand(z0.shape, generator=gen, dtype=torch.float64)
    return z0, z0 - share * width, z0 + (1 - share) * width


def test_the_second_derivatives_range_is_the_grids():
    _, lo, hi = ranges()
    m, M = gelu_second_range(lo, hi)
    t = torch.linspace(0, 1, 4001, dtype=torch.float64)
    grid = gelu_second(lo[:, None] + t * (hi - lo)[:, None])
    assert (m <= grid.amin(-1)).all() and (M >= grid.amax(-1)).all()
    assert torch.allclose(m, grid.amin(-1), atol=1e-6) and torch.allclose(M, grid.amax(-1), atol=1e-6)


def test_the_relaxation_holds_every_point_of_the_range_and_its_slope_is_autograds():
    z0, lo, hi = ranges()
    lam, beta, mu = gelu_relaxation(z0, lo, hi)
    z = z0.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(F.gelu(z).sum(), z)
    assert torch.allclose(lam, slope, rtol=1e-13, atol=1e-15)
    t = torch.linspace(0, 1, 2001, dtype=torch.float64)
    pts = lo[:, None] + t * (hi - lo)[:, None]
    err = F.gelu(pts) - F.gelu(z0)[:, None] - lam[:, None] * (pts - z0[:, None])
    slack = 1e-13 * (1 + err.abs())
    assert (err >= (beta - mu)[:, None] - slack).all() and (err <= (beta + mu)[:, None] + slack).all()
    g = torch.randn(z0.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s, b = gelu_bounds(g, z0, lo, hi)
    lhs = g[:, None] * (F.gelu(pts) - F.gelu(z0)[:, None])
    rhs = g[:, None] * (s[:, None] * (pts - z0[:, None]) + b[:, None])
    assert (lhs >= rhs - 1e-13 * (1 + lhs.abs())).all()
    assert (mu[hi - lo < 1e-3] < 1e-6).all()  # a narrow range needs almost no relaxation


def gelu_vit(seed: int, variant: str, depth: int = 2, qk: float = 1.0) -> ViT:
    torch.manual_seed(seed)
    cfg = ViTConfig(image=8, classes=4, d=8, depth=depth, heads=2, patch=2, ffn=16, variant=variant,
                    constraint=None, ffn_constraint=None, activation="gelu")
    net = ViT(cfg, constrained=False).double()
    with torch.no_grad():
        for block in net.blocks:
            block.attn.W_q.mul_(qk)
            block.attn.W_k.mul_(qk)
            block.ffn.up.bias.uniform_(-2.0, 2.0)  # pre-activations across GELU's bend
        net.pos.mul_(0.6)
    return net


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("variant,seed,qk,eps", [("vanilla", 0, 1.0, 0.02), ("lofast", 1, 4.0, 0.1),
                                                 ("lofast", 2, 0.3, 0.5)])
def test_every_stage_holds_the_sampled_deviations_on_gelu_vits(variant, seed, qk, eps, refine):
    net = gelu_vit(seed, variant, qk=qk)
    x = torch.rand(5, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert check_stages(net, x, torch.arange(5) % 4, eps, refine=refine) > 0


@pytest.mark.parametrize("variant,eps", [("vanilla", 0.01), ("vanilla", 0.03), ("lofast", 0.05),
                                         ("lofast", 0.1)])
def test_no_gelu_image_certified_by_taylor_net_or_crown_is_broken_by_an_independent_attack(variant, eps):
    net = gelu_vit(3, variant)
    x = torch.rand(30, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    survives_attack(net, x, y, eps, crown=True)


def test_an_activation_without_a_stage_is_refused_by_name():
    """(GELU's tanh approximation has its stage: tests/bounds/network/test_gelu_tanh_stage.py.)"""
    cfg = ViTConfig(image=8, classes=4, d=8, depth=1, heads=2, patch=2, ffn=16, variant="vanilla",
                    constraint=None, ffn_constraint=None, activation="gelu")
    net = ViT(cfg, constrained=False).double()
    object.__setattr__(net.cfg, "activation", "silu")  # a config this suite cannot build
    x = torch.rand(2, 8, 8, dtype=torch.float64)
    with pytest.raises(InputError, match="silu"):
        TaylorNet(net, x, torch.zeros(2, dtype=torch.long))
