"""Network files as sweep cells: a profile's ``network = ["vit.onnx", …]`` with ``data = "FILE.pt"``
(task ``certify_file``, or ``certify_file_crown`` with CROWN beside) certifies a user's whole ViT, as
``certify --model FILE --data FILE`` does (docs/guide/certify.md), and stores its rows.

Everything a cell names is checked from the files alone, before any work: the network file's kind, the
data file, the normalization, that it holds ``samples`` images. A cell carries the sha256 of both
files, taken when the profile is loaded: a file changed since then is refused, and a file exported
anew makes other cells, which ``compare`` never takes for the old ones."""

from __future__ import annotations

from pathlib import Path

from models import InputError
from models.imported.importer import SOURCES, digest

from ..core.env import ROOT
from ..core.schema import FILE_TASKS
from ..nets.from_file import DATA_SUFFIXES, read_data
from .imported import BAD_CHARS, resolve  # an id's separators and a profile's paths, as an import's

__all__ = ["DIGEST", "FILE_TASKS", "check_data", "checked", "pinned", "resolve"]

DIGEST = 16  # hex digits of a file's sha256 in a cell id (64 bits)


def checked(key: str, path: str, suffixes: tuple[str, ...]) -> Path:
    """The file ``path`` of the profile's ``key``, with one of ``suffixes``, that a cell id can hold."""
    if not path or any(ch in path for ch in BAD_CHARS):
        raise InputError(f"{key} = {path!r}: not a file name a cell id can hold (empty, or holds one of "
                         f"{BAD_CHARS!r})")
    if Path(path).suffix not in suffixes:
        raise InputError(f"{key} = {path!r}: expected a {' or '.join(suffixes)} file")
    full = resolve(path)
    if not full.is_file():
        raise InputError(f"{key} = {path!r}: no such file (relative paths are to the checkout root, {ROOT})")
    return full


def pinned(network: str, data: str, network_sha256: str, data_sha256: str) -> tuple[str, str]:
    """The first :data:`DIGEST` hex digits of both files' sha256 (the network's with the files that
    hold its tensors, models.imported.importer.digest); where the cell already names them, checked
    against the files (InputError where a file changed)."""
    now = []
    for key, path, suffixes, named in (("network", network, tuple(SOURCES), network_sha256),
                                       ("data", data, DATA_SUFFIXES, data_sha256)):
        full = checked(key, path, suffixes)
        have = digest(full)[:DIGEST]
        if named and named != have:
            raise InputError(f"{key} = {path!r} changed since the cell was made (sha256 {have}…, the cell "
                             f"names {named}…); load the profile again")
        now.append(have)
    return now[0], now[1]


def check_data(data: str, samples: int) -> None:
    """The data file holds images and labels as ``certify --data`` reads them, at least ``samples``."""
    _, labels = read_data(resolve(data), f"data = {data!r}")
    if samples > len(labels):
        raise InputError(f"data = {data!r} holds {len(labels)} images, fewer than samples = {samples}")
