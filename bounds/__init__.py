"""Every bound of docs/bounds.md, one module per family, listed in an explicit registry."""

from .base import Bound
from .certificates import Certificate
from .registry import (
    BOUNDS,
    REGISTRY,
    Value,
    applicable,
    applies,
    evaluate,
    evaluate_certified,
    get,
    has_biases,
    require,
)

__all__ = ["BOUNDS", "REGISTRY", "Bound", "Certificate", "Value", "applicable", "applies", "evaluate",
           "evaluate_certified", "get", "has_biases", "require"]
