"""Castin, Ablin & Peyré, "How Smooth Is Attention?" (ICML 2024): the √n bound on the Lipschitz
constant of self-attention over a ball of tokens, Theorem 3.3, adapted to the layer of §1.1
(docs/bounds.md §3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models import DotMHA
from models.spectral import product_norm

from ..base import radius
from ..certificates import Ledger

# The bias coordinate's scales t, as fractions of the tokens' radius R (and t = 1): biases enter
# as a constant coordinate t of every token (docs/bounds.md §3.5), each t gives a valid constant
# and the bound takes the smallest.
BIAS_SCALES = (0.25, 0.5, 1.0, 2.0)


def castin_constant(A_norm: Tensor, C_norm: Tensor, R: Tensor, n: int) -> Tensor:
    """``√3·‖V‖·(‖A‖²R⁴(4n + 1) + n)^{1/2}``, Castin et al.'s Theorem 3.3, per head.

    Args:
      A_norm: ‖A_l‖ of the scaled logit form x_iᵀA_l x_j, shape [h] or broadcastable.
      C_norm: ‖C_l‖ = ‖W^V_l W^O_l‖, the value map's norm, shape [h].
      R: the radius of the ball of tokens, shape [B, 1] or broadcastable.
      n: the number of tokens.

    Returns:
      the constant for each input and head, [B, h].
    """
    return math.sqrt(3) * C_norm * (A_norm ** 2 * R ** 4 * (4 * n + 1) + n).sqrt()


def _augmented_A_norm(layer: DotMHA, t: Tensor) -> Tensor:
    """‖Ã_l‖/√d_h for tokens (x, t): Ã_l = [W^Q_l; b_q,lᵀ/t][W^K_l; b_k,lᵀ/t]ᵀ, so that
    x̃_iᵀÃ_l x̃_j/√d_h is the biased logit exactly (docs/bounds.md §3.5). [B, h]."""
    h, d, e = layer.W_q.shape
    zeros = torch.zeros(h, e, dtype=layer.W_q.dtype, device=layer.W_q.device)
    b_q = layer.b_q if layer.b_q is not None else zeros
    b_k = layer.b_k if layer.b_k is not None else zeros
    t = t[:, None, None, None]  # [B, 1, 1, 1]
    Wq = torch.cat([layer.W_q.expand(t.shape[0], h, d, e), (b_q[:, None, :] / t)], -2)
    Wk = torch.cat([layer.W_k.expand(t.shape[0], h, d, e), (b_k[:, None, :] / t)], -2)
    return product_norm(Wq, Wk.mT) / math.sqrt(e)


def castin(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """``ε·(‖H‖ + Σ_l √3‖C_l‖(‖A_l‖²R⁴(4n + 1)/d_h + n)^{1/2})`` with ``R = max_i ‖x_i‖ + ε``.

    Castin et al., Theorem 3.3: on B_R^n (every token of norm ≤ R) one head ``x_i ↦ Σ_j P_ij V x_j``
    with ``P_i = softmax_j(x_iᵀ A x_j)`` is Lipschitz with the constant of :func:`castin_constant`.
    Every X' of the ball B(X, ε) has its tokens in B_R^n, which is convex, so the change is at most
    ε times that constant. Adaptation (docs/bounds.md §3.5): A = A_l/√d_h and V = C_lᵀ per head,
    the heads summed and ‖H‖ added for the residual; with biases every token gains a constant
    coordinate t (b_v and b_o cancel), the smallest constant over the t of ``BIAS_SCALES`` taken.
    """
    e = radius(eps, X)
    n = X.shape[1]
    R = X.norm(dim=-1).amax(-1) + e  # [B]
    C = layer.C_norm()  # [h]
    if not layer.has_biases:
        const = castin_constant(layer.A_norm() / math.sqrt(layer.d_h), C, R[:, None], n)
    else:
        # R = 0 (X = 0, ε = 0) makes every t zero: the coordinate is then 1
        scales = [R.clamp_min(torch.finfo(R.dtype).tiny) * s for s in BIAS_SCALES] + [torch.ones_like(R)]
        const = torch.stack([
            castin_constant(_augmented_A_norm(layer, t), C, (R ** 2 + t ** 2).sqrt()[:, None], n).sum(-1)
            for t in scales]).amin(0)[:, None]
    return e * (layer.H_norm + const.sum(-1))
