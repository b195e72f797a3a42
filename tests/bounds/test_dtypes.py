"""Every bound and the attack agree across dtypes (CPU float32 vs float64) and devices (CUDA vs CPU
in float64, when a GPU is present). Certified bounds always compute in float64 (docs/bounds.md
§2.4); estimates in the input's dtype; PGD searches in it and reports float64 values (§4)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attacks
import bounds
import models


def subjects():
    """(label, layer or stack, X in float64, eps) covering every kind and the stack-only bounds."""
    n = 4
    X6 = torch.cat([models.random_input(n, 6, norm=xn, seed=i) for i, xn in enumerate((0.5, 2.0))])
    X4 = torch.cat([models.random_input(n, 4, norm=xn, seed=9 + i)
                    for i, xn in enumerate((0.3, 3.0))])
    return [
        ("dot", models.random_dot(6, 2, seed=1, q_norm=1.2), X6, 0.05),
        ("dot-bare", models.random_dot(6, 3, seed=2, residual=False), X6, 0.2),
        ("l2", models.random_l2(6, 2, seed=3), X6, 0.05),
        ("olsa", models.random_olsa(6, 2, n=n, c=3.0, seed=4, residual=True), X6, 0.1),
        ("stack-dot", models.random_stack("dot", 2, 4, 2, seed=5, R=1.0), X4, 0.05),
        ("stack-l2", models.random_stack("l2", 2, 4, 1, seed=6, R=None, weight_norm=0.5), X4, 0.02),
        ("stack-olsa", models.random_stack("olsa", 2, 4, 2, seed=7, n=n, c=3.0), X4, 0.05),
        ("dot-bias", models.random_dot(6, 2, seed=8, q_norm=1.2, bias_norm=1.5), X6, 0.05),  # §1.5
    ]


SUBJECTS = subjects()
IDS = [s[0] for s in SUBJECTS]


def all_bounds(layer, X, eps) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 Lanczos may warn near its tolerance
        return {b.name: bounds.evaluate(b, layer, X, eps) for b in bounds.applicable(layer)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())


@pytest.mark.parametrize(("label", "layer", "X", "eps"), SUBJECTS, ids=IDS)
def test_float32_matches_float64(label, layer, X, eps):
    ref = all_bounds(layer, X, eps)
    got = all_bounds(layer, X.float(), eps)
    assert ref.keys() == got.keys() and len(ref) > 0
    for name in ref:
        want = torch.float64 if bounds.get(name).certified else torch.float32
        assert got[name].dtype == want and ref[name].dtype == torch.float64, name
        assert got[name].shape == ref[name].shape, name
        assert torch.all(ref[name] > 0), name
        assert rel_err(got[name], ref[name]) <= 1e-3, (label, name, got[name], ref[name])


@pytest.mark.parametrize(("label", "layer", "X", "eps"), SUBJECTS[:4] + SUBJECTS[4:5], ids=IDS[:5])
def test_pgd_float32_roughly_matches_float64(label, layer, X, eps):
    objectives = ["output", "delta1", "delta21", "delta22"] if layer.kind == "dot" else ["output"]
    for obj in objectives:
        ref = attacks.attack(layer, X, eps, obj, steps=50, restarts=4)
        got = attacks.attack(layer, X.float(), eps, obj, steps=50, restarts=4)
        assert got.dtype == torch.float64  # measured in float64 whatever the search's dtype
        assert rel_err(got, ref) <= 1e-2, (label, obj, got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("label", "layer", "X", "eps"), SUBJECTS, ids=IDS)
def test_cuda_float64_matches_cpu(label, layer, X, eps):
    ref = all_bounds(layer, X, eps)
    got = all_bounds(layer, X.cuda(), eps)
    assert ref.keys() == got.keys()
    for name in ref:
        assert got[name].is_cuda and got[name].dtype == torch.float64, name
        assert rel_err(got[name], ref[name]) <= 1e-6, (label, name, got[name], ref[name])
    objectives = ["output", "delta1", "delta2", "delta21", "delta22"] \
        if layer.kind == "dot" else ["output"]
    for obj in objectives:
        p_ref = attacks.attack(layer, X, eps, obj, steps=50, restarts=4)
        p_got = attacks.attack(layer, X.cuda(), eps, obj, steps=50, restarts=4)
        assert p_got.is_cuda
        assert rel_err(p_got, p_ref) <= 1e-6, (label, obj, p_got, p_ref)
