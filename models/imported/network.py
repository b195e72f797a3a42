"""A whole ViT read off an ONNX or torch.export file as the suite's ``standard`` ViT (models/vit.py), so
that ``certify`` certifies it with every network bound (docs/bounds.md §5.1, "Networks from a file").

The chain of stages is found in the graph and each stage's weights are read off the runtime by probes,
as ``bench import`` reads an attention's (models/imported/probe.py), never from the exporter's layout:

* the attentions (models/imported/detect.py), each pre-norm: ``X + A(norm₁(X))``, the sum found by
  following the attention's output to the add that takes the block's input X;
* the MLP branch after it, ``X + W₂ σ(W₁ norm₂(X) + b₁) + b₂``: the add that takes X and a value computed
  from X, its two linear maps and the activation between them (ReLU, GELU or its tanh form, told apart
  on a grid of values);
* every norm as a map of each token alone: an affine map per feature (BatchNorm in eval) or LayerNorm,
  fitted by least squares and its eps among the usual values;
* the embedding as an affine map of the pixels, which must be a p×p patch embedding shared by every
  patch with a learned position per token, and a class token (a token no pixel moves) first, if any;
* the head: the last linear map before the logits, on the class token after the final norm or on the
  mean of the normalized tokens.

Every fit is checked at points it was not fitted on, and the assembled network against the runtime's
own logits on the user's images (:data:`TOLERANCE`). Anything outside these stages is refused by name.
A per-channel ``mean`` and ``std`` the model expects its input normalized by are folded into the
embedding, so that ε is the ℓ2 radius over the image in [0, 1], as elsewhere in ``certify``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..vit import ACTIVATIONS, ViT, ViTConfig, activate
from . import detect, probe
from .graph import Float64Unavailable, Graph, Op

# the assembled network against the runtime's logits, relative to their size: a runtime evaluating in
# float64, or in the model's float32 (onnxruntime has no float64 Erf, so an exact-GELU model is float32)
TOLERANCE = {True: 1e-6, False: 1e-5}
FIT = {True: 1e-9, False: 1e-4}  # each stage's fit at fresh points, relative to its outputs' size
# LayerNorm's eps: the values frameworks use (torch's 1e-5, timm's 1e-6, BERT's 1e-12, ...)
LN_EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7, 1e-9, 1e-10, 1e-4, 1e-3, 0.0)
# the activations the MLP may have, told apart on a grid of values (models.vit.ACTIVATIONS)
ACTS = {name: functools.partial(activate, name) for name in ACTIVATIONS}
LINEAR = ("matmul", "linear")


@dataclass(frozen=True)
class Network:
    """The recovered ViT (float64, eval), whether every probe ran in float64, and how well its logits
    reproduce the runtime's on the user's images (max |Δ| / max |logits|)."""

    net: ViT
    float64: bool
    max_rel_err: float


def refuse(what: str) -> InputError:
    return InputError(f"the network is not a chain of the stages certify knows: {what} "
                      f"(docs/bounds.md §5.1, \"Networks from a file\")")


class _Reader:
    """The graph at one captured batch: runs of sub-graphs in float64 where the runtime can, and fits of
    token-wise maps by probes of that batch's shape."""

    def __init__(self, graph: Graph, feed: dict[str, Tensor]):
        self.graph, self.float64 = graph, True
        every = [o for op in graph.ops for o in op.outputs if o]
        got = graph.run(feed, every, False)
        self.values = {**graph.weights, **feed, **{k: v for k, v in got.items() if isinstance(v, Tensor)}}

    def run(self, given: dict[str, Tensor], wanted: str) -> Tensor:
        if self.float64:
            try:
                return self.graph.run(given, [wanted], True)[wanted].double()
            except Float64Unavailable:
                self.float64 = False
        like = self.values[next(iter(given))].dtype
        given = {k: v.to(like) for k, v in given.items()}
        return self.graph.run(given, [wanted], False)[wanted].double()

    def rows(self, src: str, dst: str, R: Tensor, where: str = "token") -> Tensor:
        """The map src → dst on the rows R [m, ·] of src, a run of src's captured shape at a time, each
        output row flattened. ``where`` puts each row: ``"token"`` alone in its own token (zeros
        elsewhere), ``"image"`` as a whole input (R [m, the rest of src's shape flattened]),
        ``"token0"`` in token 0 of a batch element (its other tokens as captured), ``"every"`` in every
        token of a batch element."""
        shape = self.values[src].shape
        base = self.values[src].double()
        per = math.prod(shape[:-1]) if where == "token" else shape[0]
        out = []
        for i in range(0, len(R), per):
            chunk = R[i:i + per]
            if where in ("token", "image"):
                Z = torch.zeros(per, *R.shape[1:], dtype=torch.float64)
                Z[:len(chunk)] = chunk
                Z = Z.reshape(shape)
            else:
                Z = base.clone()
                if where == "token0":
                    Z[:len(chunk), 0] = chunk
                else:
                    Z[:len(chunk)] = chunk[:, None]
            out.append(self.run({src: Z}, dst).reshape(per, -1)[:len(chunk)])
        return torch.cat(out)

    def probes(self, src: str, count: int, seed: int) -> Tensor:
        """``count`` rows like src's captured tokens: some of them, and random ones at their scale (a
        third of them with a small spread, where a norm's eps shows)."""
        X = self.values[src].double().reshape(-1, self.values[src].shape[-1])
        g = torch.Generator().manual_seed(seed)
        scale = float(X.std()) or 1.0
        R = torch.randn(count, X.shape[-1], generator=g, dtype=torch.float64) * scale
        R[: count // 3] *= 1e-3
        R = R + X.mean(0)
        return torch.cat([X[: count // 4], R])

    def close(self, got: Tensor, want: Tensor) -> float:
        return float((got - want).abs().max() / got.abs().max().clamp_min(1e-300))


def _affine(reader: _Reader, src: str, dst: str, what: str,
            where: str = "token") -> tuple[Tensor, Tensor]:
    """(W [d_in, d_out], b) of a token-wise affine map src → dst, read on the basis and checked."""
    d = reader.values[src].shape[-1]
    basis = torch.cat([torch.zeros(1, d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)])
    out = reader.rows(src, dst, basis, where)
    b, W = out[0], out[1:] - out[0]
    R = reader.probes(src, 16, 1)
    if reader.close(reader.rows(src, dst, R, where), R @ W + b) > FIT[reader.float64]:
        raise refuse(f"{what} is not one affine map of each token")
    return W, b


def _hat(Z: Tensor, e: float) -> Tensor:
    """Each row centred and scaled to unit mean square (with eps e): LayerNorm before γ and β."""
    Zc = Z - Z.mean(-1, keepdim=True)
    return Zc / (Zc.pow(2).mean(-1, keepdim=True) + e).sqrt()


def _ls(F: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b) [d] of the least-squares fit G_j ≈ a_j F_j + b_j, feature by feature."""
    Fc, Gc = F - F.mean(0), G - G.mean(0)
    a = (Fc * Gc).sum(0) / (Fc * Fc).sum(0).clamp_min(1e-300)
    return a, G.mean(0) - a * F.mean(0)


def _norm(reader: _Reader, src: str, dst: str, what: str, where: str = "token") -> tuple:
    """:func:`_fit` of the token-wise norm src → dst on probes of src's tokens (placed as
    :meth:`_Reader.rows` says)."""
    d = reader.values[src].shape[-1]
    R, T = reader.probes(src, 4 * d + 16, 2), reader.probes(src, 2 * d, 3)[d // 2:]
    return _fit(reader, R, reader.rows(src, dst, R, where), T, reader.rows(src, dst, T, where), what)


def _fit(reader: _Reader, R: Tensor, Y: Tensor, T: Tensor, YT: Tensor, what: str) -> tuple:
    """("batch", a, b) or ("layer", γ, β, eps): the norm mapping rows R to Y, fitted by least squares
    per feature (an affine map per feature, BatchNorm in eval; else LayerNorm at each eps of
    :data:`LN_EPS`) and checked on the rows T and their images YT."""
    tol = FIT[reader.float64]
    a, b = _ls(R, Y)
    if reader.close(YT, T * a + b) <= tol:
        return ("batch", a, b)
    fits = {e: _ls(_hat(R, e), Y) for e in LN_EPS}
    errs = {e: reader.close(YT, _hat(T, e) * g + beta) for e, (g, beta) in fits.items()}
    best = min(errs, key=errs.get)
    if errs[best] > tol:
        raise refuse(f"{what} is neither an affine map per feature (BatchNorm in eval) nor a LayerNorm "
                     f"(relative error {errs[best]:.2g})")
    return ("layer", *fits[best], best)


def _consumers(graph: Graph, value: str, kind: str) -> list[Op]:
    return [op for op in graph.consumers.get(value, []) if op.kind == kind]


def _follow(graph: Graph, value: str) -> str:
    """``value`` moved through the layout and pass ops it alone feeds (a transpose back from
    nn.MultiheadAttention's [n, B, d], a dropout, an identity)."""
    while True:
        nxt = [op for op in graph.consumers.get(value, []) if op.kind in ("layout", "pass")]
        if len(graph.consumers.get(value, [])) != 1 or not nxt:
            return value
        value = nxt[0].output


def _residual(graph: Graph, out: str, what: str) -> tuple[str, str]:
    """(the block input X, the sum X + out) of the add that takes ``out``."""
    out = _follow(graph, out)
    adds = _consumers(graph, out, "add")
    if len(adds) != 1:
        raise refuse(f"{what}'s output is not added to the block's input (post-norm blocks, LN(x + f(x)), "
                     f"are not a stage)")
    other = [v for v in adds[0].inputs if v != out]
    if len(other) != 1 or other[0] in graph.constant:
        raise refuse(f"{what}'s output is added to a constant, not to the block's input")
    return other[0], adds[0].output


def _token_value(graph: Graph, reader: _Reader, site: detect.Site) -> str:
    """The attention's input as [B, n, d]: site.x, or the value before the transpose to [n, B, d]."""
    if not site.seq_first:
        return site.x
    op = graph.producer.get(site.x)
    if op is None or op.kind != "layout":
        raise refuse(f"attention at {site.name} takes [n, B, d] tokens from no transpose")
    return graph.variable_inputs(op)[0]


def _mlp(graph: Graph, reader: _Reader, R: str, k: int) -> tuple[str, dict]:
    """(the block's output, its MLP branch's parts) for the sum R + branch(R) that follows block k's
    attention."""
    for add in _consumers(graph, R, "add"):
        other = [v for v in add.inputs if v != R]
        if len(other) == 1 and other[0] not in graph.constant and R in graph.ancestors(other[0]):
            F = other[0]
            break
    else:
        raise refuse(f"block {k}: no residual MLP x + f(norm(x)) after its attention")
    ops = graph.between(R, F)
    linear = [op for op in ops if op.kind in LINEAR and any(v in graph.constant for v in op.inputs if v)]
    if len(linear) != 2:
        raise refuse(f"block {k}: its MLP has {len(linear)} linear maps (two, with one activation between "
                     f"them, are a stage)")
    u, a = graph.variable_inputs(linear[0])[0], graph.variable_inputs(linear[1])[0]
    h = linear[0].output
    while True:  # the first map's bias, where an exporter adds it apart
        nxt = graph.consumers.get(h, [])
        if len(nxt) == 1 and nxt[0].kind == "add" and any(v in graph.constant for v in nxt[0].inputs if v):
            h = nxt[0].output
            continue
        break
    norm = _norm(reader, R, u, f"block {k}'s second norm")
    W1, b1 = _affine(reader, u, h, f"block {k}'s first MLP map")
    W2, b2 = _affine(reader, a, F, f"block {k}'s second MLP map")
    z = torch.linspace(-6, 6, 4 * W1.shape[1] + 1, dtype=torch.float64)[:, None].expand(-1, W1.shape[1])
    got = reader.rows(h, a, z.contiguous())
    act = min(ACTS, key=lambda n: reader.close(got, ACTS[n](z)))
    err = reader.close(got, ACTS[act](z))
    if err > FIT[reader.float64]:
        raise refuse(f"block {k}: its MLP's activation is not ReLU, GELU or GELU's tanh form (relative "
                     f"error {err:.2g} to the nearest, {act})")
    return add.output, {"norm": norm, "W1": W1, "b1": b1, "W2": W2, "b2": b2, "act": act}


def _outputs(graph: Graph, reader: _Reader) -> str:
    ends = [op.output for op in graph.ops if not graph.consumers.get(op.output) and op.kind != "shape"
            and op.output not in graph.constant and reader.values[op.output].dim() == 2]
    if len(ends) != 1:
        raise refuse(f"the model has {len(ends)} outputs (one, the logits, is a classifier's)")
    return ends[0]


def _head(graph: Graph, reader: _Reader, X: str, logits: str) -> tuple[str, tuple, Tensor, Tensor]:
    """(pooling, the final norm, W [d, classes], b) of the map from the last block's output X."""
    last = [op for op in graph.between(X, logits) if op.kind in LINEAR
            and any(v in graph.constant for v in op.inputs if v)]
    if not last:
        raise refuse("no linear head before the logits")
    f = graph.variable_inputs(last[-1])[0]
    if reader.values[f].dim() != 2 or reader.values[logits].dim() != 2:
        raise refuse("the head does not map one feature vector per image to one logit per class")
    W, b = _affine(reader, f, logits, "the head")
    base = reader.values[X].double()
    Z = base.clone()
    Z[:, 1:] += torch.randn(Z[:, 1:].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    moved = reader.close(reader.run({X: Z}, f), reader.run({X: base}, f))
    if moved <= FIT[reader.float64]:  # the features read token 0 alone: the class token
        return "cls", _norm(reader, X, f, "the final norm", where="token0"), W, b
    # mean pooling: on equal tokens the features are the norm of that token
    return "mean", _norm(reader, X, f, "the final norm", where="every"), W, b


def _embedding(graph: Graph, reader: _Reader, inp: str, X0: str,
               side: int) -> tuple[int, bool, Tensor, Tensor]:
    """(patch p, class token?, E [p², d], t0 [n, d]) of the affine map from the model's input to the
    first block's input, checked to be a p×p patch embedding."""
    P = side * side
    eye = torch.cat([torch.zeros(1, P, dtype=torch.float64), torch.eye(P, dtype=torch.float64)])
    out = reader.rows(inp, X0, eye, where="image").reshape(P + 1, *reader.values[X0].shape[1:])
    t0, M = out[0], out[1:] - out[0]
    live = M.abs().amax(-1) > 0  # [P, n]
    free = ~live.any(0)
    cls = bool(free[0]) and int(free.sum()) == 1
    if int(free.sum()) > cls:
        raise refuse("the embedding has tokens no pixel moves other than a class token first")
    n = M.shape[1] - cls
    p = math.isqrt(P // n) if n and P % n == 0 else 0
    if p * p * n != P or side % p:
        raise refuse(f"the embedding's {n} tokens are not p×p patches of the {side}×{side} image")
    g = side // p
    # token t, pixel j of its patch ↔ image pixel (row-major patches, as models/vit.py's)
    rows = torch.arange(side).reshape(g, p)
    pix = (rows[:, None, :, None] * side + rows[None, :, None, :]).reshape(g * g, p * p)  # [n, p²]
    E = M[pix[0], int(cls)]  # [p², d]: the first patch's
    want = torch.zeros_like(M)
    want[pix.reshape(-1), (torch.arange(n) + cls).repeat_interleave(p * p)] = E.repeat(n, 1)
    err = reader.close(M, want)
    if err > FIT[reader.float64]:
        raise refuse(f"the embedding is not one p×p patch map shared by every patch (p = {p}, relative "
                     f"error {err:.2g}: overlapping or unequal patches)")
    return p, cls, E, t0


def recover_network(graph: Graph, images: Tensor, mean: float = 0.0, std: float = 1.0) -> Network:
    """The network of ``graph`` as a standard ViT taking ``images`` [B, H, W] in [0, 1] (the model's
    input being (images − mean)/std, with a channel axis where it has one), checked against the
    runtime's logits on them. InputError names the first stage that is not one certify knows."""
    if len(graph.inputs) != 1:
        raise refuse(f"the model takes {len(graph.inputs)} inputs (an image classifier takes one)")
    name, (shape, dtype) = next(iter(graph.inputs.items()))
    if not dtype.is_floating_point:
        raise refuse("the model's input is not an image (it takes integers)")
    side = images.shape[-1]
    lay = (lambda x: x[:, None]) if len(shape) == 4 else (lambda x: x)
    if len(shape) not in (3, 4) or (len(shape) == 4 and shape[1] not in (1, None)):
        raise refuse(f"the model's input has shape {list(shape)}: one channel of [B, 1, H, W] or [B, H, W]")
    norm = lambda x: lay((x.double() - mean) / std)
    batch = shape[0] if shape[0] is not None else min(len(images), 16)
    if len(images) < batch:
        raise InputError(f"the model takes batches of {batch} images; the data holds {len(images)}")
    reader = _Reader(graph, {name: norm(images[:batch]).to(dtype)})
    sites = detect.find(graph, reader.values)
    if not sites:
        raise refuse("no attention in the model")
    if any(s.residual for s in sites):
        raise refuse("a post-norm attention, LN(x + attn(x))")
    blocks, X_prev, first = [], None, None
    for k, site in enumerate(sites):
        try:
            layer, _ = probe.recover(graph, site, reader.values, reader.float64)
        except Float64Unavailable:
            reader.float64 = False
            layer, _ = probe.recover(graph, site, reader.values, False)
        X, R = _residual(graph, site.out, f"attention {k}")
        if X_prev is not None and X != X_prev:
            raise refuse(f"something other than a block lies between blocks {k - 1} and {k}")
        first = X if first is None else first
        norm1 = _norm(reader, X, _token_value(graph, reader, site), f"block {k}'s first norm")
        X_prev, parts = _mlp(graph, reader, R, k)
        blocks.append((layer, norm1, parts))
    logits = _outputs(graph, reader)
    pool, final, W_head, b_head = _head(graph, reader, X_prev, logits)
    p, cls, E, t0 = _embedding(graph, reader, name, first, side)
    if (pool == "cls") != cls:
        raise refuse("the head reads the first token, which is not a class token" if pool == "cls"
                     else "a class token that the head does not read (mean pooling over it)")
    norms = [b[1] for b in blocks] + [b[2]["norm"] for b in blocks] + [final]
    kinds = {nm[0] for nm in norms}
    if len(kinds) != 1 or len({nm[3] for nm in norms if nm[0] == "layer"}) > 1:
        raise refuse("the norms differ in kind or eps (one kind of norm throughout is a stage)")
    layer0 = blocks[0][0]
    acts = {b[2]["act"] for b in blocks}
    if len(acts) != 1:
        raise refuse("the blocks' activations differ")
    kind = kinds.pop()
    cfg = ViTConfig(image=side, classes=W_head.shape[1], d=layer0.d, depth=len(blocks), heads=layer0.h,
                    patch=p, ffn=blocks[0][2]["W1"].shape[1], variant="standard", constraint=None,
                    ffn_constraint=None, activation=acts.pop(), norm=kind,
                    norm_eps=norms[0][3] if kind == "layer" and norms[0][3] > 0 else 1e-5,
                    pool=pool, bias=True)
    if kind == "layer" and norms[0][3] == 0:
        raise refuse("LayerNorm without eps (not Lipschitz where a token's variance is 0)")
    net = _assemble(cfg, blocks, final, E, t0, cls, W_head, b_head, mean, std)
    err = _check(graph, net, images, norm, name, dtype, batch, logits, reader.float64)
    if err > TOLERANCE[reader.float64]:
        raise InputError(f"the recovered network reproduces the runtime's logits only to {err:.3g} relative "
                         f"(more than {TOLERANCE[reader.float64]:g}); refused")
    return Network(net, reader.float64, err)


def _set_norm(module, spec: tuple) -> None:
    with torch.no_grad():
        if spec[0] == "batch":  # a ⊙ x + b as BatchNorm in eval: mean 0, var 1 − eps... held as γ
            module.running_mean.zero_()
            module.running_var.fill_(1.0)
            module.weight.copy_(spec[1] * math.sqrt(1.0 + module.eps))
            module.bias.copy_(spec[2])
        else:
            module.weight.copy_(spec[1])
            module.bias.copy_(spec[2])


def _assemble(cfg: ViTConfig, blocks, final, E, t0, cls: bool, W_head, b_head, mean: float,
              std: float) -> ViT:
    with torch.random.fork_rng(devices=[]):
        net = ViT(cfg, constrained=False).double()
    with torch.no_grad():
        # tokens = M((x − mean)/std) + t0 = (M/std)x + t0 − (mean/std)·M1: patches @ (E/std), and the
        # constant per token (a patch's pixels sum E's rows)
        net.embed.weight.copy_((E / std).T)
        pos = t0.clone()
        pos[int(cls):] -= (mean / std) * E.sum(0)
        if cls:
            net.cls.copy_(pos[:1])
            pos[0] = 0
        net.pos.copy_(pos)
        for block, (layer, norm1, parts) in zip(net.blocks, blocks, strict=True):
            for name in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"):
                value = getattr(layer, name)
                if value is None:
                    getattr(block.attn, name).zero_()
                else:
                    getattr(block.attn, name).copy_(value)
            _set_norm(block.norm, norm1)
            _set_norm(block.norm2, parts["norm"])
            block.ffn.up.weight.copy_(parts["W1"].T)
            block.ffn.up.bias.copy_(parts["b1"])
            block.ffn.down.weight.copy_(parts["W2"].T)
            block.ffn.down.bias.copy_(parts["b2"])
        _set_norm(net.norm, final)
        net.head.weight.copy_(W_head.T)
        net.head.bias.copy_(b_head)
    return net.eval()


def _check(graph: Graph, net: ViT, images: Tensor, norm, name: str, dtype, batch: int, logits: str,
           float64: bool) -> float:
    """max |net − runtime| / max |runtime| over the logits of every image (the runtime in float64 where
    it has the kernels, else in the model's dtype; the network in float64)."""
    worst, size = 0.0, 0.0
    for i in range(0, len(images) - batch + 1, batch):
        x = images[i:i + batch]
        ref = graph.run({name: norm(x).to(torch.float64 if float64 else dtype)}, [logits], float64)[logits]
        ref = ref.double()
        with torch.no_grad():
            got = net(x.double())
        worst, size = max(worst, float((got - ref).abs().max())), max(size, float(ref.abs().max()))
    return worst / max(size, 1e-300)
