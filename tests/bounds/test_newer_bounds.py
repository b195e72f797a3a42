"""Castin et al. 2024 and Yudin et al. 2025 (docs/bounds.md §3.5, §3.6): their pieces against dense
float64 constructions written here, and both certified bounds against PGD on 500 random cases
(saturated and uniform attention, biases, n = 1, X = 0)."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

import attacks
import bounds
import models
from bounds.lipschitz.castin import castin_constant
from bounds.lipschitz.yudin import attention_box
from bounds.remainder.row_bounds import softmax_jacobian_norm

REL = 1e-6


def dense_softmax_jacobian_norm(p: torch.Tensor) -> torch.Tensor:
    J = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
    return torch.linalg.eigvalsh(J)[..., -1]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 30])
def test_the_softmax_jacobian_bound_holds_over_its_box(n):
    g = torch.Generator().manual_seed(n)
    for scale in (0.0, 0.3, 3.0, 30.0):
        S = torch.randn(200, n, generator=g, dtype=torch.float64) * scale
        dev = torch.rand(200, n, generator=g, dtype=torch.float64) * 0.5
        lo, hi = attention_box(S, dev)
        bound = softmax_jacobian_norm(lo, hi)
        for _ in range(20):
            delta = (2 * torch.rand(200, n, generator=g, dtype=torch.float64) - 1) * dev
            p = torch.softmax(S + delta, -1)
            assert torch.all(p >= lo * (1 - 1e-12)) and torch.all(p <= hi * (1 + 1e-12))
            assert torch.all(dense_softmax_jacobian_norm(p) <= bound + 1e-15)
        # at a point (no deviation) the two simple bounds meet the truth where they should:
        # uniform rows (1/n) and two equal tops (½)
    u = torch.full((1, n), 1 / n, dtype=torch.float64)
    assert softmax_jacobian_norm(u, u).item() == pytest.approx(dense_softmax_jacobian_norm(u).item())


def test_the_softmax_jacobian_bound_is_not_a_constant():
    # it follows the rows: a peaked row has a small Jacobian, where ½ is the global constant
    p = torch.tensor([[0.98, 0.01, 0.01]], dtype=torch.float64)
    assert softmax_jacobian_norm(p, p).item() < 0.05
    assert softmax_jacobian_norm(p, p).item() >= dense_softmax_jacobian_norm(p).item()


def _one_head(Y: torch.Tensor, A: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Castin et al.'s self-attention, written out: ``f(Y)_i = Σ_j softmax_j(y_iᵀ A y_j) V y_j``."""
    P = torch.softmax(Y @ A @ Y.T, -1)
    return P @ Y @ V.T


@pytest.mark.parametrize("n", [1, 2, 5])
def test_castins_constant_bounds_the_jacobian_on_the_ball_of_tokens(n):
    g = torch.Generator().manual_seed(10 + n)
    d = 3
    for scale in (0.3, 1.0, 4.0):
        A = torch.randn(d, d, generator=g, dtype=torch.float64) * scale
        V = torch.randn(d, d, generator=g, dtype=torch.float64)
        R = 1.5
        const = castin_constant(torch.linalg.matrix_norm(A, 2), torch.linalg.matrix_norm(V, 2),
                                torch.tensor(R, dtype=torch.float64), n)
        for _ in range(10):
            Y = torch.randn(n, d, generator=g, dtype=torch.float64)
            Y = R * Y / Y.norm(dim=-1, keepdim=True)  # tokens on the sphere: the ball's edge
            J = torch.autograd.functional.jacobian(functools.partial(_one_head, A=A, V=V), Y)
            J = J.reshape(n * d, n * d)
            assert torch.linalg.matrix_norm(J, 2) <= const * (1 + 1e-12)


@pytest.mark.parametrize("bias", [0.0, 0.7])
def test_yudin_at_x_bounds_the_dense_jacobian_at_x(bias):
    for seed in range(6):
        h = (1, 2)[seed % 2]
        layer = models.random_dot(4 * h, h, seed=seed, q_norm=2.0, k_norm=2.0, bias_norm=bias,
                                  residual=seed % 3 == 0)
        X = models.random_input(4, 4 * h, norm=(0.5, 3.0, 8.0)[seed % 3], seed=seed, batch=1)[0]
        J = torch.autograd.functional.jacobian(layer.forward, X).reshape(X.numel(), X.numel())
        eps = 1e-3
        value = bounds.evaluate("yudin_local", layer, X, eps)
        assert value.item() >= eps * torch.linalg.matrix_norm(J, 2).item() * (1 - REL)
        # over the ball it can only be larger
        assert bounds.evaluate("yudin", layer, X, eps).item() >= value.item()


# --- the audit: 125 layers × 4 inputs ---------------------------------------------------------------

N_LAYERS, BATCH = 125, 4


@functools.cache
def config(k: int) -> dict:
    rnd = random.Random(f"newer-{k}")
    h = (1, 2, 4)[k % 3]
    return {
        "n": 1 if k % 10 == 0 else rnd.randint(2, 7), "d": h * rnd.choice((1, 2, 3)), "h": h,
        "residual": k % 2 == 0,
        # up to ‖A_l‖ ≈ 250: softmax saturated at every input of norm ≥ 1
        "weight_norm": 10 ** rnd.uniform(-0.5, 1.2),
        "bias_norm": 0.0 if k % 3 else 10 ** rnd.uniform(-1, 0.5),
        "eps": 10 ** rnd.uniform(-3, math.log10(0.5)),
        # X = 0 (uniform attention) in every fifth layer
        "norms": (0.0, 0.1, 1.0, 10.0) if k % 5 == 0
        else tuple(10 ** rnd.uniform(-1, 1) for _ in range(BATCH)),
        "seed": 7000 + k,
    }


@functools.cache
def case(k: int):
    cfg = config(k)
    X = torch.cat([models.random_input(cfg["n"], cfg["d"], norm=xn or 1.0, seed=10 * cfg["seed"] + i)
                   * (xn > 0) for i, xn in enumerate(cfg["norms"])])
    layer = models.random_layer("dot", cfg["d"], cfg["h"], seed=cfg["seed"], weight_norm=cfg["weight_norm"],
                                residual=cfg["residual"], bias_norm=cfg["bias_norm"])
    return layer, X


@functools.cache
def pgd(k: int) -> torch.Tensor:
    layer, X = case(k)
    return attacks.attack(layer, X, config(k)["eps"], "output", steps=100, restarts=4)


@pytest.mark.parametrize("name", ["castin", "yudin"])
def test_the_newer_certified_bounds_hold_against_pgd_on_500_cases(name):
    violations, ratios = [], []
    for k in range(N_LAYERS):
        layer, X = case(k)
        value = bounds.evaluate(name, layer, X, config(k)["eps"])
        lower = pgd(k)
        assert torch.isfinite(value).all() and torch.all(lower > 0)
        ratios.append(value / lower)
        for i in (~(value >= lower * (1 - REL))).nonzero()[:, 0].tolist():
            violations.append(f"layer {k} {config(k)} input {i}: {name} = {value[i]:.6g} "
                              f"< pgd {lower[i]:.6g}")
    assert not violations, "\n".join(violations)
    assert len(torch.cat(ratios)) == 500
