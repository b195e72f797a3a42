"""Attention's row remainder along a functional, each key on its own (docs/bounds.md §5.1, "The logits'
part per key"): the logits' part of a row is Σ_k p_kφ(w_k)ỹ_k exactly (against a dense float64
construction of softmax's remainder); the log-ratios' bounds hold every sampled change and are attained
at a corner; on LayerProject, BatchNorm and LayerNorm ViTs the keys' excess and moved weight hold the
set's points and the true deviations, and are below softmax's box alone somewhere; the values' per-key
form is the least over c of its dense construction."""

from __future__ import annotations

import pytest
import torch
from test_attention_set import read_on_set, set_points, staged_moves

from bounds.network.stages.logits import log_ratios, softmax_box
from bounds.remainder.row_bounds import keyed_logits, keyed_values

phi = lambda w: torch.expm1(w) - w


@pytest.mark.parametrize("n,scale,seed", [(2, 0.3, 0), (7, 2.0, 1), (17, 6.0, 2)])
def test_the_logits_part_of_a_row_is_its_keys_excess_exactly(n, scale, seed):
    """E_{p'}y − E_p y − Cov_p(u, y) = Σ_k p_kφ(w_k)(y_k − E_p y) with w_k = log(p'_k/p_k), on random
    rows and shifts up to saturation; keyed_logits of the exact excess holds it."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randn(300, n, generator=gen, dtype=torch.float64) * 3
    u = torch.randn(300, n, generator=gen, dtype=torch.float64) * scale
    y = torch.randn(300, n, generator=gen, dtype=torch.float64)
    p, q = L.softmax(-1), (L + u).softmax(-1)
    ybar = (p * y).sum(-1, keepdim=True)
    cov = (p * (u - (p * u).sum(-1, keepdim=True)) * (y - ybar)).sum(-1)
    direct = (q * y).sum(-1) - ybar[:, 0] - cov
    w = (L + u).log_softmax(-1) - L.log_softmax(-1)
    keyed = (p * phi(w) * (y - ybar)).sum(-1)
    assert torch.allclose(keyed, direct, rtol=1e-9, atol=1e-12)
    assert (direct.abs() <= keyed_logits(p * phi(w), y - ybar) * (1 + 1e-12) + 1e-14).all()


@pytest.mark.parametrize("n,width,seed", [(1, 1.0, 0), (5, 0.2, 1), (9, 3.0, 2), (17, 12.0, 3)])
def test_the_log_ratios_hold_every_sampled_change_and_a_corner_attains_them(n, width, seed):
    """With u_j ∈ [a_j, b_j] and D_jk = b_j − a_k, every sampled w_k lies within log_ratios' bounds;
    w_k = lo_k at the corner u_k = a_k with every other u_j = b_j, and hi_k at the opposite one."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randn(6, n, generator=gen, dtype=torch.float64) * 4
    P = L.softmax(-1)
    a = -torch.rand(6, n, generator=gen, dtype=torch.float64) * width
    b = torch.rand(6, n, generator=gen, dtype=torch.float64) * width
    lo, hi = log_ratios(P, b[:, :, None] - a[:, None, :])
    for _ in range(200):
        t = torch.rand(6, n, generator=gen, dtype=torch.float64)
        t = torch.where(torch.rand(6, n, generator=gen, dtype=torch.float64) < 0.3, t.round(), t)
        w = (L + a + t * (b - a)).log_softmax(-1) - L.log_softmax(-1)
        assert (w >= lo).all() and (w <= hi).all()
    for k in range(n):
        low, high = b.clone(), a.clone()
        low[:, k], high[:, k] = a[:, k], b[:, k]
        w_low = (L + low).log_softmax(-1)[:, k] - L.log_softmax(-1)[:, k]
        w_high = (L + high).log_softmax(-1)[:, k] - L.log_softmax(-1)[:, k]
        assert torch.allclose(w_low, lo[:, k], rtol=1e-9, atol=1e-10)
        assert torch.allclose(w_high, hi[:, k], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind,seed,qk,eps", [("project", 15, 2.0, 0.05), ("project", 3, 4.0, 0.1),
                                              ("batch", 17, 8.0, 0.1), ("layer", 5, 3.0, 0.05)])
def test_the_keys_excess_and_moved_weight_hold_the_set_and_beat_the_box(kind, seed, qk, eps):
    """At the set's points and at the true deviations of sampled perturbations, each key's
    p_kφ(w_k) ≤ excess_k and |p'_k − p_k| ≤ moved_k; and somewhere moved is below softmax's box."""
    tn, stages, clean, before, moved_inputs, gen = staged_moves(kind, seed, qk, eps, 7)
    below = False
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        parts, _, box, readings = read_on_set(S, layer, X, eps)
        P = parts.P
        low, high = softmax_box(P, box.centre - box.whole, box.centre + box.whole)
        below = below or bool((readings.moved < torch.maximum(high - P, P - low) * 0.9).any())
        for dev in [m[k] - X for m in moved_inputs] + list(set_points(S, eps, 6, gen)):
            with torch.no_grad():
                Pd = layer.attention(X + dev)
            w = Pd.log() - P.log()
            assert (P * phi(w) <= readings.excess * (1 + 1e-9) + 1e-15).all(), k
            assert ((Pd - P).abs() <= readings.moved * (1 + 1e-9) + 1e-15).all(), k
    assert below


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_values_per_key_form_is_the_least_over_c_of_its_dense_construction(seed):
    """keyed_values = min over c of Σ_k moved_k(|m_k − c| + h_k) (the least is at some m_k, so those are
    tried), its ranges the set's within the radii's; and it holds (p' − p)·z for sampled p' − p and z."""
    gen = torch.Generator().manual_seed(seed)
    B, C, h, n = 2, 3, 2, 6
    moved = torch.rand(B, 1, h, n, n, generator=gen, dtype=torch.float64) * 0.1
    along = 0.5 + torch.rand(B, C, h, n, generator=gen, dtype=torch.float64)
    radii = 0.5 + torch.rand(B, n, generator=gen, dtype=torch.float64)
    mid = torch.randn(B, C, h, n, n, generator=gen, dtype=torch.float64) * 0.1
    half = torch.rand(B, C, h, n, n, generator=gen, dtype=torch.float64) * 0.3
    got = keyed_values(moved, along, radii, (None, None, mid, half))
    R = radii[:, None, None, None, :] * along[..., None]
    lo, hi = torch.maximum(mid - half, -R), torch.minimum(mid + half, R)
    m, hw = (lo + hi) / 2, (hi - lo) / 2
    # c = m_j for each j: [..., j, k]
    tries = (moved[..., None, :] * ((m[..., None, :] - m[..., :, None]).abs() + hw[..., None, :])).sum(-1)
    assert torch.allclose(got, tries.amin(-1), rtol=1e-10, atol=1e-14)
    for _ in range(50):  # (p' − p)·z with |p'_k − p_k| ≤ moved_k summing to 0, and z in its ranges
        d = (torch.rand(B, 1, h, n, n, generator=gen, dtype=torch.float64) * 2 - 1) * moved
        d = d - d.mean(-1, keepdim=True)
        d = d * (moved / d.abs().clamp_min(1e-300)).amin(-1, keepdim=True).clamp_max(1)
        z = lo + torch.rand(B, C, h, n, n, generator=gen, dtype=torch.float64) * (hi - lo)
        assert ((d * z).sum(-1).abs() <= got * (1 + 1e-12)).all()


@pytest.mark.parametrize("n,seed", [(1, 0), (4, 1), (17, 2)])
def test_the_knapsack_is_the_linear_programs_optimum(n, seed):
    """knapsack = max Σ x·gain over 0 ≤ x ≤ cap, Σ x ≤ budget, as scipy's linprog finds it (budgets
    below, between and above the caps' sum; zero gains and caps; an ∞ cap)."""
    from scipy.optimize import linprog

    from bounds.remainder.row_bounds import knapsack

    gen = torch.Generator().manual_seed(seed)
    for trial in range(20):
        gain = torch.rand(n, generator=gen, dtype=torch.float64) * 3
        cap = torch.rand(n, generator=gen, dtype=torch.float64)
        gain = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.2, 0.0, gain)
        cap = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.2, 0.0, cap)
        if trial % 5 == 4:
            cap[0] = torch.inf
        total = float(cap[cap.isfinite()].sum() + 0.1)
        budget = torch.tensor(float(torch.rand(1, generator=gen)) * 1.5 * total, dtype=torch.float64)
        bounds = [(0, None if c.isinf() else float(c)) for c in cap]
        best = linprog(-gain.numpy(), A_ub=[[1.0] * n], b_ub=[float(budget)], bounds=bounds, method="highs")
        assert abs(float(knapsack(gain, cap, budget)) + best.fun) <= 1e-9 * (1 + abs(best.fun))
    assert torch.equal(knapsack(gain, cap, None), torch.where(gain > 0, cap * gain, 0.0).sum())


@pytest.mark.parametrize("n,scale,seed", [(2, 0.5, 0), (9, 3.0, 1), (17, 20.0, 2)])
def test_the_keys_excess_sums_to_kappa_within_hoeffdings_budget(n, scale, seed):
    """Σ_k p_kφ(w_k) = log E_p e^{u − ū} ≤ s²/8 (s the span of u) on random rows up to saturation: the
    budget keyed_logits takes."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randn(400, n, generator=gen, dtype=torch.float64) * 3
    u = torch.randn(400, n, generator=gen, dtype=torch.float64) * scale
    u = torch.where(torch.rand(400, n, generator=gen, dtype=torch.float64) < 0.3, u.sign() * scale, u)
    p = L.softmax(-1)
    w = (L + u).log_softmax(-1) - L.log_softmax(-1)
    total = (p * phi(w)).sum(-1)
    ubar = (p * u).sum(-1, keepdim=True)
    kappa = (p * (u - ubar).exp()).sum(-1).log()
    assert torch.allclose(total, kappa, rtol=1e-9, atol=1e-12)
    span = u.amax(-1) - u.amin(-1)
    assert (total <= span.square() / 8 * (1 + 1e-12) + 1e-15).all()
