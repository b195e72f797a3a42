"""The FFN as a stage of ``taylor_net`` (docs/bounds.md §5.1): linear per token but for the neurons
whose range the activation bends, each relaxed with a symbol of its own (ReLU's parallelogram, GELU's
exact slope and Taylor error: :mod:`bounds.network.stages.activations`), and CROWN's slopes for the backward
pass."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models.vit import TANH_FORMS

from ...norms import gram_norm
from ..record import Step
from ..zonotope import DeviationSet, columns, symbols
from .activations import gelu_bounds, relaxation

# a callable (functionals [B, C, n, d], their forward ranges lo, hi [B, C]) → tighter (lo, hi): the
# backward pass over the stages so far (:meth:`TaylorNet.stages`)
Refine = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
# the most neurons of one FFN whose ranges the backward pass refines (those nearest to stable first):
# each costs two functionals through every stage before it
REFINE_LIMIT = 4096


@dataclass
class Mapped:
    """A set under a per-token map Δ_t ↦ L_tΔ_t + shift_t not yet applied, with symbol columns ``new``
    added after it: the last FFN's, which only the margins read, as functionals pulled back through
    L (:meth:`TaylorNet._margins`), so that the set itself is never mapped (a quarter of a first
    pass's products on the 1-block digits model). ``S`` holds the set before the map with E's radii,
    route and per-token bounds of after it; L_t = I + W₂ diag(λ_t) W₁, formed for its norm (which E
    crosses, :func:`ffn`), is applied to the functionals through its factors (:meth:`pull`) and to the
    set only by :meth:`formed`, the set after the map."""

    S: DeviationSet
    W1: Tensor  # [w, d]
    W2: Tensor  # [d, w]
    lam: Tensor  # [B, n, w]: the neurons' slopes
    shift: Tensor  # [B, n, d]
    new: Tensor  # [B, n, d, m']
    L: Tensor  # [B, n, d, d]: I + W₂ diag(λ_t) W₁ per token

    def pull(self, c: Tensor) -> Tensor:
        """L_tᵀc at every token for functionals c [B, C, d]: c + W₁ᵀ diag(λ_t) W₂ᵀc, [B, C, n, d]."""
        return c[:, :, None, :] + ((c @ self.W2)[:, :, None, :] * self.lam[:, None]) @ self.W1

    def formed(self) -> DeviationSet:
        return self.S.per_token(self.L, self.shift).with_symbols(self.new)


def ffn(S: DeviationSet, block, Y: Tensor, lipschitz: float, eps: float,
        log: list | None = None, refine: Refine | None = None,
        form: bool = True, residual: bool = True) -> tuple[DeviationSet | Mapped, Tensor]:
    """``x + W₂ relu(W₁x + b₁) + b₂`` at its clean input Y: each neuron's range from the set (the
    first-order part through the token Grams, ‖(W₁G_t)_i‖² = w_iᵀ G_tG_tᵀ w_i), the unstable ones
    relaxed with a symbol each (:func:`relu_relaxation`); the rest as the per-token map
    L_t = I + W₂ diag(λ_t) W₁, which E's radii cross at max_t ‖L_t‖₂ (per token where E is kept per
    token) and the route at Lip(FFN) (every slope is in [0, 1]).
    Returns the set (without ``form``, as :class:`Mapped`) and the unstable neurons per image."""
    W1 = block.ffn.up.weight.detach().double()
    b1 = block.ffn.up.bias.detach().double()
    W2 = block.ffn.down.weight.detach().double()
    z0 = Y @ W1.T + b1  # [B, n, w]
    if form or S.gram is not None:  # the Gram per token is kept for the next block's radii
        first = torch.einsum("wd,bnde,we->bnw", W1, S.token_grams(), W1).clamp_min(0).sqrt()
    else:  # the last block: ‖(W₁G_t)_i‖ from W₁G_t itself, 2/3 of the Gram's products
        first = torch.linalg.vector_norm(torch.einsum("wd,bndp->bnwp", W1, S.G), dim=-1)
    zA = torch.einsum("wd,bndm->bnwm", W1, S.A)
    zQ = torch.einsum("wd,bndkg->bnwkg", W1, S.Q)
    zc = S.c @ W1.T
    half = (eps * first + zA.abs().sum(-1) + S.grouped(zQ.norm(dim=-1))
            + S.token_ball_along(W1.expand(*S.c.shape[:2], *W1.shape)))
    # the Gram's square root carries its own rounding: widen each range by a relative 1e-12
    half = half * (1 + 1e-12)
    B, n, w = z0.shape
    d = Y.shape[-1]
    lo, hi = z0 + zc - half, z0 + zc + half
    if refine is not None:  # the neurons that can cross 0, again by the backward pass
        lo, hi = _refine_neurons(refine, W1, z0, lo, hi)
    act = block.ffn.activation
    lam, beta, mu = relaxation(act, z0, lo, hi)
    if log is not None:
        log.append(FFNRecord(act, W1, W2, z0, lo, hi, residual))
    unstable = mu > 0
    idx, coef = symbols(unstable.reshape(B, -1), mu.reshape(B, -1))
    # E enters the relaxed neurons through z − z₀ = W₁Δ, so it leaves as L_tE_t, L_t = I + W₂ diag(λ_t) W₁:
    # ‖L_t‖₂ per token (exact float64 Gram eigenvalues, d×d), never above Lip(FFN). The route is a
    # bound of the true deviation, which the relaxation's shifts and symbols add to: it keeps Lip(FFN)
    L = torch.einsum("dw,bnw,we->bnde", W2, lam, W1)
    if residual:  # without it, the branch a standard block's residual adds (Mapped is for the residual)
        L = L + torch.eye(d, dtype=W1.dtype, device=W1.device)
    own = torch.minimum(gram_norm(L.mT @ L), torch.as_tensor(lipschitz, dtype=W1.dtype))  # [B, n]
    tok = None if S.tok is None else S.tok * own  # the FFN acts per token
    fresh = None if S.fresh is None else S.fresh * own
    kept = replace(S, rho=S.rho * own.amax(-1)[:, None], route=S.route * lipschitz, tok=tok, fresh=fresh)
    out = Mapped(kept, W1, W2, lam, beta @ W2.T, columns(idx // w, coef[..., None] * W2.T[idx % w], n, d), L)
    return out.formed() if form else out, unstable.reshape(B, -1).sum(-1)



def _refine_neurons(refine: Refine, W1: Tensor, z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """lo, hi [B, n, w] of z = W₁x + b₁ with the unstable neurons' ranges intersected with the
    backward pass's (at most :data:`REFINE_LIMIT` an image, those nearest to stable)."""
    B, n, w = z0.shape
    unstable = ((lo < 0) & (hi > 0)).reshape(B, -1)
    if not unstable.any():
        return lo, hi
    near = torch.minimum(-lo, hi).reshape(B, -1).masked_fill(~unstable, math.inf)
    k = min(int(unstable.sum(-1).max()), REFINE_LIMIT)
    idx = near.topk(k, dim=-1, largest=False).indices  # [B, k]
    valid = unstable.gather(-1, idx)
    units = columns(idx // w, W1[idx % w], n, W1.shape[-1]).movedim(-1, 1)  # [B, k, n, d]
    flat_lo, flat_hi = lo.reshape(B, -1).clone(), hi.reshape(B, -1).clone()
    base, old_lo, old_hi = (t.gather(-1, idx) for t in (z0.reshape(B, -1), flat_lo, flat_hi))
    new_lo, new_hi = refine(units, old_lo - base, old_hi - base)  # of the deviation z − z₀
    flat_lo.scatter_(-1, idx, torch.where(valid, base + new_lo, old_lo))
    flat_hi.scatter_(-1, idx, torch.where(valid, base + new_hi, old_hi))
    return flat_lo.reshape(B, n, w), flat_hi.reshape(B, n, w)


def crown_slope(lo: Tensor, hi: Tensor) -> Tensor:
    """CROWN's lower slope of relu on [lo, hi] (Zhang et al. 2018): 1 where hi ≥ −lo, else 0."""
    return (hi >= -lo).to(lo.dtype)


def relu_bounds(g: Tensor, z0: Tensor, lo: Tensor, hi: Tensor,
                alpha: Tensor | None = None, phase: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(s, b) with ``g·(relu(z) − relu(z0)) ≥ g·s·(z − z0) + g·b`` for every z ∈ [lo, hi] (CROWN's
    relaxation, Zhang et al. 2018, chosen per sign of the coefficient g): where g ≥ 0 the lower line
    αz (α = 1 if hi ≥ −lo, else 0; or ``alpha``, any values in [0, 1]: relu(z) ≥ αz holds for each),
    where g < 0 the chord λ(z − lo), λ = hi/(hi − lo); exact where the unit is stable (docs/bounds.md
    §5.1). ``phase`` (int8, +1 / −1 / 0): a branch's units held at z ≥ 0 (relu(z) = z) or z ≤ 0
    (relu(z) = 0), exact there whatever side of 0 the clean z0 is on (docs/bounds.md §5.1, "Branches
    on the kinks"); 0 leaves a unit to its relaxation."""
    active, dead = lo >= 0, hi <= 0
    unstable = ~active & ~dead
    lam = hi / torch.where(unstable, hi - lo, 1.0)
    alpha = crown_slope(lo, hi).to(g.dtype) if alpha is None else alpha.clamp(0, 1)
    # each side's slope and offset on the units' shape, then one choice per coefficient: g [B, C, …]
    # is C times the units' size, and a pass crosses it once per stage
    stable = active.to(lo.dtype)
    relu0 = torch.relu(z0)
    s_up, s_low = torch.where(unstable, lam, stable), torch.where(unstable, alpha, stable)
    b_up = torch.where(unstable, lam * (z0 - lo) - relu0, 0.0)
    b_low = torch.where(unstable, alpha * z0 - relu0, 0.0)
    up = g < 0
    s, b = torch.where(up, s_up, s_low), torch.where(up, b_up, b_low)
    if phase is not None:  # relu(z) − relu(z0) = (z − z0) + (z0 − relu(z0)) on z ≥ 0, −relu(z0) on z ≤ 0
        held = phase != 0
        s = torch.where(held, (phase > 0).to(s.dtype), s)
        b = torch.where(held, torch.where(phase > 0, z0, 0.0) - relu0, b)
    return s.to(g.dtype), b



@dataclass(frozen=True)
class FFNRecord:
    """The FFN for the backward pass: its weights, its neurons' clean values and ranges [B, n, w], the
    activation, and whether the stage holds the identity (the standard block's branch does not)."""

    act: str
    W1: Tensor
    W2: Tensor
    z0: Tensor
    lo: Tensor
    hi: Tensor
    residual: bool
    name = None

    def step(self, Lam: Tensor, alpha: Tensor | None = None, phase: Tensor | None = None) -> Step:
        """Λ ↦ Λ + W₁ᵀ diag(s) W₂ᵀΛ (without the identity for a branch), the slopes s and offsets b
        chosen per sign of W₂ᵀΛ: CROWN's for ReLU (or its lower slopes ``alpha`` [B, C, n, w] in [0, 1],
        :mod:`bounds.network.slopes`; its units held on one side of 0 by ``phase`` [B, C, n, w],
        :mod:`bounds.network.branches`), the exact slope and the error's end for GELU."""
        g = Lam @ self.W2  # [B, C, n, w]
        relu = self.act == "relu"
        if relu:
            s, b = relu_bounds(g, self.z0[:, None], self.lo[:, None], self.hi[:, None], alpha, phase)
        elif phase is not None:
            raise ValueError(f"FFNRecord.step: a {self.act} unit has no sides to branch on")
        else:
            s, b = gelu_bounds(g, self.z0[:, None], self.lo[:, None], self.hi[:, None],
                               TANH_FORMS.get(self.act))
        moved = (g * s) @ self.W1
        gain = g * b
        return Step(Lam + moved if self.residual else moved, gain.sum((-1, -2)), gain.abs().sum((-1, -2)),
                    units=gain if relu else None)
