"""Spectral norms of low-rank products through their thin factors (docs/bounds.md §2.1):
``models.spectral.product_norm`` against a dense float64 SVD of the formed product, the layer's
``A_norm``, ``C_norm``, ``XC_norm`` and ``logit_factor_norms``, and every closed-form bound that uses
them against its value computed the old way, from SVDs of the formed d×d and n×d matrices."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import np_

import bounds
import models
from bounds import lofast as lf
from bounds import taylor as tay
from bounds.base import radius
from bounds.lipschitz import specformer as sf
from models.spectral import product_norm, spectral

SAME = 1e-12  # relative: the thin form is exact, only rounding differs


def np_norm(L: torch.Tensor, R: torch.Tensor) -> np.ndarray:
    """‖L R‖₂ per trailing pair from numpy's float64 SVD of the formed (broadcast) product."""
    P = np_(L) @ np_(R)
    return np.linalg.svd(P, compute_uv=False)[..., 0]


def rand(gen: torch.Generator, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


# --- product_norm --------------------------------------------------------------------------------

# (L's shape, R's shape): thin (2r ≤ min(m, p)), not thin (the formed product's SVD), broadcast
SHAPES = [
    ((7, 2), (2, 9)), ((40, 4), (4, 30)), ((30, 3), (3, 6)), ((6, 3), (3, 6)), ((9, 5), (5, 11)),
    ((5, 5), (5, 5)), ((8, 12), (12, 3)), ((1, 1), (1, 1)), ((20, 1), (1, 1)),
    ((3, 50, 8), (3, 8, 64)), ((2, 3, 16, 4), (3, 4, 12)), ((4, 1, 10, 2), (3, 2, 10)),
    ((12, 2), (5, 2, 12)),
]


@pytest.mark.parametrize(("ls", "rs"), SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_product_norm_against_svd(ls, rs, seed):
    g = torch.Generator().manual_seed(seed)
    L, R = rand(g, *ls), rand(g, *rs)
    got = product_norm(L, R)
    assert got.shape == torch.broadcast_shapes(ls[:-2], rs[:-2])
    np.testing.assert_allclose(np_(got), np_norm(L, R), rtol=SAME, atol=0)


@pytest.mark.parametrize(("m", "r", "p", "k"), [(30, 6, 40, 2), (30, 6, 40, 1), (16, 8, 20, 5)])
def test_product_norm_rank_deficient(m, r, p, k):
    """Factors of rank k < r (and a product of rank ≤ k): R_L and R_R are singular."""
    g = torch.Generator().manual_seed(k)
    L = rand(g, 3, m, k) @ rand(g, 3, k, r)
    R = rand(g, 3, r, k) @ rand(g, 3, k, p)
    np.testing.assert_allclose(np_(product_norm(L, R)), np_norm(L, R), rtol=SAME, atol=0)
    # columns of L that R's rows never see: L R has rank ≤ r − k and its norm is that of the rest
    L2, R2 = L.clone(), R.clone()
    L2[..., :k] = 0
    R2[..., k:, :] = 0
    assert float(product_norm(L2, R2).abs().max()) == 0.0
    R2 = R.clone()
    R2[..., :k, :] = 0
    ref = np_norm(L[..., k:], R2[..., k:, :])
    np.testing.assert_allclose(np_(product_norm(L, R2)), ref, rtol=SAME, atol=0)


@pytest.mark.parametrize(("m", "r", "p"), [(20, 3, 30), (6, 5, 6)])
def test_product_norm_zero_factors(m, r, p):
    g = torch.Generator().manual_seed(0)
    L, R = rand(g, 2, m, r), rand(g, 2, r, p)
    Z = torch.zeros_like
    for a, b in ((Z(L), R), (L, Z(R)), (Z(L), Z(R))):
        got = product_norm(a, b)
        assert got.shape == (2,) and float(got.abs().max()) == 0.0
    L2 = L.clone()
    L2[1] = 0  # one zero matrix in a batch leaves the others alone
    got = product_norm(L2, R)
    assert float(got[1]) == 0.0
    np.testing.assert_allclose(float(got[0]), np_norm(L[0], R[0]), rtol=SAME)


@pytest.mark.parametrize(("ls", "rs"), [((50, 8), (8, 64)), ((3, 40, 4), (3, 4, 30)), ((6, 5), (5, 6))])
def test_product_norm_float32(ls, rs):
    """float32 factors: a float32 result within float32 rounding of the float64 SVD of the exact
    product of the same (float32-representable) factors."""
    g = torch.Generator().manual_seed(3)
    L, R = rand(g, *ls, dtype=torch.float32), rand(g, *rs, dtype=torch.float32)
    got = product_norm(L, R)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(np_(got), np_norm(L, R), rtol=2e-5, atol=0)


def test_product_norm_scales_and_transposes():
    """‖(aL)R‖ = |a|‖LR‖ and ‖Rᵀ Lᵀ‖ = ‖L R‖, both paths."""
    g = torch.Generator().manual_seed(4)
    for m, r, p in ((40, 5, 25), (6, 4, 7)):
        L, R = rand(g, 4, m, r), rand(g, 4, r, p)
        base = product_norm(L, R)
        torch.testing.assert_close(product_norm(-3.5 * L, R), 3.5 * base, rtol=SAME, atol=0)
        torch.testing.assert_close(product_norm(R.mT, L.mT), base, rtol=SAME, atol=0)


def test_product_norm_gradient():
    """An input that requires grad takes the reduced QR, which has a derivative: the gradient is
    that of the SVD of the formed product (the top singular pair, u vᵀ R ᵀ for L)."""
    g = torch.Generator().manual_seed(5)
    L, R = rand(g, 2, 30, 4).requires_grad_(True), rand(g, 2, 4, 20)
    (gL,) = torch.autograd.grad(product_norm(L, R).sum(), L)
    (ref,) = torch.autograd.grad(spectral(L @ R).sum(), L)
    torch.testing.assert_close(gL, ref, rtol=1e-10, atol=1e-12)


def test_product_norm_svd_is_r_by_r(monkeypatch):
    """Thin factors: the only SVD is of the r×r core, never of the m×p product; otherwise the
    product's own."""
    import models.spectral as ms

    seen = []
    real = ms.spectral
    monkeypatch.setattr(ms, "spectral", lambda M: seen.append(tuple(M.shape)) or real(M))
    g = torch.Generator().manual_seed(6)
    ms.product_norm(rand(g, 12, 50, 16), rand(g, 12, 16, 192))
    ms.product_norm(rand(g, 12, 20, 16), rand(g, 12, 16, 192))  # 2r > m: not thin
    assert seen == [(12, 16, 16), (12, 20, 192)]


def test_product_norm_refuses_mismatched_factors():
    with pytest.raises(ValueError, match="inner sizes"):
        product_norm(torch.zeros(5, 3), torch.zeros(4, 6))


# --- the layer's norms ---------------------------------------------------------------------------

# (n, d, h): thin everywhere, thin for A_l and C_l only (n < 2d_h), and not thin at all (2d_h > d)
LAYERS = [(8, 16, 4), (12, 24, 6), (5, 12, 3), (10, 16, 2), (3, 8, 1), (6, 6, 2)]


def layer_and_input(n, d, h, seed, *, biases, residual=True, qk=1.3):
    layer = models.random_dot(d, h, seed=seed, q_norm=qk, k_norm=0.8 * qk, v_norm=1.1, o_norm=0.9,
                              residual=residual, bias_norm=0.7 if biases else 0.0)
    # heads of different scales, so that a sum over heads weighs them differently
    s = torch.linspace(0.5, 2.0, h, dtype=torch.float64)[:, None, None]
    layer = replace(layer, W_q=layer.W_q * s, W_v=layer.W_v * s.flip(0))
    X = torch.cat([models.random_input(n, d, norm=x, seed=seed + i) for i, x in enumerate((0.2, 1.0, 6.0))])
    return layer, X


def old_U_V(layer, X):
    """U = X A_lᵀ + 1 (W^Q_l b_k)ᵀ and V = X A_l + 1 (W^K_l b_q)ᵀ formed from the d×d A_l."""
    A = layer.W_q @ layer.W_k.mT
    U, V = X[:, None] @ A.mT, X[:, None] @ A
    if layer.b_k is not None:
        U = U + (layer.W_q @ layer.b_k[..., None]).mT
    if layer.b_q is not None:
        V = V + (layer.W_k @ layer.b_q[..., None]).mT
    return U, V


@pytest.mark.parametrize(("n", "d", "h"), LAYERS)
@pytest.mark.parametrize("biases", [False, True])
def test_layer_norms_against_formed_matrices(n, d, h, biases):
    layer, X = layer_and_input(n, d, h, seed=n + d, biases=biases)
    A, C = layer.W_q @ layer.W_k.mT, layer.W_v @ layer.W_o
    close = lambda got, ref: torch.testing.assert_close(got, ref, rtol=SAME, atol=0)
    close(layer.A_norm(), spectral(A))
    close(layer.C_norm(), spectral(C))
    close(layer.XC_norm(X), spectral(X[:, None] @ C))
    U, V = old_U_V(layer, X)
    gotU, gotV = layer.logit_factor_norms(X)
    close(gotU, spectral(U))
    close(gotV, spectral(V))
    # and against the logit operator's own U and V
    op = layer.logit_operator(X)
    close(gotU, spectral(op.U))
    close(gotV, spectral(op.V))


def test_zero_biases_change_no_bit():
    """A zero bias is added to the bias-free Q_l, K_l (docs/bounds.md §1.5): the thin factors, and
    so ξ, are bit for bit those of the layer without biases."""
    layer, X = layer_and_input(8, 16, 4, seed=1, biases=False)
    zeros = {k: torch.zeros(4, 4, dtype=torch.float64) for k in ("b_q", "b_k", "b_v")}
    zero = replace(layer, **zeros, b_o=torch.zeros(16, dtype=torch.float64))
    for a, b in zip(layer.logit_factor_norms(X), zero.logit_factor_norms(X), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(lf.xi(layer, X), lf.xi(zero, X))
    assert torch.equal(zero.attention(X), layer.attention(X))


# --- every bound that uses them, against the old formulas ----------------------------------------


def old_bounds(layer, X, eps) -> dict[str, torch.Tensor]:
    """The closed forms as they were, from SVDs of the formed A_l, C_l, X C_l, U and V; ζ, ‖M_l‖
    and σ̄_J are certified norms this change leaves alone (exact at these sizes)."""
    e = radius(eps, X)
    eh = e[:, None]
    A, C = layer.W_q @ layer.W_k.mT, layer.W_v @ layer.W_o
    a, c, xc = spectral(A), spectral(C), spectral(X[:, None] @ C)
    U, V = old_U_V(layer, X)
    xi = spectral(U) + spectral(V)
    M, zeta = lf.m_norms(layer, X), lf.zeta(layer, X)
    rd = math.sqrt(layer.d_h)
    H = layer.H_norm
    out = {"xi": xi, "delta21_xi": eh / rd * (xi + eh * a), "delta21_M": eh / rd * (M + eh * a)}
    out["delta22_tight"] = xc + eh * c
    out["delta22_naive"] = c * (spectral(X) + e)[:, None]
    out["naive_delta1"] = (H + (c * spectral(layer.attention(X))).sum(-1)) * e
    out["delta2_xi"] = (out["delta21_xi"] * out["delta22_tight"]).sum(-1)
    out["delta2_M"] = (out["delta21_M"] * out["delta22_tight"]).sum(-1)
    out["naive"] = out["naive_delta1"] + out["delta2_xi"]
    out["lofast_xi"] = zeta * e + out["delta2_xi"]
    out["lofast_M"] = zeta * e + out["delta2_M"]
    out["lofast_xi_half"] = zeta * e + 0.5 * out["delta2_xi"]
    out["lofast_M_half"] = zeta * e + 0.5 * out["delta2_M"]
    m = eh * (torch.minimum(M, xi) + eh * a) / rd
    rest = ((0.5 * m**2 + 0.5 * eh**2 * a / rd) * xc + 0.5 * m * eh * c).sum(-1)
    out["taylor_remainder_global"] = rest  # taylor pays at most this (the smallest remainder, §2.3.2)
    out["taylor_global"] = tay.sigma_J(layer, X) * e + rest
    per_head = c * spectral(layer.W_q) * spectral(layer.W_k) + c
    radius_sq = (X.flatten(1).norm(dim=-1) + e) ** 2
    out["specformer"] = e * (H + X.shape[1] * (X.shape[1] + 1) * radius_sq * per_head.sum())
    return out


NEW = {"xi": lambda layer, X, eps: lf.xi(layer, X), "specformer": sf.specformer,
       "taylor_remainder_global": tay.taylor_remainder_global,
       **{k: getattr(lf, k) for k in ("delta21_xi", "delta21_M", "delta22_tight", "delta22_naive",
                                      "naive_delta1", "delta2_xi", "delta2_M", "naive", "lofast_xi",
                                      "lofast_M", "lofast_xi_half", "lofast_M_half")}}


@pytest.mark.parametrize(("n", "d", "h"), LAYERS[:5])
@pytest.mark.parametrize(("biases", "residual"), [(False, True), (False, False), (True, True), (True, False)])
def test_bounds_unchanged(n, d, h, biases, residual):
    layer, X = layer_and_input(n, d, h, seed=3 * n + h, biases=biases, residual=residual)
    for eps in (1e-3, 0.3):
        ref = old_bounds(layer, X, eps)
        for name, fn in NEW.items():
            torch.testing.assert_close(fn(layer, X, eps), ref[name], rtol=SAME, atol=0,
                                       msg=lambda m, name=name, eps=eps: f"{name} at eps={eps}: {m}")
        assert (tay.taylor(layer, X, eps) <= ref["taylor_global"] * (1 + SAME)).all()


def test_registry_values_unchanged():
    """Through bounds.evaluate (float32 input cast to float64), on a layer where every form is thin."""
    layer, X = layer_and_input(12, 24, 6, seed=7, biases=False)
    X = X.float()
    ref = old_bounds(layer, X.double(), 0.05)
    for name in ("naive", "lofast_xi", "lofast_M", "lofast_M_half", "taylor_remainder_global",
                 "specformer", "delta22_tight", "delta22_naive"):
        got = bounds.evaluate(name, layer, X, 0.05)
        torch.testing.assert_close(got, ref[name], rtol=SAME, atol=0)
