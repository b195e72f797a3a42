"""Optimized slopes for ``taylor_net``'s last backward pass (docs/bounds.md §5.1, "Optimized slopes";
α-CROWN, Xu et al. 2021): the lower slope α ∈ [0, 1] of every relaxed ReLU, per image, class and unit,
tuned by projected Adam steps on the margins' bound. relu(z) ≥ αz holds for every such α, so every
iterate is a sound bound and each margin keeps its best; the units' ranges, made before, do not move.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import torch
from torch import Tensor

from .backward import backward, has_relus
from .stages.ffn import crown_slope

# Adam steps and their rate: on the 4-block Fashion-MNIST model (image 0, ε 0.01) 100 steps at half
# the rate reach the same bound as these 20 (docs/results.md, "The balls as columns")
STEPS = 20
RATE = 0.1


def _plain(x):
    """``x`` with every tensor in it copied outside inference mode (a record's tensors were made in
    it, and autograd cannot save such tensors): dataclasses field by field, dicts, lists, tuples."""
    if isinstance(x, Tensor):
        return x.clone()
    if is_dataclass(x) and not isinstance(x, type):
        return replace(x, **{f.name: _plain(getattr(x, f.name)) for f in fields(x) if f.init})
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_plain(v) for v in x)
    return x


def _start(rec, B: int, C: int) -> Tensor | None:
    """CROWN's lower slopes of a record's ReLUs as a [B, C, ...] tensor to tune (None: no ReLU)."""
    if not has_relus(rec):
        return None
    alpha = crown_slope(rec.lo, rec.hi)[:, None]
    return alpha.expand(B, C, *alpha.shape[2:]).clone()


def optimized_backward(log: list, Lam: Tensor, embed: Tensor, eps: float, slack: float,
                       steps: int = STEPS, rate: float = RATE) -> tuple[Tensor, Tensor]:
    """The best over ``steps`` projected Adam steps of :func:`backward`'s bound with every ReLU's lower
    slope tuned, per image and class (each element of [B, C] keeps the iterate whose bound, less its
    rounding slack ``slack`` × its terms' magnitudes, is the largest; CROWN's slopes are the first
    iterate).

    Args:
      log: the stage records of a pass (:meth:`TaylorNet.stages`).
      Lam: the functionals [B, C, n, d] on the last tokens.
      embed: the pixels' map to the first tokens [n, d, P].
      eps: the image radius.
      slack: the relative rounding slack the caller charges a bound's magnitudes.
      steps, rate: Adam's steps and step size.

    Returns:
      (bounds [B, C], the sum of their terms' magnitudes [B, C]), as :func:`backward`.
    """
    with torch.inference_mode(False), torch.enable_grad():
        recs = [_plain(r) for r in log]
        Lam, embed = Lam.clone(), embed.clone()
        B, C = Lam.shape[:2]
        alphas = {i: a.requires_grad_() for i, r in enumerate(recs) if (a := _start(r, B, C)) is not None}
        best, mag = (t.detach() for t in backward(recs, Lam, embed, eps))
        if not alphas:
            return best, mag
        net = lambda low, m: low - slack * m  # what the caller's test compares
        opt = torch.optim.Adam(list(alphas.values()), lr=rate)
        for _ in range(steps):
            low, m = backward(recs, Lam, embed, eps, alphas=alphas)
            take = net(low.detach(), m.detach()) > net(best, mag)
            best, mag = torch.where(take, low.detach(), best), torch.where(take, m.detach(), mag)
            opt.zero_grad()
            (-low.sum()).backward()
            opt.step()
            with torch.no_grad():
                for a in alphas.values():
                    a.clamp_(0, 1)
        with torch.no_grad():
            low, m = backward(recs, Lam, embed, eps, alphas=alphas)
            take = net(low, m) > net(best, mag)
            best, mag = torch.where(take, low, best), torch.where(take, m, mag)
    return best, mag
