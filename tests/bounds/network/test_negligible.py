"""A network certificate's Taylor bound skips the remainder's forms where the cheaper remainders are
a negligible share of the first order (bounds.taylor.TaylorOptions.negligible, docs/bounds.md §5): it is
never below the full bound, never more than that share of σ̄_J·ε above it, and the full bound where
the remainder is not negligible."""

from __future__ import annotations

import math

import pytest
import torch

from bounds.remainder import remainder
from bounds.taylor import TaylorOptions, remainder_core, sigma_J, taylor
from models.build import random_dot


def _layer_and_inputs(scale: float, seed: int):
    # n·d ≥ h·n² so that the full bound takes the quadratic form; the inputs' norms differ by 30×,
    # so that at one ε some remainders are negligible and some are not
    layer = random_dot(16, 2, seed=seed, q_norm=scale, k_norm=scale)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    X = X / X.flatten(1).norm(dim=1)[:, None, None] * torch.tensor([0.2, 1.0, 3.0, 6.0])[:, None, None]
    return layer, X


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("share", [1e-3, 1e-1])
@pytest.mark.parametrize("eps", [1e-3, 0.05])
def test_the_skip_costs_at_most_its_share(seed, share, eps):
    layer, X = _layer_and_inputs(1.0 + seed, seed)
    full = taylor(layer, X, eps)
    cut = taylor(layer, X, eps, options=TaylorOptions(negligible=share))
    first = sigma_J(layer, X) * eps
    cheap = remainder(layer, X, eps, remainder_core(layer, X), quadratic=False)
    kept = cheap > share * first  # where the forms were computed, on those inputs alone
    # computed on a sub-batch: the forms' guesses may stop elsewhere (FORM_TAU), nothing more
    torch.testing.assert_close(cut[kept], full[kept], rtol=1e-5, atol=0)
    skipped = ~kept
    torch.testing.assert_close(cut[skipped], first[skipped] + cheap[skipped], rtol=1e-14, atol=0)
    assert (cut[skipped] >= full[skipped]).all()
    assert (cut <= full + share * first * (1 + 1e-9)).all()
    if share == 1e-1 and eps == 1e-3:
        assert skipped.any()  # the case does test the skip


def test_the_share_is_checked_and_no_options_skip_nothing():
    layer, X = _layer_and_inputs(2.0, 0)
    with pytest.raises(ValueError, match="share"):
        TaylorOptions(negligible=1.0)
    before = taylor(layer, X, 1e-3)
    taylor(layer, X, 1e-3, options=TaylorOptions(negligible=0.5))
    assert torch.equal(taylor(layer, X, 1e-3), before)
    assert torch.equal(taylor(layer, X, 1e-3, options=TaylorOptions()), before)


@pytest.mark.parametrize("seed", range(3))
def test_inputs_named_not_needed_skip_the_forms_and_the_rest_keep_them(seed):
    """bounds.taylor.TaylorOptions.not_needed: the inputs it names take the cheaper remainders alone (a
    looser, still certified value), the others the full bound (computed on a sub-batch: to the forms'
    stopping tolerance)."""
    layer, X = _layer_and_inputs(1.0 + seed, seed)
    full = taylor(layer, X, 0.05)
    skip = torch.tensor([True, False, True, False])
    cut = taylor(layer, X, 0.05, options=TaylorOptions(not_needed=skip))
    cheap = sigma_J(layer, X) * 0.05 + remainder(layer, X, 0.05, remainder_core(layer, X), quadratic=False)
    torch.testing.assert_close(cut[skip], cheap[skip], rtol=1e-14, atol=0)
    torch.testing.assert_close(cut[~skip], full[~skip], rtol=1e-5, atol=0)
    assert bool((cut >= full * (1 - 1e-12)).all())


@pytest.mark.parametrize("name", ["taylor", "best"])
@pytest.mark.parametrize(("stem", "eps"), [("digits-d32-b2-h2-c0.5", 0.02),
                                           ("digits-d32-b2-h2-c0.5-q1", 0.005),
                                           ("digits-d32-b2-h2-c0.5-q1", 0.01)])
def test_the_network_bound_skips_only_what_its_first_order_already_fails(monkeypatch, name, stem, eps):
    """Certifier's ``taylor`` and ``best``: the images whose first-order chain L_N already fails the
    pairwise test skip the forms. No full-bound verdict changes, the other images' δ_features are the
    full bound's (to rounding), and a skipped image is never one the full bound certifies; on the
    recipe model at ε 0.02 every image skips (``taylor`` took 17.5 s on 32 images with the forms,
    2.0 s without)."""
    from helpers import ROOT

    from bench.nets.accuracy import first_test_images, load_model
    from bounds.certificates import Ledger
    from bounds.network import Certifier

    net, _ = load_model(ROOT / "zoo" / f"{stem}.safetensors")
    x, y = first_test_images("digits", net, 16)
    c = Certifier(net, x.double(), y)
    norms = {}
    skip = c.first_order_fails(torch.full_like(c.logits[:, 0], c.embedding * eps), Ledger(cache=norms))
    cut = c.certify(name, eps, norms)
    c = Certifier(net, x.double(), y)
    monkeypatch.setattr(c, "first_order_fails", lambda r0, ledger: torch.zeros_like(r0, dtype=torch.bool))
    full = c.certify(name, eps, {})
    assert torch.equal(cut.pairwise, full.pairwise) and torch.equal(cut.prop1, full.prop1)
    assert not bool((skip & full.pairwise).any()) and bool(skip.any())
    torch.testing.assert_close(cut.delta[~skip], full.delta[~skip], rtol=1e-10, atol=0)
    assert bool((cut.delta[skip] >= full.delta[skip] * (1 - 1e-12)).all())
    if stem == "digits-d32-b2-h2-c0.5":
        assert bool(skip.all())


@pytest.mark.parametrize("seed", range(3))
def test_bests_other_ingredients_grow_with_the_radius(seed):
    """What Certifier.first_order_fails assumes of ``best``: each of its ingredients but taylor is
    non-decreasing in the radius, checked on random layers (with biases, sharp attention) at radii
    from 1e-4 to 2 per input."""
    from bounds.registry import best_ingredients

    layer = random_dot(16, 2, seed=seed, q_norm=1.0 + 3 * seed, bias_norm=0.5 * seed) if seed else \
        random_dot(16, 2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(3, 6, 16, generator=g, dtype=torch.float64)
    radii = torch.logspace(-4, math.log10(2.0), 25, dtype=torch.float64)
    others = [b for b in best_ingredients(layer) if b.name != "taylor"]
    assert {b.name for b in others} >= {"naive", "lofast_M", "lofast_xi"}
    for b in others:
        values = torch.stack([b.fn(layer, X, r.expand(3)) for r in radii])  # [radii, B]
        assert bool((values[1:] >= values[:-1]).all()), b.name
