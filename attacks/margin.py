"""PGD on a classifier's margin over the ℓ2 ball of the image (docs/bounds.md §5): the empirical side
of certified accuracy. A sample that a sound certificate certifies at ε can never be broken here.

The ball is the whole ``‖γ‖₂ ≤ ε`` over the image, with no [0, 1] pixel box: the certificate of
LoFAST Proposition 1 covers every point of the ball, so the attack may use all of it (a box would
only make it weaker, never the certificate wrong). The attack is :func:`attacks.pgd.maximize` on the
negative margin: normalised-gradient steps, projection onto the ball, the best value ever seen kept,
random starts drawn on the CPU from a seed (deterministic) and one start along −∇margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models import InputError, check_eps

from .pgd import maximize


def margin(logits: Tensor, labels: Tensor) -> Tensor:
    """``F_y − max_{j≠y} F_j`` for logits [..., C] and labels broadcastable to [...]: > 0 iff the
    label's logit is the unique largest."""
    labels = labels.expand(logits.shape[:-1])
    own = logits.gather(-1, labels[..., None])[..., 0]
    others = logits.scatter(-1, labels[..., None], -torch.inf)
    return own - others.amax(-1)


@dataclass(frozen=True)
class MarginAttack:
    """Per sample: the smallest margin seen in the ball (the clean point included), whether it is
    ≤ 0 (broken: some point of the ball is not classified as the label), and where it was reached."""

    margin: Tensor  # [B]
    broken: Tensor  # [B] bool
    delta: Tensor  # [B, H, W], ‖delta‖₂ ≤ ε (zeros where the clean point was the worst)


def attack_margin(net: Callable[[Tensor], Tensor], images: Tensor, labels: Tensor, eps: float, *,
                  steps: int = 100, restarts: int = 8, seed: int = 0, warm: bool = True) -> MarginAttack:
    """Minimises the margin of ``net`` (images [B, H, W] → logits [B, C]) over ``‖γ‖₂ ≤ eps`` per image.

    ``steps`` is the number of gradient steps (the Cauchy paper's "PGD-20" is ``steps=20``);
    ``restarts`` random starts on the sphere plus, with ``warm``, one start along −∇margin at the
    clean image (the first-order worst direction).
    """
    eps = check_eps(eps)
    if images.dim() != 3 or labels.shape != images.shape[:1]:
        raise InputError(f"images must be [B, H, W] with labels [B], got {list(images.shape)} and "
                         f"{list(labels.shape)}")
    if isinstance(steps, bool) or steps < 0 or restarts < 1:
        raise InputError(f"steps must be >= 0 and restarts >= 1, got {steps} and {restarts}")
    images = images.detach()

    def flat(x: Tensor) -> Tensor:  # [R, B, H, W] → margins [R, B], the restarts as one batch
        return margin(net(x.reshape(-1, *images.shape[1:])).reshape(*x.shape[:-2], -1), labels)

    starts = None
    if warm:
        with torch.enable_grad():
            x = images.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(margin(net(x), labels).sum(), x)
        starts = -torch.nan_to_num(grad)[None]
    res = maximize(lambda x: -flat(x), images, eps, steps=steps, restarts=restarts, seed=seed,
                   starts=starts)
    with torch.no_grad():
        clean = margin(net(images), labels)
    # the clean point lies in the ball too; maximize records only iterates on or near the sphere
    worse = -res.value < clean
    value = torch.where(worse, -res.value, clean)
    delta = torch.where(worse[:, None, None], res.delta, torch.zeros_like(res.delta))
    return MarginAttack(value.detach(), (value <= 0).detach(), delta.detach())
