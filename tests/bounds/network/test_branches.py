"""taylor_net's branches on the kinks (docs/bounds.md §5.1, "Branches on the kinks"; registry name
``taylor_net_bab``): a ReLU held on one side of 0 is exact there, a part's bound holds on its part of
the ball (sampled deviations, the unit's true pre-activation read off the network), and the branched
margins are never below the pass's own bounds nor above a margin change that samples and an attack
reach, on a zoo model and on random ViTs up to saturated attention."""

from __future__ import annotations

import pytest
import torch
from test_taylor_net import SHARP, attacked_margins_hold, margins_hold, perturbations, six_images

from bench.nets.accuracy import first_test_images
from bounds.network.backward import Losses, backward
from bounds.network.branches import branch_and_bound
from bounds.network.stages.ffn import FFNRecord, relu_bounds
from bounds.network.taylor_net import ROUND, TaylorNet
from models.vit_io import load_vit


@pytest.mark.parametrize("phase", [1, -1])
def test_a_held_unit_is_exact_on_its_side(phase):
    """g·(relu(z) − relu(z0)) = g·s·(z − z0) + g·b for every z on the held side, whichever side the
    clean z0 is on (an offset that assumed z0 on the held side, as a range clipped at 0 would, is off
    by relu(z0) there)."""
    gen = torch.Generator().manual_seed(1)
    lo = -torch.rand(400, generator=gen, dtype=torch.float64)
    hi = torch.rand(400, generator=gen, dtype=torch.float64)
    z0 = lo + (hi - lo) * torch.rand(400, generator=gen, dtype=torch.float64)
    g = torch.randn(400, generator=gen, dtype=torch.float64)
    s, b = relu_bounds(g, z0, lo, hi, phase=torch.full((400,), phase, dtype=torch.int8))
    side = hi if phase > 0 else lo
    assert ((z0 > 0).any() and (z0 < 0).any())
    for t in torch.linspace(0, 1, 11, dtype=torch.float64):
        z = side * t
        torch.testing.assert_close(g * (torch.relu(z) - torch.relu(z0)), g * s * (z - z0) + g * b,
                                   rtol=0, atol=1e-15)
    free = relu_bounds(g, z0, lo, hi, phase=torch.zeros(400, dtype=torch.int8))
    assert all(torch.equal(u, v) for u, v in zip(free, relu_bounds(g, z0, lo, hi), strict=True))


def _ffn_inputs(net, x: torch.Tensor) -> list[torch.Tensor]:
    """Each lofast block's FFN pre-activations W₁Y + b₁ [B, n, w] at the images x."""
    out, X = [], net.tokens(x)
    for block in net.blocks:
        Y = block.attn(block.prepare(X))
        out.append(Y @ block.ffn.up.weight.T + block.ffn.up.bias)
        X = block.ffn(Y)
    return out


def _unit_grad(net, x: torch.Tensor, block: int, tok: int, unit: int) -> torch.Tensor:
    """The gradient of one FFN pre-activation with respect to the image, at x."""
    d = torch.zeros_like(x, requires_grad=True)
    (g,) = torch.autograd.grad(_ffn_inputs(net, x + d)[block][0, tok, unit], d)
    return g


def test_each_part_bounds_the_margin_where_its_unit_keeps_its_sign():
    """Split a costly ReLU of a short margin (one whose true pre-activation takes both signs in the
    ball): each side's bound is below the margin's change at every deviation found on that side
    (sampled around the unit's gradient line, and the iterates of an attack on the margin), both sides
    reached; and the two sides' bounds differ."""
    net, _ = load_vit(SHARP)
    x, y = first_test_images("digits", net, 2)
    x = x.double()[1:2]
    y = y[1:2]
    eps = 0.1
    tn = TaylorNet(net, x, y)
    log: list = []
    with torch.no_grad():
        tn.stages(eps, slice(None), log, refine=True, form=False)
        W = net.head_matrix()
        n = tn.last.shape[1]
        j = int((tn.logits[0] - 1e9 * torch.nn.functional.one_hot(y, W.shape[0])[0]).argmax())
        Lam = ((W[y[0]] - W[j]) / n)[None, None, None, :].expand(1, 1, n, -1).contiguous()
        costs = Losses()
        backward(log, Lam, tn.embed, eps, costs)
    found = None
    for at in (a for a in costs.units if isinstance(log[a], FFNRecord)):
        rec = log[at]
        block = sum(isinstance(r, FFNRecord) for r in log[:at])
        for flat in (-costs.units[at]).flatten().topk(10).indices.tolist():
            tok, unit = divmod(flat, rec.z0.shape[-1])
            g = _unit_grad(net, x, block, tok, unit)
            u = g / g.norm()
            with torch.no_grad():
                ends = [float(_ffn_inputs(net, x + s * eps * u)[block][0, tok, unit]) for s in (1, -1)]
            if ends[0] > 0 > ends[1]:
                found = at, rec, block, tok, unit, u
                break
        if found:
            break
    assert found, "no costly unit whose pre-activation changes sign in the ball"
    at, rec, block, tok, unit, u = found
    bounds = {}
    with torch.no_grad():
        for side in (1, -1):
            ph = torch.zeros(1, 1, *rec.z0.shape[1:], dtype=torch.int8)
            ph[0, 0, tok, unit] = side
            bounds[side] = float(backward(log, Lam, tn.embed, eps, phases={at: ph})[0][0, 0])
        clean = net(x)
        base = clean[0, y[0]] - clean[0, j]
    assert bounds[1] != bounds[-1]
    seen = {1: 0, -1: 0}

    def check(delta: torch.Tensor) -> None:
        with torch.no_grad():
            z = _ffn_inputs(net, x + delta)[block][0, tok, unit]
            moved = net(x + delta)
            change = float(moved[0, y[0]] - moved[0, j] - base)
        side = 1 if z >= 0 else -1
        seen[side] += 1
        assert change >= bounds[side] - 1e-9, (side, change, bounds[side])

    gen = torch.Generator().manual_seed(5)
    for t in torch.linspace(-1, 1, 41, dtype=torch.float64):
        for noise in perturbations(x, eps, 20, gen):
            d = t * u * eps * 0.8 + 0.6 * noise
            check(d * min(1.0, eps / float(d.norm())))
    d = torch.zeros_like(x, requires_grad=True)
    for _ in range(60):  # an attack on the margin; every iterate checked on its side
        m = net(x + d)
        (g,) = torch.autograd.grad(m[0, y[0]] - m[0, j], d)
        with torch.no_grad():
            d -= 0.1 * eps * g / g.norm().clamp_min(1e-300)
            d *= eps / d.norm().clamp_min(eps)
        check(d.detach())
    assert seen[1] and seen[-1], seen


# the saturated network at ε 0.01 moved (by 0.016) until attention's remainder along a functional took
# its first-order form (docs/bounds.md §5.1, "At large logit spans"), which raised its furthest-short
# bound from −0.56 to −0.39 and its kinks' cost from 0.048 to 0.021: no branch moves a bound there since
@pytest.mark.parametrize("which,eps,moves", [("sharp", 0.1, True), ("saturated", 0.01, False),
                                            ("random", 0.3, False), ("saturated", 0.05, False)])
def test_branched_margins_are_sound_and_never_worse(which, eps, moves):
    """``moves``: some margin's bound rises (an image branches on its furthest-short margin first and
    stops where that fails, so where every image is far short no bound need rise)."""
    net, x, y = six_images(which)
    tn = TaylorNet(net, x, y, branch_budget=2000)  # the default's 20,000 cost minutes on the short images
    with torch.no_grad():
        plain = tn.one_pass(eps, slice(None), "taylor", refine=True)[0]
        branched = tn.one_pass(eps, slice(None), "taylor+bab", refine=True)[0]
    finite = torch.isfinite(plain)
    # a part's bound is net of its rounding slack (1e-9 of its terms): never below the pass's beyond that
    assert (branched[finite] >= plain[finite] - 1e-6).all()
    assert (branched[finite] > plain[finite] + 1e-6).any() or not moves
    lower = margins_hold(net, x, y, branched, eps, 12, 5)
    attacked_margins_hold(net, x, y, lower, eps, 40)  # an attack on each margin ends above its bound


def test_nothing_to_branch_on_returns_the_root():
    """No margin asked, a zero budget, or a log without a ReLU: the root's bounds, unchanged."""
    net, x, y = six_images("random")
    tn = TaylorNet(net, x, y)
    log: list = []
    eps = 0.4
    with torch.no_grad():
        tn.stages(eps, slice(None), log, refine=True, form=False)
        Lam = torch.randn(6, 3, *tn.last.shape[1:], generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
        root = backward(log, Lam, tn.embed, eps)[0]
        need = torch.ones_like(root, dtype=torch.bool)
        lim = root + 0.05 * root.abs()  # within reach of the branches (REACH)
        assert torch.equal(branch_and_bound(log, Lam, tn.embed, eps, ~need, lim, root, ROUND), root)
        assert torch.equal(branch_and_bound(log, Lam, tn.embed, eps, need, lim, root, ROUND, budget=0), root)
        assert torch.equal(branch_and_bound([], Lam, tn.embed, eps, need, lim, root, ROUND), root)
        more = branch_and_bound(log, Lam, tn.embed, eps, need, lim, root, ROUND, budget=64)
        assert (more >= root).all() and (more > root).any()
