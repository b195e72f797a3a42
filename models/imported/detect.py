"""Finds every softmax attention of a Graph and what surrounds it, or refuses it by name.

An attention is a softmax over the last axis of ``c·(Q Kᵀ)`` (c a product of scalar constants, on
either side of the product) followed by ``P V``, or a fused attention op (torch's
scaled_dot_product_attention, ONNX's Attention). Around it: X, the latest value of the model's width
from which queries, keys and values are all computed (the tensor entering the attention), and O, the
last value of the affine chain that leaves the context ``P V`` (the output projection). The layer is
residual when O is next added to X itself (post-norm, BERT), bare otherwise (pre-norm, where the sum
takes the un-normalized token): docs/bounds.md §1.1, §1.5.

Whatever the layer math of docs/bounds.md §1.1 does not cover is refused with its name: masks (causal,
padding), additive logit biases (relative-position, ALiBi), qk-norm, rotary embeddings,
cross-attention, talking heads, grouped-query attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from .graph import AFFINE, Graph, Op


@dataclass(frozen=True)
class Site:
    """One attention: value names of its queries ``q`` ([..., n, d_h]), keys ``k`` ([..., d_h, n] when
    ``k_transposed``), values ``v``, context ``context`` = P V, input ``x``, the output projection's
    result ``out`` ([B, n, d]), and ``ref``, what the layer computes (``out``, or ``x + out`` when
    ``residual``); ``factor`` multiplies Q Kᵀ in the logits."""

    name: str
    q: str
    k: str
    v: str
    k_transposed: bool
    context: str
    factor: float
    x: str
    out: str
    ref: str
    residual: bool
    seq_first: bool = False  # x is [n, B, d] (nn.MultiheadAttention's default layout), not [B, n, d]


def refuse(op: Op, what: str) -> InputError:
    return InputError(f"attention at {op.name}: refused: {what} (the layer math of docs/bounds.md §1.1 "
                      f"does not cover it, and the import never approximates)")


def scalar(graph: Graph, values: dict[str, Tensor], op: Op) -> float | None:
    """The scalar constant operand of a mul/div with one variable input, or None."""
    if len(graph.variable_inputs(op)) != 1:
        return None
    consts = [v for v in op.inputs if v is not None and v in graph.constant]
    if not consts:
        s = op.attrs.get("scalars", [])
        return float(s[0]) if len(s) == 1 else None
    if len(consts) == 1:
        t = values.get(consts[0], graph.weights.get(consts[0]))
        if t is not None and t.numel() == 1:
            return float(t.reshape(()))
    return None


def _keeps_last_two(values: dict[str, Tensor], op: Op, src: str) -> bool:
    a, b = values.get(src), values.get(op.output)
    return a is not None and b is not None and a.shape[-2:] == b.shape[-2:] and a.numel() == b.numel()


def _weighs_values(graph: Graph, sm: Op, depth: int = 6) -> bool:
    """Whether the softmax's probabilities reach, within ``depth`` ops, the left side of a product of
    two variable values (P V): what makes a softmax an attention's rather than a classifier's."""
    frontier = [sm.output]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for op in graph.consumers.get(v, []):
                if op.kind == "matmul" and op.inputs[0] == v and len(graph.variable_inputs(op)) == 2:
                    return True
                nxt.extend(op.outputs)
        frontier = nxt
    return False


def _bias_name(graph: Graph, values: dict[str, Tensor], op: Op) -> str:
    """What an additive term on the logits is: a mask, ALiBi or a relative-position bias."""
    other = [v for v in op.inputs if v is not None and v in graph.constant]
    if not other:
        return "an attention mask or bias computed from the model's inputs (a padding mask)"
    b = values.get(other[0], graph.weights.get(other[0]))
    if b is None:
        return "an additive term on the logits (relative-position bias or a mask)"
    b = b.double()
    if bool((b < -1e4).any()) or not bool(torch.isfinite(b).all()):
        n = b.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        blocked = (b < -1e4) | ~torch.isfinite(b)
        causal = b.dim() >= 2 and b.shape[-2] == n and bool((blocked == upper).all())
        return "a causal attention mask" if causal else "an attention mask"
    if b.dim() >= 2 and b.shape[-1] == b.shape[-2] and b.shape[-1] > 1:
        i = torch.arange(b.shape[-1], dtype=torch.float64)
        for dist in (i[None, :] - i[:, None], -(i[None, :] - i[:, None]).abs()):
            slope = b[..., :1, 1:2] / dist[0, 1]  # ALiBi: per head, a slope times the distance
            if bool((slope != 0).any()) and bool(torch.allclose(b, slope * dist, atol=1e-6)):
                return "ALiBi (a linear distance bias on the logits)"
    return "a relative-position bias (a term added to the logits)"


def _zero_term(graph: Graph, values: dict[str, Tensor], op: Op) -> bool:
    """Whether an add/sub on the logits adds a constant that is zero everywhere."""
    consts = [v for v in op.inputs if v is not None and v in graph.constant]
    t = values.get(consts[0], graph.weights.get(consts[0])) if len(consts) == 1 else None
    return t is not None and len(graph.variable_inputs(op)) == 1 and not bool(t.any())


def _mask_name(graph: Graph, values: dict[str, Tensor], op: Op) -> str:
    """A where/masked_fill on the logits: causal when its constant condition is triangular."""
    for c in (v for v in op.inputs if v is not None and v in graph.constant):
        t = values.get(c, graph.weights.get(c))
        if t is not None and t.dtype == torch.bool and t.dim() >= 2 and t.shape[-1] == t.shape[-2] > 1:
            tri = torch.ones(t.shape[-2:], dtype=torch.bool)
            if bool((t == tri.triu(1)).all()) or bool((t == tri.tril()).all()):
                return "a causal attention mask (where/masked_fill on the logits)"
    return "an attention mask (where/masked_fill on the logits)"


def _logits(graph: Graph, values: dict[str, Tensor], sm: Op) -> tuple[Op, float]:
    """(the Q Kᵀ product, the factor c) above an attention's softmax; InputError naming what sits
    between them otherwise."""
    cur, factor = graph.variable_inputs(sm)[0], 1.0
    while True:
        op = graph.producer.get(cur)
        if op is None:
            raise refuse(sm, f"a softmax of the model's input {cur!r} (no QKᵀ product above it)")
        var = graph.variable_inputs(op)
        if op.kind == "matmul" and len(var) == 2:
            return op, factor
        if op.kind == "matmul" and len(var) == 1:
            raise refuse(sm, "cross-attention (queries or keys that are constants: a learned query, as "
                             "in attention pooling)")
        c = scalar(graph, values, op) if op.kind in ("mul", "div") else None
        if c is not None and c != 0:
            factor = factor * c if op.kind == "mul" else factor / c
        elif op.kind == "pass" or (op.kind == "layout" and len(var) == 1
                                   and _keeps_last_two(values, op, var[0])):
            pass
        elif op.kind == "where":
            raise refuse(sm, _mask_name(graph, values, op))
        elif op.kind in ("add", "sub") and _zero_term(graph, values, op):
            pass  # an all-zero constant (a mask of all ones, made additive) changes no bit: x + 0 == x
        elif op.kind in ("add", "sub"):
            raise refuse(sm, _bias_name(graph, values, op))
        elif op.kind in ("matmul", "linear", "layout") or "einsum" in op.target.lower():
            raise refuse(sm, f"talking heads (the logits mixed across heads by {op.target})")
        else:
            raise refuse(sm, f"the operation {op.target} ({op.name}) between QKᵀ and the softmax")
        if len(var) != 1:
            raise refuse(sm, f"the operation {op.target} ({op.name}) between QKᵀ and the softmax")
        cur = var[0]


def _values_product(graph: Graph, sm: Op) -> Op:
    """The P V product below a softmax (InputError naming what sits between them)."""
    cur = sm.output
    while True:
        cons = graph.consumers.get(cur, [])
        pv = [op for op in cons if op.kind == "matmul" and op.inputs[0] == cur
              and len(graph.variable_inputs(op)) == 2]
        if pv:
            return pv[0]
        # torch's safe softmax as ONNX writes it: Where(IsNaN(P), 0, P) is P wherever P has no NaN,
        # which a softmax of finite logits never has
        passes = [op for op in cons if op.kind == "pass" or (
            op.target == "Where" and op.inputs[2] == cur and op.inputs[0] in graph.producer
            and graph.producer[op.inputs[0]].target == "IsNaN"
            and graph.producer[op.inputs[0]].inputs[0] == cur)]
        if passes:
            cur = passes[0].output
            continue
        mix = [op for op in cons
               if op.kind in ("matmul", "linear", "layout") or "einsum" in op.target.lower()]
        if mix:
            raise refuse(sm, f"talking heads (the probabilities mixed across heads by {mix[0].target})")
        what = cons[0].target if cons else "nothing"
        raise refuse(sm, f"the operation {what} after the softmax (expected the product P V)")


def _no_op_mask(graph: Graph, values: dict[str, Tensor], mask: str) -> bool:
    """Whether an attn_mask masks nothing, whatever the input: a constant that is all True (boolean)
    or all zero (additive), as transformers passes for a batch without padding."""
    t = values.get(mask, graph.weights.get(mask)) if mask in graph.constant else None
    if t is None:
        return False
    return bool(t.all()) if t.dtype == torch.bool else not bool(t.any())


def _fused(graph: Graph, values: dict[str, Tensor], op: Op) -> tuple[str, str, str, str, float | None]:
    """(q, k, v, context, scale) of a fused attention op, refusing its masks and variants by name."""
    args, kwargs = op.attrs.get("args"), op.attrs.get("kwargs", {})
    if op.target == "Attention":  # ONNX opset 23
        if len(op.inputs) > 3 and any(x is not None for x in op.inputs[3:]):
            raise refuse(op, "an attention mask or a key/value cache (inputs of ONNX Attention)")
        if op.attrs.get("is_causal", 0):
            raise refuse(op, "a causal attention mask (is_causal)")
        if op.attrs.get("softcap", 0.0):
            raise refuse(op, "logit soft-capping (softcap)")
        if values[op.inputs[0]].dim() != 4:
            raise refuse(op, "ONNX Attention on 3-D inputs (heads packed in the last axis)")
        scale = op.attrs.get("scale")  # absent: 1/√d_h, as for torch's fused attention
        return (*op.inputs[:3], op.output, float(scale) if scale else None)
    flash = "flash" in op.target
    mask = kwargs.get("attn_mask", None if flash or len(args) <= 3 else args[3])
    causal = kwargs.get("is_causal", (args[4] if len(args) > 4 else False) if flash else
                        (args[5] if len(args) > 5 else False))
    if mask is not None and not _no_op_mask(graph, values, mask):
        raise refuse(op, "an attention mask (attn_mask of scaled_dot_product_attention)")
    if causal:
        raise refuse(op, "a causal attention mask (is_causal of scaled_dot_product_attention)")
    if kwargs.get("enable_gqa", False):
        raise refuse(op, "grouped-query attention (enable_gqa)")
    context = op.output
    if flash:  # returns (output, logsumexp): the context is item 0
        items = [c for c in graph.consumers.get(op.output, []) if c.attrs.get("args", (None, None))[1] == 0]
        if not items:
            raise refuse(op, "a fused attention whose output is not read")
        context = items[0].output
    scale = kwargs.get("scale")
    return (*op.inputs[:3], context, float(scale) if scale is not None else None)


def _output(graph: Graph, values: dict[str, Tensor], site: Op, context: str, n: int) -> str:
    """O: the last value of the model's layout ([..., n, h·d_h]) in the affine chain from the context,
    after its output projection."""
    cur, projected, best = context, False, None
    numel = values[context].numel()
    while True:
        cons = graph.consumers.get(cur, [])
        if len(cons) != 1 or cons[0].kind not in AFFINE or len(cons[0].outputs) != 1:
            break
        op = cons[0]
        if graph.variable_inputs(op) != [cur]:
            break
        projected = projected or op.kind in ("linear", "matmul")
        cur = op.output
        t = values.get(cur)
        if projected and t is not None and t.dim() >= 2 and t.shape[-2] == n and t.numel() == numel:
            best = cur
    if best is None:
        raise refuse(site, "an attention without an output projection back to width h·d_h (a model "
                           "width that differs from h·d_h, or no projection)")
    return best


def find(graph: Graph, values: dict[str, Tensor]) -> list[Site]:
    """Every attention of the graph, in graph order (InputError naming the first that is refused)."""
    sites = []
    for op in graph.ops:
        if op.kind == "softmax":
            rank = values[op.output].dim()
            axis = op.attrs["axis"] if "axis" in op.attrs else op.attrs.get("args", (None, -1))[1]
            if not _weighs_values(graph, op):
                continue  # a classifier's softmax, or any that weighs no values
            found = _logits(graph, values, op)
            if axis % rank != rank - 1:
                raise refuse(op, f"a softmax over axis {axis} (not the keys' axis)")
            qk, factor = found
            pv = _values_product(graph, op)
            if pv.attrs.get("b_transposed"):
                raise refuse(op, f"values handed transposed to {pv.target} (P Vᵀᵀ)")
            # a matmul takes Kᵀ; an einsum "…id,…jd->…ij" takes K itself
            q, k, v, context = qk.inputs[0], qk.inputs[1], pv.inputs[1], pv.output
            k_t = not qk.attrs.get("b_transposed", False)
        elif op.kind == "sdpa":
            q, k, v, context, scale = _fused(graph, values, op)
            factor = scale if scale is not None else 1 / math.sqrt(values[q].shape[-1])
            k_t = False
        else:
            continue
        sites.append(_site(graph, values, op, q, k, v, k_t, context, factor))
    return sites


def _site(graph: Graph, values: dict[str, Tensor], op: Op, q: str, k: str, v: str, k_t: bool,
          context: str, factor: float) -> Site:
    Q, K, V = values[q], values[k], values[v]
    K = K.transpose(-1, -2) if k_t else K
    n, e = Q.shape[-2], Q.shape[-1]
    if K.shape[-2] != n:
        raise refuse(op, f"cross-attention ({n} queries, {K.shape[-2]} keys)")
    if K.shape[:-2] != Q.shape[:-2] or V.shape[:-2] != Q.shape[:-2]:
        raise refuse(op, "grouped-query attention (fewer key/value heads than query heads)")
    if K.shape[-1] != e or V.shape[-1] != e:
        raise refuse(op, f"values of width {V.shape[-1]} beside queries of width {e} (DotMHA has one d_h)")
    out = _output(graph, values, op, context, n)
    shape = values[out].shape
    if len(shape) != 3:
        raise refuse(op, f"an attention whose output has shape {list(shape)} (expected [batch, n, d])")
    x, seq_first = _input(graph, values, op, (q, k, v), shape)
    for o in graph.between(x, v):
        if o.kind not in AFFINE:
            raise refuse(op, f"cross-attention (the values reach the input {x} only through "
                             f"{o.target}, not affinely)")
    for o in [*graph.between(x, q), *graph.between(x, k)]:
        if o.kind == "norm":
            raise refuse(op, f"qk-norm ({o.target} on the queries or keys)")
        if o.kind == "rotary":
            raise refuse(op, f"rotary embeddings ({o.target} on the queries or keys)")
        if o.kind not in AFFINE:
            raise refuse(op, f"the operation {o.target} ({o.name}) between the input and the queries/keys")
    residual = [c for c in graph.consumers.get(out, [])
                if c.kind == "add" and sorted(graph.variable_inputs(c)) == sorted([x, out])]
    ref = residual[0].output if residual else out
    return Site(op.name, q, k, v, k_t, context, factor, x, out, ref, bool(residual), seq_first)


def _input(graph: Graph, values: dict[str, Tensor], op: Op, qkv: tuple[str, str, str],
           shape: torch.Size) -> tuple[str, bool]:
    """(X, whether it is sequence-first): the latest value from which queries, keys and values are
    all computed, of the output's shape [B, n, d] or its transpose [n, B, d]; a transpose of a value
    of the output's own shape is read as that value."""
    B, n, d = shape
    layouts = {(B, n, d): False, (n, B, d): True}
    common = set.intersection(*(graph.ancestors(v) for v in qkv))
    xs = [c for c in common if c in values and tuple(values[c].shape) in layouts]
    if not xs:
        raise refuse(op, f"cross-attention (queries and keys/values computed from no one tensor of "
                         f"shape {list(shape)})")
    x = max(xs, key=lambda c: graph.order.get(c, -1))
    cur = x
    while tuple(values[cur].shape) != tuple(shape) and cur in graph.producer:
        prev = graph.producer[cur]
        var = graph.variable_inputs(prev)
        if prev.kind not in ("layout", "pass") or len(var) != 1 or var[0] not in xs:
            break
        cur = var[0]
    if tuple(values[cur].shape) == tuple(shape):
        return cur, False
    return x, layouts[tuple(values[x].shape)]
