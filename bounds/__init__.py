"""Every bound of docs/bounds.md, one module per family, listed in an explicit registry."""

from .base import Bound
from .registry import BOUNDS, REGISTRY, applicable, applies, evaluate, get, require

__all__ = ["BOUNDS", "REGISTRY", "Bound", "applicable", "applies", "evaluate", "get", "require"]
