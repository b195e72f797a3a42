"""The FFN's activation as ``taylor_net`` relaxes it per neuron (docs/bounds.md §5.1, "GELU"): for
z in a neuron's range [lo, hi] around its clean pre-activation z₀,

    σ(z) − σ(z₀) ∈ λ(z − z₀) + β + μ[−1, 1],

ReLU's parallelogram (:func:`bounds.network.zonotope.relu_relaxation`) or, for GELU σ(z) = z·Φ(z), the
exact slope λ = σ'(z₀) and the second-order error ½σ''(ξ)(z − z₀)², which lies in
[min(0, ½m·D²), max(0, ½M·D²)] with m, M the least and largest σ''(ξ) = φ(ξ)(2 − ξ²) on [lo, hi] and
D = max(z₀ − lo, hi − z₀). σ'' is smooth with critical points −2, 0 and 2 only (σ''' = φ(ξ)·ξ(ξ² − 4)),
so m and M are its values at the ends and at the critical points inside: exact, not sampled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..zonotope import relu_relaxation

__all__ = ["ACTIVATION_STAGES", "gelu_bounds", "gelu_relaxation", "gelu_second", "gelu_slope", "relaxation"]

# the activations taylor_net has a stage for (models.vit.ACTIVATIONS holds one more: gelu_tanh)
ACTIVATION_STAGES = ("relu", "gelu")
# σ'' computed in float64 is off by a few ulps of its size (≤ 0.8): widen its range by this
SECOND_ROUND = 1e-14


def _phi(z: Tensor) -> Tensor:
    return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def gelu_second(z: Tensor) -> Tensor:
    """GELU''(z) = φ(z)(2 − z²)."""
    return _phi(z) * (2 - z * z)


def gelu_slope(z: Tensor) -> Tensor:
    """GELU'(z) = Φ(z) + z·φ(z)."""
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * _phi(z)


def _second_range(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(least, largest) of GELU'' on [lo, hi], elementwise, widened by its rounding."""
    vals = [gelu_second(lo), gelu_second(hi)]
    for c in (-2.0, 0.0, 2.0):
        inside = (lo <= c) & (c <= hi)
        v = float(gelu_second(torch.tensor(c, dtype=torch.float64)))
        vals.append(torch.where(inside, v, math.nan))
    stack = torch.stack(vals)
    m = torch.nan_to_num(stack, nan=math.inf).amin(0)
    M = torch.nan_to_num(stack, nan=-math.inf).amax(0)
    return m - SECOND_ROUND, M + SECOND_ROUND


def gelu_relaxation(z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) with ``GELU(z) − GELU(z₀) ∈ λ(z − z₀) + β + μ[−1, 1]`` for every z ∈ [lo, hi]
    (module docstring)."""
    m, M = _second_range(torch.minimum(lo, z0), torch.maximum(hi, z0))
    D2 = torch.maximum(z0 - lo, hi - z0).clamp_min(0) ** 2
    e_lo, e_hi = (0.5 * m * D2).clamp_max(0), (0.5 * M * D2).clamp_min(0)
    return gelu_slope(z0), (e_lo + e_hi) / 2, (e_hi - e_lo) / 2


def relaxation(act: str, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) of ``act`` (:data:`ACTIVATION_STAGES`) on every neuron's range."""
    return relu_relaxation(z0, lo, hi) if act == "relu" else gelu_relaxation(z0, lo, hi)


def gelu_bounds(g: Tensor, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(s, b) with ``g·(GELU(z) − GELU(z₀)) ≥ g·s·(z − z₀) + g·b`` for every z ∈ [lo, hi]: the exact
    slope, and the end of the error's range that the sign of g picks (ReLU's counterpart:
    ``taylor_net.relu_bounds``)."""
    lam, beta, mu = gelu_relaxation(z0, lo, hi)
    return lam.expand_as(g), torch.where(g >= 0, beta - mu, beta + mu)
