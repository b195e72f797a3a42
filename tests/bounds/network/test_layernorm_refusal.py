"""A block's LayerNorm refuses an image whose set exceeds the norm's range at every token
(bounds.network.stages.layernorm.layer_norm; docs/bounds.md §5.1, "LayerNorm"): the range lemma
‖LN(x) − LN(x₀)‖ ≤ 2√d·max|γ| against nn.LayerNorm (reached within 1 %, so a smaller constant fails),
the pass stopping where every image is refused, and refusal costing no verdict on random standard ViTs
where the unrefused pass certifies some images and not others."""

from __future__ import annotations

import math

import pytest
import torch
from test_standard_vit import standard_vit

import bounds.network.taylor_net as taylor_net
from bounds.network.taylor_net import REFUSED, TaylorNet


@pytest.mark.parametrize("d", [2, 8, 64])
@pytest.mark.parametrize("e", [0.0, 1e-5, 1e-2])
def test_layernorms_change_is_within_its_range_and_reaches_it(d, e):
    gen = torch.Generator().manual_seed(d)
    norm = torch.nn.LayerNorm(d, eps=e).double()
    with torch.no_grad():
        norm.weight.uniform_(-2.0, 2.0, generator=gen)
        norm.bias.uniform_(-1.0, 1.0, generator=gen)
    bound = 2 * math.sqrt(d) * float(norm.weight.abs().max())
    scale = torch.logspace(-4, 4, 9, dtype=torch.float64)[:, None, None]
    x0 = torch.randn(9, 200, d, generator=gen, dtype=torch.float64) * scale
    x = torch.randn(9, 200, d, generator=gen, dtype=torch.float64) * scale.flip(0)
    with torch.no_grad():
        change = (norm(x) - norm(x0)).norm(dim=-1)
        assert float(change.max()) <= bound * (1 + 1e-12)
        # reached: γ one value up to sign on a token of two coordinates far from σ = 0, and its mirror
        norm.weight.fill_(float(norm.weight.abs().max()))
        t = torch.zeros(1, d, dtype=torch.float64)
        t[0, 0], t[0, 1] = 1e3, -1e3
        if d > 2:
            t = torch.where(torch.arange(d) < d // 2, 1e3, -1e3)[None].double()
        assert float((norm(t) - norm(-t)).norm()) >= 0.99 * bound


PLAIN = taylor_net.layer_norm  # as imported, before any test patches it


def refusing(monkeypatch, refuse: bool) -> None:
    """Every block norm of a pass with ``refuse`` (the final norm never refuses)."""

    def forced(*args, **kwargs):
        if kwargs.get("refuse", True):
            kwargs["refuse"] = refuse
        return PLAIN(*args, **kwargs)

    monkeypatch.setattr(taylor_net, "layer_norm", forced)


def test_an_image_past_every_tokens_range_is_refused_and_the_pass_stops():
    net = standard_vit(1, 1.0)
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    tn = TaylorNet(net, x, y)
    with torch.inference_mode():
        names = [name for name, _, _ in tn.stages(5.0)]
        full = [name for name, _, _ in tn.stages(5.0, refuse=False)]
    assert names[-1] == REFUSED and len(names) < len(full) and full[-1] == "norm_out"
    cert = tn.certify(5.0)
    assert cert.diagnostics.refused.all() and not cert.certified.any()
    assert (cert.lower[~torch.nn.functional.one_hot(y, 4).bool()] == -math.inf).all()


@pytest.mark.parametrize("seed,qk,grid", [(0, 0.5, (0.15,)), (2, 1.0, (0.04, 0.05)), (3, 0.3, (0.1, 0.15))])
def test_refusing_costs_no_verdict(monkeypatch, seed, qk, grid):
    """At each ε the refusing pass certifies exactly what the unrefused one does, where it certifies
    some images and refuses others (each ε at the edge of what these networks certify)."""
    net = standard_vit(seed, qk)
    x = torch.rand(12, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    mixed = refused = 0
    for eps in grid:
        refusing(monkeypatch, False)
        plain = TaylorNet(net, x, y).certify(eps)
        refusing(monkeypatch, True)
        cert = TaylorNet(net, x, y).certify(eps)
        assert torch.equal(cert.certified, plain.certified), eps
        assert not (cert.certified & cert.diagnostics.refused).any()
        mixed += bool(plain.certified.any() and not plain.certified.all())
        refused += int(cert.diagnostics.refused.sum())
    assert mixed and refused  # the grid holds both kinds of image
