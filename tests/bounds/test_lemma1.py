"""Lemma 1 of LoFAST is exact: PGD on ‖Δ₁‖ must reach ζ(X)ε and never exceed it (docs/bounds.md §4).

This checks both sides at once: ζ (checked against an independent Kronecker construction in
test_exact.py) and the attack machinery.

Cold PGD (random starts only) converges like a damped power iteration on KᵀK, so it is slow when
the top of ζ's spectrum is nearly degenerate (residual layers with small weights: K ≈ I). The cold
cases below use weight scales of 0.5 to 2.5, where 500 steps suffice; the nearly degenerate cases
are covered with the warm start of docs/bounds.md §4 (the top singular direction of Δ₁).
"""

from __future__ import annotations

import pytest
import torch

import attacks
import models
from bounds.lofast import zeta

TOL = 1e-3

# (n, d, h, residual, input norm, weight scale, eps, seed)
COLD = [
    (2, 4, 1, True, 1.0, 1.0, 0.1, 0),
    (4, 6, 2, False, 3.0, 1.5, 0.01, 1),
    (5, 8, 4, True, 0.5, 0.6, 0.3, 2),
    (3, 4, 2, False, 10.0, 0.8, 0.05, 3),
    (6, 8, 2, True, 2.0, 2.0, 0.5, 4),
    (4, 4, 4, False, 0.1, 2.5, 1e-3, 5),
    (8, 8, 2, False, 5.0, 1.0, 0.2, 6),
    (3, 6, 3, True, 1.0, 0.7, 0.1, 7),
    (7, 3, 1, True, 0.3, 1.2, 0.02, 8),
]

# nearly degenerate spectra: residual, small weights (cold PGD needs thousands of steps here)
NEAR_DEGENERATE = [
    (8, 6, 2, True, 4.17, 0.124, 0.054, 25),
    (5, 12, 4, True, 2.28, 0.157, 0.0025, 11),
    (7, 4, 1, True, 0.10, 0.105, 0.11, 35),
    (2, 8, 2, True, 0.38, 0.154, 0.008, 8),
]


def case(n, d, h, res, xn, ws, seed):
    layer = models.random_dot(d, h, seed=seed, q_norm=ws, k_norm=ws, v_norm=ws, o_norm=ws,
                              residual=res)
    X = models.random_input(n, d, norm=xn, seed=100 + seed, batch=3)
    return layer, X


def check(value: torch.Tensor, exact: torch.Tensor) -> None:
    assert value.shape == exact.shape
    assert torch.all(value >= exact * (1 - TOL)), ((exact - value) / exact).tolist()
    # Lemma 1 is the exact maximum: no perturbation in the ball may exceed it
    assert torch.all(value <= exact * (1 + 1e-9)), ((value - exact) / exact).tolist()


@pytest.mark.parametrize(("n", "d", "h", "res", "xn", "ws", "eps", "seed"), COLD)
def test_cold_pgd_on_delta1_reaches_zeta_eps(n, d, h, res, xn, ws, eps, seed):
    layer, X = case(n, d, h, res, xn, ws, seed)
    exact = zeta(layer, X, method="dense") * eps
    value = attacks.attack(layer, X, eps, "delta1", warm=False, steps=500, restarts=4)
    check(value, exact)


@pytest.mark.parametrize(("n", "d", "h", "res", "xn", "ws", "eps", "seed"),
                         COLD[:4] + NEAR_DEGENERATE)
def test_warm_pgd_on_delta1_reaches_zeta_eps(n, d, h, res, xn, ws, eps, seed):
    layer, X = case(n, d, h, res, xn, ws, seed)
    exact = zeta(layer, X, method="dense") * eps
    value = attacks.attack(layer, X, eps, "delta1")
    check(value, exact)
