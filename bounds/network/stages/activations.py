"""The FFN's activation as ``taylor_net`` relaxes it per neuron (docs/bounds.md §5.1, "GELU"): for
z in a neuron's range [lo, hi] around its clean pre-activation z₀,

    σ(z) − σ(z₀) ∈ λ(z − z₀) + β + μ[−1, 1],

ReLU's parallelogram (:func:`bounds.network.zonotope.relu_relaxation`) or, for GELU σ(z) = z·Φ(z), the
exact slope λ = σ'(z₀) and the second-order error ½σ''(ξ)(z − z₀)², which lies in
[min(0, ½m·D²), max(0, ½M·D²)] with m, M the least and largest σ''(ξ) = φ(ξ)(2 − ξ²) on [lo, hi] and
D = max(z₀ − lo, hi − z₀). σ'' is smooth with critical points −2, 0 and 2 only (σ''' = φ(ξ)·ξ(ξ² − 4)),
so m and M are its values at the ends and at the critical points inside: exact, not sampled.

GELU's tanh approximation σ(z) = ½z(1 + tanh u), u = c(z + az³) (c = √(2/π), a = 0.044715, or the two
rounded to float32 for ``gelu_tanh_f32``: models.vit.TANH_FORMS), takes the
same relaxation with its own slope σ'(z₀) = ½(1 + t) + ½z(1 − t²)u' and its σ'' =
(1 − t²)(u' + ½z(u'' − 2t·u'²)) (t = tanh u, u' = c(1 + 3az²), u'' = 6acz), whose range on [lo, hi] is
bounded by interval arithmetic on that expression over :data:`TANH_PIECES` equal pieces of the
interval (u is increasing, so t's interval is tanh of u's ends): sound, and tight where the range is
narrow.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models.vit import ACTIVATIONS, TANH_FORMS

from ..zonotope import relu_relaxation

__all__ = ["ACTIVATION_STAGES", "gelu_bounds", "gelu_relaxation", "gelu_second", "gelu_slope", "relaxation",
           "tanh_second", "tanh_slope"]

# the activations taylor_net has a stage for: every one of models.vit.ACTIVATIONS
ACTIVATION_STAGES = ACTIVATIONS
# the tanh approximation's constants (torch.nn.functional.gelu(approximate="tanh"))
TANH_C, TANH_A = TANH_FORMS["gelu_tanh"]
Form = tuple[float, float]  # a tanh form's (c, a)
# the pieces of a neuron's range on each of which σ'' of the tanh approximation is bounded apart
TANH_PIECES = 8
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


def gelu_second_range(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
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


def tanh_slope(z: Tensor, form: Form = (TANH_C, TANH_A)) -> Tensor:
    """σ'(z) of GELU's tanh approximation with ``form``'s (c, a): ½(1 + t) + ½z(1 − t²)u'."""
    c, a = form
    t = torch.tanh(c * (z + a * z**3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * a * z * z)


def tanh_second(z: Tensor, form: Form = (TANH_C, TANH_A)) -> Tensor:
    """σ''(z) of GELU's tanh approximation with ``form``'s (c, a): (1 − t²)(u' + ½z(u'' − 2t·u'²))."""
    c, a = form
    t = torch.tanh(c * (z + a * z**3))
    du, ddu = c * (1 + 3 * a * z * z), 6 * a * c * z
    return (1 - t * t) * (du + 0.5 * z * (ddu - 2 * t * du * du))


def _times(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The interval product [a] · [b]."""
    p = torch.stack([a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]])
    return p.amin(0), p.amax(0)


def _square(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """The interval {x² : x ∈ [lo, hi]}."""
    low = torch.where((lo <= 0) & (hi >= 0), 0.0, torch.minimum(lo * lo, hi * hi))
    return low, torch.maximum(lo * lo, hi * hi)


def _tanh_second_piece(lo: Tensor, hi: Tensor, form: Form) -> tuple[Tensor, Tensor]:
    """An interval holding σ''(z) of the tanh approximation for every z ∈ [lo, hi] (interval arithmetic
    on :func:`tanh_second`'s expression; z ↦ u is increasing, as c, a > 0)."""
    C, A = form
    t = (torch.tanh(C * (lo + A * lo**3)), torch.tanh(C * (hi + A * hi**3)))
    z = (lo, hi)
    zz, tt = _square(lo, hi), _square(*t)
    one_minus = (1 - tt[1], 1 - tt[0])
    du = (C * (1 + 3 * A * zz[0]), C * (1 + 3 * A * zz[1]))
    ddu = (6 * A * C * lo, 6 * A * C * hi)
    du2 = (du[0] ** 2, du[1] ** 2)
    tdu2 = _times(t, du2)
    inner = (ddu[0] - 2 * tdu2[1], ddu[1] - 2 * tdu2[0])
    half_z = (0.5 * z[0], 0.5 * z[1])
    zi = _times(half_z, inner)
    bracket = (du[0] + zi[0], du[1] + zi[1])
    return _times(one_minus, bracket)


def tanh_second_range(lo: Tensor, hi: Tensor, form: Form = (TANH_C, TANH_A)) -> tuple[Tensor, Tensor]:
    """(least, largest) bounds of the tanh approximation's σ'' (``form``'s (c, a)) on [lo, hi], over
    :data:`TANH_PIECES` pieces, widened by a relative and an absolute rounding slack."""
    steps = torch.linspace(0, 1, TANH_PIECES + 1, dtype=lo.dtype, device=lo.device)
    edges = lo[..., None] + (hi - lo)[..., None] * steps  # [..., pieces + 1]
    edges[..., -1] = hi
    m, M = _tanh_second_piece(edges[..., :-1], edges[..., 1:], form)
    m, M = m.amin(-1), M.amax(-1)
    return m - 1e-12 * m.abs() - SECOND_ROUND, M + 1e-12 * M.abs() + SECOND_ROUND


def gelu_relaxation(z0: Tensor, lo: Tensor, hi: Tensor,
                    form: Form | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) with ``GELU(z) − GELU(z₀) ∈ λ(z − z₀) + β + μ[−1, 1]`` for every z ∈ [lo, hi]
    (module docstring); ``form``: GELU's tanh approximation with these (c, a) (None: GELU itself)."""
    a, b = torch.minimum(lo, z0), torch.maximum(hi, z0)
    m, M = tanh_second_range(a, b, form) if form is not None else gelu_second_range(a, b)
    D2 = torch.maximum(z0 - lo, hi - z0).clamp_min(0) ** 2
    e_lo, e_hi = (0.5 * m * D2).clamp_max(0), (0.5 * M * D2).clamp_min(0)
    slope = tanh_slope(z0, form) if form is not None else gelu_slope(z0)
    return slope, (e_lo + e_hi) / 2, (e_hi - e_lo) / 2


def relaxation(act: str, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) of ``act`` (:data:`ACTIVATION_STAGES`) on every neuron's range."""
    if act not in ACTIVATION_STAGES:
        raise ValueError(f"no relaxation of the activation {act!r}")
    if act == "relu":
        return relu_relaxation(z0, lo, hi)
    return gelu_relaxation(z0, lo, hi, TANH_FORMS.get(act))


def gelu_bounds(g: Tensor, z0: Tensor, lo: Tensor, hi: Tensor,
                form: Form | None = None) -> tuple[Tensor, Tensor]:
    """(s, b) with ``g·(GELU(z) − GELU(z₀)) ≥ g·s·(z − z₀) + g·b`` for every z ∈ [lo, hi]: the exact
    slope, and the end of the error's range that the sign of g picks (ReLU's counterpart:
    ``taylor_net.relu_bounds``); ``form`` as in :func:`gelu_relaxation`."""
    lam, beta, mu = gelu_relaxation(z0, lo, hi, form)
    return lam.expand_as(g), torch.where(g >= 0, beta - mu, beta + mu)
