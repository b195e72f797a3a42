"""The directories of ``python -m bench import`` as sweep cells: a profile's ``imported = ["DIR", …]``
names them, and each of their layers at each of its inputs becomes a cell of task ``imported``
(bench/sweep/cases.py). Everything is checked from the manifest and the files alone, before any work:
a directory without manifest.json, a manifest naming a missing file, a layer above its tolerance (the
import refuses such a layer, so a manifest holding one was edited or cut) is one InputError.

A cell names its layer by the directory (as the profile wrote it: relative to the checkout, or
absolute), the layer and input index, the manifest's sha256 of the model file, and a digest of the
layer and input files' bytes: a model exported anew, or imported at other inputs, makes other cells,
which ``compare`` never takes for the old ones."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from models import InputError

from ..core.env import ROOT

MANIFEST = "manifest.json"
BAD_CHARS = ",=[]"  # a cell id is ``imported[dir=…,layer=…]`` or ``file[network=…,…]``: these would cut it
DIGEST = 16  # hex digits of the files' digest (64 bits) in a cell id


def resolve(directory: str) -> Path:
    """A path as a profile names it (an import directory, a network or data file): absolute, or
    relative to the checkout root."""
    path = Path(directory)
    return path if path.is_absolute() else ROOT / path


def check_name(directory: str) -> None:
    if not directory or any(ch in directory for ch in BAD_CHARS):
        raise InputError(f"imported: {directory!r} is not a directory name a cell id can hold "
                         f"(empty, or holds one of {BAD_CHARS!r})")


def manifest(directory: str) -> dict:
    """The manifest of an import directory, its layer entries checked (InputError naming the first
    fault). Read anew on each call: a cache keyed by size and mtime would miss a re-import within the
    clock's tick, and the file is small."""
    check_name(directory)
    path = resolve(directory) / MANIFEST
    if not resolve(directory).is_dir():
        raise InputError(f"imported: {directory}: no such directory (relative paths are to the checkout "
                         f"root, {ROOT})")
    if not path.is_file():
        raise InputError(f"imported: {directory} holds no {MANIFEST}: not the --out of "
                         f"`python -m bench import`")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"imported: {path} is not a readable manifest ({e})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    sha = data.get("sha256") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or not _is_sha256(sha):
        raise InputError(f"imported: {path} is not an import's manifest (it needs 'sha256' and a non-empty "
                         f"'layers' list)")
    for k, entry in enumerate(layers):
        _check_entry(directory, k, entry)
    return data


def _is_sha256(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def _check_entry(directory: str, k: int, e) -> None:
    """A layer entry: its shape fields, an error within its tolerance, and its files present."""
    where = f"imported: {directory}/{MANIFEST}: layer {k}"
    need = ("node", "heads", "d", "d_h", "n", "residual", "max_rel_err", "tolerance", "files")
    if not isinstance(e, dict) or any(key not in e for key in need):
        raise InputError(f"{where}: an entry needs {', '.join(need)}")
    err, tol = e["max_rel_err"], e["tolerance"]
    if not (isinstance(err, (int, float)) and isinstance(tol, (int, float)) and math.isfinite(err)
            and err <= tol):
        raise InputError(f"{where} ({e['node']}): max_rel_err {err!r} is above its tolerance {tol!r}: the "
                         f"import refuses such a layer; import the model again")
    files = e["files"]
    inputs = files.get("inputs") if isinstance(files, dict) else None
    if not isinstance(inputs, list) or not inputs or not isinstance(files.get("layer"), str):
        raise InputError(f"{where}: 'files' needs 'layer' and a non-empty 'inputs' list")
    for name in [files["layer"], *inputs]:
        if not isinstance(name, str) or Path(name).name != name or not (resolve(directory) / name).is_file():
            raise InputError(f"{where}: the manifest names {name!r}, which is not a file in {directory}")


def entry(directory: str, layer: int) -> dict:
    """Layer ``layer``'s entry of the manifest (InputError when there is none)."""
    layers = manifest(directory)["layers"]
    if not 0 <= layer < len(layers):
        raise InputError(f"imported: {directory} holds layers 0..{len(layers) - 1}, not layer {layer}")
    return layers[layer]


def files(directory: str, layer: int, index: int) -> tuple[Path, Path]:
    """(layer file, input file) of one cell (InputError when the manifest has no such input)."""
    e = entry(directory, layer)
    inputs = e["files"]["inputs"]
    if not 0 <= index < len(inputs):
        raise InputError(f"imported: {directory} layer {layer} has inputs 0..{len(inputs) - 1}, "
                         f"not input {index}")
    root = resolve(directory)
    return root / e["files"]["layer"], root / inputs[index]


def digest(directory: str, layer: int, index: int) -> str:
    """The first :data:`DIGEST` hex digits of the sha256 of the layer file's and the input file's sha256."""
    h = hashlib.sha256()
    for path in files(directory, layer, index):
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:DIGEST]


def cells(directory: str) -> list[dict]:
    """Per layer and input of an import directory: the fields of its cell (bench/sweep/cases.py)."""
    data = manifest(directory)
    return [{"imported": directory, "imported_layer": k, "imported_input": i,
             "imported_sha256": data["sha256"], "imported_data": digest(directory, k, i)}
            for k, e in enumerate(data["layers"]) for i in range(len(e["files"]["inputs"]))]


def check(directory: str, layer: int, index: int, sha256: str, data: str) -> None:
    """A cell's layer is still the one it names: the manifest's model hash and the files' digest."""
    have = manifest(directory)["sha256"]
    if sha256 != have:
        raise InputError(f"imported: {directory} now holds an import of another model (sha256 "
                         f"{have[:12]}…, the cell names {sha256[:12]}…); load the profile again")
    now = digest(directory, layer, index)
    if data != now:
        raise InputError(f"imported: {directory} layer {layer} input {index}: its files changed since the "
                         f"cell was made (digest {now}, the cell names {data}); load the profile again")
