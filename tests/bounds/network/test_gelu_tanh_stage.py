"""GELU's tanh approximation as a stage of taylor_net (docs/bounds.md §5.1, "GELU"): its slope and σ''
against autograd of torch's own ``gelu(approximate="tanh")`` in float64, the interval bound of σ''
holding every sampled value on ranges from narrow to saturated, the relaxation holding sampled
changes, and a random ViT with it: every stage's set holds the sampled deviations, and an attack
breaks none of the images it certifies."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import gelu

from bounds.network.stages.activations import relaxation, tanh_second, tanh_second_range, tanh_slope
from bounds.network.taylor_net import TaylorNet
from models.vit import TANH_FORMS, ViT, ViTConfig, activate

# the tanh form as torch computes it, and with its constants rounded to float32 (an ONNX exporter's
# before opset 20), each checked against its own formula: torch's gelu, and models.vit.activate
FORMS = ["gelu_tanh", "gelu_tanh_f32"]


def _tanh(z):
    return gelu(z, approximate="tanh")


@pytest.mark.parametrize("act", FORMS)
def test_slope_and_second_derivative_against_autograd(act):
    z = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    f = _tanh if act == "gelu_tanh" else (lambda t: 0.5 * t * (1 + torch.tanh(
        0.7978845834732056 * (t + 0.044714998453855515 * t**3))))  # float32's c and a, written out
    (d1,) = torch.autograd.grad(f(z).sum(), z, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), z)
    assert torch.allclose(tanh_slope(z.detach(), TANH_FORMS[act]), d1.detach(), atol=1e-13)
    assert torch.allclose(tanh_second(z.detach(), TANH_FORMS[act]), d2, atol=1e-13)
    assert torch.allclose(activate(act, z.detach()), f(z.detach()), rtol=0, atol=1e-15)


@pytest.mark.parametrize("act", FORMS)
@pytest.mark.parametrize("width", [1e-4, 0.1, 1.0, 4.0, 20.0])
def test_the_second_derivatives_range_holds_every_sampled_value(width, act):
    g = torch.Generator().manual_seed(int(width * 10))
    lo = torch.randn(300, generator=g, dtype=torch.float64) * 3
    hi = lo + width * torch.rand(300, generator=g, dtype=torch.float64)
    m, M = tanh_second_range(lo, hi, TANH_FORMS[act])
    t = torch.linspace(0, 1, 401, dtype=torch.float64)
    vals = tanh_second(lo[:, None] + (hi - lo)[:, None] * t, TANH_FORMS[act])
    assert (vals >= m[:, None]).all() and (vals <= M[:, None]).all()
    # and not far above it: the 8 pieces' interval arithmetic overshoots the true range by at most
    # 0.08 of the width on these ranges (measured 0.067–0.077, the true range's slope up to 0.78)
    if width <= 1:  # (a wide range's pieces are wide: there it is only sound)
        assert ((M - m) <= (vals.amax(-1) - vals.amin(-1)) + 0.1 * width + 1e-9).all()


@pytest.mark.parametrize("act", FORMS)
@pytest.mark.parametrize("width", [0.01, 0.5, 3.0])
def test_the_relaxation_holds_sampled_changes(width, act):
    g = torch.Generator().manual_seed(7)
    z0 = torch.randn(400, generator=g, dtype=torch.float64) * 2
    lo = z0 - width * torch.rand(400, generator=g, dtype=torch.float64)
    hi = z0 + width * torch.rand(400, generator=g, dtype=torch.float64)
    lam, beta, mu = relaxation(act, z0, lo, hi)
    z = lo[:, None] + (hi - lo)[:, None] * torch.linspace(0, 1, 301, dtype=torch.float64)
    f = lambda t: activate(act, t)
    err = f(z) - f(z0)[:, None] - lam[:, None] * (z - z0[:, None]) - beta[:, None]
    assert (err.abs() <= mu[:, None] * (1 + 1e-9) + 1e-14).all()  # the evaluations' own rounding


def _random_gelu_tanh_vit(seed: int, act: str = "gelu_tanh") -> ViT:
    torch.manual_seed(seed)
    cfg = ViTConfig(image=8, classes=4, d=8, depth=2, heads=2, patch=2, ffn=16, constraint=None,
                    ffn_constraint=None, activation=act)
    return ViT(cfg, constrained=False).double()


@pytest.mark.parametrize("seed,eps,act", [(0, 0.02, "gelu_tanh"), (1, 0.1, "gelu_tanh"),
                                          (1, 0.1, "gelu_tanh_f32")])
def test_a_gelu_tanh_vit_is_certified_soundly(seed, eps, act):
    from test_taylor_net import margins_hold
    net = _random_gelu_tanh_vit(seed, act)
    x = torch.rand(6, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    cert = TaylorNet(net, x, y).certify(eps)
    lower = margins_hold(net, x, y, cert.lower, eps, 16, 9)
    assert torch.isfinite(lower).all() and cert.certified.any()


def test_crown_bounds_the_same_network():
    """CROWN beside it (bounds.network.netcrown): the traced network computes the tanh approximation
    from ops auto_LiRPA bounds, and its margins' lower bounds hold at sampled perturbations."""
    pytest.importorskip("auto_LiRPA")
    from test_taylor_net import perturbations

    from bounds.network.netcrown import TracedViT, verify
    net = _random_gelu_tanh_vit(0)
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
        assert torch.allclose(TracedViT(net)(x.reshape(3, -1)), net(x), atol=1e-12)
    v = verify(net, x, y, 0.02)
    assert torch.isfinite(v.lower).all()
    with torch.no_grad():
        for delta in perturbations(x, 0.02, 8, torch.Generator().manual_seed(3)):
            logits = net(x + delta)
            others = [[j for j in range(4) if j != int(t)] for t in y]
            margins = logits.gather(-1, y[:, None]) - logits.gather(-1, torch.tensor(others))
            assert (margins >= v.lower - 1e-9).all()
