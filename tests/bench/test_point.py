"""`python -m bench point`: the library's numbers, and one error line with exit 2 on bad input."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli, main_inprocess
from safetensors.torch import save_file

import bounds
import models
from attacks import attack


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("point")
    layer = models.random_dot(16, 4, seed=3, v_norm=0.5, o_norm=0.5)
    X = models.random_input(6, 16, norm=1.5, seed=4)[0]
    models.save_layer(d / "layer.safetensors", layer)
    models.save_input(d / "x.safetensors", X)
    return d, layer, X


def test_point_json_matches_library(files):
    d, layer, X = files
    r = cli("point", "--layer", d / "layer.safetensors", "--input", d / "x.safetensors",
            "--eps", "0.05", "--json", "--pgd-steps", "20", "--pgd-restarts", "2", cwd=d)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for b in bounds.applicable(layer):
        want = bounds.evaluate(b, layer, X, 0.05)[0]
        got = torch.tensor(out[b.name], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-9, atol=0), b.name
        assert out["meta"]["certified"][b.name] == b.certified
    pgd = attack(layer, X, 0.05, steps=20, restarts=2, seed=0)[0]
    assert out["pgd"] == pytest.approx(float(pgd), rel=1e-9)
    assert out["meta"]["kind"] == "dot" and out["meta"]["n"] == 6 and out["meta"]["h"] == 4
    assert len(out["delta21_M"]) == 4 and isinstance(out["lofast_M"], float)
    # taylor = σ̄_J ε + taylor_remainder (σ̄_J exact here: a dense SVD of autograd's Jacobian), and
    # the remainder's bound is above the attack on the remainder itself
    J = torch.autograd.functional.jacobian(layer.forward, X).reshape(X.numel(), X.numel())
    sigma = float(torch.linalg.matrix_norm(J, ord=2))
    assert out["taylor"] == pytest.approx(sigma * 0.05 + out["taylor_remainder"], rel=1e-8)
    assert out["taylor_remainder"] >= out["pgd_remainder"] > 0


def test_point_table_and_batch(files, tmp_path):
    d, _, _ = files
    models.save_input(tmp_path / "xb.safetensors", models.random_input(5, 16, batch=2))
    r = cli("point", "--layer", d / "layer.safetensors", "--input", tmp_path / "xb.safetensors",
            "--eps", "0.1", "--pgd-steps", "5", "--pgd-restarts", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["lofast_M"]) == 2 and len(out["delta22_tight"][1]) == 4
    r = cli("point", "--layer", d / "layer.safetensors", "--input", d / "x.safetensors", "--eps",
            "0.1", "--pgd-steps", "5", "--pgd-restarts", "1", cwd=tmp_path)
    assert r.returncode == 0 and "lofast_M" in r.stdout and "value/PGD" in r.stdout


def _bad_layer_files(d):
    good = models.random_dot(8, 2, seed=0)
    t, meta = models.io.layer_to_tensors(good)
    cases = {}
    save_file({k: v for k, v in t.items() if k != "W_k"}, str(d / "missing.st"), metadata=meta)
    cases["missing"] = ("missing.st", "missing tensor 'W_k'")
    save_file(t, str(d / "nokind.st"), metadata={"residual": "1"})
    cases["nokind"] = ("nokind.st", "missing metadata key 'kind'")
    bad = dict(t, W_q=torch.zeros(3, 10, 3), W_k=torch.zeros(3, 10, 3), W_v=torch.zeros(3, 10, 3),
               W_o=torch.zeros(3, 3, 10))
    save_file(bad, str(d / "dmodh.st"), metadata=meta)
    cases["dmodh"] = ("dmodh.st", "d % h != 0")
    shape = dict(t, W_o=torch.zeros(2, 5, 8))
    save_file(shape, str(d / "shape.st"), metadata=meta)
    cases["shape"] = ("shape.st", "inconsistent")
    nan = dict(t, W_v=t["W_v"].clone().fill_(float("nan")))
    save_file(nan, str(d / "nan.st"), metadata=meta)
    cases["nan"] = ("nan.st", "NaN or inf")
    (d / "garbage.st").write_bytes(b"\x00not a safetensors file at all")
    cases["garbage"] = ("garbage.st", "cannot read")
    cases["absent"] = ("absent.st", "no such file")
    return cases


@pytest.mark.parametrize("case", ["missing", "nokind", "dmodh", "shape", "nan", "garbage", "absent"])
def test_point_bad_layer(tmp_path, case, capsys):
    fname, words = _bad_layer_files(tmp_path)[case]
    models.save_input(tmp_path / "x.st", models.random_input(4, 8)[0])
    code, out, err = main_inprocess(capsys, "point", "--layer", tmp_path / fname, "--input",
                                    tmp_path / "x.st", "--eps", "0.1")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert out == ""


def test_point_bad_layer_subprocess(tmp_path):
    fname, words = _bad_layer_files(tmp_path)["garbage"]
    models.save_input(tmp_path / "x.st", models.random_input(4, 8)[0])
    r = cli("point", "--layer", tmp_path / fname, "--input", tmp_path / "x.st", "--eps", "0.1",
            cwd=tmp_path)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("eps,words", [("0", "eps must be finite and > 0"),
                                       ("-1", "eps must be finite and > 0"),
                                       ("inf", "eps must be finite and > 0"),
                                       ("nan", "eps must be finite and > 0"),
                                       ("abc", "invalid float value")])
def test_point_bad_eps(files, eps, words, capsys):
    d, _, _ = files
    code, _, err = main_inprocess(capsys, "point", "--layer", d / "layer.safetensors", "--input",
                                  d / "x.safetensors", "--eps", eps)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_point_bad_input_and_kind(files, tmp_path, capsys):
    d, _, _ = files
    save_file({"X": torch.full((4, 16), float("inf"))}, str(tmp_path / "inf.st"))
    save_file({"Y": torch.zeros(4, 16)}, str(tmp_path / "noX.st"))
    models.save_input(tmp_path / "wrongd.st", torch.zeros(4, 7))
    models.save_input(tmp_path / "rank4.st", torch.zeros(1, 1, 4, 16))
    for fname, words in [("inf.st", "NaN or inf"), ("noX.st", "missing tensor 'X'"),
                         ("wrongd.st", "X has d=7 but the layer has d=16"),
                         ("rank4.st", "X must be [n, d] or [B, n, d]")]:
        code, _, err = main_inprocess(capsys, "point", "--layer", d / "layer.safetensors",
                                      "--input", tmp_path / fname, "--eps", "0.1")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (fname, err)
    layer_args = ("point", "--layer", d / "layer.safetensors", "--input", d / "x.safetensors")
    code, _, err = main_inprocess(capsys, *layer_args, "--eps", "0.1", "--bounds", "kim")
    assert code == 2 and "does not apply to dot layers" in err
    code, _, err = main_inprocess(capsys, *layer_args, "--eps", "0.1", "--bounds", "nosuch")
    assert code == 2 and "unknown bound 'nosuch'" in err
    code, _, err = main_inprocess(capsys, "point", "--layer", d / "layer.safetensors")
    assert code == 2 and "required" in err and len(err.strip().splitlines()) == 1


def test_point_on_a_stack_file(tmp_path, capsys):
    stack = models.random_stack("dot", 3, 8, 2, seed=1, R=1.0)
    X = models.random_input(4, 8, norm=2.0, seed=2)[0]
    models.save_layer(tmp_path / "stack.st", stack)
    models.save_input(tmp_path / "x.st", X)
    code, out, err = main_inprocess(capsys, "point", "--layer", tmp_path / "stack.st", "--input",
                                    tmp_path / "x.st", "--eps", "0.01", "--json",
                                    "--pgd-steps", "10", "--pgd-restarts", "2")
    assert code == 0, err
    res = json.loads(out)
    assert res["meta"]["kind"] == "stack" and res["meta"]["depth"] == 3
    assert {"lofast_M", "jacobian_exp", "specformer"} <= set(res) and "zeta" not in res
    want = bounds.evaluate("lofast_M", stack, X, 0.01)[0]
    assert res["lofast_M"] == pytest.approx(float(want), rel=1e-9)
    assert res["lofast_M"] >= res["pgd"]
