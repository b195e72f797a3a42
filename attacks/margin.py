"""PGD on a classifier's margin over the ℓ2 ball of the image (docs/bounds.md §5): the empirical side
of certified accuracy. A sample that a sound certificate certifies at ε can never be broken here.

The ball is the whole ``‖γ‖₂ ≤ ε`` over the image, with no [0, 1] pixel box: the certificate of
LoFAST Proposition 1 covers every point of the ball, so the attack may use all of it (a box would
only make it weaker, never the certificate wrong). The attack is :func:`attacks.pgd.maximize` on the
negative margin: normalised-gradient steps, projection onto the ball, the best value ever seen kept,
random starts drawn on the CPU from a seed (deterministic) and one start along −∇margin.

The search may run in a lower precision than the network's (``dtype``): a copy of the network cast to
it searches, and every start's best perturbation is then measured on the network as given in float64,
so an image is called broken by its float64 margin at a point of the ball (docs/bounds.md §4).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models import InputError, check_eps

from .pgd import maximize, search_dtype


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


def _cast(net: Callable[[Tensor], Tensor], dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """``net`` with its parameters and buffers in ``dtype``: itself where they are already, else a copy
    (an ``nn.Module``; any other callable cannot be cast: InputError)."""
    if not isinstance(net, torch.nn.Module):
        raise InputError(f"a margin attack in {dtype} needs a network it can cast (a torch.nn.Module), "
                         f"not {type(net).__name__}")
    tensors = [*net.parameters(), *net.buffers()]
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return net
    return copy.deepcopy(net).to(dtype)


def attack_margin(net: Callable[[Tensor], Tensor], images: Tensor, labels: Tensor, eps: float, *,
                  steps: int = 100, restarts: int = 8, seed: int = 0, warm: bool = True,
                  dtype: torch.dtype | None = None) -> MarginAttack:
    """Minimises the margin of ``net`` (images [B, H, W] → logits [B, C]) over ``‖γ‖₂ ≤ eps`` per image.

    ``steps`` is the number of gradient steps (the Cauchy paper's "PGD-20" is ``steps=20``);
    ``restarts`` random starts on the sphere plus, with ``warm``, one start along −∇margin at the
    clean image (the first-order worst direction). The search runs in ``dtype`` (default the images');
    unless both it and the images are float64, the margins, the clean one included, are measured on
    ``net`` and the images cast to float64 (``net`` must then be an ``nn.Module``), and ``delta`` is
    float64.
    """
    eps = check_eps(eps)
    if images.dim() != 3 or labels.shape != images.shape[:1]:
        raise InputError(f"images must be [B, H, W] with labels [B], got {list(images.shape)} and "
                         f"{list(labels.shape)}")
    if isinstance(steps, bool) or steps < 0 or restarts < 1:
        raise InputError(f"steps must be >= 0 and restarts >= 1, got {steps} and {restarts}")
    dtype = search_dtype(dtype, images)
    images = images.detach()
    exact = dtype == torch.float64 and images.dtype == torch.float64
    net64, images64 = (net, images) if exact else (_cast(net, torch.float64), images.to(torch.float64))
    search, images = (net, images) if exact else (_cast(net, dtype), images.to(dtype))

    def flat(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:  # [R, B, H, W] → margins [R, B]
        return margin(f(x.reshape(-1, *x.shape[-2:])).reshape(*x.shape[:-2], -1), labels)

    def measure(G: Tensor) -> Tensor:  # the negative margin in float64 at images + G
        with torch.no_grad():
            return -flat(net64, images64 + G)

    starts = None
    if warm:
        with torch.enable_grad():
            x = images.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(margin(search(x), labels).sum(), x)
        starts = -torch.nan_to_num(grad)[None]
    res = maximize(lambda x: -flat(search, x), images, eps, steps=steps, restarts=restarts, seed=seed,
                   starts=starts, measure=None if exact else measure)
    with torch.no_grad():
        clean = margin(net64(images64), labels)
    # the clean point lies in the ball too; maximize records only iterates on or near the sphere
    worse = -res.value < clean
    value = torch.where(worse, -res.value, clean)
    delta = torch.where(worse[:, None, None], res.delta, torch.zeros_like(res.delta))
    return MarginAttack(value.detach(), (value <= 0).detach(), delta.detach())
