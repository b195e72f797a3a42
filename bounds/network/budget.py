"""Errors that share one ball's budget (docs/bounds.md §5.1, "The budget, exactly").

A block's per-token errors are each at most ``v_t·s_t/cap_t`` where ``s_t = ‖Δ_t‖²`` ranges over
``0 ≤ s_t ≤ cap_t`` and the tokens share the ball ``Σ_t s_t ≤ budget``. The largest sum of the errors
over that set is a fractional knapsack: its optimum is the greedy fill by ratio ``v_t/cap_t``
(Dantzig 1957), which is at most both ``Σ_t v_t`` and ``budget·max_t v_t/cap_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shared(v: Tensor, caps: Tensor, budget: Tensor) -> Tensor:
    """The largest ``Σ_j (s_j/caps_j)·v_j`` over ``0 ≤ s_j ≤ caps_j``, ``Σ_j s_j ≤ budget``.

    Args:
      v: each item's value at its cap, ≥ 0 (+inf allowed), [..., k].
      caps: each item's cap, ≥ 0, broadcastable to ``v``; an item of cap 0 is taken whole.
      budget: the shared budget, ≥ 0, broadcastable to ``v.shape[:-1]``.

    Returns:
      the optimum, [...], rounded up (a relative 4k unit roundoffs covers the sums' rounding).
    """
    caps = caps.expand_as(v)
    tiny = torch.finfo(v.dtype).tiny
    # value per unit of budget; an item of cap 0 costs nothing and comes first
    ratio = torch.where(caps > 0, v / caps.clamp_min(tiny), torch.inf)
    order = ratio.argsort(-1, descending=True)
    ratio, caps, v = (t.gather(-1, order) for t in (ratio, caps, v))
    room = (budget.expand(v.shape[:-1])[..., None] - (caps.cumsum(-1) - caps)).clamp_min(0)
    # the item fits whole, or takes what room is left (0 where none is: never ∞·0)
    part = torch.where(room > 0, ratio * torch.minimum(room, caps), 0.0)
    take = torch.where(room >= caps, v, part)
    return take.sum(-1) * (1 + 4 * v.shape[-1] * torch.finfo(v.dtype).eps)
