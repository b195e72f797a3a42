"""A researcher's own bounds as plugin files (``--plugin FILE.py``, a profile's ``plugins = [...]``;
docs/guide/plugins.md).

The contract: a Python file whose module-level ``BOUNDS`` is a tuple (or list) of
:class:`bounds.base.Bound` — a name, ``fn(layer, X, eps) -> Tensor [B]``, paper, equation, whether it
certifies, the layer kinds it applies to. Each file is read once, as bytes: those bytes are hashed
(sha256, recorded on every row of its bounds), executed here, and sent as text to Dask workers, which
execute the same text (they need no file of the client's). Everything a file can get wrong without
any work being done (missing, unreadable, a syntax error, an import that fails, no ``BOUNDS``, an
entry that is not a Bound or asks for what a plugin cannot have, a name clash) is one InputError.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bounds import registry
from bounds.base import Bound
from models import InputError

KINDS = frozenset({"dot", "l2", "olsa"})
# a name that --bounds, the CSV and a file name all take as it is; pgd_ names PGD's own rows
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class PluginFile:
    """One plugin file as read: its path (for messages), its text and the sha256 of its bytes."""

    path: str
    text: str
    sha256: str


def read(path: str | Path) -> PluginFile:
    """A plugin file's bytes, hashed; InputError when it cannot be read as a Python file."""
    p = Path(path)
    if p.suffix != ".py":
        raise InputError(f"plugin {path}: expected a Python file (.py)")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise InputError(f"plugin {path}: no such file") from None
    except OSError as e:
        raise InputError(f"plugin {path}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"plugin {path}: not UTF-8 text ({e})") from None
    return PluginFile(str(p.resolve()), text, hashlib.sha256(raw).hexdigest())


def bounds_of(plugin: PluginFile) -> tuple[Bound, ...]:
    """The checked ``BOUNDS`` of a plugin file, executed as a module of its own."""
    name = f"bench_plugin_{plugin.sha256[:16]}"
    module = types.ModuleType(name)
    module.__file__ = plugin.path
    sys.modules[name] = module  # dataclasses and pickling look a class's module up by name
    try:
        exec(compile(plugin.text, plugin.path, "exec"), module.__dict__)
    except SyntaxError as e:
        raise InputError(f"plugin {plugin.path}: syntax error at line {e.lineno}: {e.msg}") from None
    except (Exception, SystemExit) as e:  # its imports, its own code: whatever it raises, one line
        raise InputError(f"plugin {plugin.path} failed to import: {type(e).__name__}: {e}") from None
    finally:
        sys.modules.pop(name, None)
    found = getattr(module, "BOUNDS", None)
    if found is None:
        raise InputError(f"plugin {plugin.path} defines no BOUNDS: a module-level tuple of "
                         f"bounds.Bound (docs/guide/plugins.md)")
    if not isinstance(found, (tuple, list)) or not found:
        raise InputError(f"plugin {plugin.path}: BOUNDS must be a non-empty tuple of bounds.Bound, got "
                         f"{type(found).__name__}")
    for b in found:
        _check(b, plugin.path)
    names = [b.name for b in found]
    if len(set(names)) != len(names):
        raise InputError(f"plugin {plugin.path}: BOUNDS names a bound twice: {names}")
    return tuple(found)


def _check(b, path: str) -> None:
    """One entry of BOUNDS: a Bound a layer sweep, ``point`` and the gate can take as it is."""
    if not isinstance(b, Bound):
        raise InputError(f"plugin {path}: BOUNDS holds a {type(b).__name__}, not a bounds.Bound")
    what = f"plugin {path}: bound {b.name!r}"
    if not isinstance(b.name, str) or not NAME.fullmatch(b.name) or b.name.startswith("pgd_"):
        raise InputError(f"{what}: a name is letters, digits and _, starting with a letter, and not "
                         f"pgd_…")
    if not callable(b.fn):
        raise InputError(f"{what}: fn is not callable")
    if not isinstance(b.certified, bool):
        raise InputError(f"{what}: certified must be True or False, got {b.certified!r}")
    if not isinstance(b.paper, str) or not isinstance(b.equation, str):
        raise InputError(f"{what}: paper and equation must be strings")
    kinds = b.kinds if isinstance(b.kinds, (set, frozenset)) else None
    if not kinds or not kinds <= KINDS:
        raise InputError(f"{what}: kinds must be a non-empty frozenset of {sorted(KINDS)}, got {b.kinds!r}")
    # the audit compares a plugin's value with PGD on the layer's output: a plugin bounds that
    if b.objective != "output" or b.per_head:
        raise InputError(f"{what}: a plugin bounds the output change (objective 'output', one value "
                         f"per input), got objective {b.objective!r}, per_head {b.per_head}")
    if b.stack not in ("no", "propagate"):
        raise InputError(f"{what}: stack must be 'no' or 'propagate', got {b.stack!r}")
    if b.finding:  # a finding excuses a value below PGD: the suite's verdict, never a bound's own claim
        raise InputError(f"{what}: finding is this suite's verdict on a published bound; a plugin "
                         f"cannot set it")
    if b.check is not None and not callable(b.check):
        raise InputError(f"{what}: check must be callable or None")


def load(paths: Sequence[str | Path]) -> list[PluginFile]:
    """Reads and checks plugin files (each once: a path named twice is read once)."""
    out: dict[str, PluginFile] = {}
    for path in paths:
        plugin = read(path)
        bounds_of(plugin)  # every check before any work
        out.setdefault(plugin.path, plugin)
    return list(out.values())


@contextlib.contextmanager
def using(plugins: Sequence[PluginFile]) -> Iterator[None]:
    """Registers the plugins' bounds for the block, and removes those it added on the way out (the
    same file registered by an enclosing block stays)."""
    added: list[str] = []
    try:
        for plugin in plugins:
            added += registry.register(bounds_of(plugin), plugin.path, plugin.sha256)
        yield
    finally:
        registry.unregister(added)


def describe(plugins: Sequence[PluginFile]) -> list[dict]:
    """The plugins as a run's manifest records them: a changed file refuses a resume."""
    return [{"file": p.path, "sha256": p.sha256} for p in plugins]
