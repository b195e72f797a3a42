"""The contract every registered bound keeps with the registry: its function takes the ledger
(``fn(layer, X, eps, *, ledger)``, bounds.base.Bound), and the certificate of every certified norm
it computes reaches the ledger, through every function between (docs/bounds.md §2.4)."""

from __future__ import annotations

import inspect

import pytest

import bounds
import models
from bounds import lofast, registry, taylor

# bounds whose value rests on a certified norm (ζ, ‖M_l‖ or σ̄_J): forced onto the Lanczos
# certificate, each must say probabilistic; a function that dropped the ledger on the way would
# say exact
ON_NORMS = ["zeta", "delta1", "delta2_M", "delta21_M", "lofast_M", "lofast_xi", "lofast_M_half",
            "lofast_xi_half", "taylor", "best", "taylor_remainder", "taylor_remainder_global"]


@pytest.mark.parametrize("bound", registry.BOUNDS, ids=lambda b: b.name)
def test_every_bound_takes_the_ledger(bound):
    params = inspect.signature(bound.fn).parameters
    assert "ledger" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()), bound.name


@pytest.fixture
def lanczos_only(monkeypatch):
    """Every certified norm by the Lanczos certificate (its dense limits at 0)."""
    monkeypatch.setattr(lofast, "ZETA_GRAM_LIMIT", 0)
    monkeypatch.setattr(lofast, "M_GRAM_LIMIT", 0)
    monkeypatch.setattr(taylor, "JACOBIAN_LIMIT", 0)


@pytest.mark.parametrize("name", ON_NORMS)
def test_a_probabilistic_norm_reaches_the_certificate(name, lanczos_only):
    layer = models.random_dot(8, 2, seed=0)
    X = models.random_input(4, 8, seed=1)
    v = bounds.evaluate_certified(name, layer, X, 0.05)
    assert v.certificate.kind == "probabilistic" and v.certificate.p > 0, (name, v.certificate)
    if registry.get(name).stack == "propagate":  # every block's norms, one union bound
        stack = models.Stack((layer, models.random_dot(8, 2, seed=2)))
        s = bounds.evaluate_certified(name, stack, X, 0.05)
        assert s.certificate.kind == "probabilistic" and s.certificate.p > v.certificate.p * 1.5


def test_a_bound_without_norms_stays_exact(lanczos_only):
    layer = models.random_dot(8, 2, seed=0)
    X = models.random_input(4, 8, seed=1)
    assert bounds.evaluate_certified("naive", layer, X, 0.05).certificate.kind == "exact"
