"""CROWN and α-CROWN through auto_LiRPA (docs/bounds.md §2.5): sound against PGD on random dot layers
(n, d, h, H, biases, input norm, weight scale and ε varied), α-CROWN never looser than CROWN, exact
on a layer whose attention is constant (a linear map), opt-in in the registry; and without
auto_LiRPA one ``error:`` line from ``point`` and one note from a sweep."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import ROOT, main_inprocess

import attacks
import bounds
import models
from bounds import crown
from bounds.certificates import Certificate

needs_lirpa = pytest.mark.skipif(not crown.available(),
                                 reason="auto_LiRPA is not installed (the crown extra, docs/crown.md)")
REL = 1e-6  # as tests/bounds/test_soundness.py: a value below pgd·(1 − 1e-6) is a violation
N_LAYERS, BATCH = 12, 2  # 24 CROWN cases
ALPHA_CASES = (0, 3, 7)  # α-CROWN takes seconds a case even at these sizes


@functools.cache
def config(k: int) -> dict:
    rnd = random.Random(f"crown-{k}")
    h = (1, 2, 4)[k % 3]
    return {"n": rnd.randint(2, 6), "d": h * rnd.choice((1, 2, 3)), "h": h, "residual": k % 2 == 0,
            "bias_norm": 0.0 if k % 4 == 0 else rnd.choice((0.5, 2.0)),
            "weight_norm": 10 ** rnd.uniform(-0.5, 0.5), "eps": 10 ** rnd.uniform(-3, math.log10(0.5)),
            "norms": tuple(10 ** rnd.uniform(-1, 1) for _ in range(BATCH)), "seed": 700 + k}


@functools.cache
def case(k: int):
    cfg = config(k)
    X = torch.cat([models.random_input(cfg["n"], cfg["d"], norm=xn, seed=10 * cfg["seed"] + i)
                   for i, xn in enumerate(cfg["norms"])])
    w = cfg["weight_norm"]
    layer = models.random_dot(cfg["d"], cfg["h"], seed=cfg["seed"], q_norm=w, k_norm=w, v_norm=w,
                              o_norm=w, residual=cfg["residual"], bias_norm=cfg["bias_norm"])
    return layer, X


@functools.cache
def pgd(k: int) -> torch.Tensor:
    layer, X = case(k)
    return attacks.attack(layer, X, config(k)["eps"], "output", steps=200, restarts=8)


def test_cases_vary_what_the_audit_claims():
    cfgs = [config(k) for k in range(N_LAYERS)]
    assert {c["h"] for c in cfgs} == {1, 2, 4} and {c["residual"] for c in cfgs} == {True, False}
    assert sum(case(k)[0].has_biases for k in range(N_LAYERS)) >= N_LAYERS // 2
    assert min(c["eps"] for c in cfgs) < 1e-2 < 0.1 < max(c["eps"] for c in cfgs)


@needs_lirpa
def test_crown_is_sound_against_pgd():
    violations = []
    for k in range(N_LAYERS):
        layer, X = case(k)
        v = bounds.evaluate_certified("crown", layer, X, config(k)["eps"])
        lower = pgd(k)
        assert v.certificate == Certificate("relaxation")
        assert v.value.shape == lower.shape == (BATCH,) and torch.all(lower > 0)
        assert torch.isfinite(v.value).all()
        if not torch.all(v.value >= lower * (1 - REL)):
            violations.append(f"layer {k} {config(k)}: crown {v.value.tolist()} < pgd {lower.tolist()}")
    assert not violations, "\n".join(violations)


@needs_lirpa
@pytest.mark.parametrize("k", ALPHA_CASES)
def test_alpha_crown_is_sound_and_never_looser_than_crown(k):
    layer, X = case(k)
    eps, X = config(k)["eps"], X[:1]  # one input of the case: α-CROWN takes seconds per input
    alpha = bounds.evaluate("alpha_crown", layer, X, eps)
    assert torch.all(alpha >= pgd(k)[:1] * (1 - REL)), (alpha.tolist(), pgd(k).tolist())
    assert torch.all(alpha <= bounds.evaluate("crown", layer, X, eps) * (1 + 1e-12))


@needs_lirpa
@pytest.mark.parametrize(("n", "d", "h", "residual"), [(4, 6, 2, True), (3, 1, 1, False)])
def test_crown_is_exact_per_output_where_attention_is_constant(n, d, h, residual):
    """W^Q = W^K = 0: every P_l = 11ᵀ/n, so F is the linear map J = H ⊗ I + Σ_l (11ᵀ/n) ⊗ C_lᵀ (row-major
    vec, docs/bounds.md notation). Over the *joint* ball ‖Γ‖_F ≤ ε the change of output i is at most
    ε‖J_i‖, attained, so CROWN's value must be ε‖J‖_F: no less (auto_LiRPA's own softmax relaxation
    was 1.2e-7 relative short here, bounds/crown.py), and no more (balls per token would give more).
    With d = 1 and H = 0, J is rank one and that is the true sensitivity, which PGD attains."""
    eps = 0.1
    base = models.random_dot(d, h, seed=5, residual=residual, bias_norm=1.0)
    zero = torch.zeros_like
    layer = models.DotMHA(zero(base.W_q), zero(base.W_k), base.W_v, base.W_o, residual,
                          zero(base.b_q), zero(base.b_k), base.b_v, base.b_o)
    X = models.random_input(n, d, norm=2.0, seed=6)
    C = (layer.W_v @ layer.W_o).numpy()
    J = (np.eye(n * d) if residual else 0) + sum(np.kron(np.ones((n, n)) / n, c.T) for c in C)
    value = float(bounds.evaluate("crown", layer, X, eps)[0])
    assert value == pytest.approx(eps * np.linalg.norm(J, "fro"), rel=1e-12)
    lower = float(attacks.attack(layer, X, eps, "output", steps=200, restarts=8)[0])
    assert lower == pytest.approx(eps * np.linalg.norm(J, 2), rel=1e-6)
    if d == 1 and not residual:
        assert value >= lower * (1 - 1e-12) and value == pytest.approx(lower, rel=1e-9)
    else:  # the box of per-output bounds is loose by ‖J‖_F/‖J‖ (docs/bounds.md §2.5)
        assert value > 1.5 * lower


def test_traced_layer_is_the_layer():
    layer = models.random_dot(8, 2, seed=0, bias_norm=0.5, residual=False)
    X = models.random_input(4, 8, norm=3.0, seed=0, batch=2)
    for Xb in X:
        got = crown.Traced(layer, Xb)(X.reshape(2, -1)).reshape(2, 4, 8)
        assert torch.allclose(got, layer.forward(X), rtol=1e-13, atol=1e-13)


@needs_lirpa
def test_crown_propagates_through_a_stack():
    stack = models.random_stack("dot", 2, 4, 2, seed=51, R=1.0, weight_norm=0.8, n=3)
    X = models.projected_input(3, 4, R=1.0, scale=2.0, seed=1, batch=2)
    value = bounds.evaluate("crown", stack, X, 0.05)
    lower = attacks.attack(stack, X, 0.05, "output", steps=100, restarts=8)
    assert torch.all(value >= lower * (1 - REL)) and torch.all(lower > 0)


def test_crown_is_opt_in_and_certified_as_a_relaxation():
    layer = models.random_dot(4, 2, seed=0)
    names = [b.name for b in bounds.applicable(layer)]
    assert "crown" not in names and "alpha_crown" not in names and "taylor" in names
    # CROWN's family is opt-in (others may be too: the set is not pinned, a new opt-in bound keeps it)
    assert {"crown", "alpha_crown", "cascade_crown", "cascade_taylor_net_crown"} <= {
        b.name for b in bounds.BOUNDS if b.opt_in}
    for name in ("crown", "alpha_crown"):
        b = bounds.REGISTRY[name]
        assert b.certified and not b.finding and b.biases and b.kinds == {"dot"}
    with pytest.raises(models.InputError, match="does not apply to l2 layers"):
        bounds.require(bounds.get("crown"), models.random_layer("l2", 4, 2))
    # the cascade is a whole-network procedure: certified (its rows are judged), on no layer
    for name in ("cascade_crown", "cascade_taylor_net_crown"):
        cascade = bounds.REGISTRY[name]
        assert cascade.certified and not cascade.finding and not cascade.kinds
    with pytest.raises(models.InputError, match="does not apply to dot layers"):
        bounds.require(cascade, layer)
    # relaxation sits between deterministic and probabilistic, and is what a sum of both is
    assert (Certificate("relaxation") & Certificate("deterministic")).kind == "relaxation"
    assert (Certificate("relaxation") & Certificate("probabilistic", 1e-9)).kind == "probabilistic"


@pytest.fixture
def files(tmp_path):
    models.save_layer(tmp_path / "layer.safetensors", models.random_dot(4, 2, seed=1, bias_norm=0.5))
    models.save_input(tmp_path / "x.safetensors", models.random_input(3, 4, norm=1.5, seed=2)[0])
    return ("point", "--layer", tmp_path / "layer.safetensors", "--input", tmp_path / "x.safetensors",
            "--eps", "0.05", "--pgd-steps", "10", "--pgd-restarts", "2")


@needs_lirpa
def test_point_shows_crown(files, capsys):
    code, out, err = main_inprocess(capsys, *files, "--bounds", "crown,taylor", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["meta"]["certificates"]["crown"]["kind"] == "relaxation"
    assert got["crown"] >= got["taylor"] >= got["pgd"] > 0


def test_point_without_auto_lirpa_is_one_error_line(files, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)  # import auto_LiRPA now raises ImportError
    assert not crown.available()
    code, out, err = main_inprocess(capsys, *files, "--bounds", "taylor,crown")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: auto_LiRPA is not installed") and "pip install" in line


def test_a_sweep_without_auto_lirpa_leaves_crown_out_with_one_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)
    profile = tmp_path / "p.toml"
    profile.write_text('[run]\npgd_steps = 5\npgd_restarts = 1\n[[sweep]]\nname = "c"\ntask = "crown"\n'
                       'n = 3\nd = 4\nh = 2\neps = [0.01, 0.1]\n')
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "out")
    assert code == 0, err
    assert [ln for ln in err.splitlines() if "auto_LiRPA" in ln] == [f"note: the CROWN rows are left out: "
                                                                      f"{crown.INSTALL}"]
    df = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(df.loc[df["role"] == "bound", "bound"]) == {"taylor", "lofast_xi", "best"}


def test_the_wheel_installer_succeeds_without_the_wheels(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("crown_wheels", ROOT / "tools" / "crown_wheels.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(tool, "WHEELS", tmp_path / "absent")
    monkeypatch.setattr(tool.subprocess, "call", lambda *a, **k: pytest.fail("pip must not run"))
    assert tool.main() == 0
    assert capsys.readouterr().out.startswith("note: ")


def test_crown_sweeps_opt_in_where_the_profiles_say():
    from bench.sweep.profiles import load_profile

    for profile in ("quick", "crown"):
        cells = [c for _, c in load_profile(profile).cells() if c.task in ("crown", "alpha_crown")]
        assert cells and {c.eps for c in cells} == {0.01, 0.1}
        big = [c for c in cells if (c.n, c.d, c.h, c.x, c.x_norm) == (16, 32, 4, "fro", 5.0)]
        assert {c.task for c in big} == ({"crown"} if profile == "quick" else {"crown", "alpha_crown"})
    quick = load_profile("quick").cells()
    assert sum(c.task == "alpha_crown" for _, c in quick) == 1  # a small layer: seconds, not minutes


@needs_lirpa
def test_importing_auto_lirpa_leaves_the_root_logger_alone():
    # auto_LiRPA's import calls logging.basicConfig(level=INFO); in a fresh process, so that it runs
    code = ("import logging; from bounds import crown; crown.check(); r = logging.getLogger(); "
            "print(r.level, len(r.handlers))")
    # the checkout first, then whatever path auto_LiRPA came by (a lent GPU machine's PYTHONPATH)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["30", "0"]
