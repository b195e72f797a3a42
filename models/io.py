"""Layer, stack and input files in safetensors (no pickle); the format is in
docs/guide/file-format.md.

A layer file holds per-head tensors and string metadata (``kind`` and the layer's scalars). A stack
file holds each block's tensors and metadata under the prefix ``blocks.{k}.``, plus ``kind=stack``,
``depth`` and ``R`` (a number, or ``none`` for no LayerProject).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

from .errors import InputError, check_finite, check_float, check_tokens
from .layers import ACTIVATIONS, L2MHA, OLSA, DotMHA, Layer, Stack

# tensor name -> (dims, as letters of h, d, e=d_h), per layer kind
SCHEMA: dict[str, dict[str, str]] = {
    "dot": {"W_q": "hde", "W_k": "hde", "W_v": "hde", "W_o": "hed"},
    "l2": {"W_q": "hde", "W_v": "hde", "W_o": "hed"},
    "olsa": {"W_q": "hed", "W_k": "hed", "W_v": "hed", "w_s": "he"},
}
# optional tensors (docs/bounds.md §1.5: biases of a pretrained dot layer), same letters; a kind not
# listed takes none, and a file that gives it one is refused rather than silently read without it
OPTIONAL: dict[str, dict[str, str]] = {
    "dot": {"b_q": "he", "b_k": "he", "b_v": "he", "b_o": "d"},
}
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Writes ``data`` through a temp file beside ``path`` and a rename: a reader sees the old file or
    the new, never a part. The temp file is created with mode 0666, which the kernel narrows by the
    umask, so the file gets the usual mode (mkstemp's, and safetensors' own save_file's, is 0600: a
    model or a report the user could not share). On failure the temp file is removed and the
    OSError raised."""
    path = Path(path)
    # the name ``.NAME.*.tmp`` is what bench.core.store.remove_stale_temps clears after a killed run
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def save_tensors(path: str | Path, tensors: dict[str, Tensor],
                 metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by :func:`write_atomic` (whole or not at all, the usual mode)."""
    write_atomic(path, save(tensors, metadata=metadata))


def read_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise InputError(f"cannot read {path}: no such file") from None
    except Exception as e:  # safetensors raises its own error type for a corrupt header
        raise InputError(f"cannot read {path}: not a readable safetensors file ({e})") from None


def _meta(meta: dict[str, str], key: str, where: str, default: str | None = None) -> str:
    if key in meta:
        return meta[key]
    if default is not None:
        return default
    raise InputError(f"{where}: missing metadata key {key!r}")


def _flag(value: str, key: str, where: str) -> bool:
    if value not in ("0", "1"):
        raise InputError(f"{where}: metadata {key!r} must be '0' or '1', got {value!r}")
    return value == "1"


def _positive(value: str, key: str, where: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise InputError(f"{where}: metadata {key!r} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise InputError(f"{where}: metadata {key!r} must be finite and > 0, got {value!r}")
    return x


def _check_shapes(kind: str, t: dict[str, Tensor], where: str) -> None:
    sizes: dict[str, int] = {}
    optional = OPTIONAL.get(kind, {})
    for name in BIAS_NAMES:
        if name in t and name not in optional:
            raise InputError(f"{where}: tensor {name!r} is a bias, which kind {kind!r} does not take "
                             f"(only dot layers have biases, docs/bounds.md §1.5)")
    # a tensor the layer would not read is refused: silently ignoring it hides a wrong file or kind
    known = [*SCHEMA[kind], *optional]
    for name in t:
        if name not in known:
            raise InputError(f"{where}: unknown tensor {name!r} for kind {kind!r} (its tensors: "
                             f"{', '.join(known)})")
    # required tensors first, so that the sizes an optional tensor is checked against come from them
    for name, dims in [*SCHEMA[kind].items(), *((n, dm) for n, dm in optional.items() if n in t)]:
        if name not in t:
            raise InputError(f"{where}: missing tensor {name!r} for kind {kind!r}")
        x = t[name]
        if x.dim() != len(dims):
            raise InputError(f"{where}: {name} must have {len(dims)} dims ({','.join(dims)}), "
                             f"got shape {list(x.shape)}")
        for letter, size in zip(dims, x.shape, strict=False):
            if sizes.setdefault(letter, size) != size:
                raise InputError(f"{where}: {name} has shape {list(x.shape)}, inconsistent with "
                                 f"{letter}={sizes[letter]} from the other tensors")
        check_float(f"{where}: {name}", x)
        check_finite(f"{where}: {name}", x)
    h, d, e = sizes["h"], sizes.get("d", sizes["e"] * sizes["h"]), sizes["e"]
    if min(h, d, e) < 1:
        raise InputError(f"{where}: empty weights (h={h}, d={d}, d_h={e})")
    if h * e != d:
        raise InputError(f"{where}: d % h != 0 or wrong head width: d={d}, h={h}, d_h={e} "
                         f"(need d = h*d_h)")


def layer_from_tensors(t: dict[str, Tensor], meta: dict[str, str], where: str = "layer") -> Layer:
    kind = _meta(meta, "kind", where)
    if kind not in SCHEMA:
        raise InputError(f"{where}: unknown kind {kind!r}; expected one of {sorted(SCHEMA)} or stack")
    _check_shapes(kind, t, where)
    t = {k: t[k].to(torch.float64) for k in (*SCHEMA[kind], *OPTIONAL.get(kind, {})) if k in t}
    if kind == "dot":
        return DotMHA(**t, residual=_flag(_meta(meta, "residual", where, "1"), "residual", where))
    if kind == "l2":
        return L2MHA(**t, residual=_flag(_meta(meta, "residual", where, "1"), "residual", where))
    act = _meta(meta, "activation", where, "relu")
    if act not in ACTIVATIONS:
        raise InputError(f"{where}: activation {act!r} is not one of {sorted(ACTIVATIONS)}")
    return OLSA(**t, alpha1=_positive(_meta(meta, "alpha1", where), "alpha1", where),
                alpha2=_positive(_meta(meta, "alpha2", where), "alpha2", where), activation=act,
                residual=_flag(_meta(meta, "residual", where, "0"), "residual", where))


def layer_to_tensors(layer: Layer) -> tuple[dict[str, Tensor], dict[str, str]]:
    names = (*SCHEMA[layer.kind], *OPTIONAL.get(layer.kind, {}))
    t = {k: getattr(layer, k).detach().cpu().contiguous() for k in names
         if getattr(layer, k) is not None}  # an absent bias is not written
    meta = {"kind": layer.kind, "residual": "1" if layer.residual else "0"}
    if isinstance(layer, OLSA):
        meta.update(alpha1=repr(layer.alpha1), alpha2=repr(layer.alpha2), activation=layer.activation)
    return t, meta


def save_layer(path: str | Path, layer: Layer | Stack) -> None:
    if isinstance(layer, Stack):
        tensors: dict[str, Tensor] = {}
        meta = {"kind": "stack", "depth": str(len(layer.blocks)),
                "R": "none" if layer.R is None else repr(layer.R)}
        for k, block in enumerate(layer.blocks):
            t, m = layer_to_tensors(block)
            tensors.update({f"blocks.{k}.{name}": x for name, x in t.items()})
            meta.update({f"blocks.{k}.{name}": v for name, v in m.items()})
    else:
        tensors, meta = layer_to_tensors(layer)
    save_tensors(path, tensors, meta)


def load_layer(path: str | Path) -> Layer | Stack:
    """Reads a layer or stack file, validating every tensor and metadata key (InputError if bad)."""
    tensors, meta = read_file(path)
    where = str(path)
    if _meta(meta, "kind", where) != "stack":
        return layer_from_tensors(tensors, meta, where)
    depth_s = _meta(meta, "depth", where)
    if not depth_s.isdigit() or int(depth_s) < 1:
        raise InputError(f"{where}: metadata 'depth' must be a positive integer, got {depth_s!r}")
    R_s = _meta(meta, "R", where)
    R = None if R_s == "none" else _positive(R_s, "R", where)
    depth = int(depth_s)
    present = set()
    for name in tensors:
        k, dot, _ = name.removeprefix("blocks.").partition(".")
        if not name.startswith("blocks.") or not dot or not k.isdigit():
            raise InputError(f"{where}: tensor {name!r} is not of the form blocks.<k>.<name>")
        present.add(int(k))
    if present != set(range(depth)):
        raise InputError(f"{where}: metadata 'depth' = {depth} but the file holds blocks "
                         f"{sorted(present)}; depth must equal the number of blocks, numbered from 0")
    blocks = []
    for k in range(depth):
        p = f"blocks.{k}."
        bt = {n[len(p):]: x for n, x in tensors.items() if n.startswith(p)}
        bm = {n[len(p):]: v for n, v in meta.items() if n.startswith(p)}
        blocks.append(layer_from_tensors(bt, bm, f"{where} block {k}"))
    if len({(b.kind, b.d) for b in blocks}) != 1:
        raise InputError(f"{where}: all blocks of a stack must share kind and d")
    return Stack(tuple(blocks), R=R)


def save_input(path: str | Path, X: Tensor) -> None:
    save_tensors(path, {"X": X.detach().cpu().contiguous()})


def load_input(path: str | Path) -> Tensor:
    """Reads ``X`` ([n, d] or [B, n, d]) from an input file, as float64."""
    tensors, _ = read_file(path)
    if "X" not in tensors:
        raise InputError(f"{path}: missing tensor 'X'")
    extra = sorted(set(tensors) - {"X"})
    if extra:
        raise InputError(f"{path}: unknown tensor {extra[0]!r}; an input file holds only 'X'")
    X = tensors["X"]
    check_float(f"{path}: X", X)
    if X.dim() not in (2, 3):
        raise InputError(f"{path}: X must be [n, d] or [B, n, d], got shape {list(X.shape)}")
    check_tokens(f"{path}: X", X)
    check_finite(f"{path}: X", X)
    return X.to(torch.float64)
