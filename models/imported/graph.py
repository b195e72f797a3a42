"""One view of a computation graph for both sources (ONNX, torch.export): its operations in topological
order, each with a *kind* from a small vocabulary, which values are constant, and a runtime that
evaluates any values of the graph, optionally with some values replaced (the probes of
models/imported/probe.py).

The kinds are what the detection (models/imported/detect.py) needs to tell apart; every op of either
format that is not in its backend's table gets the kind ``other`` and keeps its own name for messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# kinds: softmax, sdpa (a fused attention), matmul, linear (weights constant: Gemm, aten.linear, addmm),
# add, sub, mul, div, where (a mask: Where, masked_fill), layout (reshape, transpose, slice, select,
# squeeze, concat of one value's parts...), pass (identity, dropout, clone, a cast), norm (layer, RMS,
# batch or L2 normalization, or its reductions), rotary (sin, cos, neg: the parts of a rotation),
# shape (reads a value's shape only: Shape, sym_size), other
AFFINE = frozenset({"matmul", "linear", "add", "sub", "mul", "div", "layout", "pass"})


class Float64Unavailable(RuntimeError):
    """The runtime cannot evaluate the graph in float64 (a kernel or an op it lacks in float64)."""


@dataclass(frozen=True)
class Op:
    """One operation: ``inputs`` are value names (None where the argument is not a tensor), ``attrs``
    the few attributes detection reads (softmax axis, a fused attention's mask, causality and scale,
    a python scalar operand)."""

    name: str
    kind: str
    target: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    attrs: dict = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.outputs[0]


Runner = Callable[[dict[str, Tensor], list[str], bool], dict[str, Tensor]]


@dataclass
class Graph:
    """``ops`` in topological order; ``constant``: the values that depend on no graph input (weights
    and what is computed from them alone); ``inputs``: the graph's input names with their shapes
    (None for a symbolic size) and dtypes; ``run(values, wanted, float64)``
    evaluates ``wanted`` from ``values`` (graph inputs, or any values standing in for what computes
    them), in the model's dtype or in float64; ``weights``: the values of the constants the source
    stores (initializers, parameters, buffers)."""

    ops: list[Op]
    constant: set[str]
    inputs: dict[str, tuple[tuple[int | None, ...], torch.dtype]]
    run: Runner
    weights: dict[str, Tensor] = field(default_factory=dict)  # constant values known without a run
    producer: dict[str, Op] = field(init=False)
    consumers: dict[str, list[Op]] = field(init=False)
    order: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.producer, self.consumers, self.order = {}, {}, {}
        for i, op in enumerate(self.ops):
            for v in op.outputs:
                self.producer[v] = op
                self.order[v] = i
            if op.kind == "shape":  # reads no value: an older exporter's view of a product is no fork
                continue
            for v in op.inputs:
                if v is not None:
                    self.consumers.setdefault(v, []).append(op)

    def variable_inputs(self, op: Op) -> list[str]:
        """The op's inputs that are not constant, in order."""
        return [v for v in op.inputs if v is not None and v not in self.constant]

    def ancestors(self, value: str) -> set[str]:
        """Every non-constant value ``value`` is computed from, itself included."""
        seen, todo = set(), [value]
        while todo:
            v = todo.pop()
            if v in seen or v in self.constant:
                continue
            seen.add(v)
            if v in self.producer:
                todo.extend(x for x in self.producer[v].inputs if x is not None)
        return seen

    def between(self, source: str, target: str) -> list[Op]:
        """The ops on some path from ``source`` to ``target`` (descendants of one, ancestors of the
        other), in graph order."""
        up = self.ancestors(target)
        down, todo = set(), [source]
        while todo:
            v = todo.pop()
            if v in down:
                continue
            down.add(v)
            todo.extend(o for op in self.consumers.get(v, []) for o in op.outputs)
        ops = {self.producer[v].name: self.producer[v] for v in up & down
               if v != source and v in self.producer}
        return sorted(ops.values(), key=lambda op: self.order[op.output])


def needed(graph: Graph, wanted: Iterable[str], given: Iterable[str]) -> set[str]:
    """The names of the ops that compute ``wanted`` when the values ``given`` are supplied: the
    ancestors of ``wanted``, constants included, stopping at ``given``."""
    given = set(given)
    ops, seen, todo = set(), set(), list(wanted)
    while todo:
        v = todo.pop()
        if v in seen or v in given:
            continue
        seen.add(v)
        op = graph.producer.get(v)
        if op is not None and op.name not in ops:
            ops.add(op.name)
            todo.extend(x for x in op.inputs if x is not None)
    return ops


def einsum_product(equation: str) -> bool | None:
    """For a two-operand einsum that is a batched matrix product: False for ``a @ b``
    ("bhij,bhjd->bhid"), True for ``a @ bᵀ`` ("bhid,bhjd->bhij"); None for anything else."""
    try:
        lhs, o = equation.replace(" ", "").split("->")
        a, b = lhs.split(",")
    except ValueError:
        return None
    if "." in equation or not len(a) == len(b) == len(o) >= 2 or not a[:-2] == b[:-2] == o[:-2]:
        return None
    x, y = a[-2:]
    if o[-2] != x or len({x, y, o[-1]}) != 3 or o[-1] in a[:-2]:
        return None
    z = o[-1]
    return {y + z: False, z + y: True}.get(b[-2:])
