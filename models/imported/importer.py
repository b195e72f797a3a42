"""The import of a whole model: its source read, its attentions found on the user's batch, each read
as a DotMHA and checked against the runtime, and the files of ``python -m bench import`` written:
``layer{k}.safetensors`` (k in graph order from 0), ``layer{k}_input{i}.safetensors`` (the input X of
layer k at input i of the batch) and ``manifest.json``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError, check_finite
from ..io import save_input, save_layer, write_atomic
from . import detect, probe
from .graph import Float64Unavailable, Graph
from .inputs import fit

SOURCES = {".onnx": "onnx", ".pt2": "torch.export"}


@dataclass(frozen=True)
class Result:
    """The imported layers (graph order) and, per layer, its inputs X [n, d] in batch order."""

    layers: list[probe.Imported]
    inputs: list[list[Tensor]]


def digest(source: str | Path) -> str:
    """The sha256 (hex) that names a model file: of its bytes, and where an ONNX model keeps its
    tensors in files beside it (external data), of its bytes followed by each such file's name and
    bytes, so that new weights behind an unchanged .onnx name another model. InputError where a file
    the model names is missing."""
    source = Path(source)
    h = hashlib.sha256(source.read_bytes())
    if source.suffix == ".onnx":
        from .onnx_source import external_files

        for path in external_files(source):
            if not path.is_file():
                raise InputError(f"{source}: its tensors are stored in {path.name}, which is not beside it")
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def check_source(source: str | Path) -> Path:
    """The model file's path, refused before any work when it cannot be one."""
    source = Path(source)
    if source.suffix not in SOURCES:
        raise InputError(f"{source}: expected an ONNX model (.onnx) or a torch.export program (.pt2)")
    if not source.is_file():
        raise InputError(f"cannot read {source}: no such file")
    return source


def load(source: str | Path) -> Graph:
    """The graph of an ``.onnx`` or ``.pt2`` file (InputError for anything else)."""
    source = check_source(source)
    if source.suffix == ".onnx":
        from .onnx_source import load as load_onnx

        return load_onnx(source)
    from .export_source import load as load_pt2

    return load_pt2(source)


def _tensors(got: dict) -> dict[str, Tensor]:
    return {k: v for k, v in got.items() if isinstance(v, Tensor)}


def run(graph: Graph, given: dict[str, Tensor] | Tensor, where: str = "inputs") -> Result:
    """Imports every attention of ``graph`` at the batch ``given`` (InputError naming what is refused)."""
    feeds, batch, step = fit(graph, given, where)
    for name, t in feeds.items():
        if t.is_floating_point():
            check_finite(f"--inputs {where}: {name}", t)
    chunks = [{k: v[i:i + step] for k, v in feeds.items()} for i in range(0, batch, step)]
    every = [o for op in graph.ops for o in op.outputs if o]
    try:
        values = {**graph.weights, **chunks[0], **_tensors(graph.run(chunks[0], every, False))}
    except InputError:
        raise
    except Exception as e:  # the runtime's own error for inputs it cannot run (a token id out of range)
        raise InputError(f"the model does not run on --inputs {where} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    sites = detect.find(graph, values)
    if not sites:
        raise InputError("no softmax attention in the model (an explicit softmax of QKᵀ, or a fused "
                         "attention op)")
    recovered = [_recover(graph, site, values) for site in sites]
    wanted = sorted({n for s in sites for n in (s.x, s.ref)})
    errs = [[0.0, 0.0] for _ in sites]
    xs: list[list[Tensor]] = [[] for _ in sites]
    for chunk in chunks:
        got = graph.run(chunk, wanted, False)
        for k, (site, layer, float64) in enumerate(recovered):
            X = got[site.x]
            err, err_model = probe.check(graph, site, layer, X, got[site.ref], float64)
            errs[k] = [max(errs[k][0], err), max(errs[k][1], err_model)]
            xs[k] += list(probe.tokens(site, X).double())
    layers = []
    for k, (site, layer, float64) in enumerate(recovered):
        tol = probe.TOLERANCE[float64]
        if not errs[k][0] <= tol:
            raise InputError(f"attention at {site.name}: the imported layer reproduces the runtime only to "
                             f"{errs[k][0]:.3g} relative (more than {tol:g}); refused")
        layers.append(probe.Imported(layer, site, float64, errs[k][0], errs[k][1]))
    return Result(layers, xs)


def _recover(graph: Graph, site: detect.Site, values: dict[str, Tensor]) -> tuple:
    """(site, layer, whether in float64): probed in float64, else in the model's dtype where the
    runtime has no float64 kernel for some op of the attention's sub-graph."""
    try:
        try:
            return site, probe.recover(graph, site, values, float64=True)[0], True
        except Float64Unavailable:
            return site, probe.recover(graph, site, values, float64=False)[0], False
    except InputError:
        raise
    except Exception as e:  # the runtime cannot evaluate the sub-graph from X alone
        msg = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"attention at {site.name}: its queries, keys, values or output depend on more "
                         f"than its input {site.x} ({type(e).__name__}: {msg[:200]})") from None


def manifest(source: str | Path, result: Result) -> dict:
    """``{"source", "sha256", "layers": [...]}`` as README's "Your own model" describes."""
    source = Path(source)
    sha = digest(source)
    layers = []
    for k, imp in enumerate(result.layers):
        lay, s = imp.layer, imp.site
        layers.append({
            "node": s.name, "heads": lay.h, "d": lay.d, "d_h": lay.d_h, "residual": s.residual,
            "input": s.x, "output": s.ref, "n": int(result.inputs[k][0].shape[0]),
            "dtype": "float64" if imp.float64 else "model", "tolerance": probe.TOLERANCE[imp.float64],
            "max_rel_err": imp.max_rel_err, "max_rel_err_model_dtype": imp.max_rel_err_model,
            "files": {"layer": f"layer{k}.safetensors",
                      "inputs": [f"layer{k}_input{i}.safetensors" for i in range(len(result.inputs[k]))]},
        })
    return {"source": str(source), "format": SOURCES[source.suffix], "sha256": sha,
            "max_rel_err": "max over the inputs of max|F(X) - runtime| / max|runtime|, the runtime "
                           "evaluating the attention's sub-graph from the captured X in float64 (dtype "
                           "'float64') or in the model's dtype where it has no float64 kernel ('model')",
            "layers": layers}


def write(out: str | Path, source: str | Path, result: Result) -> Path:
    """Writes the layer, input and manifest files under ``out`` (created); returns the manifest's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for k, imp in enumerate(result.layers):
        save_layer(out / f"layer{k}.safetensors", imp.layer)
        for i, X in enumerate(result.inputs[k]):
            save_input(out / f"layer{k}_input{i}.safetensors", X)
    path = out / "manifest.json"
    write_atomic(path, json.dumps(manifest(source, result), indent=1) + "\n")
    return path


def import_module(module: torch.nn.Module, example: tuple, given: dict[str, Tensor] | Tensor) -> Result:
    """An in-process ``nn.Module``: exported by torch.export at ``example``, then imported at ``given``."""
    from .export_source import from_module

    return run(from_module(module, example), given)
