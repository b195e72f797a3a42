"""Closed-form bounds against their formulas (docs/bounds.md §2, §3.1–§3.3), rebuilt in numpy."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import np_, softmax_rows
from scipy.special import lambertw

import bounds
import models
from bounds.lipschitz.kim import phi_inv

RTOL = 1e-9



def norm2(M: np.ndarray) -> float:
    return float(np.linalg.norm(M, 2))



def close(got: torch.Tensor, ref, rtol: float = RTOL) -> None:
    np.testing.assert_allclose(np_(got), np.asarray(ref, dtype=np.float64), rtol=rtol, atol=0)


def inputs(n: int, d: int, norms=(0.1, 1.0, 7.0), seed: int = 0) -> torch.Tensor:
    return torch.cat([models.random_input(n, d, norm=xn, seed=seed + i)
                      for i, xn in enumerate(norms)])


# --- Kim et al. (docs/bounds.md §3.2) -----------------------------------------------------------


@pytest.mark.parametrize("y", [0.0, 1e-6, 0.5, 1.0, 2.0, 7.0, 63.0, 1e4])
def test_phi_inv_inverts_phi(y):
    x = phi_inv(y)
    assert x >= 0
    assert math.isclose(x * math.exp(x + 1), y, rel_tol=1e-12, abs_tol=1e-15)


def test_phi_inv_is_increasing():
    ys = [0.0, 0.5, 1.0, 3.0, 10.0, 100.0]
    xs = [phi_inv(y) for y in ys]
    assert all(a < b for a, b in itertools.pairwise(xs))


@pytest.mark.parametrize(("n", "d", "h", "residual", "seed"),
                         [(2, 4, 1, True, 0), (5, 6, 2, False, 1), (9, 8, 4, True, 2),
                          (1, 3, 3, False, 3), (16, 4, 2, True, 4)])
def test_kim_closed_form(n, d, h, residual, seed):
    layer = models.random_l2(d, h, seed=seed, q_norm=0.7, v_norm=1.3, o_norm=0.9,
                             residual=residual)
    # make the heads' norms differ, so the sum over heads matters
    scale = torch.arange(1, h + 1, dtype=torch.float64)[:, None, None]
    layer = replace(layer, W_q=layer.W_q * scale)
    Wq, Wv, Wo = np_(layer.W_q), np_(layer.W_v), np_(layer.W_o)
    d_h = d // h
    W_O = np.concatenate([Wo[hd] for hd in range(h)], axis=0)  # (h·d_h) × d
    assert W_O.shape == (h * d_h, d)
    heads = math.sqrt(sum(norm2(Wq[hd]) ** 2 * norm2(Wv[hd]) ** 2 for hd in range(h)))
    w0 = float(np.real(lambertw((n - 1) / math.e, 0)))
    lip = (1.0 if residual else 0.0) + math.sqrt(n) / math.sqrt(d_h) * (4 * w0 + 1) * heads \
        * norm2(W_O)
    eps = 0.03
    X = inputs(n, d, seed=seed)
    close(bounds.evaluate("kim", layer, X, eps), [lip * eps] * X.shape[0])
    # a global constant: it depends on X only through n
    X2 = inputs(n, d, norms=(20.0,), seed=seed + 50)
    close(bounds.evaluate("kim", layer, X2, 0.5), [lip * 0.5])


# --- OLSA (docs/bounds.md §3.3) -----------------------------------------------------------------


@pytest.mark.parametrize(("n", "d", "h", "alpha1", "c", "residual"),
                         [(3, 4, 2, 1.0, 2.0, False), (5, 6, 3, 0.3, 10.0, True),
                          (2, 2, 1, 4.0, 0.5, False), (7, 8, 4, 1.5, 1.0, True)])
def test_olsa_closed_form(n, d, h, alpha1, c, residual):
    layer = models.random_olsa(d, h, n=n, c=c, seed=n, alpha1=alpha1, residual=residual)
    assert math.isclose(layer.alpha2, 1 + c * math.sqrt(n) / (4 * alpha1))
    X = inputs(n, d, seed=3)
    for eps in (1e-3, 0.2):
        ref = [eps * ((1.0 if residual else 0.0)
                      + (1 + (np.linalg.norm(np_(Xb)) + eps) * math.sqrt(n) / (4 * alpha1))
                      / layer.alpha2)
               for Xb in X]
        close(bounds.evaluate("olsa", layer, X, eps), ref)


def test_olsa_explicit_alpha2():
    layer = models.random_olsa(4, 2, n=3, c=1.0, seed=0, alpha1=2.0, alpha2=5.0)
    X = inputs(3, 4)
    ref = [0.1 * (1 + (np.linalg.norm(np_(Xb)) + 0.1) * math.sqrt(3) / 8) / 5 for Xb in X]
    close(bounds.evaluate("olsa", layer, X, 0.1), ref)


@pytest.mark.parametrize("field", ["W_q", "W_k", "W_v", "w_s"])
def test_olsa_refuses_broken_assumptions(field):
    layer = models.random_olsa(4, 2, n=3, c=1.0, seed=0)
    broken = replace(layer, **{field: getattr(layer, field) * 1.5})
    X = inputs(3, 4)
    with pytest.raises(models.InputError, match=r"orthogonal|w_s"):
        bounds.evaluate("olsa", broken, X, 0.1)
    # a non-orthogonal but otherwise well-formed W_q (a random matrix) is refused too
    if field == "W_q":
        gen = torch.Generator().manual_seed(1)
        rand = replace(layer, W_q=torch.randn(layer.W_q.shape, generator=gen, dtype=torch.float64))
        with pytest.raises(models.InputError, match="orthogonal"):
            bounds.evaluate("olsa", rand, X, 0.1)


# --- SpecFormer, adapted (docs/bounds.md §3.1) --------------------------------------------------


@pytest.mark.parametrize(("n", "d", "h", "residual"),
                         [(3, 4, 1, False), (4, 6, 2, True), (6, 8, 4, False)])
def test_specformer_closed_form(n, d, h, residual):
    layer = models.random_dot(d, h, seed=h, q_norm=0.8, k_norm=1.3, v_norm=0.6, o_norm=1.1,
                              residual=residual)
    Wq, Wk, Wv, Wo = (np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o"))
    X = inputs(n, d, seed=7)
    for eps in (1e-3, 0.3):
        ref = []
        for Xb in X:
            r2 = (np.linalg.norm(np_(Xb)) + eps) ** 2
            s = sum(n * (n + 1) * r2 * (norm2(Wv[hd] @ Wo[hd]) * norm2(Wq[hd]) * norm2(Wk[hd])
                                        + norm2(Wv[hd] @ Wo[hd])) for hd in range(h))
            ref.append(eps * ((1.0 if residual else 0.0) + s))
        close(bounds.evaluate("specformer", layer, X, eps), ref)


# --- LoFAST's closed forms (docs/bounds.md §2) --------------------------------------------------


def dot_parts(layer, Xb: np.ndarray):
    Wq, Wk, Wv, Wo = (np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o"))
    d_h = Wq.shape[2]
    for hd in range(Wq.shape[0]):
        A, C = Wq[hd] @ Wk[hd].T, Wv[hd] @ Wo[hd]
        yield A, C, softmax_rows(Xb @ A @ Xb.T / math.sqrt(d_h))


def M_matrix(A: np.ndarray, Xb: np.ndarray) -> np.ndarray:
    """Columns: Γ ↦ Γ A Xᵀ + X A Γᵀ applied to each basis matrix E_ka (row-major vec)."""
    n, d = Xb.shape
    cols = []
    for k in range(n):
        for a in range(d):
            E = np.zeros((n, d))
            E[k, a] = 1.0
            cols.append((E @ A @ Xb.T + Xb @ A @ E.T).reshape(-1))
    return np.stack(cols, axis=1)


DOT_CASES = [(3, 4, 2, True, 0), (5, 6, 3, False, 1), (2, 8, 4, True, 2), (4, 2, 1, False, 3)]


@pytest.mark.parametrize(("n", "d", "h", "residual", "seed"), DOT_CASES)
def test_lofast_closed_forms(n, d, h, residual, seed):
    layer = models.random_dot(d, h, seed=seed, q_norm=1.4, k_norm=0.9, v_norm=1.2, o_norm=0.8,
                              residual=residual)
    d_h = d // h
    X = inputs(n, d, seed=seed)
    Hn = 1.0 if residual else 0.0
    for eps in (2e-3, 0.4):
        ev = {name: np_(bounds.evaluate(name, layer, X, eps)) for name in (
            "naive_delta1", "delta21_M", "delta21_xi", "delta22_tight", "delta22_naive",
            "delta2_M", "delta2_xi")}
        for b, Xt in enumerate(X):
            Xb = np_(Xt)
            parts = list(dot_parts(layer, Xb))
            naive = (Hn + sum(norm2(C) * norm2(P) for _, C, P in parts)) * eps
            d21M = [eps / math.sqrt(d_h) * (norm2(M_matrix(A, Xb)) + eps * norm2(A))
                    for A, _, _ in parts]
            d21xi = [eps / math.sqrt(d_h) * (norm2(A @ Xb.T) + norm2(Xb @ A) + eps * norm2(A))
                     for A, _, _ in parts]
            d22t = [norm2(Xb @ C) + eps * norm2(C) for _, C, _ in parts]
            d22n = [norm2(C) * (norm2(Xb) + eps) for _, C, _ in parts]
            np.testing.assert_allclose(ev["naive_delta1"][b], naive, rtol=RTOL)
            np.testing.assert_allclose(ev["delta21_M"][b], d21M, rtol=1e-7)
            np.testing.assert_allclose(ev["delta21_xi"][b], d21xi, rtol=RTOL)
            np.testing.assert_allclose(ev["delta22_tight"][b], d22t, rtol=RTOL)
            np.testing.assert_allclose(ev["delta22_naive"][b], d22n, rtol=RTOL)
            np.testing.assert_allclose(ev["delta2_M"][b], np.dot(d21M, d22t), rtol=1e-7)
            np.testing.assert_allclose(ev["delta2_xi"][b], np.dot(d21xi, d22t), rtol=RTOL)


def test_naive_delta1_uses_spectral_norm_of_P():
    """‖P_l(X)‖ is spectral and can exceed 1 for a row-stochastic P (docs/bounds.md §2's note)."""
    layer = models.random_dot(2, 1, seed=0, q_norm=3.0, k_norm=3.0, residual=False)
    X = models.random_input(6, 2, norm=6.0, seed=0)
    P = next(dot_parts(layer, np_(X[0])))[2]
    np.testing.assert_allclose(P.sum(1), 1.0, rtol=1e-12)
    assert norm2(P) > 1.01  # the case is informative
    C = np_(layer.W_v[0] @ layer.W_o[0])
    close(bounds.evaluate("naive_delta1", layer, X, 0.1), [0.1 * norm2(C) * norm2(P)])


def test_jacobian_l1linf_closed_form():
    layer = models.random_l2(4, 2, seed=0)
    X = inputs(3, 4, seed=9)
    got = np_(bounds.evaluate("jacobian_l1linf", layer, X, 0.05))
    for b in range(X.shape[0]):
        J = np_(torch.autograd.functional.jacobian(layer.forward, X[b]).reshape(12, 12))
        ref = math.sqrt(np.abs(J).sum(0).max() * np.abs(J).sum(1).max()) * 0.05
        np.testing.assert_allclose(got[b], ref, rtol=1e-9)
