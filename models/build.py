"""Seeded builders for random layers, stacks and inputs.

Everything is drawn in float64 on the CPU from a ``torch.Generator``, then cast, so a (builder,
parameters, seed) triple gives bit-identical tensors on every device and in every dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import InputError, check_heads
from .layers import L2MHA, OLSA, DotMHA, Layer, Stack, layer_project


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def with_spectral_norm(M: Tensor, norm: float) -> Tensor:
    """Rescales each trailing matrix of M to the given spectral norm."""
    s = torch.linalg.matrix_norm(M, ord=2).clamp_min(1e-300)
    return M * (norm / s)[..., None, None]


def _random(gen: torch.Generator, shape: tuple[int, ...], norm: float) -> Tensor:
    return with_spectral_norm(torch.randn(*shape, generator=gen, dtype=torch.float64), norm)


def random_orthogonal(d: int, gen: torch.Generator) -> Tensor:
    """A Haar-random d×d orthogonal matrix (QR with the sign fix)."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _random_vectors(gen: torch.Generator, shape: tuple[int, ...], norm: float) -> Tensor:
    """Gaussian vectors along the last dimension, each rescaled to Euclidean norm ``norm``."""
    v = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return v * (norm / v.norm(dim=-1, keepdim=True).clamp_min(1e-300))


def random_dot(
    d: int, h: int, *, seed: int = 0, q_norm: float = 1.0, k_norm: float = 1.0,
    v_norm: float = 1.0, o_norm: float = 1.0, residual: bool = True, bias_norm: float = 0.0,
) -> DotMHA:
    """Dot-product MHA with every per-head W^Q_l, W^K_l, W^V_l, W^O_l of the given spectral norm.

    ``bias_norm > 0`` adds biases (docs/bounds.md §1.5): per-head b_q, b_k, b_v and the output b_o,
    each vector of Euclidean norm ``bias_norm``. They are drawn after the weights from the same
    generator, so the weights are those of the bias-free layer of the same seed; ``bias_norm = 0``
    gives no bias fields at all.
    """
    d_h = check_heads(d, h)
    if not (math.isfinite(bias_norm) and bias_norm >= 0):
        raise InputError(f"bias_norm must be finite and >= 0, got {bias_norm}")
    g = _gen(seed)
    W = {"W_q": _random(g, (h, d, d_h), q_norm), "W_k": _random(g, (h, d, d_h), k_norm),
         "W_v": _random(g, (h, d, d_h), v_norm), "W_o": _random(g, (h, d_h, d), o_norm)}
    if bias_norm > 0:
        W.update({name: _random_vectors(g, (h, d_h), bias_norm) for name in ("b_q", "b_k", "b_v")},
                 b_o=_random_vectors(g, (d,), bias_norm))
    return DotMHA(**W, residual=residual)


def random_l2(
    d: int, h: int, *, seed: int = 0, q_norm: float = 1.0, v_norm: float = 1.0,
    o_norm: float = 1.0, residual: bool = True,
) -> L2MHA:
    """L2-MHA with tied keys; per-head W^Q_l, W^V_l, W^O_l of the given spectral norms."""
    d_h = check_heads(d, h)
    g = _gen(seed)
    return L2MHA(
        W_q=_random(g, (h, d, d_h), q_norm), W_v=_random(g, (h, d, d_h), v_norm),
        W_o=_random(g, (h, d_h, d), o_norm), residual=residual,
    )


def random_olsa(
    d: int, h: int, *, n: int, c: float, seed: int = 0, alpha1: float = 1.0,
    alpha2: float | None = None, activation: str = "relu", residual: bool = False,
) -> OLSA:
    """OLSA with orthogonal stacked W^Q, W^K, W^V and unit w^S_l.

    ``alpha2=None`` takes docs/bounds.md §1.3's default ``1 + c√n/(4α1)``, which makes Theorem 4.1's bound 1
    on the ball ‖X‖_F ≤ c.
    """
    d_h = check_heads(d, h)
    if alpha1 <= 0 or (alpha2 is not None and alpha2 <= 0):
        raise InputError(f"alpha1 and alpha2 must be > 0, got {alpha1}, {alpha2}")
    g = _gen(seed)
    W = [random_orthogonal(d, g).reshape(h, d_h, d) for _ in range(3)]
    w_s = torch.randn(h, d_h, generator=g, dtype=torch.float64)
    w_s = w_s / w_s.norm(dim=-1, keepdim=True)
    if alpha2 is None:
        alpha2 = 1.0 + c * math.sqrt(n) / (4.0 * alpha1)
    return OLSA(W_q=W[0], W_k=W[1], W_v=W[2], w_s=w_s, alpha1=float(alpha1),
                alpha2=float(alpha2), activation=activation, residual=residual)


def random_layer(kind: str, d: int, h: int, *, seed: int = 0, weight_norm: float = 1.0,
                 residual: bool = True, n: int = 1, c: float = 1.0, bias_norm: float = 0.0) -> Layer:
    """One builder for every kind; ``weight_norm`` is the per-head norm of every weight family.

    For ``olsa`` the weights are orthogonal and ``c`` is the input-norm radius of its bound.
    ``bias_norm > 0`` draws biases, which only dot layers have (docs/bounds.md §1.5).
    """
    if bias_norm and kind in ("l2", "olsa"):
        raise InputError(f"only dot layers have biases (docs/bounds.md §1.5), not {kind!r}")
    if kind == "dot":
        return random_dot(d, h, seed=seed, q_norm=weight_norm, k_norm=weight_norm,
                          v_norm=weight_norm, o_norm=weight_norm, residual=residual,
                          bias_norm=bias_norm)
    if kind == "l2":
        return random_l2(d, h, seed=seed, q_norm=weight_norm, v_norm=weight_norm,
                         o_norm=weight_norm, residual=residual)
    if kind == "olsa":
        return random_olsa(d, h, n=n, c=c, seed=seed, residual=residual)
    raise InputError(f"unknown layer kind {kind!r}; expected dot, l2 or olsa")


def random_stack(kind: str, depth: int, d: int, h: int, *, seed: int = 0, R: float | None = 1.0,
                 **layer_kw) -> Stack:
    """A stack of ``depth`` independent random blocks (block k drawn with seed ``seed + k``)."""
    if depth < 1:
        raise InputError(f"depth must be >= 1, got {depth}")
    return Stack(tuple(random_layer(kind, d, h, seed=seed + k, **layer_kw) for k in range(depth)), R=R)


def random_input(n: int, d: int, *, norm: float = 1.0, seed: int = 0, batch: int = 1) -> Tensor:
    """Gaussian X of shape [batch, n, d], each rescaled to spectral norm ``norm``."""
    if n < 1 or d < 1 or batch < 1:
        raise InputError(f"n, d and batch must be positive, got n={n}, d={d}, batch={batch}")
    return _random(_gen(seed), (batch, n, d), norm)


def projected_input(n: int, d: int, *, R: float = 1.0, scale: float = 3.0, seed: int = 0,
                    batch: int = 1) -> Tensor:
    """Gaussian rows of norm about ``scale`` passed through LayerProject(R)."""
    X = torch.randn(batch, n, d, generator=_gen(seed), dtype=torch.float64) * (scale / math.sqrt(d))
    return layer_project(X, R)
