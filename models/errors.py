"""Input validation shared by the library and the CLI.

Every check raises :class:`InputError`, a ``ValueError``, with one line that names what is wrong;
the CLI turns it into that line on stderr and exit code 2.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The largest |entry| of a weight or input tensor, and the largest ε, the suite accepts. The bounds are
# polynomials in them of degree up to about 11 at one block (Taylor's: its value grows like s¹¹ when X,
# ε and every weight are scaled by s), so 1e12 keeps a block's values far below float64's 1.8e308; a
# deeper stack compounds the degrees, and a value that still overflows is refused after the computation
# (bench/sweep/evaluate.py).
MAX_MAGNITUDE = 1e12


class InputError(ValueError):
    """Bad user input: a shape, a value, a file or a layer kind that does not fit."""


def check_float(name: str, t: Tensor) -> None:
    """Refuses a tensor that is not floating point: the file format is float (docs/guide/file-format.md),
    and an integer tensor is more likely a wrong file than weights."""
    if not t.is_floating_point():
        raise InputError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected a float dtype "
                         f"(float16, bfloat16, float32 or float64)")


def check_finite(name: str, t: Tensor) -> None:
    """Refuses NaN, inf, and entries beyond ±MAX_MAGNITUDE (one pass over ``t`` when all is well)."""
    if bool((t.abs() <= MAX_MAGNITUDE).all()):
        return
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{name} contains NaN or inf")
    raise InputError(f"{name} has an entry of magnitude {float(t.abs().max()):.3g}, beyond the "
                     f"{MAX_MAGNITUDE:g} the bounds can be computed with in float64 without overflow; "
                     f"rescale it")


def check_eps(eps: float) -> float:
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise InputError(f"eps must be a number, got {eps!r}") from None
    if not math.isfinite(eps) or eps <= 0:
        raise InputError(f"eps must be finite and > 0, got {eps}")
    if eps > MAX_MAGNITUDE:
        raise InputError(f"eps = {eps:g} is beyond {MAX_MAGNITUDE:g}: the bounds would overflow float64")
    return eps


def check_heads(d: int, h: int) -> int:
    if h < 1 or d < 1:
        raise InputError(f"d and h must be positive, got d={d}, h={h}")
    if d % h:
        raise InputError(f"d % h != 0: d={d} is not divisible by h={h}")
    return d // h


def check_tokens(name: str, X: Tensor) -> None:
    """Refuses an X ([n, d] or [B, n, d]) with nothing in it, saying which of its sizes is 0: a batch
    of zero inputs and inputs of zero tokens are different mistakes in the file."""
    shape = list(X.shape)
    if X.dim() == 3 and shape[0] == 0:
        raise InputError(f"{name} has shape {shape}: the batch is empty (B = 0); it needs at least one "
                         f"input [n, d]")
    if X.dim() in (2, 3) and shape[-2] == 0:
        which = "its inputs have" if X.dim() == 3 else "the input has"
        raise InputError(f"{name} has shape {shape}: {which} no tokens (n = 0); an input needs at least "
                         f"one token")


def as_batch(X: Tensor, d: int) -> Tensor:
    """Returns X as [B, n, d]; accepts [n, d]."""
    if X.dim() not in (2, 3):
        raise InputError(f"X must be [n, d] or [B, n, d], got shape {list(X.shape)}")
    if X.shape[-1] != d:
        raise InputError(f"X has d={X.shape[-1]} but the layer has d={d}")
    check_tokens("X", X)  # before the [n, d] → [1, n, d] below, so that the shape named is the one given
    if X.dim() == 2:
        X = X.unsqueeze(0)
    check_finite("X", X)
    return X
