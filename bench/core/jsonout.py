"""JSON that strict parsers read: Python's json writes NaN and Infinity by default, which are not
JSON (issue #23: CROWN's NaN in ``certify --json``). Every command's JSON goes through :func:`dumps`:
a non-finite number becomes ``null`` (value unknown or unbounded; the text output says which), and
``allow_nan=False`` makes one that slipped past :func:`finite` an error, never invalid output."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every NaN and ±inf float, in dicts, lists and tuples at any depth, as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """:func:`json.dumps` of :func:`finite` ``obj``, refusing (ValueError) any non-finite number left."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
