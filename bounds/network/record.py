"""What a stage of ``taylor_net`` leaves for the backward pass (docs/bounds.md §5.1, "the backward
pass"): each stage's record is a frozen dataclass with ``step(Λ) → Step``, the functionals moved to
the stage's input and what the stage adds to their lower bound; a residual branch is marked by a
:class:`Fork` before it and a :class:`Join` after it. :func:`bounds.network.backward.backward` walks
the records back and refuses one it does not know."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Fork", "Join", "Step"]


@dataclass(frozen=True)
class Step:
    """One stage crossed backward: ``Lam`` the functionals on the stage's input [B, C, n, d]; ``gain``
    [B, C] the relaxations' offsets added to the bound and ``offsets`` their magnitudes (the rounding
    slack); ``charge`` [B, C] the stage's remainder, subtracted (None: the stage has none); ``units``
    [B, C, *units] each ReLU unit's own offset in ``gain`` (what its relaxation costs the bound where
    negative; :mod:`bounds.network.branches` splits the costliest), None where the stage has none."""

    Lam: Tensor
    gain: Tensor | float = 0.0
    offsets: Tensor | float = 0.0
    charge: Tensor | None = None
    units: Tensor | None = None


@dataclass(frozen=True)
class Fork:
    """A residual's input, where its branch starts: the functionals kept at the join come back here."""


@dataclass(frozen=True)
class Join:
    """A residual's output x + branch(x): the functionals reach x both through the branch and directly."""
