"""The shared budget's optimum (bounds.network.budget.shared) against an independent linear program."""

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from bounds.network.budget import shared


def by_linprog(v: np.ndarray, caps: np.ndarray, budget: float) -> float:
    """max Σ_j (s_j/caps_j)·v_j over 0 ≤ s_j ≤ caps_j, Σ_j s_j ≤ budget, by HiGHS (an item of cap 0
    adds its value whole: its s_j is 0 and its error with it)."""
    free = caps > 0
    whole = float(v[~free].sum())
    if not free.any():
        return whole
    c = -(v[free] / caps[free])
    res = linprog(c, A_ub=np.ones((1, int(free.sum()))), b_ub=[budget],
                  bounds=list(zip(np.zeros(int(free.sum())), caps[free], strict=True)), method="highs")
    assert res.status == 0
    return whole - res.fun


@pytest.mark.parametrize("k", [1, 2, 5, 16, 40])
def test_shared_is_the_linear_programs_optimum(k):
    gen = np.random.default_rng(k)
    for case in range(60):
        # values over decades, caps some 0, budgets from none to more than every cap
        v = gen.lognormal(0, 2, k) * (gen.random(k) > 0.1)
        caps = gen.lognormal(-2, 1.5, k) * (gen.random(k) > 0.1)
        budget = float(caps.sum() * gen.choice([0.0, 0.05, 0.3, 0.7, 1.0, 2.0]))
        got = float(shared(torch.tensor(v), torch.tensor(caps), torch.tensor(budget, dtype=torch.float64)))
        want = by_linprog(v, caps, budget)
        # HiGHS' own feasibility tolerance is 1e-7
        assert abs(got - want) <= 1e-7 * max(want, 1.0), (case, got, want)
        # at most the two bounds it replaces, and at least every feasible share's sum
        free = caps > 0
        old = min(v.sum(), budget * (v[free] / caps[free]).max(initial=0) + v[~free].sum())
        assert got <= old * (1 + 1e-9) + 1e-12
        s = caps * gen.random(k)
        s *= min(1.0, budget / max(s.sum(), 1e-300))
        assert float((np.where(free, s / np.where(free, caps, 1), 1) * v).sum()) <= got * (1 + 1e-9) + 1e-12


def test_shared_batches_and_broadcasts():
    """Rows of a batch are independent, the caps and budget broadcast, and an infinite value stays
    infinite only where it is taken."""
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 1.0]], dtype=torch.float64)
    caps = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    budget = torch.tensor([[2.0], [4.0]], dtype=torch.float64)
    got = shared(v, caps, budget[:, 0])
    # row 0: ratios 1, 2, 1.5 → item 2 whole (2), then half of item 3 (1.5); row 1: everything (5)
    assert torch.allclose(got, torch.tensor([3.5, 5.0], dtype=torch.float64), rtol=1e-12)
    f64 = lambda *x: torch.tensor(x, dtype=torch.float64)
    inf, ones = f64(torch.inf, 1.0)[None], f64(1.0, 1.0)
    assert torch.isinf(shared(inf, ones, f64(0.5)))
    assert float(shared(inf, ones, f64(0.0))) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_rounds_up(dtype):
    """Many items with budget for all but a sliver: the result is never below the float64 optimum."""
    gen = torch.Generator().manual_seed(3)
    v = torch.rand(200, 64, generator=gen, dtype=torch.float64)
    caps = torch.rand(200, 64, generator=gen, dtype=torch.float64)
    budget = caps.sum(-1) * 0.999
    exact = shared(v, caps, budget)
    assert (shared(v.to(dtype), caps.to(dtype), budget.to(dtype)).double() >= exact * (1 - 1e-15)).all()
