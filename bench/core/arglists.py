"""Comma-separated lists on the command line (``--eps 0.01,0.05``, ``--bounds a,b``): one rule for
every flag, so that a list one command refuses is not quietly shortened by another."""

from __future__ import annotations

from models import InputError


def split_list(flag: str, text: str) -> list[str]:
    """The items of ``text``, stripped. An empty list, an empty item (``a,,b``, a trailing comma) or
    an item given twice is an InputError naming ``flag``: each is a typo more often than a wish, and
    dropping it would run something other than what was typed."""
    items = [s.strip() for s in str(text).split(",")]
    if not any(items):
        raise InputError(f"{flag} must be a comma-separated list, got an empty list {text!r} (leave "
                         f"the option out for its default)")
    if not all(items):
        raise InputError(f"{flag} must be a comma-separated list without empty items, got {text!r}")
    twice = sorted({s for s in items if items.count(s) > 1})
    if twice:
        raise InputError(f"{flag} lists {twice[0]!r} twice: {text!r}")
    return items
