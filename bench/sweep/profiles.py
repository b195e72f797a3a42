"""Sweeps as data: a profile (TOML) lists named sweeps, each a grid over the cells' parameters.

    [run]                       # run options: pgd_steps, pgd_restarts, dtype, seed
    pgd_steps = 100
    [[sweep]]
    name = "eps"
    kind = "dot"
    h = [1, 8]                  # a list is an axis; the sweep is the product of its axes
    eps = [0.01, 0.05]
    [[sweep]]
    name = "mine"
    imported = ["results/vit_layers"]   # import directories: every layer at every input, task imported
    eps = [0.01, 0.1]                   # relative, as task pretrained's (docs/guide/import.md)
    [[sweep]]
    name = "imported_networks"
    network = ["results/mine/vit.onnx"] # whole ViTs from files (.onnx, .pt2), task certify_file
    data = "results/mine/data.pt"       # their images in [0, 1] and labels (docs/guide/certify.md)
    mean = 0.3                          # the models' input normalization
    std = 0.4
    eps = [0.001, 0.005]                # over the image, as task certify's
    samples = 30

A top-level ``plugins = ["my_bound.py"]`` adds a researcher's own bounds to every layer sweep
(docs/guide/plugins.md); a relative path is relative to the profile file's directory, so a profile and
its plugin travel together.

``quick``, ``paper`` and ``crown`` ship in bench/profiles/; any other TOML file is a user profile. CLI
overrides (``--eps 0.01,0.05``) replace that axis in every sweep.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from models import InputError

from ..core import plugins as plugin_files
from ..core.arglists import split_list
from ..core.env import DTYPES
from . import imported as import_dirs
from .cases import FIELDS, IMPORTED_FIELDS, Cell, make_cell

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILES = Path(__file__).resolve().parents[1] / "profiles"  # bench/profiles
CELL_FIELDS = FIELDS  # every cell parameter with its type's name
RUN_DEFAULTS = {"pgd_steps": 100, "pgd_restarts": 8, "dtype": "float64", "seed": 0}
# CLI override flag -> Cell field
OVERRIDES = {"eps": "eps", "heads": "h", "n": "n", "d": "d", "depth": "depth", "x_norm": "x_norm",
             "kind": "kind", "w_vo": "w_vo", "w_qk": "w_qk", "residual": "residual",
             "samples": "samples"}


@dataclass(frozen=True)
class Profile:
    name: str
    run: dict
    sweeps: dict[str, list[Cell]]
    plugins: tuple[plugin_files.PluginFile, ...] = ()  # read and checked when the profile is loaded

    def cells(self) -> list[tuple[str, Cell]]:
        return [(s, c) for s, cells in self.sweeps.items() for c in cells]


def _convert(key: str, value, where: str):
    """A value of Cell field ``key`` from the command line's text: ``--n 16``, ``--residual yes``."""
    kind = CELL_FIELDS[key]
    text = str(value).strip()
    try:
        if kind == "int":
            return int(text)  # "16.5", "1e3" and "16.0" are not integers
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "i"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        return text
    except ValueError:
        raise InputError(f"{where}: {key} = {value!r} is not a valid {kind}") from None


# the TOML types a profile may give each Cell field's type: TOML is typed, so 16.5 or "16" for an
# integer axis is a typo, not a value to round or parse (an integer is a float, never a bool)
TOML_TYPES = {"int": ((int,), "an unquoted integer"), "float": ((int, float), "an unquoted number"),
              "bool": ((bool,), "true or false"), "str": ((str,), "a quoted string")}


def _typed(key: str, value, where: str):
    """A profile's value of Cell field ``key``, of the field's type or refused."""
    kind = CELL_FIELDS[key]
    types, expected = TOML_TYPES[kind]
    if not isinstance(value, types) or (kind != "bool" and isinstance(value, bool)):
        raise InputError(f"{where}: {key} = {value!r} is not a valid {kind}: expected {expected}")
    return float(value) if kind == "float" else value


def expand(name: str, spec: dict, where: str = "") -> list[Cell]:
    """The cells of one sweep: the product of its list-valued keys. ``where`` (the profile) starts
    every error, so that one line says which file, sweep and axis to fix."""
    where = f"{where}: sweep {name!r}" if where else f"sweep {name!r}"
    unknown = set(spec) - set(CELL_FIELDS)
    if unknown:
        raise InputError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(CELL_FIELDS)}")
    spec, layers = _imported(spec, where)
    spec = _network_files(spec, where)
    axes = {}
    for k, v in spec.items():
        vs = [_typed(k, x, where) for x in (v if isinstance(v, list) else [v])]
        if not vs:
            raise InputError(f"{where}: axis {k} is empty")
        twice = [x for i, x in enumerate(vs) if x in vs[:i]]
        if twice:  # as --eps 0.01,0.01 (core/arglists.py): the same cells twice, a typo more than a wish
            raise InputError(f"{where}: axis {k} lists {twice[0]!r} twice: {v!r}")
        axes[k] = vs
    keys = list(axes)
    cells = []
    for combo in itertools.product(*(axes[k] for k in keys)):
        for layer in layers:
            try:
                cells.append(make_cell(**dict(zip(keys, combo, strict=True)), **layer))
            except InputError as e:
                raise InputError(f"{where}: {e}") from None
    return cells


def _imported(spec: dict, where: str) -> tuple[dict, list[dict]]:
    """(the other keys, the imported cells' fields) of a sweep: ``imported = ["DIR", …]`` is one axis
    over every layer and input of each directory, in the manifests' order, and sets task
    ``imported``; a sweep without it has one empty entry. The fields a manifest fills are not a
    profile's to set."""
    set_ = sorted(set(IMPORTED_FIELDS[1:]) & set(spec))
    if set_:
        raise InputError(f"{where}: {', '.join(set_)} come from an import's manifest; name its directory "
                         f"with imported = [\"DIR\", ...]")
    if "imported" not in spec:
        return spec, [{}]
    spec = dict(spec)
    dirs = spec.pop("imported")
    dirs = dirs if isinstance(dirs, list) else [dirs]
    if not dirs or not all(isinstance(d, str) for d in dirs):
        raise InputError(f"{where}: imported must be a list of directories (quoted strings), got {dirs!r}")
    if len(set(dirs)) != len(dirs):
        raise InputError(f"{where}: imported lists a directory twice: {dirs!r}")
    spec.setdefault("task", "imported")
    try:
        return spec, [cell for d in dirs for cell in import_dirs.cells(d)]
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


def _network_files(spec: dict, where: str) -> dict:
    """A sweep of network files (``network = ["vit.onnx", …]`` with ``data``): task ``certify_file``
    unless it names ``certify_file_crown``; the files' hashes are taken when its cells are made, not a
    profile's to set."""
    set_ = sorted({"network_sha256", "data_sha256"} & set(spec))
    if set_:
        raise InputError(f"{where}: {', '.join(set_)} are taken from the files when the profile is loaded")
    if "network" not in spec:
        return spec
    return {"task": "certify_file"} | spec


def parse_list(flag: str, text: str) -> list:
    """``--eps 0.01,0.05`` -> [0.01, 0.05], checked against the Cell field's type."""
    option = f"--{flag.replace('_', '-')}"
    values = [_convert(OVERRIDES[flag], s, option) for s in split_list(option, text)]
    if len(set(values)) != len(values):  # 0.05 and 0.050 name the same cells
        raise InputError(f"{option} lists a value twice: {text!r}")
    return values


def _run_int(run: dict, key: str, low: int, where: str) -> None:
    v = run[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InputError(f"{where}: [run] {key} must be an integer >= {low}, got {v!r}")


def check_run(run, where: str) -> dict:
    """The [run] options with their defaults, each checked before anything is written."""
    if not isinstance(run, dict):
        raise InputError(f"{where}: [run] must be a table, got {run!r}")
    bad = set(run) - set(RUN_DEFAULTS)
    if bad:
        raise InputError(f"{where}: unknown run options {sorted(bad)}; known: {sorted(RUN_DEFAULTS)}")
    run = RUN_DEFAULTS | run
    _run_int(run, "pgd_steps", 0, where)
    _run_int(run, "pgd_restarts", 1, where)
    _run_int(run, "seed", 0, where)
    if run["dtype"] not in DTYPES:
        raise InputError(f"{where}: [run] dtype must be one of {sorted(DTYPES)}, got {run['dtype']!r}")
    return run


def load_profile(name_or_path: str, overrides: dict[str, list] | None = None) -> Profile:
    path = Path(name_or_path)
    if not path.suffix and (PROFILES / f"{name_or_path}.toml").exists():
        path = PROFILES / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(p.stem for p in PROFILES.glob("*.toml"))
        raise InputError(f"no profile {name_or_path!r}: not a file, nor one of {known}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read profile {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"profile {path} is not valid TOML: {e}") from None
    run = check_run(data.get("run", {}), f"profile {path}")
    specs = data.get("sweep", [])
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise InputError(f"profile {path}: 'sweep' must be an array of tables ([[sweep]]), "
                         f"got {specs!r}")
    sweeps: dict[str, list[Cell]] = {}
    for i, spec in enumerate(specs):
        spec = dict(spec)
        # every row carries its sweep's name and the report selects by it: a made-up or converted
        # name would file the rows under something the profile never said
        if "name" not in spec:
            raise InputError(f"profile {path}: sweep #{i + 1} has no name (name = \"...\")")
        name = spec.pop("name")
        if not isinstance(name, str) or not name.strip():
            raise InputError(f"profile {path}: sweep #{i + 1}: name must be a non-empty string, "
                             f"got {name!r}")
        for flag, values in (overrides or {}).items():
            spec[OVERRIDES[flag]] = values
        if name in sweeps:
            raise InputError(f"profile {path}: two sweeps named {name!r}")
        sweeps[name] = expand(name, spec, f"profile {path}")
    if not sweeps:
        raise InputError(f"profile {path}: no [[sweep]] tables")
    return Profile(path.stem, run, sweeps, _plugins(data, path))


def _plugins(data: dict, path: Path) -> tuple[plugin_files.PluginFile, ...]:
    """A profile's ``plugins = ["FILE.py", ...]``, relative to the profile's directory, read and
    checked (bench/core/plugins.py) before any work."""
    files = data.get("plugins", [])
    if not isinstance(files, list) or not all(isinstance(f, str) and f.strip() for f in files):
        raise InputError(f"profile {path}: plugins must be a list of file paths (quoted strings), "
                         f"got {files!r}")
    return tuple(plugin_files.load([path.parent / f for f in files]))
