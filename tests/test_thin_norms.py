"""Spectral norms of low-rank products through their thin factors (docs/bounds.md §2.1):
``models.spectral.product_norm`` against a dense float64 SVD of the formed product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import np_

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
