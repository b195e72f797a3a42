"""Image classification data bundled with the machine, never downloaded at run time.

Every loader returns ``(X_train, y_train, X_test, y_test)``: float64 images in [0, 1] of shape
[N, H, W] and int64 labels. ε of a certificate lives in this pixel space, as an ℓ2 norm over the
whole image (LoFAST §5.2).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .errors import InputError

# Debian's dataset-fashion-mnist installs the four IDX files here; tests monkeypatch it
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz", "test_labels": "t10k-labels-idx1-ubyte.gz",
}
IDX_UBYTE = 0x08  # IDX type code of unsigned bytes, the only type these files use

Split = tuple[Tensor, Tensor, Tensor, Tensor]


def load_digits() -> Split:
    """scikit-learn's bundled 8×8 digits (1,797 images, 10 classes), pixels 0..16 divided by 16.

    The split is ``train_test_split(test_size=0.25, random_state=0, stratify=y)``: 1,347 training and
    450 test images, the same on every machine (stratified, so each class keeps its share in both).
    """
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    data = sk_digits()
    X = data.images.astype(np.float64) / 16.0
    X_tr, X_te, y_tr, y_te = train_test_split(X, data.target, test_size=0.25, random_state=0,
                                              stratify=data.target)
    return (torch.from_numpy(X_tr), torch.from_numpy(y_tr).long(),
            torch.from_numpy(X_te), torch.from_numpy(y_te).long())


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """One gzip-compressed IDX file of unsigned bytes (magic 0, 0, type, ndim; big-endian sizes)."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if len(raw) < 4 + 4 * ndim or raw[0] != 0 or raw[1] != 0 or raw[2] != IDX_UBYTE or raw[3] != ndim:
        raise InputError(f"{path}: not an IDX file of unsigned bytes with {ndim} dimensions")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise InputError(f"{path}: header says shape {list(shape)} but the file holds {body.size} bytes")
    return body.reshape(shape)


def load_fashion_mnist(directory: Path | None = None) -> Split:
    """Fashion-MNIST (28×28, 60,000 training and 10,000 test images) from Debian's package files,
    pixels 0..255 divided by 255; the split is the dataset's own."""
    directory = Path(directory or FASHION_MNIST_DIR)
    paths = {k: directory / f for k, f in FASHION_MNIST_FILES.items()}
    missing = [p for p in paths.values() if not p.is_file()]
    if missing:
        raise InputError(f"fashion-mnist is not installed: {missing[0]} not found; it comes from the Debian "
                         f"package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")
    arrays = {k: read_idx(p, 3 if k.endswith("images") else 1) for k, p in paths.items()}
    for part in ("train", "test"):
        if len(arrays[f"{part}_images"]) != len(arrays[f"{part}_labels"]):
            raise InputError(f"fashion-mnist: {part} images and labels differ in number")
    images = {k: torch.from_numpy(a.astype(np.float64) / 255.0) for k, a in arrays.items()
              if k.endswith("images")}
    labels = {k: torch.from_numpy(a.astype(np.int64)) for k, a in arrays.items() if k.endswith("labels")}
    return images["train_images"], labels["train_labels"], images["test_images"], labels["test_labels"]


DATASETS = {"digits": load_digits, "fashion-mnist": load_fashion_mnist}
SHAPES = {"digits": (8, 10), "fashion-mnist": (28, 10)}  # (image side, classes), known before loading


def load_dataset(name: str) -> Split:
    """``(X_train, y_train, X_test, y_test)`` of a bundled dataset: ``digits`` or ``fashion-mnist``."""
    if name not in DATASETS:
        raise InputError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return DATASETS[name]()
