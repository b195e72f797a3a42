"""The final LayerNorm read through the margins' sign (docs/bounds.md §5.1, "The final LayerNorm through
the margins' sign"; :func:`bounds.network.stages.layernorm.margin_sign`). Against a dense float64
construction from ``nn.LayerNorm`` and a linear head: m̃ = m·ρ(z)/ρ₀ has m's sign and value at x₀, its
gradient there is g, and m̃ − m₀ − ⟨g, Δ⟩ lies in [−charge, ∞) on the ball, the charge nearly reached
by a tangential step where k < 0. On the zoo's standard GELU ViT the reading certifies images the
Jacobian with its remainder does not, and its margin bounds hold under sampling and an own attack."""

from __future__ import annotations

import math

import pytest
import torch
from test_taylor_net import attacked_margins_hold, margins_hold, survives_attack

from bench.nets.accuracy import first_test_images
from bounds.network.stages.layernorm import margin_sign
from bounds.network.taylor_net import TaylorNet
from models import load_vit

STANDARD = "zoo/digits-d32-b2-h2-standard-q1-gelu.safetensors"


def head_margins(norm: torch.nn.LayerNorm, W: torch.Tensor, b: torch.Tensor, y: int, x: torch.Tensor):
    """m_j(x) = logit_y − logit_j of the head (W, b) on LayerNorm(x), [..., C], from torch's modules."""
    logits = torch.nn.functional.linear(norm(x), W, b)
    return logits[..., y, None] - logits


def rho(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """ρ(Cx) = √d·(var(x) + e)^½, the population variance (torch's own var)."""
    return math.sqrt(x.shape[-1]) * (x.var(-1, unbiased=False) + norm.eps).sqrt()


def case(seed: int, d: int, scale: float, eps: float):
    gen = torch.Generator().manual_seed(seed)
    norm = torch.nn.LayerNorm(d, eps=eps).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=gen, dtype=torch.float64) * 2 - 0.5)
        norm.bias.copy_(torch.randn(d, generator=gen, dtype=torch.float64))
    C = 5
    W = torch.randn(C, d, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64) * 2
    x0 = torch.randn(d, generator=gen, dtype=torch.float64) * scale + 3.0  # an offset C removes
    return norm, W, b, x0, gen


@pytest.mark.parametrize("seed,d,scale,eps,r", [
    (0, 2, 1.0, 1e-5, 0.5), (1, 8, 1.0, 1e-5, 0.3), (2, 32, 0.2, 1e-5, 0.5), (3, 16, 1.0, 0.0, 0.9),
    (4, 16, 1e-3, 1e-5, 0.02), (5, 64, 3.0, 1e-2, 4.0), (6, 8, 1.0, 1e-5, 20.0)],
    ids=["d2", "d8", "d32-small", "e0", "near-sigma0", "d64-wide", "r-beyond"])
def test_the_signed_margin_is_linear_but_for_its_charge(seed, d, scale, eps, r):
    norm, W, b, x0, gen = case(seed, d, scale, eps)
    y = 1
    others = torch.tensor([j for j in range(W.shape[0]) if j != y])
    rows = (W[y] - W[others])[None]  # [1, C − 1, d]
    k = ((rows @ norm.bias.detach()) + b[y] - b[others])[0]
    with torch.no_grad():
        g, charge, ratio = margin_sign(norm, x0[None], rows, k[None], torch.tensor([r], dtype=torch.float64))
        m0 = head_margins(norm, W, b, y, x0)[others]
        rho0 = rho(norm, x0)
        # Δ: random directions on the sphere and inside, and the tangential ones (C and z₀-free)
        D = torch.randn(4000, d, generator=gen, dtype=torch.float64)
        z0 = x0 - x0.mean()
        tang = D - D.mean(-1, keepdim=True)
        tang = tang - (tang @ z0)[:, None] * z0 / z0.square().sum()
        D = torch.cat([D, tang[tang.norm(dim=-1) > 1e-9]])  # none for d = 2: C's range is z₀'s line
        D = D / D.norm(dim=-1, keepdim=True) * r
        D[::3] *= torch.rand(len(D[::3]), 1, generator=gen, dtype=torch.float64)
        x = x0 + D
        m = head_margins(norm, W, b, y, x)[:, others]
        tilde = m * (rho(norm, x) / rho0)[:, None]
        gap = tilde - m0 - D @ g[0].T  # (k/ρ₀)·B(Δ)
    # the same sign, and m̃'s bound read as m's: m ≥ m̃·ρ₀/ρ_max where m̃ > 0
    assert torch.equal(tilde > 0, m > 0)
    pos = tilde > 0
    assert (m[pos] >= (tilde * ratio)[pos] - 1e-12 * m.abs()[pos]).all()
    scale_ = m0.abs() + (D @ g[0].T).abs() + 1.0
    assert (gap >= -charge[0] - 1e-11 * scale_).all()
    assert (gap[:, k >= 0] >= -1e-11 * scale_[:, k >= 0]).all()  # convex: no charge where k ≥ 0
    neg = k < 0
    if neg.any() and r < rho0 / 4:  # the charge nearly reached (a tangential step of radius r)
        assert float((-gap[:, neg] / charge[0, neg]).amax()) > 0.8


def test_its_gradient_is_autograds():
    norm, W, b, x0, _ = case(7, 12, 1.0, 1e-5)
    y = 0
    others = torch.arange(1, W.shape[0])
    rows = (W[y] - W[others])[None]
    k = (rows @ norm.bias.detach()) + b[y] - b[others]
    g, _, _ = margin_sign(norm, x0[None], rows, k.detach(), torch.tensor([0.1], dtype=torch.float64))
    rho0 = rho(norm, x0).detach()
    f = lambda x: head_margins(norm, W, b, y, x)[others] * rho(norm, x) / rho0
    J = torch.autograd.functional.jacobian(f, x0)
    torch.testing.assert_close(g[0].detach(), J, rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def standard():
    net, _ = load_vit(STANDARD)
    x, y = first_test_images("digits", net, 8)
    return net, x, y


def test_the_sign_certifies_what_the_jacobian_alone_does_not(standard, monkeypatch):
    """The first pass at ε 0.01 on the zoo's capped standard GELU ViT: image 1 with the sign's reading,
    not without it. (Image 6 needed it too until attention's remainder was taken key by key, session 35;
    docs/bounds.md §5.1, "The logits' part per key".)"""
    net, x, y = standard
    pick = torch.tensor([1])
    with torch.inference_mode():
        on = TaylorNet(net, x[pick], y[pick]).one_pass(0.01, slice(None), "taylor", refine=False)[2]
        monkeypatch.setattr(TaylorNet, "_sign", lambda self, *a: None)
        off = TaylorNet(net, x[pick], y[pick]).one_pass(0.01, slice(None), "taylor", refine=False)[2]
    assert on.all() and not off.any()


@pytest.mark.parametrize("eps", [0.01, 0.02])
def test_its_margin_bounds_hold(standard, eps):
    net, x, y = standard
    lower = TaylorNet(net, x, y).certify(eps).lower
    margins_hold(net, x, y, lower, eps, 24, 11)
    attacked_margins_hold(net, x, y, lower.masked_fill(lower == math.inf, 0.0), eps, 30)


def test_no_image_it_certifies_is_broken(standard):
    net, x, y = standard
    survives_attack(net, x, y, 0.01)
