"""Certified means certified (docs/bounds.md §2.4): spectral norms inside certified bounds are exact
or probabilistic upper bounds, never a value from below; each value says which."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import bounds
import models
from bounds import norms
from bounds.certificates import Certificate, Ledger
from bounds.lofast import m_norms, zeta
from bounds.norms import cholesky_check, gram_norm, kw_delta, kw_steps, lanczos_upper, verified_gram_norm
from bounds.taylor import sigma_J
from models.operators import delta1_matrix
from models.spectral import random_start


def hidden_direction_layer(n: int, d: int, s: float) -> tuple[models.DotMHA, torch.Tensor]:
    """One residual head with C = s·u uᵀ, u orthogonal to the column sums of the fixed Lanczos
    start of ζ: at X = 0 that start has no component along the top direction 1uᵀ/√n."""
    start = random_start((1, n, d), torch.zeros(1, dtype=torch.float64), seed=0)[0]
    c = start.sum(0).numpy()
    u = np.linalg.svd(c[None, :])[2][-1]  # a unit vector orthogonal to c
    assert abs(u @ c) < 1e-12
    u = torch.from_numpy(u)
    e1 = torch.zeros(d, dtype=torch.float64)
    e1[0] = 1.0
    W_v = (math.sqrt(s) * torch.outer(u, e1))[None]  # [1, d, d_h = d]
    W_o = (math.sqrt(s) * torch.outer(e1, u))[None]
    g = torch.Generator().manual_seed(1)
    W_q, W_k = (torch.randn(1, d, d, generator=g, dtype=torch.float64) for _ in range(2))
    return models.DotMHA(W_q, W_k, W_v, W_o, residual=True), u


@pytest.mark.parametrize("s", [0.5, 1.0, 3.0])
def test_fixed_start_witness_is_certified(s):
    """The audit's witness: from the fixed start, restarted Lanczos sees ζ = 1 (the estimate is
    kept for PGD warm starts); every certified path gives ζ ≥ 1 + s, and every bound built on ζ is
    at least the true change (1 + s)ε, reached by Γ = ε·1uᵀ/√n (all tokens stay equal, so
    attention stays uniform)."""
    n, d, eps = 3, 4, 0.1
    layer, u = hidden_direction_layer(n, d, s)
    X = torch.zeros(1, n, d, dtype=torch.float64)
    assert float(zeta(layer, X, method="lanczos")) == pytest.approx(1.0, abs=1e-9)
    assert float(zeta(layer, X)) >= 1 + s
    assert float(zeta(layer, X, method="probabilistic")) >= 1 + s
    G = eps * torch.ones(n, 1, dtype=torch.float64) * u / math.sqrt(n)
    change = float((layer(X + G) - layer(X)).norm())
    assert change == pytest.approx((1 + s) * eps, rel=1e-12)
    for name in ("delta1", "lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "taylor",
                 "best", "naive"):
        assert float(bounds.evaluate(name, layer, X, eps)) >= change * (1 - 1e-12), name


@pytest.mark.parametrize("seed", range(6))
def test_probabilistic_norms_are_above_the_exact_ones(seed):
    rnd = np.random.default_rng(seed)
    h = int(rnd.choice([1, 2, 4]))
    d, n = 4 * h, int(rnd.integers(2, 7))
    layer = models.random_dot(d, h, seed=seed, q_norm=float(10 ** rnd.uniform(-0.5, 1)),
                              residual=bool(seed % 2))
    X = models.random_input(n, d, norm=float(10 ** rnd.uniform(-1, 1)), seed=seed, batch=2)
    for fn in (zeta, m_norms):
        exact = fn(layer, X, method="dense")
        prob = fn(layer, X, method="probabilistic")
        assert torch.all(prob >= exact) and torch.all(prob <= exact * 1.03 + 1e-12), fn.__name__
    exact_J = bounds.jacobian.sigma_exact(layer, X)
    assert torch.all(sigma_J(layer, X, probabilistic=True) >= exact_J)
    assert torch.all(sigma_J(layer, X) >= exact_J)


def test_kw_steps_meet_the_inequality():
    """k steps certify δ: 1.648·√N·exp(−√δ(2k−1)) ≤ p, and k − 1 steps would not."""
    for N, p, delta in [(10, 1e-9, 1e-2), (1024, 1e-9, 2e-3), (151_296, 1e-12, 1e-3)]:
        k = kw_steps(N, p, delta)
        assert 1.648 * math.sqrt(N) * math.exp(-math.sqrt(delta) * (2 * k - 1)) <= p * (1 + 1e-12)
        assert 1.648 * math.sqrt(N) * math.exp(-math.sqrt(delta) * (2 * k - 3)) > p
        assert kw_delta(N, k, p) <= delta


def test_probabilistic_certificate_records_fresh_seeds_that_replay():
    layer = models.random_dot(8, 2, seed=0)
    X = models.random_input(5, 8, seed=1, batch=3)
    op = layer.delta1_operator(X)
    A = lambda v: op.Tt(op.T(v.reshape(3, 5, 8))).reshape(3, -1)
    a, b = lanczos_upper(A, (3,), 40, X), lanczos_upper(A, (3,), 40, X)
    assert a.certificate.kind == "probabilistic" and a.certificate.p == pytest.approx(1e-9)
    assert a.certificate.seeds != b.certificate.seeds, "each call draws fresh randomness"
    again = lanczos_upper(A, (3,), 40, X, seed=a.certificate.seeds[0])
    assert torch.equal(again.value, a.value)
    # a value resting on h norms (one per head) fails with at most h·p
    lop = layer.logit_operator(X)
    M = lambda v: lop.Tt(lop.T(v.reshape(3, 2, 5, 8))).reshape(6, -1)
    assert lanczos_upper(M, (3, 2), 40, X).certificate.p == pytest.approx(2e-9)


def test_certificates_combine_to_the_weakest_with_summed_p():
    c = Certificate("exact") & Certificate("probabilistic", 1e-9, (1,)) & Certificate(
        "probabilistic", 2e-9, (2,))
    assert c.kind == "probabilistic" and c.p == pytest.approx(3e-9) and c.seeds == (1, 2)
    assert (Certificate("exact") & Certificate("estimate")).kind == "estimate"
    assert str(Certificate("exact")) == "exact"


def test_evaluation_names_each_certificate():
    layer = models.random_dot(8, 2, seed=0)
    X = models.random_input(5, 8, seed=1)
    assert bounds.evaluate_certified("lofast_M", layer, X, 0.1).certificate.kind == "exact"
    assert bounds.evaluate_certified("jacobian", layer, X, 0.1).certificate.kind == "estimate"
    stack = models.random_stack("dot", 3, 8, 2, seed=2)
    v = bounds.evaluate_certified("taylor", stack, X, 0.01)
    assert v.certificate.kind == "exact" and v.value.dtype == torch.float64


def test_reuse_computes_a_norm_once_and_charges_each_user():
    layer = models.random_dot(8, 2, seed=0)
    X = models.random_input(5, 8, seed=1)
    first = Ledger(cache={})
    second = first.sharing()
    a = zeta(layer, X, ledger=first)
    b = zeta(layer, X, ledger=second)
    assert torch.equal(a, b)
    assert not first.entries[0].reused and second.entries[0].reused
    assert second.reused_seconds == first.entries[0].seconds > 0


def test_float32_inputs_are_certified_in_float64():
    """The audit's float32 case: residual layers with V/O weights of 1e-3 have ζ = 1 + O(1e-6),
    which float32 Lanczos returned as 1.0, below the float64 truth; certified values now compute
    in float64, so they stay above a float64 PGD."""
    layer = models.random_dot(8, 2, seed=3, v_norm=1e-3, o_norm=1e-3)
    X = models.random_input(6, 8, norm=1.0, seed=4)
    truth = zeta(layer, X, method="dense")
    for name in ("delta1", "lofast_M_half", "taylor"):
        got = bounds.evaluate(name, layer, X.float(), 0.05)
        assert got.dtype == torch.float64
        lower = bounds.evaluate(name, layer, X, 0.05)
        assert torch.all(got >= lower * (1 - 1e-6)), name
    assert float(bounds.evaluate("zeta", layer, X.float(), 0.05)) >= float(truth) * (1 - 1e-9)


def exact_gram(eigs: np.ndarray) -> torch.Tensor:
    """H diag(eigs) Hᵀ / D with H a Sylvester–Hadamard matrix (D = 4^k) and integer eigenvalues: every
    entry is an integer sum divided by a power of two, so the float64 matrix is exactly the one
    whose eigenvalues are ``eigs``."""
    from scipy.linalg import hadamard

    H = hadamard(len(eigs)).astype(np.float64)
    return torch.from_numpy((H * eigs) @ H.T / len(eigs))


@pytest.mark.parametrize("D", [256, 1024])
def test_cholesky_check_proves_only_true_upper_bounds(D):
    rng = np.random.default_rng(0)
    top = 2.0**20
    eigs = np.concatenate([[top, top - 1], rng.integers(0, 2**19, D - 2)]).astype(np.float64)
    G = exact_gram(rng.permutation(eigs))[None]
    confirmed = {}
    for t in (-1e-6, -1e-9, -1e-12, -1e-14, 0.0, 1e-14, 1e-12, 1e-10, 1e-9):
        ok, lam = cholesky_check(G.clone(), torch.tensor([top * (1 + t)], dtype=torch.float64))
        confirmed[t] = bool(ok)
        if ok:  # a confirmation is a proof: its bound is above the true top eigenvalue
            assert float(lam) >= top, t
    assert not confirmed[-1e-6] and not confirmed[-1e-9]
    assert confirmed[1e-9]  # and it confirms a guess 1e-9 above the truth, so it is tight


@pytest.mark.parametrize("seed", range(3))
def test_verified_gram_norm_is_just_above_the_exact_norm(seed):
    g = torch.Generator().manual_seed(seed)
    D = 256 + 37 * seed
    M = torch.randn(2, D + 3, D, generator=g, dtype=torch.float64)
    low_rank = torch.randn(1, 40, D, generator=g, dtype=torch.float64)  # rank 40 < D
    Q = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64)).Q
    s = torch.rand(D, generator=g, dtype=torch.float64)
    s[:2] = torch.tensor([3.0, 3.0 * (1 - 1e-13)])  # a near-tie at the top
    clustered = (Q * s) @ Q.T
    for G in (M.mT @ M, low_rank.mT @ low_rank, clustered[None]):
        value, all_exact = verified_gram_norm(G)
        truth = np.sqrt(np.linalg.eigvalsh(G.numpy())[:, -1].clip(0))
        assert not all_exact
        assert (value.numpy() >= truth).all()
        np.testing.assert_array_less(value.numpy(), truth * (1 + 2e-9))
        assert torch.equal(verified_gram_norm(G)[0], value)  # the same bits on every call


def test_a_looser_tau_stays_above_the_top_eigenvalue_and_within_it():
    """tau = 1e-6 (the remainder's forms): still ≥ the exact norm, and at most about 1e-6 above it;
    a matrix whose triangles differ by rounding is certified as its lower triangle says."""
    g = torch.Generator().manual_seed(11)
    for D in (40, 300, 700):
        M = torch.randn(2, D + 7, D, generator=g, dtype=torch.float64)
        G = M.mT @ M
        G = G + 1e-14 * torch.randn(G.shape, generator=g, dtype=torch.float64) * G.abs().amax()  # asymmetric
        truth = torch.linalg.eigvalsh(G.tril() + G.tril(-1).mT)[:, -1].sqrt()  # what the check reads
        value, _ = verified_gram_norm(G, tau=1e-6)
        assert (value >= truth).all()
        np.testing.assert_array_less(value.numpy(), truth.numpy() * (1 + 1e-6))


@pytest.mark.parametrize("D", [16, 64, 300, 512])
def test_a_gram_of_low_rank_gets_a_guess_never_above_its_top_eigenvalue(D):
    """Where G's rank is below the Krylov block's width (or its space turns invariant part way), a
    column of the residual block is rounding noise; normalised by the QR it is no longer orthogonal
    to the basis, and the Ritz value came out up to 44× λ_max, which the Cholesky check confirmed:
    sound, and that loose (the values spectral_spread found on the uncapped digits ViT's saturated
    rows). The guess stays ≤ λ_max and the certified norm within τ of it."""
    g = torch.Generator().manual_seed(D)
    for r in (1, 2, 3, 5, 7):
        scales = torch.logspace(0, -3, r, dtype=torch.float64)
        A = torch.randn(3, D, r, generator=g, dtype=torch.float64) * scales
        G = A @ A.mT
        lam = torch.linalg.eigvalsh(G)[:, -1]
        assert (norms.top_estimate(G, 1e-8) <= lam * (1 + 1e-12)).all()
        for tau in (1e-9, 1e-6):
            value = verified_gram_norm(G, tau)[0].square()
            assert (value >= lam).all() and (value <= lam * (1 + 2 * tau + 1e-12)).all()


@pytest.mark.parametrize("guess", ["second", "nan"])
def test_a_wrong_guess_falls_back_to_the_eigendecomposition(monkeypatch, guess):
    """The guess is not trusted: one below the top eigenvalue (a Krylov space that missed the top
    direction) or none at all makes the Cholesky check fail, and the exact path answers."""
    g = torch.Generator().manual_seed(5)
    M = torch.randn(3, 300, 280, generator=g, dtype=torch.float64)
    G = M.mT @ M
    eigs = torch.linalg.eigvalsh(G)
    wrong = eigs[:, -2] if guess == "second" else torch.full((3,), float("nan"), dtype=torch.float64)
    monkeypatch.setattr(norms, "top_estimate", lambda G, rtol, apply=None, start=None: wrong)
    value, all_exact = verified_gram_norm(G)
    assert all_exact
    torch.testing.assert_close(value, gram_norm(G), rtol=0, atol=0)
    assert (value >= eigs[:, -1].sqrt()).all()


def test_large_grams_are_checked_by_cholesky_and_say_deterministic():
    layer = models.random_dot(32, 2, seed=0)
    X = models.random_input(8, 32, seed=1)  # n·d = 256 = VERIFY_MIN
    book = Ledger()
    value = zeta(layer, X, ledger=book)
    assert book.certificate.kind == "deterministic" and book.certificate.p == 0
    truth = np.linalg.svd(delta1_matrix(layer, X).numpy(), compute_uv=False)[:, 0]
    assert (value.numpy() >= truth).all()
    np.testing.assert_array_less(value.numpy(), truth * (1 + 2e-9))
    book = Ledger()
    zeta(layer, X[:, :4], ledger=book)  # n·d = 128: the eigendecomposition, exact
    assert book.certificate.kind == "exact"


@pytest.mark.parametrize("D", [1, 2, 3, 5, 7, 9, 40])
def test_the_guess_fills_small_spaces_and_is_confirmed(D):
    """The block Krylov guess on sides that are no multiple of its block (the remainder's forms
    can be as small as h·n² = 1): the last block fills the space, so the guess is the top eigenvalue
    and the Cholesky check confirms it instead of falling back."""
    g = torch.Generator().manual_seed(D)
    M = torch.randn(3, D + 2, D, generator=g, dtype=torch.float64)
    G = M.mT @ M
    value, all_exact = verified_gram_norm(G)
    truth = torch.linalg.eigvalsh(G)[:, -1].sqrt()
    assert not all_exact
    assert (value >= truth).all() and (value <= truth * (1 + 2e-9)).all()
