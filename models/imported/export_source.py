"""A torch.export program (a ``.pt2`` file, or an ``nn.Module`` exported here) as a
models/imported/graph.py Graph, evaluated node by node by a torch.fx Interpreter.

The program's module is run as exported for the values a user's model computes, and a float64 copy of
it (parameters and buffers widened) for the probes and checks of models/imported/probe.py; an
interpreter that is handed some values computes only the nodes the wanted ones need from them.
"""

from __future__ import annotations

import logging
import operator
from pathlib import Path

import torch
from torch import Tensor, fx

from ..errors import InputError
from .graph import Float64Unavailable, Graph, Op, einsum_product, needed

KINDS = {
    **dict.fromkeys(["softmax", "_softmax", "_safe_softmax"], "softmax"),
    **dict.fromkeys(["scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"], "sdpa"),
    **dict.fromkeys(["matmul", "bmm", "mm"], "matmul"),
    **dict.fromkeys(["linear", "addmm"], "linear"),
    "add": "add", "sub": "sub", "mul": "mul", "div": "div",
    **dict.fromkeys(["where", "masked_fill"], "where"),
    **dict.fromkeys(["view", "reshape", "_unsafe_view", "permute", "transpose", "t", "squeeze", "unsqueeze",
                     "flatten", "unflatten", "select", "slice", "unbind", "split", "split_with_sizes",
                     "chunk", "expand", "cat", "getitem", "narrow"], "layout"),
    **dict.fromkeys(["contiguous", "clone", "alias", "detach", "dropout", "_to_copy", "to", "type_as",
                     "lift_fresh_copy"], "pass"),
    **dict.fromkeys(["layer_norm", "native_layer_norm", "rms_norm", "batch_norm", "group_norm",
                     "_native_batch_norm_legit_no_training", "instance_norm", "mean", "rsqrt", "sqrt",
                     "norm", "linalg_vector_norm", "var", "normalize"], "norm"),
    **dict.fromkeys(["sin", "cos", "neg"], "rotary"),
}
SHAPE_OPS = {"sym_size", "size"}
KINDS.update(dict.fromkeys(SHAPE_OPS, "shape"))
# A view traced at one batch holds for that batch's strides only: a program exported at a batch of 1
# reshapes a transposed [n, 1, d] with aten.view, which fails at a batch of 2 (torch 2.11's export of
# nn.MultiheadAttention). reshape returns that very view wherever the strides allow one, and copies
# only where view would raise.
VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def op_name(node: fx.Node) -> str:
    """``linear`` for aten.linear.default, ``getitem`` for operator.getitem."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    schema = getattr(t, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _names(a) -> list:
    """The fx nodes inside an argument, flattened (lists of tensors: cat, the index of a view)."""
    if isinstance(a, fx.Node):
        return [a]
    if isinstance(a, (list, tuple)):
        return [n for x in a for n in _names(x)]
    return []


def _plain(a):
    """An argument with its nodes as their names: what detection reads (a scalar factor, an axis)."""
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return type(a)(_plain(x) for x in a)
    return a


def extract(gm: fx.GraphModule, graph: Graph, given: list[str], wanted: list[str],
            sizes: dict[str, int]) -> fx.GraphModule:
    """A module of the nodes that compute ``wanted`` from ``given`` (placeholders in that order),
    returning them as a tuple; attributes are read from ``gm``. A size read off a tensor that is not
    given (a symbolic batch) is the number ``sizes`` holds from the model's own run."""
    ops = needed(graph, wanted, given)
    sub, env = fx.Graph(), {}
    for name in given:
        env[name] = sub.placeholder(name)
    for n in gm.graph.nodes:
        if n.name in env:
            continue
        inputs = [a.name for a in n.all_input_nodes]
        if n.name in ops and n.name in sizes and not all(a in env for a in inputs):
            env[n.name] = sizes[n.name]
        elif n.op == "get_attr" or (n.op == "call_function" and n.name in ops):
            env[n.name] = sub.node_copy(n, lambda a: env[a.name])
            if n.target in VIEWS:  # see VIEWS
                env[n.name].target = torch.ops.aten.reshape.default
        elif n.op == "placeholder" and n.name in ops:
            raise InputError(f"the program needs its input {n.name!r} to compute {wanted[0]!r}")
    sub.output(tuple(env[w] for w in wanted))
    sub.eliminate_dead_code()
    return fx.GraphModule(gm, sub)


class ExportRuntime:
    """Evaluates values of one program by sub-modules of its nodes, one per question."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.gm64: fx.GraphModule | None = None
        self.graph: Graph | None = None
        self.modules: dict = {}
        self.sizes: dict[str, int] = {}  # every size the program reads off a tensor, from its own run

    def __call__(self, given: dict[str, Tensor], wanted: list[str], float64: bool) -> dict[str, Tensor]:
        if float64:
            if self.gm64 is None:
                import copy

                self.gm64 = copy.deepcopy(self.gm).to(torch.float64)
            given = {k: v.double() if v.is_floating_point() else v for k, v in given.items()}
        key = (tuple(given), tuple(wanted), float64)
        if key not in self.modules:
            self.modules[key] = extract(self.gm64 if float64 else self.gm, self.graph, list(given), wanted,
                                        self.sizes)
        try:
            with torch.no_grad():
                out = self.modules[key](*given.values())
        except RuntimeError as e:  # an op with a dtype of its own (a cast, a float32 constant) in float64
            if float64:
                raise Float64Unavailable(str(e)) from e
            raise
        got = dict(zip(wanted, out, strict=True))
        self.sizes.update({k: int(v) for k, v in got.items() if isinstance(v, (int, torch.SymInt))})
        return got


def from_program(ep: torch.export.ExportedProgram) -> Graph:
    """An exported program as a Graph, run through its module (parameters as attributes)."""
    gm = ep.module()
    constant: set[str] = set()
    ops, inputs, weights = [], {}, {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            shape = tuple(int(s) if isinstance(s, int) else None for s in getattr(val, "shape", ()))
            inputs[n.name] = (shape, getattr(val, "dtype", torch.float32))
        elif n.op == "get_attr":
            constant.add(n.name)
            w = gm
            for part in str(n.target).split("."):
                w = getattr(w, part)
            if isinstance(w, Tensor):
                weights[n.name] = w.detach()
        elif n.op == "call_function":
            name = op_name(n)
            args = [x for a in (*n.args, *n.kwargs.values()) for x in _names(a)]
            kind = KINDS.get(name, "other")
            scalars = [a for a in n.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            attrs = {"args": _plain(n.args), "kwargs": _plain(dict(n.kwargs)), "scalars": scalars}
            if name == "einsum" and len(args) == 2:
                attrs["b_transposed"] = einsum_product(str(n.args[0]))
                kind = "matmul" if attrs["b_transposed"] is not None else kind
                if kind != "matmul" and sum(a.name in constant for a in args) == 1:
                    kind = "linear"  # a weight contracted with one value (the per-head W^O of an einsum)
            ops.append(Op(n.name, kind, f"aten.{name}", tuple(a.name for a in args), (n.name,), attrs))
            if name in SHAPE_OPS or all(a.name in constant for a in args):
                constant.add(n.name)
    runtime = ExportRuntime(gm)
    graph = Graph(ops, constant, inputs, runtime, weights)
    runtime.graph = graph
    return graph


class _Caught(logging.Handler):
    """Keeps the exception a log record carries (torch.export.load logs its cause and raises another)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.error = record.exc_info[1]


def load(path: str | Path) -> Graph:
    """The program saved at ``path`` by torch.export.save (InputError when it is not one)."""
    log = logging.getLogger("torch.export")  # it logs why a load failed, then raises a bare error
    caught = _Caught()
    handlers, propagate = log.handlers[:], log.propagate
    log.handlers[:], log.propagate = [caught], False  # torch's own handler would print the traceback
    try:
        ep = torch.export.load(str(path))
    except FileNotFoundError:
        raise InputError(f"cannot read {path}: no such file") from None
    except Exception as e:  # a zip that is not a program, or no zip at all
        e = caught.error or e
        msg = str(e).splitlines()[0] if str(e) else ""
        hint = ("; a program must load without the code that built it: export a module that returns "
                "tensors" if "pytree" in msg else "")
        raise InputError(f"{path}: not a readable torch.export program ({type(e).__name__}: {msg}){hint}") \
            from None
    finally:
        log.handlers[:], log.propagate = handlers, propagate
    return from_program(ep)


def from_module(module: torch.nn.Module, example: tuple) -> Graph:
    """``module`` exported by torch.export at ``example`` (a tuple of its inputs), in eval mode."""
    module = module.eval()
    with torch.no_grad():
        ep = torch.export.export(module, tuple(example))
    return from_program(ep)
