"""PGD lower bounds over the Frobenius ball (docs/bounds.md §4)."""

from .objectives import OBJECTIVES, PER_HEAD
from .pgd import PGDResult, attack, attack_remainder, maximize, warm_starts

__all__ = ["OBJECTIVES", "PER_HEAD", "PGDResult", "attack", "attack_remainder", "maximize", "warm_starts"]
