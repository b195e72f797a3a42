"""The three ways a quantity of attention's remainder is taken (docs/bounds.md §2.3.4, rule 4)."""

from __future__ import annotations

import enum


class Estimate(enum.Enum):
    """How a quantity of the remainder's assembly is taken (docs/bounds.md §2.3.4, rule 4): the one
    vocabulary of bounds.remainder and :func:`bounds.heads.heads_top_as`."""

    ABOVE = "above"  # from above without an eigenproblem: a bound, looser
    BELOW = "below"  # an estimate from below (a Ritz value): it judges the others, never a bound
    CERTIFIED = "certified"  # certified with its eigenproblem: a bound, the tightest
