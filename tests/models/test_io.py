"""Layer, stack and input files: round trips, and one clear InputError for every kind of bad input."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

import attacks
import bounds
import models
from models import InputError


def layers():
    return {
        "dot": models.random_dot(6, 2, seed=0, q_norm=1.3, residual=False),
        "l2": models.random_l2(6, 3, seed=1),
        "olsa": models.random_olsa(6, 2, n=4, c=2.5, seed=2, alpha1=0.7, activation="tanh",
                                   residual=True),
        "stack": models.random_stack("dot", 3, 6, 2, seed=3, R=1.5),
        "stack-noproj": models.random_stack("olsa", 2, 6, 3, seed=4, R=None, n=4, c=1.0),
    }


def same_block(a, b) -> None:
    assert type(a) is type(b) and a.kind == b.kind and a.residual == b.residual
    for name in ("W_q", "W_k", "W_v", "W_o", "w_s"):
        if hasattr(a, name):
            assert getattr(b, name).dtype == torch.float64
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    if isinstance(a, models.OLSA):
        assert (a.alpha1, a.alpha2, a.activation) == (b.alpha1, b.alpha2, b.activation)


@pytest.mark.parametrize("name", list(layers()))
def test_layer_round_trip(tmp_path, name):
    layer = layers()[name]
    path = tmp_path / f"{name}.safetensors"
    models.save_layer(path, layer)
    back = models.load_layer(path)
    assert back.kind == layer.kind
    if isinstance(layer, models.Stack):
        assert back.R == layer.R and len(back.blocks) == len(layer.blocks)
        for a, b in zip(layer.blocks, back.blocks, strict=True):
            same_block(a, b)
    else:
        same_block(layer, back)
    X = models.random_input(4, 6, norm=2.0, seed=5, batch=2)
    assert torch.equal(layer(X), back(X))
    # also through a str path
    models.save_layer(str(tmp_path / "again.safetensors"), back)
    assert torch.equal(models.load_layer(str(tmp_path / "again.safetensors"))(X), layer(X))


@pytest.mark.parametrize("shape", [(4, 6), (3, 4, 6)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_input_round_trip(tmp_path, shape, dtype):
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    models.save_input(tmp_path / "x.safetensors", X)
    back = models.load_input(tmp_path / "x.safetensors")
    assert back.dtype == torch.float64 and back.shape == X.shape
    assert torch.equal(back, X.double())


# --- bad files ----------------------------------------------------------------------------------


def dot_tensors(h=2, d=6, e=3):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return {"W_q": r(h, d, e), "W_k": r(h, d, e), "W_v": r(h, d, e), "W_o": r(h, e, d)}


def write(tmp_path, tensors, meta) -> str:
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return str(path)


def raises(match: str):
    return pytest.raises(InputError, match=match)


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


def test_missing_tensor(tmp_path):
    t = dot_tensors()
    del t["W_k"]
    with raises(r"missing tensor 'W_k'"):
        models.load_layer(write(tmp_path, t, {"kind": "dot"}))


def test_missing_kind(tmp_path):
    with raises(r"missing metadata key 'kind'"):
        models.load_layer(write(tmp_path, dot_tensors(), {"residual": "1"}))
    with raises(r"missing metadata key 'kind'"):
        models.load_layer(write(tmp_path, dot_tensors(), {}))


def test_unknown_kind(tmp_path):
    with raises(r"unknown kind 'conv'"):
        models.load_layer(write(tmp_path, dot_tensors(), {"kind": "conv"}))


def test_wrong_shape(tmp_path):
    t = dot_tensors()
    t["W_q"] = t["W_q"][0]  # [d, e]: a head dimension is missing
    with raises(r"W_q must have 3 dims"):
        models.load_layer(write(tmp_path, t, {"kind": "dot"}))
    t = dot_tensors()
    t["W_v"] = torch.zeros(2, 5, 3, dtype=torch.float64)  # d=5 against d=6 elsewhere
    with raises(r"W_v has shape \[2, 5, 3\], inconsistent"):
        models.load_layer(write(tmp_path, t, {"kind": "dot"}))


def test_d_not_divisible_by_h_in_file(tmp_path):
    t = dot_tensors(h=3, d=10, e=3)  # W_q [3, 10, 3]: h·d_h = 9 != d = 10
    with raises(r"d % h != 0"):
        models.load_layer(write(tmp_path, t, {"kind": "dot"}))


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_weights(tmp_path, value):
    t = dot_tensors()
    t["W_o"][1, 2, 3] = value
    with raises(r"W_o contains NaN or inf"):
        models.load_layer(write(tmp_path, t, {"kind": "dot"}))


def test_bad_metadata_values(tmp_path):
    with raises(r"'residual' must be '0' or '1'"):
        models.load_layer(write(tmp_path, dot_tensors(), {"kind": "dot", "residual": "yes"}))
    layer = models.random_olsa(4, 2, n=3, c=1.0, seed=0)
    t = {k: getattr(layer, k).contiguous() for k in ("W_q", "W_k", "W_v", "w_s")}
    with raises(r"missing metadata key 'alpha1'"):
        models.load_layer(write(tmp_path, t, {"kind": "olsa", "alpha2": "1.0"}))
    with raises(r"'alpha2' must be finite and > 0"):
        models.load_layer(write(tmp_path, t, {"kind": "olsa", "alpha1": "1", "alpha2": "-2"}))
    with raises(r"activation 'gelu'"):
        models.load_layer(write(tmp_path, t, {"kind": "olsa", "alpha1": "1", "alpha2": "1",
                                              "activation": "gelu"}))
    with raises(r"'depth' must be a positive integer"):
        models.load_layer(write(tmp_path, dot_tensors(), {"kind": "stack", "depth": "0",
                                                          "R": "1.0"}))


def test_nan_in_input(tmp_path):
    X = torch.ones(3, 4, dtype=torch.float64)
    X[1, 1] = math.nan
    models.save_input(tmp_path / "x.safetensors", X)
    with raises(r"X contains NaN or inf"):
        models.load_input(tmp_path / "x.safetensors")
    layer = models.random_dot(4, 2, seed=0)
    with raises(r"X contains NaN or inf"):
        bounds.evaluate("lofast_M", layer, X, 0.1)
    with raises(r"X contains NaN or inf"):
        attacks.attack(layer, X, 0.1)


def test_bad_input_file_contents(tmp_path):
    save_file({"Y": torch.zeros(2, 2)}, str(tmp_path / "noX.safetensors"))
    with raises(r"missing tensor 'X'"):
        models.load_input(tmp_path / "noX.safetensors")
    save_file({"X": torch.zeros(2, 2, 2, 2)}, str(tmp_path / "x4.safetensors"))
    with raises(r"X must be \[n, d\] or \[B, n, d\]"):
        models.load_input(tmp_path / "x4.safetensors")


@pytest.mark.parametrize("loader", [models.load_layer, models.load_input])
def test_garbage_file(tmp_path, loader):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\x93NUMPY not a safetensors header at all \x00\xff" * 7)
    with raises(r"not a readable safetensors file"):
        loader(path)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with raises(r"cannot read"):
        loader(empty)


@pytest.mark.parametrize("loader", [models.load_layer, models.load_input])
def test_nonexistent_file(tmp_path, loader):
    with raises(r"no such file"):
        loader(tmp_path / "does-not-exist.safetensors")


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, -0.1, math.inf, -math.inf, math.nan, "abc", None])
def test_bad_eps(eps):
    layer = models.random_dot(4, 2, seed=0)
    X = models.random_input(3, 4)
    with raises(r"eps must be"):
        bounds.evaluate("lofast_M", layer, X, eps)
    with raises(r"eps must be"):
        attacks.attack(layer, X, eps)


def test_bound_of_wrong_kind():
    dot = models.random_dot(4, 2, seed=0)
    l2 = models.random_l2(4, 2, seed=0)
    X = models.random_input(3, 4)
    with raises(r"bound 'kim' does not apply to dot layers"):
        bounds.evaluate("kim", dot, X, 0.1)
    with raises(r"bound 'lofast_M' does not apply to l2 layers"):
        bounds.evaluate("lofast_M", l2, X, 0.1)
    with raises(r"does not apply to a stack of dot blocks"):
        bounds.evaluate("kim", models.random_stack("dot", 2, 4, 2), X, 0.1)
    with raises(r"jacobian_exp"):
        bounds.evaluate("jacobian_exp", dot, X, 0.1)
    with raises(r"unknown bound 'lofast'"):
        bounds.evaluate("lofast", dot, X, 0.1)
    with raises(r"applies to dot layers only"):
        attacks.attack(l2, X, 0.1, "delta1")
    with raises(r"unknown objective"):
        attacks.attack(dot, X, 0.1, "delta3")


def test_bad_shapes_of_X():
    layer = models.random_dot(4, 2, seed=0)
    with raises(r"X has d=5 but the layer has d=4"):
        bounds.evaluate("delta1", layer, torch.zeros(3, 5, dtype=torch.float64), 0.1)
    with raises(r"X must be \[n, d\] or \[B, n, d\]"):
        bounds.evaluate("delta1", layer, torch.zeros(2, 2, 3, 4, dtype=torch.float64), 0.1)
    with raises(r"at least one token"):
        bounds.evaluate("delta1", layer, torch.zeros(1, 0, 4, dtype=torch.float64), 0.1)


@pytest.mark.parametrize("builder", [models.random_dot, models.random_l2])
def test_builder_refuses_d_not_divisible_by_h(builder):
    with raises(r"d % h != 0: d=10 is not divisible by h=3"):
        builder(10, 3)


def test_builders_refuse_bad_arguments():
    with raises(r"d % h != 0"):
        models.random_olsa(10, 3, n=2, c=1.0)
    with raises(r"alpha1 and alpha2 must be > 0"):
        models.random_olsa(4, 2, n=2, c=1.0, alpha1=0.0)
    with raises(r"unknown layer kind 'conv'"):
        models.random_layer("conv", 4, 2)
    with raises(r"depth must be >= 1"):
        models.random_stack("dot", 0, 4, 2)
    with raises(r"d and h must be positive"):
        models.random_dot(4, 0)


def _stack_file(tmp_path, stack, **meta_changes) -> str:
    from models.io import layer_to_tensors

    tensors, meta = {}, {"kind": "stack", "depth": str(len(stack.blocks)), "R": repr(stack.R)}
    for k, block in enumerate(stack.blocks):
        t, m = layer_to_tensors(block)
        tensors.update({f"blocks.{k}.{n}": x for n, x in t.items()})
        meta.update({f"blocks.{k}.{n}": v for n, v in m.items()})
    meta.update(meta_changes)
    return write(tmp_path, tensors, meta)


@pytest.mark.parametrize("depth", ["1", "3"])
def test_stack_depth_must_equal_the_blocks_present(tmp_path, depth):
    """A depth smaller than the blocks present once truncated the stack silently (naive 0.224
    instead of 1.026 for the real 2-block stack); larger, it named a missing tensor of a block."""
    stack = models.random_stack("dot", 2, 4, 2, seed=0)
    with raises(rf"'depth' = {depth} but the file holds blocks \[0, 1\]"):
        models.load_layer(_stack_file(tmp_path, stack, depth=depth))


def test_stack_blocks_numbered_from_zero_and_nothing_else(tmp_path):
    stack = models.random_stack("dot", 2, 4, 2, seed=0)
    path = _stack_file(tmp_path, stack)
    tensors, meta = models.io.read_file(path)
    shifted = {n.replace("blocks.1.", "blocks.2."): x for n, x in tensors.items()}
    with raises(r"holds blocks \[0, 2\]"):
        models.load_layer(write(tmp_path, shifted, meta))
    with raises(r"tensor 'extra' is not of the form blocks.<k>.<name>"):
        models.load_layer(write(tmp_path, dict(tensors, extra=torch.zeros(2)), meta))
