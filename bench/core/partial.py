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
from pathlib import Path

import torch

from .store import PARTIAL, atomic_write

__all__ = ["PARTIAL", "DiskStore", "code_salt"]


def code_salt(commit: str) -> str:
    """What a stored batch's bounds depend on besides its inputs: the suite's commit, torch's and
    auto_LiRPA's versions."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        lirpa = version("auto_LiRPA")
    except (ImportError, PackageNotFoundError):
        lirpa = "none"
    return f"{commit}|torch {torch.__version__}|auto_LiRPA {lirpa}"


class DiskStore:
    """Batches' results under ``root``, one file each, named by the sha256 of ``salt`` and the key:
    the salt names the code and libraries (the run's commit, torch's and auto_LiRPA's versions), the
    key the inputs (:func:`bounds.network.netcrown.batch_key`). A file that cannot be read is a miss."""

    def __init__(self, root: Path, salt: str):
        self.root, self.salt = Path(root), salt

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
        buf = io.BytesIO()
        torch.save(value, buf)
        atomic_write(self._path(key), buf.getvalue())
