"""The ordering facts of docs/bounds.md §2 and §2.2, on many random dot-product layers and inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

import bounds
import models
from bounds.lofast import m_norms, xi, zeta

SLACK = 1e-9  # relative, for round-off between two exactly ordered quantities


def le(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.all(a <= b * (1 + SLACK) + 1e-300))


def random_case(k: int):
    rnd = random.Random(k)
    h = rnd.choice((1, 2, 4))
    d, n = h * rnd.choice((1, 2, 3)), rnd.randint(1, 7)
    ws = 10 ** rnd.uniform(-0.7, 0.7)
    layer = models.random_dot(d, h, seed=k, q_norm=ws, k_norm=10 ** rnd.uniform(-0.5, 0.5),
                              v_norm=ws, o_norm=10 ** rnd.uniform(-0.5, 0.5),
                              residual=rnd.random() < 0.5)
    X = torch.cat([models.random_input(n, d, norm=10 ** rnd.uniform(-1, 1), seed=100 * k + i)
                   for i in range(4)])
    return layer, X, 10 ** rnd.uniform(-3, math.log10(0.5))


CASES = range(40)


@pytest.mark.parametrize("k", CASES)
def test_orderings(k):
    layer, X, eps = random_case(k)
    ev = {name: bounds.evaluate(name, layer, X, eps) for name in (
        "naive_delta1", "delta1", "naive", "delta2_M", "delta2_xi", "lofast_M", "lofast_xi",
        "lofast_M_half", "lofast_xi_half", "delta21_M", "delta21_xi", "delta22_tight",
        "delta22_naive")}
    M, Xi = m_norms(layer, X, method="dense"), xi(layer, X)
    assert M.shape == Xi.shape == (X.shape[0], layer.h)
    assert le(M, Xi), "‖M_l‖ <= ξ_l"
    assert le(m_norms(layer, X), Xi), "‖M_l‖ (Lanczos) <= ξ_l"
    assert le(ev["delta21_M"], ev["delta21_xi"])
    assert le(ev["delta2_M"], ev["delta2_xi"]), "δ₂⁽¹⁾ <= δ₂⁽²⁾"
    for method in ("lanczos", "dense"):
        assert le(zeta(layer, X, method=method), ev["naive_delta1"] / eps), "ζ <= naive δ₁/ε"
    assert le(ev["delta1"], ev["naive_delta1"])
    assert le(ev["delta22_tight"], ev["delta22_naive"]), "δ₂,₂⁽¹⁾ <= δ₂,₂⁽²⁾"
    assert le(ev["lofast_M_half"], ev["lofast_M"])
    assert le(ev["lofast_xi_half"], ev["lofast_xi"])
    assert le(ev["lofast_M_half"], ev["lofast_xi_half"])
    assert le(ev["lofast_M"], ev["lofast_xi"])
    assert le(ev["lofast_xi"], ev["naive"])
    # the halved variants halve exactly the δ₂ part
    torch.testing.assert_close(ev["lofast_M"] - ev["lofast_M_half"], ev["delta2_M"] / 2,
                               rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(ev["lofast_xi"] - ev["lofast_xi_half"], ev["delta2_xi"] / 2,
                               rtol=1e-9, atol=1e-15)
    # ... and the totals are the sums of their parts (Theorem 1, Fig. 1)
    torch.testing.assert_close(ev["lofast_M"], ev["delta1"] + ev["delta2_M"], rtol=1e-12, atol=0)
    torch.testing.assert_close(ev["naive"], ev["naive_delta1"] + ev["delta2_xi"], rtol=1e-12,
                               atol=0)


def test_orderings_are_not_all_ties():
    """On generic cases the inequalities are strict, so the checks above could catch a swap."""
    strict = {"M<xi": 0, "zeta<naive": 0, "d22": 0, "xi<naive": 0}
    for k in CASES:
        layer, X, eps = random_case(k)
        if X.shape[1] < 2:
            continue
        strict["M<xi"] += bool(torch.any(m_norms(layer, X, method="dense") < xi(layer, X) * 0.999))
        strict["zeta<naive"] += bool(torch.any(
            bounds.evaluate("delta1", layer, X, eps)
            < bounds.evaluate("naive_delta1", layer, X, eps) * 0.999))
        strict["d22"] += bool(torch.any(bounds.evaluate("delta22_tight", layer, X, eps)
                                        < bounds.evaluate("delta22_naive", layer, X, eps) * 0.999))
        strict["xi<naive"] += bool(torch.any(bounds.evaluate("lofast_xi", layer, X, eps)
                                             < bounds.evaluate("naive", layer, X, eps) * 0.999))
    assert all(v > 0 for v in strict.values()), strict
