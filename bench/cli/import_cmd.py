"""``python -m bench import SOURCE --inputs FILE --out DIR``: every softmax attention of an ONNX model
or a torch.export program as a layer file, with its inputs at the user's batch and a manifest
(models/imported/)."""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
from pathlib import Path

from models import InputError

from .train_cmd import check_writable

# what an import directory holds: an existing --out with anything else is not overwritten even with --force
OWN = re.compile(r"layer\d+(_input\d+)?\.safetensors|manifest\.json")


def add_parser(sub) -> None:
    im = sub.add_parser("import", help="the attention layers of an ONNX model or a torch.export program, "
                                       "with their inputs at a batch of yours (pip install "
                                       "'attnbounds[import]' for ONNX)")
    im.add_argument("source", help="the model: .onnx (ONNX) or .pt2 (torch.export.save)")
    im.add_argument("--inputs", required=True,
                    help="a batch of the model's inputs (.pt, .npy or .safetensors; token ids allowed), "
                         "the batch along the first axis")
    im.add_argument("--out", required=True, help="directory of layer{k}.safetensors, "
                                                 "layer{k}_input{i}.safetensors and manifest.json")
    im.add_argument("--force", action="store_true",
                    help="replace an --out that holds a previous import (refused otherwise)")


def check_out(out: Path, force: bool) -> None:
    """--out, checked before any work: absent or empty, or (with --force) a previous import."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise InputError(f"--out {out}: exists and is not empty; pass --force to replace a previous "
                             f"import, or choose another --out")
        other = sorted(p.name for p in out.iterdir() if not OWN.fullmatch(p.name))
        if other:
            raise InputError(f"--out {out}: holds {other[0]!r}, which no import writes; --force replaces "
                             f"only a previous import's directory")
    check_writable(out.parent, f"--out {out}")  # the import is written beside --out, then renamed


def run(args: argparse.Namespace) -> int:
    from models.imported import load, run, write
    from models.imported.importer import check_source
    from models.imported.inputs import check_path, read

    out = Path(args.out)
    check_out(out, args.force)
    check_source(args.source)
    inputs = check_path(args.inputs)
    given = read(inputs)
    result = run(load(args.source), given, str(inputs))
    # whole or not at all: written into a fresh directory beside --out, which then takes its place
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp, args.source, result)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k, imp in enumerate(result.layers):
        s = imp.site
        print(f"layer{k}: {s.name}, h={imp.layer.h}, d={imp.layer.d}, d_h={imp.layer.d_h}, "
              f"{'residual' if s.residual else 'bare'}, {len(result.inputs[k])} inputs, max_rel_err "
              f"{imp.max_rel_err:.2g} ({'float64' if imp.float64 else 'model dtype'})")
    print(f"manifest: {out / 'manifest.json'}")
    return 0
