"""An ONNX model as a models/imported/graph.py Graph, evaluated by onnxruntime.

onnx and onnxruntime are the optional ``import`` extra, imported here only when a model is read. The
runtime, never onnx's reference evaluator, computes every value: the reference evaluator's
BatchNormalization uses batch statistics in inference (issue #30). Values are computed by a sub-model
that takes the given values as its inputs and returns the wanted ones; a float64 copy of that sub-model
(its float weights, constants and casts widened) gives the probes and the checks of
models/imported/probe.py their float64 reference where the runtime has the kernels for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from .graph import Float64Unavailable, Graph, Op, einsum_product, needed

INSTALL = "pip install 'attnbounds[import]' (onnx, onnxruntime, onnxscript)"

KINDS = {
    "Softmax": "softmax", "Attention": "sdpa", "MatMul": "matmul", "Gemm": "linear",
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Where": "where",
    **dict.fromkeys(["Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Gather",
                     "Split", "Concat", "Expand"], "layout"),
    **dict.fromkeys(["Identity", "Dropout", "Cast", "CastLike"], "pass"),
    **dict.fromkeys(["LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
                     "BatchNormalization", "InstanceNormalization", "GroupNormalization",
                     "LpNormalization", "ReduceMean", "ReduceL2", "ReduceSumSquare", "Sqrt",
                     "Reciprocal"], "norm"),
    **dict.fromkeys(["Sin", "Cos", "Neg"], "rotary"),
    **dict.fromkeys(["Shape", "Size"], "shape"),
}
SHAPE_OPS = {"Shape", "Size"}  # their value is the static shape: constant whatever the input
FLOAT, DOUBLE = 1, 11  # onnx.TensorProto.FLOAT, DOUBLE


def require() -> tuple:
    """(onnx, onnxruntime), or InputError naming the install."""
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise InputError(f"reading ONNX needs optional packages ({e}): {INSTALL}") from None
    return onnx, onnxruntime


def _widen(model) -> None:
    """float32 → float64 in place: initializers, Constant and ConstantOfShape values, Cast targets and
    every declared value type."""
    from onnx import helper, numpy_helper

    g = model.graph
    for i, t in enumerate(g.initializer):
        if t.data_type == FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64),
                                                              t.name))
    for node in g.node:
        for a in node.attribute:
            if a.name == "value" and a.t.data_type == FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64)))
            if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
                a.i = DOUBLE
        if node.op_type == "Constant" and any(a.name in ("value_float", "value_floats")
                                              for a in node.attribute):
            a = next(a for a in node.attribute if a.name in ("value_float", "value_floats"))
            v = np.array(a.f if a.name == "value_float" else list(a.floats), dtype=np.float64)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(v)))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == FLOAT:
            vi.type.tensor_type.elem_type = DOUBLE


class OnnxRuntime:
    """Evaluates values of one ONNX model by sub-models in onnxruntime, one session per question."""

    def __init__(self, model) -> None:
        self.model = model
        self.sessions: dict = {}
        self.graph: Graph | None = None
        # the values read off a tensor's shape (Shape and what is computed from it alone), from the
        # model's own last run: an older exporter computes a reshape's target or a class token's expand
        # from the batch size of the graph's input, which a probe from an inner value does not have
        self.known: dict[str, Tensor] = {}

    def outside(self, given: dict[str, Tensor], wanted: list[str]) -> dict[str, Tensor]:
        """The known shape values the sub-model computing ``wanted`` from ``given`` is fed because
        their own computation needs a value that is neither given nor stored (a graph input)."""
        g = self.graph
        avail = set(given) | set(g.weights) | {None}
        ops = needed(g, wanted, given)
        fed: dict[str, Tensor] = {}
        for op in g.ops:
            if op.name not in ops:
                continue
            if all(x in avail for x in op.inputs):
                avail.update(op.outputs)
                continue
            for o in op.outputs:
                if o in self.known:
                    fed[o] = self.known[o]
                    avail.add(o)
        return fed

    def session(self, given: dict[str, Tensor], wanted: list[str], float64: bool):
        onnx, ort = require()
        from onnx import helper

        key = (tuple((k, str(v.dtype), tuple(v.shape)) for k, v in given.items()), tuple(wanted), float64)
        if key in self.sessions:
            return self.sessions[key]
        g = self.model.graph
        ops = needed(self.graph, wanted, given)
        nodes = [n for n in g.node if n.name in ops]
        used = {x for n in nodes for x in n.input}
        inits = [t for t in g.initializer if t.name in used and t.name not in given]
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(_np(v).dtype),
                                                list(v.shape)) for k, v in given.items()]
        outputs = [onnx.ValueInfoProto(name=w) for w in wanted]
        sub = helper.make_model(helper.make_graph(nodes, "probe", inputs, outputs, inits),
                                opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        sub.functions.extend(self.model.functions)
        if float64:
            _widen(sub)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        sess = ort.InferenceSession(sub.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.sessions[key] = sess
        return sess

    def __call__(self, given: dict[str, Tensor], wanted: list[str], float64: bool) -> dict[str, Tensor]:
        given = {**self.outside(given, wanted), **given}
        if float64:
            given = {k: v.double() if v.is_floating_point() else v for k, v in given.items()}
        try:
            sess = self.session(given, wanted, float64)
            outs = sess.run(wanted, {k: _np(v) for k, v in given.items()})
        except Exception as e:  # onnxruntime's errors share no base class but Exception
            if float64:
                raise Float64Unavailable(str(e)) from e
            raise
        got = {w: torch.from_numpy(np.asarray(o)) for w, o in zip(wanted, outs, strict=True)}
        if not float64 and set(self.graph.inputs) <= set(given):  # the model's own run: its shape values
            self.known.update({w: v for w, v in got.items() if w in self.graph.constant
                               and w not in self.graph.weights})
        return got


def _np(t: Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def external_files(path: str | Path) -> list[Path]:
    """The files beside an ONNX model that hold its tensors (external data: what torch.onnx.export writes
    for a model over 2 GiB, and its dynamo exporter for smaller ones too), in the order the model names
    them; [] where every tensor is inside the file. Reads the model without its tensors."""
    onnx, _ = require()
    from onnx.external_data_helper import uses_external_data

    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # as load: a file that is not a model
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__})") from None
    tensors = _tensors(model.graph) + [t for f in model.functions for n in f.node for t in _node_tensors(n)]
    found: list[Path] = []
    for t in tensors:
        if uses_external_data(t):
            location = next((e.value for e in t.external_data if e.key == "location"), None)
            if not location:
                raise InputError(f"{path}: tensor {t.name!r} is stored outside the file but names no "
                                 f"location")
            if path.parent / location not in found:
                found.append(path.parent / location)
    return found


def _node_tensors(node) -> list:
    """The tensors of a node's attributes, those of its subgraphs (If, Loop, Scan) included."""
    out = []
    for a in node.attribute:
        out += ([a.t] if a.HasField("t") else []) + list(a.tensors)
        out += _tensors(a.g) if a.HasField("g") else []
        out += [t for g in a.graphs for t in _tensors(g)]
    return out


def _tensors(graph) -> list:
    """Every tensor a graph holds: its initializers, sparse ones' values and indices, and its nodes'."""
    out = list(graph.initializer)
    out += [t for s in graph.sparse_initializer for t in (s.values, s.indices)]
    return out + [t for n in graph.node for t in _node_tensors(n)]


def load(path: str | Path) -> Graph:
    """The model at ``path`` as a Graph (InputError when it is not an ONNX model)."""
    onnx, _ = require()
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as e:  # onnx raises DecodeError, ValidationError, ... for a file that is not a model
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    g = model.graph
    constant = {t.name for t in g.initializer} | {""}
    ops = []
    for k, n in enumerate(g.node):
        name = n.name or f"{n.op_type}_{k}"
        if not n.name:
            n.name = name
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute
                 if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT)}
        kind = KINDS.get(n.op_type, "other")
        if n.op_type == "Einsum" and len(n.input) == 2:
            eq = next((a.s.decode() for a in n.attribute if a.name == "equation"), "")
            attrs["b_transposed"] = einsum_product(eq)
            kind = "matmul" if attrs["b_transposed"] is not None else kind
            if kind != "matmul" and sum(x in constant for x in n.input) == 1:
                kind = "linear"  # a weight contracted with one value (the per-head W^O of an einsum)
        ops.append(Op(name, kind, n.op_type, tuple(x if x else None for x in n.input), tuple(n.output),
                      attrs))
        if n.op_type in SHAPE_OPS or all(x in constant for x in n.input):
            constant.update(n.output)
    inputs = {}
    for vi in g.input:
        if vi.name in constant:
            continue
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        inputs[vi.name] = (dims, torch.from_numpy(np.zeros(0, dtype=np_dtype)).dtype)
    runtime = OnnxRuntime(model)
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in g.initializer}
    graph = Graph(ops, constant, inputs, runtime, weights)
    runtime.graph = graph
    return graph
