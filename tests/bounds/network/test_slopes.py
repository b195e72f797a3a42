"""taylor_net's optimized slopes (docs/bounds.md §5.1, "Optimized slopes"; registry name
``taylor_net_alpha``): the second pass's last backward pass with every ReLU's lower slope tuned is
never below CROWN's slopes' bound, and never above a margin change reached by sampled and attacked
perturbations, on a zoo model and on random ViTs up to saturated attention."""

from __future__ import annotations

import pytest
import torch
from test_taylor_net import attacked_margins_hold, margins_hold, six_images

from bounds.network.slopes import optimized_backward
from bounds.network.taylor_net import TaylorNet


@pytest.mark.parametrize("which,eps", [("sharp", 0.05), ("random", 0.2), ("saturated", 0.01)])
def test_tuned_slopes_are_sound_and_never_worse(which, eps):
    net, x, y = six_images(which)
    tn = TaylorNet(net, x, y)
    with torch.no_grad():
        plain = tn.one_pass(eps, slice(None), "taylor", refine=True)[0]
        tuned = tn.one_pass(eps, slice(None), "taylor+alpha", refine=True)[0]
    finite = torch.isfinite(plain)
    assert (tuned[finite] >= plain[finite] - 1e-12).all()  # CROWN's slopes are its first iterate
    assert (tuned[finite] > plain[finite]).any()  # and the steps move it (0.003–0.63 on these cases)
    lower = margins_hold(net, x, y, tuned, eps, 12, 5)
    attacked_margins_hold(net, x, y, lower, eps, 40)  # an attack on each margin ends above its bound


def test_the_slopes_stay_in_their_interval():
    """Adam may step α out of [0, 1]; the bound is taken only after projecting back (relu(z) ≥ αz
    needs α ∈ [0, 1]): an α of 2 or −1 gives the bound of its clamp."""
    from bounds.network.stages.ffn import relu_bounds
    g = torch.tensor([1.0, 1.0]).double()
    z0, lo, hi = torch.zeros(2).double(), -torch.ones(2).double(), torch.ones(2).double()
    for a, clamped in ((2.0, 1.0), (-1.0, 0.0)):
        got = relu_bounds(g, z0, lo, hi, torch.full((2,), a).double())
        want = relu_bounds(g, z0, lo, hi, torch.full((2,), clamped).double())
        assert all(torch.equal(u, v) for u, v in zip(got, want, strict=True))


def test_no_relu_no_tuning():
    """A log without ReLU records returns the plain backward pass."""
    lam = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    embed = torch.randn(3, 4, 5, dtype=torch.float64)
    low, _ = optimized_backward([], lam, embed, 0.1, 1e-9)
    assert torch.allclose(low, -0.1 * torch.einsum("bcnd,ndp->bcp", lam, embed).norm(dim=-1))
