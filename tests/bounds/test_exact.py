"""Exact quantities against independent dense float64 constructions in numpy (docs/bounds.md §1, §2, §3.4).

Nothing here calls the code path under test to build its reference: attention matrices, the
Kronecker matrix of ζ, the matrix M_l of Lemma 2 and the layers' outputs are all rebuilt from the
raw weights with plain numpy loops.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import np_, softmax_rows

import models
from bounds.lofast import m_norms, zeta
from models.operators import jacobian_lanczos

RTOL = 1e-6




# --- numpy references of the layers (docs/bounds.md §1) ----------------------------------------


def ref_dot_parts(layer: models.DotMHA, X: np.ndarray):
    """Per head (A_l, C_l, P_l) from the raw weights, P_l = softmax(X A_l Xᵀ/√d_h)."""
    Wq, Wk, Wv, Wo = (np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o"))
    d_h = Wq.shape[2]
    out = []
    for hd in range(Wq.shape[0]):
        A = Wq[hd] @ Wk[hd].T
        C = Wv[hd] @ Wo[hd]
        P = softmax_rows(X @ A @ X.T / math.sqrt(d_h))
        out.append((A, C, P))
    return out


def ref_dot_forward(layer: models.DotMHA, X: np.ndarray) -> np.ndarray:
    n, d = X.shape
    Wq, Wk, Wv, Wo = (np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o"))
    d_h = Wq.shape[2]
    Y = X.copy() if layer.residual else np.zeros((n, d))
    for hd in range(Wq.shape[0]):
        Q, K, V = X @ Wq[hd], X @ Wk[hd], X @ Wv[hd]
        S = np.empty((n, n))
        for i in range(n):
            for j in range(n):
                S[i, j] = Q[i] @ K[j] / math.sqrt(d_h)
        Y += softmax_rows(S) @ V @ Wo[hd]
    return Y


def ref_l2_forward(layer: models.L2MHA, X: np.ndarray) -> np.ndarray:
    n, d = X.shape
    Wq, Wv, Wo = (np_(getattr(layer, k)) for k in ("W_q", "W_v", "W_o"))
    d_h = Wq.shape[2]
    Y = X.copy() if layer.residual else np.zeros((n, d))
    for hd in range(Wq.shape[0]):
        S = np.empty((n, n))
        for i in range(n):
            for j in range(n):
                diff = X[i] @ Wq[hd] - X[j] @ Wq[hd]
                S[i, j] = -(diff @ diff) / math.sqrt(d_h)
        A = Wq[hd] @ Wq[hd].T / math.sqrt(d_h)
        Y += softmax_rows(S) @ X @ A @ Wv[hd] @ Wo[hd]
    return Y


def ref_olsa_forward(layer: models.OLSA, X: np.ndarray) -> np.ndarray:
    n, d = X.shape
    Wq, Wk, Wv, ws = (np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "w_s"))
    act = {"relu": lambda z: np.maximum(z, 0.0), "tanh": np.tanh}[layer.activation]
    h = ws.shape[0]
    Y = np.zeros((n, d))
    for i in range(n):
        pieces = []
        for hd in range(h):
            s = np.array([ws[hd] @ act((Wq[hd] @ X[i] + Wk[hd] @ X[j]) / 2) / layer.alpha1
                          for j in range(n)])
            p = softmax_rows(s[None])[0]
            pieces.append(sum(p[j] * (Wv[hd] @ X[j]) for j in range(n)) / layer.alpha2)
        Y[i] = np.concatenate(pieces)  # head-major
    return Y + X if layer.residual else Y


def ref_project(X: np.ndarray, R: float) -> np.ndarray:
    Y = X.copy()
    for i in range(X.shape[0]):
        norm = np.linalg.norm(X[i])
        if norm > R:
            Y[i] = X[i] * (R / norm)
    return Y


# --- the cases ---------------------------------------------------------------------------------

# (n, d, h, residual, input norm, weight scale, seed): 29 cases with h in {1, 2, 4}, H in {0, I}
ZETA_CASES = [
    (n, d, h, res, xn, ws, 10 * k + res)
    for k, ((n, d, h), xn, ws) in enumerate(zip(
        [(2, 4, 1), (3, 4, 2), (4, 4, 4), (5, 8, 2), (3, 8, 4), (6, 2, 1), (2, 8, 4), (4, 6, 2),
         (5, 4, 1), (3, 6, 1), (6, 4, 2), (4, 8, 4)],
        [0.1, 1.0, 3.0, 10.0, 0.5, 2.0, 5.0, 0.2, 1.5, 8.0, 0.7, 4.0],
        [1.0, 0.3, 2.0, 0.5, 1.5, 3.0, 0.7, 1.0, 0.2, 0.4, 2.5, 1.2],
        strict=True,
    ))
    for res in (False, True)
] + [
    # saturated attention (large weights and inputs: rows of P_l are nearly one-hot)
    (6, 4, 2, False, 27.4, 7.4, 660),
    (4, 6, 2, False, 28.4, 4.9, 661),
    (5, 4, 2, True, 11.7, 8.9, 662),
    (3, 6, 3, False, 20.0, 5.0, 663),
    (6, 8, 4, True, 15.0, 3.0, 664),
]


def dot_case(n, d, h, res, xn, ws, seed):
    layer = models.random_dot(d, h, seed=seed, q_norm=ws, k_norm=ws * 0.9, v_norm=ws,
                              o_norm=ws * 1.1, residual=res)
    X = models.random_input(n, d, norm=xn, seed=seed + 1000, batch=2)
    return layer, X


def test_row_major_vec_convention():
    """vec(P Γ C) = (P ⊗ Cᵀ) vec(Γ) with row-major vec, the convention of the ζ reference."""
    rng = np.random.default_rng(0)
    for n, d in [(3, 4), (5, 2), (1, 3)]:
        P, C, G = rng.normal(size=(n, n)), rng.normal(size=(d, d)), rng.normal(size=(n, d))
        lhs = (P @ G @ C).reshape(-1)
        rhs = np.kron(P, C.T) @ G.reshape(-1)
        np.testing.assert_allclose(rhs, lhs, rtol=1e-12, atol=1e-12)
        # and the transposed convention is genuinely different (so the check can fail)
        assert not np.allclose(np.kron(P, C) @ G.reshape(-1), lhs)


@pytest.mark.parametrize(("n", "d", "h", "res", "xn", "ws", "seed"), ZETA_CASES)
def test_zeta_against_kronecker(n, d, h, res, xn, ws, seed):
    layer, X = dot_case(n, d, h, res, xn, ws, seed)
    lanczos = zeta(layer, X, method="lanczos")
    dense = zeta(layer, X, method="dense")
    rng = np.random.default_rng(seed)
    for b in range(X.shape[0]):
        Xb = np_(X[b])
        parts = ref_dot_parts(layer, Xb)
        K = (1.0 if res else 0.0) * np.eye(n * d)
        for _, C, P in parts:
            K = K + np.kron(P, C.T)
        # K applied to a random vec(Γ) is vec(HΓ + Σ_l P_l Γ C_l)
        G = rng.normal(size=(n, d))
        direct = (G if res else 0.0) + sum(P @ G @ C for _, C, P in parts)
        np.testing.assert_allclose(K @ G.reshape(-1), direct.reshape(-1), rtol=1e-10, atol=1e-12)
        ref = np.linalg.norm(K, 2)
        assert abs(float(lanczos[b]) - ref) <= RTOL * ref, f"lanczos: {float(lanczos[b])} vs {ref}"
        assert abs(float(dense[b]) - ref) <= RTOL * ref, f"dense: {float(dense[b])} vs {ref}"


def ref_M(A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """M_l entry by entry: row (i, j) holds the coefficients of β_ij = Γ_iᵀ A x_j + x_iᵀ A Γ_j in
    the nd coordinates (k, a) of Γ."""
    n, d = X.shape
    M = np.zeros((n * n, n * d))
    for i in range(n):
        for j in range(n):
            for k in range(n):
                for a in range(d):
                    G = np.zeros((n, d))
                    G[k, a] = 1.0
                    M[i * n + j, k * d + a] = G[i] @ A @ X[j] + X[i] @ A @ G[j]
    return M


@pytest.mark.parametrize(("n", "d", "h", "res", "xn", "ws", "seed"), ZETA_CASES[:24:2] + ZETA_CASES[24:])
def test_m_norms_against_entrywise_matrix(n, d, h, res, xn, ws, seed):
    layer, X = dot_case(n, d, h, res, xn, ws, seed)
    lanczos = m_norms(layer, X, method="lanczos")
    dense = m_norms(layer, X, method="dense")
    assert lanczos.shape == dense.shape == (X.shape[0], h)
    rng = np.random.default_rng(seed)
    for b in range(X.shape[0]):
        Xb = np_(X[b])
        for hd, (A, _, _) in enumerate(ref_dot_parts(layer, Xb)):
            M = ref_M(A, Xb)
            # sanity of the reference: M vec(Γ) = vec(Γ A Xᵀ + X A Γᵀ)
            G = rng.normal(size=(n, d))
            np.testing.assert_allclose(M @ G.reshape(-1), (G @ A @ Xb.T + Xb @ A @ G.T).reshape(-1),
                                       rtol=1e-10, atol=1e-12)
            ref = np.linalg.norm(M, 2)
            got_l, got_d = float(lanczos[b, hd]), float(dense[b, hd])
            assert abs(got_l - ref) <= RTOL * ref, f"lanczos: {got_l} vs {ref}"
            assert abs(got_d - ref) <= RTOL * ref, f"dense: {got_d} vs {ref}"


# --- Jacobian σ_max ----------------------------------------------------------------------------


def jac_layers():
    n, d, h = 4, 6, 2
    c = 3.0
    return [
        ("dot", models.random_dot(d, h, seed=3, q_norm=1.5, k_norm=1.2)),
        ("dot-bare", models.random_dot(d, h, seed=4, residual=False)),
        ("l2", models.random_l2(d, h, seed=5, q_norm=1.3)),
        ("l2-bare", models.random_l2(d, 3, seed=6, residual=False)),
        ("olsa", models.random_olsa(d, h, n=n, c=c, seed=7, alpha1=0.5)),
        ("olsa-tanh-res", models.random_olsa(d, 3, n=n, c=c, seed=8, activation="tanh",
                                             residual=True)),
        ("stack-dot", models.random_stack("dot", 3, d, h, seed=9, R=1.0)),
        ("stack-l2", models.random_stack("l2", 2, d, h, seed=12, R=None)),
    ]


@pytest.mark.parametrize(("name", "layer"), jac_layers(), ids=[c[0] for c in jac_layers()])
def test_jacobian_sigma_against_autograd(name, layer):
    n, d = 4, layer.d
    X = models.random_input(n, d, norm=2.0, seed=21, batch=3)
    got = jacobian_lanczos(layer.forward, X).sigma
    assert got.shape == (3,)
    for b in range(3):
        J = torch.autograd.functional.jacobian(lambda x: layer.forward(x), X[b])
        ref = float(torch.linalg.svdvals(J.reshape(n * d, n * d)).max())
        assert abs(float(got[b]) - ref) <= RTOL * ref, (name, float(got[b]), ref)


# --- the layers' forward -----------------------------------------------------------------------


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(("n", "d", "h"), [(1, 4, 2), (3, 4, 1), (5, 6, 3), (4, 8, 4)])
def test_forward_against_naive_loops(n, d, h, residual):
    X = models.random_input(n, d, norm=2.5, seed=n * 100 + d, batch=2)
    c = float(X[0].norm())
    layers = [
        (models.random_dot(d, h, seed=1, q_norm=1.7, residual=residual), ref_dot_forward),
        (models.random_l2(d, h, seed=2, q_norm=1.3, residual=residual), ref_l2_forward),
        (models.random_olsa(d, h, n=n, c=c, seed=3, alpha1=0.7, residual=residual),
         ref_olsa_forward),
        (models.random_olsa(d, h, n=n, c=c, seed=4, activation="tanh", residual=residual),
         ref_olsa_forward),
    ]
    for layer, ref in layers:
        Y = layer(X)
        assert Y.shape == X.shape
        for b in range(2):
            np.testing.assert_allclose(np_(Y[b]), ref(layer, np_(X[b])), rtol=1e-10, atol=1e-12)
        # an unbatched [n, d] input gives the same rows
        np.testing.assert_allclose(np_(layer(X[1])), np_(Y[1]), rtol=1e-12, atol=1e-14)


def test_olsa_heads_are_head_major():
    """Zeroing the value weights of head 0 zeroes exactly the first d_h output columns."""
    n, d, h = 3, 6, 3
    layer = models.random_olsa(d, h, n=n, c=1.0, seed=0)
    W_v = layer.W_v.clone()
    W_v[0] = 0
    from dataclasses import replace

    Y = replace(layer, W_v=W_v)(models.random_input(n, d, seed=1))[0]
    d_h = d // h
    assert torch.all(Y[:, :d_h] == 0)
    assert torch.all(Y[:, d_h:].abs().sum(0) > 0)


@pytest.mark.parametrize("R", [0.3, 1.0, 2.0])
def test_layer_project_against_rowwise_loop(R):
    gen = torch.Generator().manual_seed(int(R * 10))
    X = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)
    X[0, 0] = 0  # a zero row stays zero
    Y = models.layer_project(X, R)
    for b in range(2):
        np.testing.assert_allclose(np_(Y[b]), ref_project(np_(X[b]), R), rtol=1e-12, atol=1e-15)
    assert torch.all(Y.norm(dim=-1) <= R * (1 + 1e-12))
    assert not torch.isnan(Y).any()


def test_stack_forward_is_projection_then_block():
    n, d, h = 4, 4, 2
    stack = models.random_stack("dot", 3, d, h, seed=2, R=0.8)
    X = models.random_input(n, d, norm=4.0, seed=5)[0]
    Y = np_(X)
    for block in stack.blocks:
        Y = ref_dot_forward(block, ref_project(Y, 0.8))
    np.testing.assert_allclose(np_(stack(X)), Y, rtol=1e-10, atol=1e-12)
