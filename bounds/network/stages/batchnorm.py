"""BatchNorm in eval as a stage of ``taylor_net`` (docs/bounds.md §5.1, "BatchNorm"): an affine map per
feature, x ↦ a ⊙ x + b with a = γ/√(var + eps), the same at every token and every image. Its Jacobian
is diag(a) and it has no remainder; the deviation set is mapped exactly."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models.vit import TokenBatchNorm

from ..record import Step
from ..zonotope import DeviationSet


@dataclass(frozen=True)
class ScaleRecord:
    """What the backward pass needs of a BatchNorm stage: its per-feature scale a [d]."""

    a: Tensor
    name = None

    def step(self, Lam: Tensor) -> Step:
        """diag(a)Λ_t at every token, for functionals Λ [B, C, n, d]: exact, nothing charged."""
        return Step(Lam * self.a)


def batch_norm(S: DeviationSet, norm: TokenBatchNorm, log: list | None = None,
               eps: float | None = None) -> tuple[DeviationSet, Tensor]:
    """The set after BatchNorm in eval: every part scaled per feature by a (the shift b cancels in
    deviations), E's radii and the route by max|a| (the map's spectral norm), the route then the
    smaller of that and the scaled set's own radius where ``eps`` is given (attention reads it, as
    after LayerNorm). Returns the set and the count 0 per image (no kink)."""
    if norm.training:
        raise ValueError("a BatchNorm in training mode normalizes by its batch: certify the network in eval")
    a = norm.scale_shift()[0].to(S.G)
    top = a.abs().max()
    scale = lambda t: None if t is None else t * top
    Q = S.Q * a[:, None, None] if S.Q is not None else None
    gram = None if S.gram is None else S.gram * a[:, None] * a[None, :]
    out = replace(S, G=S.G * a[:, None], A=S.A * a[:, None], Q=Q, c=S.c * a, gram=gram, rho=S.rho * top,
                  route=S.route * top, tok=scale(S.tok), W=None if S.W is None else S.W * a[:, None],
                  fresh=scale(S.fresh), emap=None if S.emap is None else S.emap * a[:, None])
    if eps is not None:  # the residual stream's route adds every branch's norms; the set keeps directions
        out = replace(out, route=out.radius(eps))  # (radius is never above the route it is given)
    if log is not None:
        log.append(ScaleRecord(a))
    return out, torch.zeros(S.G.shape[0], dtype=torch.long, device=S.G.device)
