"""A run's partial results on disk (a :class:`~bounds.network.netcrown.BatchStore`): each batch of
whole-network CROWN bounds (``bounds.network.netcrown.verify``) and each chunk's taylor_net certificate
and PGD attack (``bench.nets.accuracy.run_certify``) as its own small file in the run directory,
written as soon as it is made, so that a cell cut short (a stopped process, a machine given back)
resumes where it stopped. A CROWN cell of the paper profile is hours of a CPU core; without this, a
session shorter than the cell never finishes it (docs/guide/run.md)."""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
from pathlib import Path

import torch

from models import InputError

from .store import PARTIAL, atomic_write

__all__ = ["PARTIAL", "DiskStore", "code_salt"]


# the suite's packages: what a kept result was computed by
PACKAGES = ("attacks", "bench", "bounds", "models")


def code_salt(root: Path | None = None) -> str:
    """What a kept result depends on besides its inputs: the suite's own code (the sha256 of every
    ``.py`` file of its packages under ``root``, this checkout's by default, as they are on disk,
    committed or not, so that an edit between a cut and its resume is another salt) and torch's and
    auto_LiRPA's versions."""
    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
    h = hashlib.sha256()
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        h.update(f"{path.relative_to(root)}\n".encode())
        h.update(path.read_bytes())
    try:
        from importlib.metadata import PackageNotFoundError, version

        lirpa = version("auto_LiRPA")
    except (ImportError, PackageNotFoundError):
        lirpa = "none"
    return f"{h.hexdigest()}|torch {torch.__version__}|auto_LiRPA {lirpa}"


class DiskStore:
    """Results under ``root``, one file each, named by the sha256 of ``salt`` and the key: the salt
    names the code and libraries (:func:`code_salt`), the key the inputs
    (:func:`bounds.network.netcrown.batch_key`). A file that cannot be read is a miss; a result that
    cannot be written (a full disk) is said once on stderr and not kept, and the run goes on."""

    def __init__(self, root: Path, salt: str):
        self.root, self.salt = Path(root), salt
        self.failed = False

    def _path(self, key: str) -> Path:
        name = hashlib.sha256(f"{self.salt}|{key}".encode()).hexdigest()
        return self.root / name[:2] / f"{name}.pt"

    def get(self, key: str) -> dict | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError):
            return None  # not a file this store wrote (writes are atomic): bounded again, replaced

    def put(self, key: str, value: dict) -> None:
        if self.failed:
            return
        buf = io.BytesIO()
        torch.save(value, buf)
        try:
            atomic_write(self._path(key), buf.getvalue())
        except InputError as e:
            self.failed = True
            print(f"note: results are no longer kept for a resume ({e})", file=sys.stderr)
