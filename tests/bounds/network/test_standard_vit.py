"""The standard ViT (#56): pre-LayerNorm residual blocks X + A(LN₁X), then + M(LN₂·), a class token,
a final LayerNorm and the head on the class token. Its forward pass equals an independent float64
construction from its weights; taylor_net's set after every stage (the residual sums of
DeviationSet.plus included) holds the sampled deviations; every margin bound (the backward pass
through forks and joins included) is below the sampled and attacked margin changes; and no image
taylor_net or CROWN certifies is broken by an independent attack."""

from __future__ import annotations

import math

import pytest
import torch
from test_taylor_net import perturbations, sampled_margins_hold, survives_attack

from bounds.network.taylor_net import TaylorNet
from models.vit import ViT, ViTConfig


def standard_vit(seed: int, qk: float = 0.5, depth: int = 2, activation: str = "gelu") -> ViT:
    torch.manual_seed(seed)
    cfg = ViTConfig(image=8, classes=4, d=8, depth=depth, heads=2, patch=2, ffn=16, variant="standard",
                    constraint=None, ffn_constraint=None, activation=activation)
    net = ViT(cfg, constrained=False).double()
    with torch.no_grad():
        for block in net.blocks:
            block.attn.W_q.mul_(qk)
            block.attn.W_k.mul_(qk)
            block.ffn.up.bias.uniform_(-1.0, 1.0)
            for norm in (block.norm, block.norm2):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.3, 0.3)
        net.cls.normal_()
    return net


def dense_forward(net: ViT, x: torch.Tensor) -> list[torch.Tensor]:
    """Every stage's output, from the weights alone (einsums, no module of the network): LN₁'s, the
    sum after attention, LN₂'s, the sum after the FFN per block, and the final LayerNorm's."""
    cfg = net.cfg
    p, g = cfg.patch, cfg.image // cfg.patch
    patches = x.reshape(len(x), g, p, g, p).permute(0, 1, 3, 2, 4).reshape(len(x), g * g, p * p)
    X = torch.cat([net.cls.expand(len(x), 1, -1), patches @ net.embed.weight.T], 1) + net.pos

    def ln(X, m):
        z = X - X.mean(-1, keepdim=True)
        return z / ((z * z).mean(-1, keepdim=True) + m.eps).sqrt() * m.weight + m.bias

    out = []
    for b in net.blocks:
        Y = ln(X, b.norm)
        out.append(Y)
        Q, K, V = (torch.einsum("bnd,hde->bhne", Y, getattr(b.attn, w)) for w in ("W_q", "W_k", "W_v"))
        P = torch.softmax(Q @ K.mT / math.sqrt(Q.shape[-1]), -1)
        X = X + torch.einsum("bhne,hed->bnd", P @ V, b.attn.W_o)
        out.append(X)
        Z = ln(X, b.norm2)
        out.append(Z)
        h = Z @ b.ffn.up.weight.T + b.ffn.up.bias
        act = torch.nn.functional.gelu(h) if cfg.activation == "gelu" else torch.relu(h)
        X = X + act @ b.ffn.down.weight.T + b.ffn.down.bias
        out.append(X)
    out.append(ln(X, net.norm))
    return out


def test_the_forward_pass_is_the_dense_constructions():
    net = standard_vit(0)
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stages = dense_forward(net, x)
    with torch.no_grad():
        want = stages[-1][:, 0] @ net.head.weight.T + net.head.bias
        assert torch.allclose(net(x), want, rtol=1e-12, atol=1e-12)
        assert net.cfg.n_tokens == 17 and net.pixel_map().shape == (64, 17, 8)


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("seed,qk,eps,act", [(0, 0.5, 0.01, "gelu"), (1, 1.0, 0.05, "relu"),
                                             (2, 0.2, 0.2, "gelu")])
def test_every_stage_holds_the_sampled_deviations(seed, qk, eps, act, refine):
    net = standard_vit(seed, qk, activation=act)
    x = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = torch.arange(4) % 4
    tn = TaylorNet(net, x, y)
    with torch.no_grad():
        stages = tn.stages(eps, log=[] if refine else None, refine=refine, refuse=False)
        assert [s[0] for s in stages] == ["norm0", "attention0", "norm0b", "ffn0", "norm1", "attention1",
                                          "norm1b", "ffn1", "norm_out"]
        clean = dense_forward(net, x)
        gen = torch.Generator().manual_seed(0)
        for delta in perturbations(x, eps, 16, gen):
            for (name, S, _), a, b in zip(stages, clean, dense_forward(net, x + delta), strict=True):
                dev = b - a
                assert (dev.norm(dim=-1) <= S.token_radii(eps) * (1 + 1e-9) + 1e-12).all(), name
                unit = dev / dev.flatten(1).norm(dim=-1).clamp_min(1e-300)[:, None, None]
                for c in (unit, -unit, torch.randn(dev.shape, generator=gen, dtype=dev.dtype)):
                    attained, support = (c * dev).sum((-1, -2)), S.support(c, eps)
                    assert (attained <= support + 1e-9 * (1 + support.abs())).all(), name


@pytest.mark.parametrize("seed,qk,eps", [(3, 1.0, 0.05), (4, 2.0, 0.02)])
def test_every_token_radius_holds_an_ascent_on_that_tokens_deviation(seed, qk, eps):
    """Adam ascent (independent of the certificate: the dense construction's forward pass) on ‖Δ_t‖ at
    every stage for the class token and the last one, never above the set's token radius: the
    residual's E across the FFN branch (DeviationSet.fork) and attention's second order on the set
    (bounds.network.stages.second_order) included."""
    net = standard_vit(seed, qk)
    x = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    tn = TaylorNet(net, x, torch.arange(2))
    with torch.no_grad():
        stages = tn.stages(eps, log=[], refine=True, refuse=False)
        clean = dense_forward(net, x)
    for k, (name, S, _) in enumerate(stages):
        radii = S.token_radii(eps)
        for t in (0, radii.shape[1] - 1):
            delta = torch.randn(x.shape, generator=torch.Generator().manual_seed(k * 7 + t), dtype=x.dtype)
            delta = (delta * eps / delta.flatten(1).norm(dim=-1)[:, None, None]).requires_grad_()
            opt = torch.optim.Adam([delta], lr=eps / 10)
            for _ in range(40):
                dev = (dense_forward(net, x + delta)[k] - clean[k])[:, t].norm(dim=-1)  # [B]
                assert (dev <= radii[:, t] * (1 + 1e-9) + 1e-12).all(), (name, t)
                opt.zero_grad()
                (-dev.sum()).backward()
                opt.step()
                with torch.no_grad():
                    delta.mul_(torch.clamp(eps / delta.flatten(1).norm(dim=-1), max=1.0)[:, None, None])


@pytest.mark.parametrize("eps", [0.01, 0.05])
def test_every_margin_change_is_above_its_lower_bound(eps):
    net = standard_vit(3, 0.5)
    x = torch.rand(8, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    assert torch.isfinite(sampled_margins_hold(net, x, y, eps, 24)).all()


@pytest.mark.parametrize("eps", [0.003, 0.01])
def test_no_image_taylor_net_or_crown_certifies_is_broken_by_an_independent_attack(eps):
    net = standard_vit(4, 0.5)
    x = torch.rand(30, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    survives_attack(net, x, y, eps, crown=True)


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
def test_the_backward_pass_through_residuals_is_below_an_attack_on_each_functional(refine):
    """⟨Λ, Δ⟩ on the final LayerNorm's tokens for random Λ: the backward pass's lower bound (through
    the forks and joins of both residuals per block) is below the least value an ascent finds, where
    dropping a residual's skip path would put it above (its first order would be another map's)."""
    from bounds.network.taylor_net import backward

    net = standard_vit(5, 0.5)
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y = torch.arange(3) % 4
    eps = 0.002  # small enough that the bound is within 1.5× of the attack: a wrong first order shows
    tn = TaylorNet(net, x, y)
    log: list = []
    with torch.no_grad():
        tn.stages(eps, log=log, refine=refine, refuse=False)
    Lam = torch.randn(3, 4, *tn.last.shape[1:], generator=torch.Generator().manual_seed(6),
                      dtype=torch.float64)
    bound, _ = backward(log, Lam, tn.embed, eps)
    clean = dense_forward(net, x)[-1].detach()
    value = lambda d: torch.einsum("bcnd,bnd->bc", Lam, dense_forward(net, x + d)[-1] - clean)
    for c in range(Lam.shape[1]):
        d = torch.zeros_like(x, requires_grad=True)
        for _ in range(80):
            (g,) = torch.autograd.grad(value(d)[:, c].sum(), d)
            with torch.no_grad():
                d -= 0.3 * eps * g / g.flatten(1).norm(dim=-1).clamp_min(1e-300)[:, None, None]
                d *= eps / d.flatten(1).norm(dim=-1).clamp_min(eps)[:, None, None]
            d.requires_grad_(True)
        with torch.no_grad():
            assert (value(d)[:, c] >= bound[:, c] - 1e-9 * (1 + bound[:, c].abs())).all(), c
