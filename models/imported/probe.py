"""Reads an attention's weights off the runtime: the affine maps X → Q, K, V and context → O probed
on basis perturbations, checked affine at random points, assembled as the suite's DotMHA
(docs/bounds.md §1.1, with the biases of §1.5) and checked against the runtime's own output.

A map f is affine per token when ``f(Z)_t = z_t W + b`` for every token t: with ``Z = 0`` each token's
output is b, and with ``e_j`` at token t (zeros elsewhere) token t's output is ``W_j + b``, so one
run reads n rows of W. The runtime evaluates in float64 where it has the kernels (the sub-graph from
X is widened: models/imported/onnx_source.py, export_source.py), else in the model's dtype, and the
tolerance of the checks says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..layers import DotMHA
from .detect import Site
from .graph import Graph

TOLERANCE = {True: 1e-6, False: 1e-5}  # the check's relative error: float64 runtime, float32 runtime
AFFINE_TOL = {True: 1e-9, False: 1e-4}  # the affinity check's, relative to the outputs' size


@dataclass(frozen=True)
class Imported:
    """An imported layer, where it came from, and how well it reproduces the runtime."""

    layer: DotMHA
    site: Site
    float64: bool
    max_rel_err: float  # against the runtime's own output in float64 (or the model's dtype)
    max_rel_err_model: float  # against the whole model's run in its own dtype


def tokens(site: Site, X: Tensor) -> Tensor:
    """The attention's input as [B, n, d], from its value in the graph's layout."""
    return X.transpose(0, 1) if site.seq_first else X


def _graph_layout(site: Site, Z: Tensor) -> Tensor:
    return Z.transpose(0, 1).contiguous() if site.seq_first else Z


def _heads(t: Tensor, batch: int) -> Tensor:
    """[*lead, n, e] → [B, h, n, e], the batch outermost in the lead dims."""
    return t.reshape(batch, -1, *t.shape[-2:])


def _affine(run, shape: tuple[int, ...], rows: int, put, read, like: Tensor) -> tuple[Tensor, Tensor]:
    """(W [rows, m], b [m]) of a token-wise affine map: ``run(Z)`` for Z of ``shape`` whose tokens
    each hold ``rows`` inputs, ``put(Z, t, j)`` sets input j of token t to 1, ``read(out, t)`` is token
    t's output [m]."""
    n = shape[-2]
    base = run(torch.zeros(shape, dtype=like.dtype))
    W = []
    for start in range(0, rows, n):
        Z = torch.zeros(shape, dtype=like.dtype)
        js = range(start, min(start + n, rows))
        for t, j in enumerate(js):
            put(Z, t, j)
        out = run(Z)
        W += [read(out, t) - read(base, t) for t in range(len(js))]
    return torch.stack(W), read(base, 0)


def recover(graph: Graph, site: Site, values: dict[str, Tensor], float64: bool) -> tuple[DotMHA, int]:
    """(the layer, the batch size of one run) read by probing; InputError when a map is not affine."""
    X = tokens(site, values[site.x])
    B, n, d = X.shape
    dtype = torch.float64 if float64 else X.dtype

    def qkv(Z: Tensor) -> Tensor:  # [B, h, n, 3·d_h]: each head's query, key and value side by side
        out = graph.run({site.x: _graph_layout(site, Z)}, [site.q, site.k, site.v], float64)
        k = out[site.k].transpose(-1, -2) if site.k_transposed else out[site.k]
        return torch.cat([_heads(out[site.q], B), _heads(k, B), _heads(out[site.v], B)], -1)

    like = torch.zeros((), dtype=dtype)
    def put_x(Z: Tensor, t: int, j: int) -> None:
        Z[:, t, j] = 1

    W3, b3 = _affine(qkv, (B, n, d), d, put_x, lambda out, t: out[0, :, t, :].reshape(-1), like)
    h = _heads(values[site.q], B).shape[1]
    e = W3.shape[1] // (3 * h)
    W3, b3 = W3.reshape(d, h, 3, e), b3.reshape(h, 3, e)
    maps = {m: (W3[:, :, i].reshape(d, h * e), b3[:, i].reshape(h * e)) for i, m in enumerate("qkv")}
    C = values[site.context]

    def out_run(Z: Tensor) -> Tensor:
        return graph.run({site.context: Z.reshape(C.shape)}, [site.out], float64)[site.out].reshape(B, n, -1)

    def put_c(Z: Tensor, t: int, j: int) -> None:  # unit j of a token's heads-major context
        Z[:, j // e, t, j % e] = 1

    W_o, b_o = _affine(out_run, (B, h, n, e), h * e, put_c, lambda out, t: out[0, t, :], like)
    if W_o.shape[1] != d:
        raise InputError(f"attention at {site.name}: its output has width {W_o.shape[1]}, its input {d}")

    def per_head(W: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:  # [d, h·e], [h·e] → [h, d, e], [h, e]
        return W.reshape(d, h, e).permute(1, 0, 2).contiguous(), b.reshape(h, e)

    (W_q, b_q), (W_k, b_k), (W_v, b_v) = (per_head(*maps[m]) for m in ("q", "k", "v"))
    # DotMHA's logits are Q Kᵀ / √d_h; the graph's are c·Q Kᵀ: the factor c·√d_h goes into W^Q, b_q
    # (exactly 1 for a fused attention at its default scale)
    s = site.factor * math.sqrt(e)
    s = 1.0 if abs(s - 1.0) < 1e-15 else s
    layer = DotMHA(W_q * s, W_k, W_v, W_o.reshape(h, e, d), residual=site.residual, b_q=b_q * s, b_k=b_k,
                   b_v=b_v, b_o=b_o)
    _check_affine(graph, site, values, layer, maps, (W_o, b_o), float64, B)
    return layer.to(torch.zeros((), dtype=torch.float64)), B


def _check_affine(graph, site, values, layer, maps, out_map, float64: bool, B: int) -> None:
    """Refuses a layer whose maps are not one affine map per token: at the captured X plus noise of
    its own size, every token's Q, K, V (and O from a random context) must equal z W + b."""
    X = tokens(site, values[site.x])
    dtype = torch.float64 if float64 else X.dtype
    g = torch.Generator().manual_seed(0)
    Zb = X.to(dtype) + X.abs().max() * torch.randn(X.shape, generator=g, dtype=dtype)
    out = graph.run({site.x: _graph_layout(site, Zb)}, [site.q, site.k, site.v], float64)
    for name, key in (("queries", "q"), ("keys", "k"), ("values", "v")):
        got = out[getattr(site, key)]
        if key == "k" and site.k_transposed:
            got = got.transpose(-1, -2)
        got = _heads(got, B)
        W, b = maps[key]
        want = (Zb @ W.to(dtype) + b.to(dtype)).reshape(B, Zb.shape[1], got.shape[1], -1).transpose(1, 2)
        _close(site, name, got, want, float64)
    C = values[site.context]
    Zc = torch.randn(C.shape, generator=g, dtype=dtype) * C.abs().max().to(dtype)
    got = graph.run({site.context: Zc}, [site.out], float64)[site.out].reshape(B, Zb.shape[1], -1)
    Cb = _heads(Zc, B).transpose(1, 2).reshape(B, Zb.shape[1], -1)  # tokens × (heads · d_h)
    W_o, b_o = out_map
    _close(site, "output", got, Cb @ W_o.to(dtype) + b_o.to(dtype), float64)


def _close(site: Site, name: str, got: Tensor, want: Tensor, float64: bool) -> None:
    err = float((got.double() - want.double()).abs().max() / got.double().abs().max().clamp_min(1e-300))
    if not err <= AFFINE_TOL[float64]:
        raise InputError(f"attention at {site.name}: its {name} are not one affine map of the input shared "
                         f"by every token (relative error {err:.2g}): a position-dependent term such as "
                         f"rotary embeddings, or a mix across tokens, is not supported")


def check(graph: Graph, site: Site, layer: DotMHA, X: Tensor, model_ref: Tensor, float64: bool) -> tuple:
    """(max relative error against the runtime's float64 (or model-dtype) output, and against the
    whole model's run) of the layer at one captured input X (the graph's layout):
    max |F(X) − ref| / max |ref|."""
    ref = graph.run({site.x: X}, [site.ref], float64)[site.ref].double()
    F = layer(tokens(site, X).double()).reshape(ref.shape)
    err = float((F - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    err_model = float((F - model_ref.double().reshape(ref.shape)).abs().max()
                      / model_ref.double().abs().max().clamp_min(1e-300))
    return err, err_model
