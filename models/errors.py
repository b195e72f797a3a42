"""Input validation shared by the library and the CLI.

Every check raises :class:`InputError`, a ``ValueError``, with one line that names what is wrong;
the CLI turns it into that line on stderr and exit code 2.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class InputError(ValueError):
    """Bad user input: a shape, a value, a file or a layer kind that does not fit."""


def check_finite(name: str, t: Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{name} contains NaN or inf")


def check_eps(eps: float) -> float:
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise InputError(f"eps must be a number, got {eps!r}") from None
    if not math.isfinite(eps) or eps <= 0:
        raise InputError(f"eps must be finite and > 0, got {eps}")
    return eps


def check_heads(d: int, h: int) -> int:
    if h < 1 or d < 1:
        raise InputError(f"d and h must be positive, got d={d}, h={h}")
    if d % h:
        raise InputError(f"d % h != 0: d={d} is not divisible by h={h}")
    return d // h


def as_batch(X: Tensor, d: int) -> Tensor:
    """Returns X as [B, n, d]; accepts [n, d]."""
    if X.dim() == 2:
        X = X.unsqueeze(0)
    if X.dim() != 3:
        raise InputError(f"X must be [n, d] or [B, n, d], got shape {list(X.shape)}")
    if X.shape[-1] != d:
        raise InputError(f"X has d={X.shape[-1]} but the layer has d={d}")
    if X.shape[1] < 1 or X.shape[0] < 1:
        raise InputError(f"X must hold at least one token, got shape {list(X.shape)}")
    check_finite("X", X)
    return X
