"""Dot layers with biases (docs/bounds.md §1.5): exact values against independent numpy references,
bit-identity of zero biases, the file format, the refusal of bounds §1.5 does not extend, and the
soundness audit of tests/bounds/test_soundness.py repeated on biased layers.

The references are built from the definitions with the raw weights and biases, never from the code's
U, V or P: ``Q_l = X W^Q_l + 1 b_qᵀ``, ``K_l = X W^K_l + 1 b_kᵀ``, ``P_l = softmax(Q_l K_lᵀ/√d_h)``,
``F(X) = HX + Σ_l P_l (X W^V_l + 1 b_vᵀ) W^O_l + 1 b_oᵀ``. M_l is rebuilt column by column from the
logits themselves, ``(S(X + E) − S(X − E))/2`` (exact: S is quadratic in X), and the Jacobian by the
complex step, ``Im F(X + i·t·E)/t``, which has no cancellation error.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import main_inprocess, np_
from safetensors.torch import save_file

import attacks
import bounds
import models
from bounds.jacobian import sigma_exact
from bounds.lofast import m_norms, xi, zeta
from models import InputError
from models.operators import jacobian_lanczos, jacobian_matrix

RTOL = 1e-6
REL = 1e-6  # a certified bound passes a case when bound >= pgd·(1 − REL), as in test_soundness.py


# --- numpy references from the definitions (docs/bounds.md §1.5) ---------------------------------


def np_layer(layer: models.DotMHA) -> dict[str, np.ndarray]:
    """Weights and biases as float64 arrays, an absent bias as zeros."""
    h, d, e = layer.h, layer.d, layer.d_h
    shapes = {"b_q": (h, e), "b_k": (h, e), "b_v": (h, e), "b_o": (d,)}
    out = {k: np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o")}
    for k, shape in shapes.items():
        b = getattr(layer, k)
        out[k] = np.zeros(shape) if b is None else np_(b)
    return out


def softmax_rows_c(S: np.ndarray) -> np.ndarray:
    """Row softmax that also takes complex logits (the complex step): shift by the real maximum."""
    E = np.exp(S - S.real.max(axis=-1, keepdims=True))
    return E / E.sum(axis=-1, keepdims=True)


def ref_qk(w: dict, X: np.ndarray, hd: int) -> tuple[np.ndarray, np.ndarray]:
    n = X.shape[0]
    Q = X @ w["W_q"][hd] + np.ones((n, 1)) * w["b_q"][hd]
    K = X @ w["W_k"][hd] + np.ones((n, 1)) * w["b_k"][hd]
    return Q, K


def ref_logits(w: dict, X: np.ndarray, hd: int) -> np.ndarray:
    """Unscaled logits Q_l K_lᵀ, entry by entry."""
    Q, K = ref_qk(w, X, hd)
    n = X.shape[0]
    return np.array([[Q[i] @ K[j] for j in range(n)] for i in range(n)])


def ref_P(w: dict, X: np.ndarray, hd: int) -> np.ndarray:
    return softmax_rows_c(ref_logits(w, X, hd) / math.sqrt(w["W_q"].shape[2]))


def ref_forward(layer: models.DotMHA, X: np.ndarray) -> np.ndarray:
    w = np_layer(layer)
    n, d = X.shape
    Y = X.copy() if layer.residual else np.zeros((n, d), dtype=X.dtype)
    for hd in range(layer.h):
        V = X @ w["W_v"][hd] + np.ones((n, 1)) * w["b_v"][hd]
        Y = Y + ref_P(w, X, hd) @ V @ w["W_o"][hd]
    return Y + np.ones((n, 1)) * w["b_o"]


def ref_M(w: dict, X: np.ndarray, hd: int) -> np.ndarray:
    """M_l [n², nd]: column (k, a) is the part of Q'K'ᵀ − QKᵀ linear in Γ = E_ka, obtained as
    (S(X + E) − S(X − E))/2 (the quadratic part Γ A Γᵀ is even in Γ and cancels)."""
    n, d = X.shape
    M = np.zeros((n * n, n * d))
    for k in range(n):
        for a in range(d):
            E = np.zeros((n, d))
            E[k, a] = 1.0
            M[:, k * d + a] = ((ref_logits(w, X + E, hd) - ref_logits(w, X - E, hd)) / 2).reshape(-1)
    return M


def ref_jacobian(layer: models.DotMHA, X: np.ndarray) -> np.ndarray:
    """The nd×nd Jacobian (rows: outputs, row-major) by the complex step, exact to rounding."""
    n, d = X.shape
    t = 1e-30
    J = np.zeros((n * d, n * d))
    for c in range(n * d):
        E = np.zeros(n * d, dtype=complex)
        E[c] = 1j * t
        J[:, c] = ref_forward(layer, X.astype(complex) + E.reshape(n, d)).imag.reshape(-1) / t
    return J


# --- the exact cases -----------------------------------------------------------------------------

# (n, d, h, residual, input norm, q/k weight norm, bias norm, which biases, seed)
EXACT_CASES = [
    (3, 4, 1, True, 1.0, 1.0, 1.0, "all", 0),
    (4, 6, 2, False, 2.0, 1.5, 0.5, "all", 1),
    (5, 8, 4, True, 0.1, 0.7, 3.0, "all", 2),
    (2, 4, 2, False, 10.0, 0.5, 2.0, "all", 3),
    (4, 6, 3, True, 3.0, 1.2, 1.5, "q", 4),  # only b_q: enters V = Q W^Kᵀ, not U
    (4, 6, 2, False, 1.5, 1.0, 2.5, "k", 5),  # only b_k: enters U = K W^Qᵀ, not V
    (3, 4, 1, False, 0.0, 1.0, 2.0, "all", 6),  # X = 0: the logits are b_q·b_k alone
    (6, 4, 2, True, 5.0, 3.0, 3.0, "all", 7),  # saturated attention
    (3, 6, 2, False, 1.0, 1.0, 0.0, "zero", 8),  # biases present and zero
]
EXACT_IDS = [f"n{c[0]}d{c[1]}h{c[2]}{'-res' if c[3] else ''}-x{c[4]}-b{c[6]}{c[7]}" for c in EXACT_CASES]


def biased_layer(d, h, residual, qk, bias_norm, which, seed) -> models.DotMHA:
    layer = models.random_dot(d, h, seed=seed, q_norm=qk, k_norm=qk, residual=residual,
                              bias_norm=bias_norm if which != "zero" else 1.0)
    if which == "zero":
        return replace(layer, **{k: torch.zeros_like(getattr(layer, k))
                                 for k in ("b_q", "b_k", "b_v", "b_o")})
    if which in ("q", "k"):
        keep = f"b_{which}"
        return replace(layer, **{k: None for k in ("b_q", "b_k", "b_v", "b_o") if k != keep})
    return layer


@functools.cache
def exact_case(n, d, h, res, xn, qk, bn, which, seed):
    layer = biased_layer(d, h, res, qk, bn, which, seed)
    X = models.random_input(n, d, norm=xn or 1.0, seed=seed + 500, batch=2)
    return layer, torch.zeros_like(X) if xn == 0 else X


@pytest.mark.parametrize("case", EXACT_CASES, ids=EXACT_IDS)
def test_forward_and_attention_against_the_definitions(case):
    layer, X = exact_case(*case)
    w = np_layer(layer)
    P = layer.attention(X)
    Y = layer(X)
    for b in range(X.shape[0]):
        Xb = np_(X[b])
        for hd in range(layer.h):
            np.testing.assert_allclose(np_(P[b, hd]), ref_P(w, Xb, hd).real, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(np_(Y[b]), ref_forward(layer, Xb).real, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", EXACT_CASES, ids=EXACT_IDS)
def test_zeta_with_biases_against_kronecker(case):
    """ζ = ‖H⊗I_d + Σ_l P_l⊗C_lᵀ‖ with the biased P_l: b_v and b_o do not enter (docs/bounds.md §1.5)."""
    layer, X = exact_case(*case)
    w = np_layer(layer)
    n, d = X.shape[1:]
    got = {m: zeta(layer, X, method=m) for m in ("certified", "dense", "lanczos")}
    for b in range(X.shape[0]):
        Xb = np_(X[b])
        K = (1.0 if layer.residual else 0.0) * np.eye(n * d)
        for hd in range(layer.h):
            K = K + np.kron(ref_P(w, Xb, hd).real, (w["W_v"][hd] @ w["W_o"][hd]).T)
        ref = np.linalg.norm(K, 2)
        for m, v in got.items():
            assert abs(float(v[b]) - ref) <= RTOL * ref, (m, float(v[b]), ref)
        assert float(got["certified"][b]) >= ref * (1 - 1e-12)


@pytest.mark.parametrize("case", EXACT_CASES, ids=EXACT_IDS)
def test_m_norms_and_xi_with_biases_against_logit_differences(case):
    layer, X = exact_case(*case)
    w = np_layer(layer)
    n, d = X.shape[1:]
    got = {m: m_norms(layer, X, method=m) for m in ("certified", "dense", "lanczos")}
    got_xi = xi(layer, X)
    rng = np.random.default_rng(case[-1])
    for b in range(X.shape[0]):
        Xb = np_(X[b])
        for hd in range(layer.h):
            M = ref_M(w, Xb, hd)
            Q, K = ref_qk(w, Xb, hd)
            Wq, Wk = w["W_q"][hd], w["W_k"][hd]
            # the reference is §1.5's linear part Γ W^Q Kᵀ + Q W^Kᵀ Γᵀ
            G = rng.normal(size=(n, d))
            np.testing.assert_allclose(M @ G.reshape(-1), (G @ Wq @ K.T + Q @ Wk.T @ G.T).reshape(-1),
                                       rtol=1e-9, atol=1e-9 * (1 + np.abs(M).max()))
            ref = np.linalg.norm(M, 2)
            for m, v in got.items():
                assert abs(float(v[b, hd]) - ref) <= RTOL * ref, (m, float(v[b, hd]), ref)
            assert float(got["certified"][b, hd]) >= ref * (1 - 1e-12)
            ref_xi = np.linalg.norm(K @ Wq.T, 2) + np.linalg.norm(Q @ Wk.T, 2)
            assert abs(float(got_xi[b, hd]) - ref_xi) <= RTOL * ref_xi
            assert ref <= ref_xi * (1 + 1e-12)  # ‖M_l‖ ≤ ξ_l also with biases
            if case[7] in ("all", "q", "k"):
                # the bias-free M (from X A_l alone) is a different matrix: the test can fail
                A = Wq @ Wk.T
                M0 = (np.einsum("ik,ja->ijka", np.eye(n), Xb @ A.T)
                      + np.einsum("jk,ia->ijka", np.eye(n), Xb @ A)).reshape(n * n, n * d)
                assert not np.allclose(M0, M)


@pytest.mark.parametrize("case", EXACT_CASES, ids=EXACT_IDS)
def test_jacobian_with_biases_against_complex_step(case):
    layer, X = exact_case(*case)
    J = jacobian_matrix(layer.forward, X)
    sig, lan = sigma_exact(layer, X), jacobian_lanczos(layer.forward, X).sigma
    for b in range(X.shape[0]):
        ref = ref_jacobian(layer, np_(X[b]))
        np.testing.assert_allclose(np_(J[b]), ref, rtol=1e-9, atol=1e-11 * (1 + np.abs(ref).max()))
        s = np.linalg.norm(ref, 2)
        assert abs(float(sig[b]) - s) <= RTOL * s and abs(float(lan[b]) - s) <= RTOL * s


@pytest.mark.parametrize("case", EXACT_CASES, ids=EXACT_IDS)
def test_split_into_delta1_and_delta2_with_biases(case):
    """F(X') − F(X) = HΓ + Σ_l P_l Γ C_l + Σ_l (P_l' − P_l) X' C_l: b_o and b_v cancel (docs/bounds.md
    §1.5), so the objectives delta1 and delta2 measure the two parts of the biased layer's change."""
    layer, X = exact_case(*case)
    w = np_layer(layer)
    rng = np.random.default_rng(case[-1] + 1)
    G = torch.from_numpy(rng.normal(size=tuple(X.shape)) * 0.3)
    d1 = attacks.objectives.delta1(layer, X)(X + G)
    d2 = attacks.objectives.delta2(layer, X)(X + G)
    for b in range(X.shape[0]):
        Xb, Gb = np_(X[b]), np_(G[b])
        Xp = Xb + Gb
        change = (ref_forward(layer, Xp) - ref_forward(layer, Xb)).real
        D1 = (Gb if layer.residual else 0.0) + sum(
            ref_P(w, Xb, hd).real @ Gb @ w["W_v"][hd] @ w["W_o"][hd] for hd in range(layer.h))
        D2 = sum((ref_P(w, Xp, hd) - ref_P(w, Xb, hd)).real @ Xp @ w["W_v"][hd] @ w["W_o"][hd]
                 for hd in range(layer.h))
        np.testing.assert_allclose(D1 + D2, change, rtol=1e-9, atol=1e-11 * (1 + np.abs(change).max()))
        assert float(d1[b]) == pytest.approx(np.linalg.norm(D1), rel=1e-9, abs=1e-13)
        assert float(d2[b]) == pytest.approx(np.linalg.norm(D2), rel=1e-9, abs=1e-13)


# --- zero biases change nothing, bit for bit -----------------------------------------------------


def zero_biased(layer):
    if isinstance(layer, models.Stack):
        return replace(layer, blocks=tuple(zero_biased(b) for b in layer.blocks))
    z = functools.partial(torch.zeros, dtype=torch.float64)
    return replace(layer, b_q=z(layer.h, layer.d_h), b_k=z(layer.h, layer.d_h), b_v=z(layer.h, layer.d_h),
                   b_o=z(layer.d))


ZERO_SUBJECTS = [
    ("dot", models.random_dot(6, 2, seed=3, q_norm=1.5, k_norm=1.2),
     models.random_input(4, 6, norm=2.0, seed=1, batch=3)),
    ("dot-bare", models.random_dot(8, 4, seed=4, residual=False, q_norm=3.0),
     models.random_input(5, 8, norm=5.0, seed=2, batch=2)),
    ("stack", models.random_stack("dot", 2, 6, 2, seed=9, R=1.0), models.projected_input(4, 6, seed=4)),
]


@pytest.mark.parametrize(("label", "layer", "X"), ZERO_SUBJECTS, ids=[s[0] for s in ZERO_SUBJECTS])
def test_zero_biases_give_bit_identical_values(label, layer, X):
    """Every bound, the forward, P, both operators and PGD: zero biases are added to the bias-free
    computation, and x + 0.0 == x (docs/bounds.md §1.5)."""
    zlayer = zero_biased(layer)
    assert not bounds.has_biases(zlayer)
    assert [b.name for b in bounds.applicable(zlayer)] == [b.name for b in bounds.applicable(layer)]
    assert "specformer" in [b.name for b in bounds.applicable(zlayer)]
    for b in bounds.applicable(layer):
        assert torch.equal(bounds.evaluate(b, zlayer, X, 0.05), bounds.evaluate(b, layer, X, 0.05)), b.name
    assert torch.equal(zlayer(X), layer(X))
    if isinstance(layer, models.DotMHA):
        assert torch.equal(zlayer.attention(X), layer.attention(X))
        G = torch.randn(X.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        assert torch.equal(zlayer.delta1_operator(X).T(G), layer.delta1_operator(X).T(G))
        zop, op = zlayer.logit_operator(X), layer.logit_operator(X)
        assert torch.equal(zop.U, op.U) and torch.equal(zop.V, op.V)
        for obj in ("delta2", "delta21"):
            assert torch.equal(attacks.attack(zlayer, X, 0.05, obj, steps=10, restarts=2),
                               attacks.attack(layer, X, 0.05, obj, steps=10, restarts=2))
    assert torch.equal(attacks.attack(zlayer, X, 0.05, steps=10, restarts=2),
                       attacks.attack(layer, X, 0.05, steps=10, restarts=2))


def test_random_dot_biases():
    plain = models.random_dot(6, 3, seed=5, q_norm=2.0)
    biased = models.random_dot(6, 3, seed=5, q_norm=2.0, bias_norm=1.5)
    assert plain.biases() == (None, None, None, None) and not plain.has_biases
    assert biased.has_biases
    for k in ("W_q", "W_k", "W_v", "W_o"):  # the weights are those of the bias-free layer
        assert torch.equal(getattr(plain, k), getattr(biased, k))
    for k, shape in (("b_q", (3, 2)), ("b_k", (3, 2)), ("b_v", (3, 2)), ("b_o", (6,))):
        b = getattr(biased, k)
        assert b.shape == shape and b.dtype == torch.float64
        assert torch.allclose(b.norm(dim=-1), torch.tensor(1.5, dtype=torch.float64))
    assert models.random_layer("dot", 6, 3, seed=5, bias_norm=1.5).has_biases
    with pytest.raises(InputError, match=r"bias_norm must be finite and >= 0"):
        models.random_dot(6, 3, bias_norm=-1.0)
    with pytest.raises(InputError, match=r"only dot layers have biases"):
        models.random_layer("l2", 6, 3, bias_norm=1.0)


# --- the file format -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["all", "q", "k", "zero"])
def test_round_trip_with_biases(tmp_path, which):
    layer = biased_layer(6, 2, False, 1.3, 2.0, which, 11)
    path = tmp_path / "layer.safetensors"
    models.save_layer(path, layer)
    back = models.load_layer(path)
    for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"):
        a, b = getattr(layer, k), getattr(back, k)
        assert (a is None and b is None) or (b.dtype == torch.float64 and torch.equal(a, b)), k
    X = models.random_input(4, 6, norm=2.0, seed=5, batch=2)
    assert torch.equal(layer(X), back(X))
    assert torch.equal(bounds.evaluate("lofast_M", layer, X, 0.1), bounds.evaluate("lofast_M", back, X, 0.1))


def test_stack_round_trip_with_biases(tmp_path):
    stack = models.random_stack("dot", 2, 4, 2, seed=3, R=1.5, bias_norm=0.7)
    models.save_layer(tmp_path / "s.safetensors", stack)
    back = models.load_layer(tmp_path / "s.safetensors")
    X = models.random_input(3, 4, norm=2.0, seed=1)
    assert all(b.has_biases for b in back.blocks)
    assert torch.equal(stack(X), back(X))


def dot_file(tmp_path, **changes) -> str:
    layer = models.random_dot(6, 2, seed=0, bias_norm=1.0)
    t = {k: getattr(layer, k).contiguous() for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")}
    t.update(changes)
    path = tmp_path / "bad.safetensors"
    save_file(t, str(path), metadata={"kind": "dot"})
    return str(path)


@pytest.mark.parametrize(("name", "tensor", "match"), [
    ("b_q", torch.zeros(2, 4, dtype=torch.float64), r"b_q has shape \[2, 4\], inconsistent with e=3"),
    ("b_k", torch.zeros(3, 3, dtype=torch.float64), r"b_k has shape \[3, 3\], inconsistent with h=2"),
    ("b_v", torch.zeros(6, dtype=torch.float64), r"b_v must have 2 dims \(h,e\), got shape \[6\]"),
    ("b_o", torch.zeros(5, dtype=torch.float64), r"b_o has shape \[5\], inconsistent with d=6"),
    ("b_o", torch.zeros(2, 3, dtype=torch.float64), r"b_o must have 1 dims \(d\), got shape \[2, 3\]"),
    ("b_q", torch.tensor([[0.0, math.nan, 0.0], [0.0] * 3], dtype=torch.float64), r"b_q contains NaN or inf"),
    ("b_o", torch.full((6,), math.inf, dtype=torch.float64), r"b_o contains NaN or inf"),
])
def test_bad_bias_tensors(tmp_path, name, tensor, match):
    with pytest.raises(InputError, match=match) as err:
        models.load_layer(dot_file(tmp_path, **{name: tensor}))
    assert "\n" not in str(err.value)


def test_bias_in_a_kind_without_biases(tmp_path):
    layer = models.random_l2(4, 2, seed=0)
    t = {k: getattr(layer, k).contiguous() for k in ("W_q", "W_v", "W_o")}
    save_file(dict(t, b_q=torch.zeros(2, 2, dtype=torch.float64)), str(tmp_path / "l2.safetensors"),
              metadata={"kind": "l2"})
    with pytest.raises(InputError, match=r"tensor 'b_q' is a bias, which kind 'l2' does not take"):
        models.load_layer(tmp_path / "l2.safetensors")


# --- bounds that §1.5 does not extend refuse -----------------------------------------------------


def test_bounds_not_extended_refuse_biased_layers():
    biased = models.random_dot(4, 2, seed=0, bias_norm=1.0)
    plain = models.random_dot(4, 2, seed=0)
    X = models.random_input(3, 4)
    msg = r"^bound 'specformer' does not apply to a layer with biases \(docs/bounds.md §1.5\)$"
    with pytest.raises(InputError, match=msg):
        bounds.evaluate("specformer", biased, X, 0.1)
    with pytest.raises(InputError, match=msg):
        bounds.require(bounds.get("specformer"), biased)
    names = [b.name for b in bounds.applicable(biased)]
    assert names == [b.name for b in bounds.applicable(plain) if b.name != "specformer"]
    assert not bounds.applies(bounds.get("specformer"), biased)
    # one biased block is enough for a stack to refuse
    stack = models.Stack((plain, biased), R=1.0)
    with pytest.raises(InputError, match=r"does not apply to a stack whose blocks have biases"):
        bounds.evaluate("specformer", stack, X, 0.1)
    assert "specformer" not in [b.name for b in bounds.applicable(stack)]
    assert "lofast_M" in [b.name for b in bounds.applicable(stack)]
    # the wrong kind is still named first
    with pytest.raises(InputError, match=r"bound 'kim' does not apply to dot layers"):
        bounds.evaluate("kim", biased, X, 0.1)
    # accepting biases is opt-in: a new bound refuses until it is extended as §1.5 says
    assert not bounds.Bound(name="x", fn=lambda *a: None, paper="", equation="", certified=True,
                            kinds=frozenset({"dot"})).biases
    assert {b.name for b in bounds.BOUNDS if b.kinds and not b.biases} == {"specformer", "kim", "olsa"}


def test_point_on_a_biased_layer_file(tmp_path, capsys):
    layer = models.random_dot(6, 2, seed=1, bias_norm=2.0)
    X = models.random_input(4, 6, norm=1.5, seed=2)[0]
    models.save_layer(tmp_path / "layer.safetensors", layer)
    models.save_input(tmp_path / "x.safetensors", X)
    args = ("point", "--layer", tmp_path / "layer.safetensors", "--input", tmp_path / "x.safetensors",
            "--eps", "0.05", "--pgd-steps", "10", "--pgd-restarts", "2")
    code, out, err = main_inprocess(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert "specformer" not in got
    assert got["lofast_M"] == pytest.approx(float(bounds.evaluate("lofast_M", layer, X, 0.05)[0]), rel=1e-9)
    code, out, err = main_inprocess(capsys, *args, "--bounds", "specformer")
    assert code == 2 and err.strip().splitlines() == [
        "error: bound 'specformer' does not apply to a layer with biases (docs/bounds.md §1.5)"]


# --- the soundness audit on biased layers (as tests/bounds/test_soundness.py) ---------------------------

N_LAYERS, BATCH = 16, 4  # 64 cases


@functools.cache
def config(k: int) -> dict:
    rnd = random.Random(f"dot-bias-{k}")
    h = (1, 2, 4)[k % 3]
    saturated = k % 4 == 3  # ‖A_l‖ up to about 50: rows of P_l nearly one-hot
    return {
        "n": rnd.randint(2, 6), "d": h * rnd.choice((1, 2, 3)), "h": h, "residual": k % 2 == 0,
        "qk_norm": rnd.uniform(3.0, 7.0) if saturated else 10 ** rnd.uniform(-0.5, 0.5),
        "vo_norm": 10 ** rnd.uniform(-0.5, 0.5),
        # no biases, the largest norm 3, log-uniform in between
        "bias_norm": 0.0 if k % 8 == 0 else 3.0 if k % 8 == 1 else 10 ** rnd.uniform(-1.5, math.log10(3)),
        "eps": 10 ** rnd.uniform(-3, math.log10(0.5)),
        "norms": (0.1, 10.0, 1.0, 3.0) if k % 4 == 0
        else tuple(10 ** rnd.uniform(-1, 1) for _ in range(BATCH)),
        "seed": 7000 + k,
    }


@functools.cache
def case(k: int):
    cfg = config(k)
    n, d, seed = cfg["n"], cfg["d"], cfg["seed"]
    X = torch.cat([models.random_input(n, d, norm=xn, seed=10 * seed + i)
                   for i, xn in enumerate(cfg["norms"])])
    layer = models.random_dot(d, cfg["h"], seed=seed, q_norm=cfg["qk_norm"], k_norm=cfg["qk_norm"],
                              v_norm=cfg["vo_norm"], o_norm=cfg["vo_norm"], residual=cfg["residual"],
                              bias_norm=cfg["bias_norm"])
    return layer, X


@functools.cache
def pgd(k: int, objective: str) -> torch.Tensor:
    layer, X = case(k)
    return attacks.attack(layer, X, config(k)["eps"], objective, steps=200, restarts=8)


CERTIFIED = [b.name for b in bounds.BOUNDS if b.certified and b.objective is not None and "dot" in b.kinds
             and b.biases and not b.finding and not b.opt_in]  # opt-in: tests/bounds/test_crown.py


def test_the_biased_audit_covers_every_objective_and_enough_cases():
    assert {bounds.REGISTRY[name].objective for name in CERTIFIED} == {
        "output", "delta1", "delta2", "delta21", "delta22"}
    assert len(CERTIFIED) >= 15  # the suite's as this test was written; a new bound adds to them
    assert sum(case(k)[0].has_biases for k in range(N_LAYERS)) == N_LAYERS - 2


@pytest.mark.parametrize("name", CERTIFIED)
def test_certified_bound_is_sound_with_biases(name):
    b = bounds.REGISTRY[name]
    violations = []
    for k in range(N_LAYERS):
        layer, X = case(k)
        cfg = config(k)
        value = bounds.evaluate(b, layer, X, cfg["eps"])
        lower = pgd(k, b.objective)
        assert value.shape == lower.shape == ((BATCH, layer.h) if b.per_head else (BATCH,))
        assert torch.isfinite(value).all() and torch.isfinite(lower).all()
        assert torch.all(lower > 0)
        bad = ~(value >= lower * (1 - REL))
        for i in bad.nonzero()[:, 0].unique().tolist():
            violations.append(f"biased layer {k} {cfg} input {i}: {name} = {value[i].tolist()} "
                              f"< pgd({b.objective}) = {lower[i].tolist()}")
    assert not violations, f"{len(violations)} unsound case(s):\n" + "\n".join(violations)


def test_pgd_on_delta1_reaches_zeta_eps_with_biases():
    """Lemma 1 stays exact with biases (only P_l changes): PGD on ‖Δ₁‖ reaches ζε and never exceeds it."""
    for k in range(N_LAYERS):
        layer, X = case(k)
        exact = zeta(layer, X, method="dense") * config(k)["eps"]
        value = pgd(k, "delta1")
        assert torch.all(value >= exact * (1 - 1e-3)), (k, ((exact - value) / exact).tolist())
        assert torch.all(value <= exact * (1 + 1e-9)), (k, ((value - exact) / exact).tolist())


STACK_BOUNDS = [b.name for b in bounds.BOUNDS if b.certified and b.stack == "propagate" and "dot" in b.kinds
                and b.biases and not b.opt_in]


@pytest.mark.parametrize("name", STACK_BOUNDS)
def test_certified_bound_is_sound_on_biased_stacks(name):
    violations = []
    stacks = [(2, 4, 2, 3, 1.0, 0.05, 1.0), (3, 6, 3, 4, 2.0, 0.2, 3.0), (2, 4, 1, 5, None, 0.01, 0.3)]
    for k, (depth, d, h, n, R, eps, bn) in enumerate(stacks):
        stack = models.random_stack("dot", depth, d, h, seed=80 + k, R=R, weight_norm=0.8, bias_norm=bn)
        X = models.projected_input(n, d, R=R or 1.0, scale=2.0, seed=k, batch=3)
        value = bounds.evaluate(name, stack, X, eps)
        lower = attacks.attack(stack, X, eps, "output", steps=100, restarts=8)
        assert value.shape == lower.shape == (3,) and torch.all(lower > 0)
        if not torch.all(value >= lower * (1 - REL)):
            violations.append(f"stack {k}: {name} = {value.tolist()} < pgd = {lower.tolist()}")
    assert not violations, "\n".join(violations)


TAYLOR_CASES = [  # (label, d, h, residual, q/k norm, input norm, bias norm, ε): where the remainder bites
    ("saturated", 8, 2, True, math.sqrt(50), 3.0, 2.0, 0.05),
    ("saturated-bare", 8, 1, False, math.sqrt(50), 3.0, 3.0, 0.2),
    ("bias-only-logits", 8, 2, True, 2.0, 1e-3, 3.0, 0.01),  # X ≈ 0: the logits are b_q·b_k
    ("zero-ish-bare", 4, 1, False, 3.0, 1e-4, 1.0, 0.3),
    ("large-eps", 8, 4, True, 1.5, 2.0, 1.0, 1.0),
    ("large-eps-bare", 6, 2, False, 1.0, 0.5, 3.0, 2.0),
]


@pytest.mark.parametrize("name", ["taylor", "best"])
@pytest.mark.parametrize("case", TAYLOR_CASES, ids=[c[0] for c in TAYLOR_CASES])
def test_taylor_and_best_are_sound_with_biases_where_the_remainder_is_large(name, case):
    label, d, h, residual, qk, x_norm, bn, eps = case
    layer = models.random_dot(d, h, seed=sum(map(ord, label)), q_norm=qk, k_norm=qk, residual=residual,
                              bias_norm=bn)
    X = models.random_input(5, d, norm=x_norm, seed=7, batch=3)
    value = bounds.evaluate(name, layer, X, eps)
    lower = attacks.attack(layer, X, eps, "output", steps=200, restarts=8)
    assert torch.all(lower > 0)
    assert torch.all(value >= lower * (1 - REL)), (label, value.tolist(), lower.tolist())
