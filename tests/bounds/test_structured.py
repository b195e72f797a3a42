"""The structured exact forms (models.structured) against independent dense float64 constructions:
ζ's Gram from its Kronecker structure, and ‖M_l‖ on the span of [W^Q_l, W^K_l]."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import np_

import models
from bounds.lofast import m_norms, zeta
from models.structured import (
    logit_gram,
    logit_gram_cols,
    reduced_logit,
    reduced_logit_matrix,
    zeta_gram,
)

CASES = [(5, 8, 2, True, 0.0), (4, 16, 4, False, 0.0), (6, 12, 3, True, 0.5), (3, 8, 1, True, 0.3),
         (7, 16, 8, True, 0.0)]


def ref_K(layer: models.DotMHA, X: np.ndarray) -> np.ndarray:
    """H⊗I_d + Σ_l P_l⊗C_lᵀ entry by entry (row-major vec: T(Γ)[i,c] = K[(i,c),(k,a)] Γ[k,a])."""
    P = np_(layer.attention(torch.from_numpy(X)))
    C = np_(layer.C())
    n, d = X.shape
    K = np.eye(n * d) * layer.H_norm
    for i in range(n):
        for c in range(d):
            for k in range(n):
                for a in range(d):
                    K[i * d + c, k * d + a] += sum(P[g, i, k] * C[g, a, c] for g in range(layer.h))
    return K


def ref_M(layer: models.DotMHA, X: np.ndarray) -> np.ndarray:
    """[h, n², nd]: β_ij = Γ_iᵀ U_j + V_iᵀ Γ_j with U = K_l W^Q_lᵀ, V = Q_l W^K_lᵀ (docs/bounds.md §1.5)."""
    n, d = X.shape
    Wq, Wk = np_(layer.W_q), np_(layer.W_k)
    bq = np_(layer.b_q) if layer.b_q is not None else np.zeros(Wq.shape[::2])
    bk = np_(layer.b_k) if layer.b_k is not None else np.zeros(Wq.shape[::2])
    out = np.zeros((layer.h, n * n, n * d))
    for g in range(layer.h):
        U = (X @ Wk[g] + bk[g]) @ Wq[g].T
        V = (X @ Wq[g] + bq[g]) @ Wk[g].T
        for i in range(n):
            for j in range(n):
                out[g, i * n + j, i * d:(i + 1) * d] += U[j]
                out[g, i * n + j, j * d:(j + 1) * d] += V[i]
    return out


@pytest.mark.parametrize("n,d,h,residual,bias", CASES)
def test_delta1_operator_against_entrywise_K(n, d, h, residual, bias):
    """ζ's map and its adjoint (DotMHA.delta1_operator) against ref_K, with a leading dimension of
    attack restarts broadcast against the batch."""
    layer = models.random_dot(d, h, seed=n + d, residual=residual, bias_norm=bias)
    X = models.random_input(n, d, norm=2.0, seed=h, batch=2)
    K = np.stack([ref_K(layer, np_(x)) for x in X])  # [2, nd, nd]
    op = layer.delta1_operator(X)
    G = torch.randn(3, 2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    g = np_(G).reshape(3, 2, -1)
    np.testing.assert_allclose(np_(op.T(G)).reshape(3, 2, -1), np.einsum("bij,rbj->rbi", K, g),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(np_(op.Tt(G)).reshape(3, 2, -1), np.einsum("bji,rbj->rbi", K, g),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,d,h,residual,bias", CASES)
def test_zeta_gram_and_zeta(n, d, h, residual, bias):
    layer = models.random_dot(d, h, seed=n + d, residual=residual, bias_norm=bias)
    X = models.random_input(n, d, norm=2.0, seed=h)
    K = ref_K(layer, np_(X[0]))
    np.testing.assert_allclose(np_(zeta_gram(layer, X)[0]), K.T @ K, rtol=1e-12, atol=1e-12)
    truth = np.linalg.svd(K, compute_uv=False)[0]
    got = float(zeta(layer, X))
    assert truth <= got <= truth * (1 + 1e-12)


@pytest.mark.parametrize("n,d,h,residual,bias", CASES)
def test_reduced_logit_norms(n, d, h, residual, bias):
    layer = models.random_dot(d, h, seed=n * d, residual=residual, bias_norm=bias, q_norm=2.0)
    X = models.random_input(n, d, norm=3.0, seed=h + 1)
    M = ref_M(layer, np_(X[0]))
    truth = np.array([np.linalg.svd(m, compute_uv=False)[0] for m in M])
    red = reduced_logit(layer, X)
    assert red.U.shape[-1] == min(d, 2 * d // h)
    assert float(red.slack.max()) < 1e-12 * truth.max() and float(red.scale.max() - 1) < 1e-14
    Mt = np_(reduced_logit_matrix(red)[0])
    np.testing.assert_allclose(np_(logit_gram(red)[0]), Mt @ Mt.transpose(0, 2, 1), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(np_(logit_gram_cols(red)[0]), Mt.transpose(0, 2, 1) @ Mt, rtol=1e-12,
                               atol=1e-12)
    for method in ("certified", "probabilistic"):
        got = np_(m_norms(layer, X, method=method)[0])
        slack = 1e-12 if method == "certified" else 3e-3
        assert np.all(got >= truth) and np.all(got <= truth * (1 + slack))
    np.testing.assert_allclose(np_(m_norms(layer, X, method="dense")[0]), truth, rtol=1e-12)


def test_reduced_logit_lifts_a_rank_deficient_span():
    """W^K_l = W^Q_l: the span has d_h columns, not 2d_h; the QR basis still covers it exactly."""
    layer = models.random_dot(16, 4, seed=3)
    layer = models.DotMHA(layer.W_q, layer.W_q.clone(), layer.W_v, layer.W_o)
    X = models.random_input(5, 16, seed=2)
    truth = np.array([np.linalg.svd(m, compute_uv=False)[0] for m in ref_M(layer, np_(X[0]))])
    got = np_(m_norms(layer, X)[0])
    assert np.all(got >= truth) and np.all(got <= truth * (1 + 1e-10))


@pytest.mark.parametrize("n,d,h,residual,bias", CASES)
def test_dot_jacobian_against_autograd(n, d, h, residual, bias):
    from models.operators import jacobian_matrix
    from models.structured import dot_jacobian

    layer = models.random_dot(d, h, seed=n + h, residual=residual, bias_norm=bias, q_norm=1.5)
    X = models.random_input(n, d, norm=2.0, seed=d, batch=2)
    np.testing.assert_allclose(np_(dot_jacobian(layer, X)), np_(jacobian_matrix(layer.forward, X)),
                               rtol=1e-10, atol=1e-12)


# the closed-form map against the dense autograd Jacobian (jacrev of forward, an independent path):
# every CASES layer, n = 1, a zero input, and saturated attention (q_norm 40: rows one-hot to rounding)
OPERATOR_CASES = [(*c, 1.5, 2.0) for c in CASES] + [(1, 8, 2, True, 0.3, 1.5, 2.0),
                                                     (5, 8, 2, True, 0.5, 1.5, 0.0),
                                                     (6, 12, 3, False, 0.0, 40.0, 4.0)]


@pytest.mark.parametrize("n,d,h,residual,bias,q,norm", OPERATOR_CASES)
def test_dot_jacobian_operator_against_autograd(n, d, h, residual, bias, q, norm):
    from models.operators import jacobian_matrix
    from models.structured import dot_jacobian_operator

    layer = models.random_dot(d, h, seed=n + h, residual=residual, bias_norm=bias, q_norm=q, k_norm=q)
    X = models.random_input(n, d, norm=norm, seed=d, batch=2)
    J = np_(jacobian_matrix(layer.forward, X))  # [B, nd, nd]
    op = dot_jacobian_operator(layer, X)
    G, Y = (torch.randn(2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
            for s in (1, 2))
    g, y = np_(G).reshape(2, -1), np_(Y).reshape(2, -1)
    tol = 1e-13 * np.abs(J).max() * np.sqrt(n * d)
    np.testing.assert_allclose(np_(op.T(G)).reshape(2, -1), np.einsum("bij,bj->bi", J, g), rtol=0, atol=tol)
    np.testing.assert_allclose(np_(op.Tt(Y)).reshape(2, -1), np.einsum("bji,bj->bi", J, y), rtol=0, atol=tol)
