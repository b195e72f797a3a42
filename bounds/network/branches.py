"""Branches on the kinks for ``taylor_net``'s last backward pass (docs/bounds.md §5.1, "Branches on the
kinks"; the branch and bound of β-CROWN, Wang et al. 2021, without its multipliers): a margin the pass
leaves short is bounded again on the parts of the ball where its costliest relaxed ReLUs keep one sign.
On each part those units are exact (relu(z) = z or 0), every other relaxation and remainder holds as on
the whole ball, and the parts cover the ball, so the smallest of their bounds bounds the margin; each
part also keeps its parent's bound (the parent's ball holds it). Each part splits next the unit whose
relaxation costs its own bound most, breadth first, and a part whose bound verifies the margin is
closed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .backward import Losses, backward, has_relus

# the most parts one margin may bound (each a column of a backward pass): 20,000 parts of the 3-block
# 0.88 Fashion-MNIST model cost about 18 s on one core (docs/results.md, "Branches on the kinks")
BUDGET = 20000
# columns per backward pass
WIDTH = 512
# a margin short by more than REACH times what its root's relaxations cost in all is not branched on:
# a part's bound drops some of those costs, and the gains measured were a fraction of them (the
# 3-block 0.88 Fashion-MNIST model's image 1 at ε 0.1, short by 0.30 of them, verified; the q1 digits
# model's image 15, short by 1.26 of them, gained 0.21 of them; docs/results.md, "Branches on the
# kinks"). A choice of where to spend the budget, not a bound: it can cost a verdict, never soundness
REACH = 2.0


def branch_and_bound(log: list, Lam: Tensor, embed: Tensor, eps: float, need: Tensor, threshold: Tensor,
                     root: Tensor, slack: float, charge: Tensor | None = None,
                     budget: int = BUDGET) -> Tensor:
    """Lower bounds of the functionals' change over the ball, by splitting the relaxed ReLUs of ``log``.

    Args:
      log: the stage records of a pass (:meth:`TaylorNet.stages`).
      Lam: the functionals [B, C, n, d] on the last tokens.
      embed: the pixels' map to the first tokens [n, d, P].
      eps: the image radius.
      need: [B, C] bool, the functionals to branch on.
      threshold: [B, C], the net bound above which a functional is verified (a part is closed).
      root: [B, C], a sound net bound over the whole ball (a bound less its rounding slack).
      slack: the relative rounding slack charged to a bound's terms' magnitudes.
      charge: [B, C], charged to every part's bound (stages outside ``log``), or None.
      budget: the most parts bounded per functional.

    Returns:
      [B, C] net bounds, each at least ``root``: where a functional was branched on, the smallest over
      its last parts of each part's bound (the larger of its own and its parents'); ``root`` elsewhere.
    """
    at = [a for a, rec in enumerate(log) if has_relus(rec)]
    out = root.clone()
    if not need.any() or not at or budget < 1:
        return out
    todo = need.clone()
    # each round, every image branches on its margin furthest short: where that fails the image is not
    # certified, and its other margins are not worth the parts (their bounds stay the root's)
    short = threshold - root
    while todo.any():
        rows = todo.any(-1).nonzero()[:, 0]
        pick = short.masked_fill(~todo, -math.inf).argmax(-1)[rows]
        low = _branch(log, Lam, embed, eps, rows, pick, threshold, root, slack, charge, budget, at)
        out[rows, pick] = low
        todo[rows, pick] = False
        todo[rows[low <= threshold[rows, pick]]] = False
    return out


def _branch(log: list, Lam: Tensor, embed: Tensor, eps: float, image: Tensor, col: Tensor,
            threshold: Tensor, root: Tensor, slack: float, charge: Tensor | None, budget: int,
            at: list[int]) -> Tensor:
    """:func:`branch_and_bound` of the functionals ``col`` [P] of the images ``image`` [P], their net
    bounds [P] (at least the root's); ``at``: the indices of the records with ReLU units."""
    P, dev = len(image), Lam.device
    lim = threshold[image, col]
    # the charge with its own rounding slack, as the root's bound carries it among its magnitudes
    extra = torch.zeros_like(lim) if charge is None else charge[image, col] * (1 + slack)
    # the open parts: their functional, the units they hold (record, unit, sign), their bounds, and
    # the unit each would split next (its costliest free one in its own pass)
    owner = torch.arange(P, device=dev)
    held = torch.zeros(P, 0, 3, dtype=torch.long, device=dev)
    value, nxt, spare = _bound(log, Lam, embed, eps, slack, image, col, at, owner, held)
    value = torch.maximum(value - extra, root[image, col])
    closed = torch.full_like(value, math.inf)  # the smallest bound of each functional's closed parts
    spent = torch.ones(P, dtype=torch.long, device=dev)
    far = lim - value > REACH * spare
    while len(owner):
        done = value > lim[owner]
        closed = closed.scatter_reduce(0, owner[done], value[done], "amin")
        owner, held, value, nxt = owner[~done], held[~done], value[~done], nxt[~done]
        open_ = torch.bincount(owner, minlength=P)
        # a functional stops where a part has no unit left whose relaxation costs anything, or where
        # its next level would exceed the budget: it is not verified, and its bound is its leaves' least
        exhausted = torch.zeros(P, dtype=torch.bool, device=dev).index_fill(0, owner[nxt[:, 1] < 0], True)
        stop = far | exhausted | (spent + 2 * open_ > budget)
        go = ~stop[owner]
        if not go.any():
            break
        parent = owner[go]
        split = torch.cat([nxt[go], torch.ones_like(nxt[go, :1])], -1)[:, None]  # [k, 1, 3]: z ≥ 0
        flip = split.clone()
        flip[..., 2] = -1  # z ≤ 0
        child = torch.cat([torch.cat([held[go], split], 1), torch.cat([held[go], flip], 1)])
        kids = parent.repeat(2)
        fresh, fresh_next, _ = _bound(log, Lam, embed, eps, slack, image, col, at, kids, child)
        fresh = torch.maximum(fresh - extra[kids], value[go].repeat(2))
        spent += torch.bincount(kids, minlength=P)
        keep = ~go
        owner, value, nxt = torch.cat([owner[keep], kids]), torch.cat([value[keep], fresh]), \
            torch.cat([nxt[keep], fresh_next])
        held = torch.cat([_pad(held[keep], child.shape[1]), child])
    low = closed.scatter_reduce(0, owner, value, "amin") if len(owner) else closed
    return torch.maximum(root[image, col], low)


def _pad(held: Tensor, depth: int) -> Tensor:
    """``held`` [K, D, 3] padded to depth ``depth`` with entries of sign 0 (held nowhere)."""
    pad = held.new_zeros(held.shape[0], depth - held.shape[1], 3)
    return torch.cat([held, pad], 1)


def _bound(log: list, Lam: Tensor, embed: Tensor, eps: float, slack: float, image: Tensor, col: Tensor,
           at: list[int], owner: Tensor, held: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Net bounds [K] of the parts ``owner`` [K] (each a functional's index into ``image``, ``col``)
    holding the units ``held`` [K, D, 3] (an index into ``at``, the unit's flat index in its record,
    its sign: +1, −1, or 0 for none), each part's costliest free unit [K, 2] (index into ``at``,
    unit; −1, −1 where none costs anything) and what its free units cost in all [K], by backward
    passes of at most :data:`WIDTH` columns per image."""
    B, dev = Lam.shape[0], Lam.device
    img = image[owner]
    rank = torch.zeros_like(owner)  # each part's column among its image's parts
    for b in img.unique():
        mine = img == b
        rank[mine] = torch.arange(int(mine.sum()), device=dev)
    out = torch.empty(len(owner), dtype=Lam.dtype, device=dev)
    nxt = torch.full((len(owner), 2), -1, dtype=torch.long, device=dev)
    spare = torch.zeros(len(owner), dtype=Lam.dtype, device=dev)
    for start in range(0, int(rank.max()) + 1 if len(owner) else 0, WIDTH):
        sel = (rank >= start) & (rank < start + WIDTH)
        k = int(rank[sel].max()) - start + 1
        b, c, o = img[sel], rank[sel] - start, owner[sel]
        cols = Lam.new_zeros(B, k, *Lam.shape[2:])
        cols[b, c] = Lam[image[o], col[o]]
        phases = {}
        mine = held[sel]
        for i, a in enumerate(at):
            shape = log[a].z0.shape[1:]
            ph = torch.zeros(B, k, math.prod(shape), dtype=torch.int8, device=dev)
            mask = (mine[..., 0] == i) & (mine[..., 2] != 0)
            rows = mask.nonzero()[:, 0]
            ph[b[rows], c[rows], mine[..., 1][mask]] = mine[..., 2][mask].to(torch.int8)
            phases[a] = ph.reshape(B, k, *shape)
        losses = Losses()
        low, mag = backward(log, cols, embed, eps, losses, phases=phases)
        out[sel] = (low - slack * mag)[b, c]
        best = torch.zeros(len(b), dtype=Lam.dtype, device=dev)  # a unit must cost more than 0
        for i, a in enumerate(at):
            cost = (-losses.units[a]).reshape(B, k, -1)[b, c]
            cost = cost.masked_fill(phases[a].reshape(B, k, -1)[b, c] != 0, -math.inf)  # held: exact
            spare[sel] += cost.clamp_min(0).sum(-1)
            top, unit = cost.max(-1)
            better = top > best
            best = torch.where(better, top, best)
            pick = nxt[sel]
            pick[better] = torch.stack([torch.full_like(unit, i), unit], -1)[better]
            nxt[sel] = pick
    return out, nxt, spare
