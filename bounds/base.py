"""What every bound is: a name, its source, whether it certifies, and a batched function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

BoundFn = Callable[..., Tensor]


@dataclass(frozen=True, kw_only=True)
class Bound:
    """One bound of docs/bounds.md, built with keywords only (``Bound(name=..., fn=..., ...)``).

    ``fn(layer, X, eps, *, ledger)`` takes a layer already on X's device and dtype, ``X`` as
    [B, n, d], ``eps`` as a float or a per-input tensor [B], and the
    :class:`bounds.certificates.Ledger` that records the certificate of every certified norm it
    computes (and shares them through its cache); it returns [B] (or [B, h] when ``per_head``).
    ``objective`` names the PGD objective (attacks.objectives) the value is compared with.
    ``stack`` says how it meets a stack: ``no``; ``propagate`` the radius block by block
    (docs/bounds.md §1.4); or ``only`` on stacks (its fn then takes the stack itself).
    ``biases`` says whether the bound holds for a dot layer with biases, as docs/bounds.md §1.5
    extends it; a bound that is not extended so (the default) refuses such a layer.
    ``opt_in``: computed only when asked for by name (never by ``applicable`` nor inside ``best``),
    for a bound too slow for every cell; ``check`` raises InputError when it cannot run here (an
    optional package it needs is missing), before any work. ``taylor_options``: ``fn`` also takes
    ``options=`` a :class:`bounds.taylor.TaylorOptions` as a keyword (what a network certificate
    lets it skip, docs/bounds.md §5); the others are called with (layer, X, eps, ledger=) alone.
    """

    name: str
    fn: BoundFn
    paper: str
    equation: str
    certified: bool
    kinds: frozenset[str]
    objective: str | None = "output"
    per_head: bool = False
    stack: str = "no"
    ours: bool = False  # a tightening of this suite, not of the cited paper
    finding: str = ""  # a soundness failure of the published statement that this suite found
    description: str = ""
    display: str = ""  # the name a reader sees in figures and tables (e.g. "LoFAST δ₂⁽¹⁾ (‖M‖)")
    biases: bool = False  # accepts layers with biases (docs/bounds.md §1.5); opt in, never by default
    opt_in: bool = False
    check: Callable[[], None] | None = None
    taylor_options: bool = False

    @property
    def label(self) -> str:
        """The display name, marked where the value is not a paper's certificate."""
        text = self.display or self.name
        if not self.certified:
            return f"{text} (estimate)"
        return f"{text} (this suite)" if self.ours else text


def radius(eps: float | Tensor, X: Tensor) -> Tensor:
    """eps as a tensor [B] on X's device and dtype."""
    return torch.as_tensor(eps, dtype=X.dtype, device=X.device).expand(X.shape[0])


def propagate(bound: Bound, blocks: Sequence, inputs: Sequence[Tensor], eps: float | Tensor,
              after: Sequence[float] | None = None, **options) -> Tensor:
    """The one walk of a stack (docs/bounds.md §1.4): r_0 = eps, r_{k+1} = after_k · bound(block_k,
    X_k, r_k), with X_k block k's input on the clean trajectory. ``after`` holds the Lipschitz
    constant of what follows each block inside the network (a ViT's FFN, bounds.network); a plain
    stack has nothing there and its radius is not multiplied at all. ``options`` go to every block's
    ``bound.fn`` as keywords (``ledger=``, and ``options=`` a TaylorOptions for a bound with
    ``taylor_options``)."""
    if len(inputs) != len(blocks) or (after is not None and len(after) != len(blocks)):
        raise ValueError(f"{len(blocks)} blocks need as many inputs and constants, got {len(inputs)} "
                         f"and {None if after is None else len(after)}")
    radius = eps
    for k, (block, X) in enumerate(zip(blocks, inputs, strict=True)):
        radius = bound.fn(block, X, radius, **options)
        if after is not None:
            radius = radius * after[k]
    return radius
