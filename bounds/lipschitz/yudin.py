"""Yudin, Gaponov, Kudriashov & Rakhuba, "Pay Attention to Attention Distribution: A New Local
Lipschitz Bound for Transformers" (arXiv 2507.07814, 2025): a local Lipschitz bound of attention
whose softmax factor is the spectral norm of the softmax Jacobian at the attention rows themselves,
not its global ½ (docs/bounds.md §3.6).

The stored copy of the paper this suite could read holds its abstract only, so the bound here is the
construction the abstract describes, proved in docs/bounds.md §3.6, not the paper's equation: the
Jacobian of the layer bounded through ‖diag(p) − ppᵀ‖ of each attention row, taken over the ball
(``yudin``, certified) or at the clean input alone (``yudin_local``, the local constant at X: an
estimate of the ball's, like σ_max(J)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models import DotMHA
from models.spectral import spectral

from ..base import radius
from ..certificates import Ledger
from ..remainder.row_bounds import softmax_jacobian_norm


def attention_box(S: Tensor, dev: Tensor) -> tuple[Tensor, Tensor]:
    """Entrywise bounds of softmax_rows(S + Δ) over every Δ with |Δ| ≤ dev entrywise.

    The numerator takes its extreme, the denominator Σ_k exp(S_ik + Δ_ik) its opposite one with
    every k (the k = j term included, which only widens): ``p_ij ≤ exp(S_ij + dev_ij)/Σ_k exp(S_ik −
    dev_ik)``, and symmetrically from below.

    Returns:
      (lo, hi), each shaped as S.
    """
    hi = (S + dev - torch.logsumexp(S - dev, -1, keepdim=True)).exp().clamp(max=1.0)
    lo = (S - dev - torch.logsumexp(S + dev, -1, keepdim=True)).exp()
    return lo, hi


def yudin(layer: DotMHA, X: Tensor, eps, *, local: bool = False, ledger: Ledger | None = None) -> Tensor:
    """``ε·(‖H‖ + Σ_l [‖C_l‖·p̄_l + (J̄_l/√d_h)(‖U_l‖ + ‖V_l‖ + 2ε‖A_l‖)(‖X C_l‖ + ε‖C_l‖)])``.

    For X' in B(X, ε), dF = HΓ + Σ_l [P_l(X') Γ C_l + dP_l X' C_l] with dP_l's row i the softmax
    Jacobian J(p_i) times the logits' change (docs/bounds.md §3.6): ‖P_l(X')‖ ≤ p̄_l, the square root
    of the largest column sum of P_l's box, and ‖J(p_i)‖ ≤ J̄_l over the box of every row; U_l =
    K_l W^Qᵀ_l and V_l = Q_l W^Kᵀ_l are the logit factors of §1.5 (biases included). The box comes
    from the logits' change entrywise, ``(ε‖U_{l,j}‖ + ε‖V_{l,i}‖ + ε²‖A_l‖)/√d_h``.

    ``local`` evaluates the same Jacobian bound at X alone (the box a point): the local Lipschitz
    constant at X times ε, an estimate of the change over the ball.
    """
    e = radius(eps, X)
    r = torch.zeros_like(e) if local else e
    d_h = layer.d_h
    Q, K = layer.queries_keys(X)  # [B, h, n, d_h]
    S = Q @ K.mT / math.sqrt(d_h)
    U = K @ layer.W_q.mT  # [B, h, n, d]: row j is W^Q_l k_j
    V = Q @ layer.W_k.mT  # row i is W^K_l q_i
    A = layer.A_norm()  # [h]
    rb = r[:, None, None, None]
    dev = (rb * U.norm(dim=-1)[..., None, :] + rb * V.norm(dim=-1)[..., :, None]
           + rb ** 2 * A[:, None, None]) / math.sqrt(d_h)
    lo, hi = attention_box(S, dev)
    J = softmax_jacobian_norm(lo, hi).amax(-1)  # [B, h]
    n = X.shape[1]
    P = hi.sum(-2).amax(-1).clamp(max=n).sqrt()  # ‖P‖² ≤ ‖P‖₁‖P‖_∞, ‖P‖_∞ = 1
    U_norm, V_norm = spectral(U), spectral(V)  # [B, h]: ‖U_l‖, ‖V_l‖ of the factors formed above
    C = layer.C_norm()
    logits = U_norm + V_norm + 2 * r[:, None] * A
    values = layer.XC_norm(X) + r[:, None] * C
    return e * (layer.H_norm + (C * P + J * logits * values / math.sqrt(d_h)).sum(-1))


def yudin_local(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """:func:`yudin` at X alone: ε times the bound of ‖J_F(X)‖ (an estimate, docs/bounds.md §3.6)."""
    return yudin(layer, X, eps, local=True)
