"""docs/contributing.md's recipes, followed step by step: a bound added to the registry runs through
``point``, a sweep added to a profile runs, a figure added to FIGURES is drawn by ``report``, and the
gate judges the new rows; a toy stage built by the stage recipe holds its deviations forward and
backward; the plugin route adds a bound without an edit; every path the page names exists."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import pandas as pd
import pytest
import torch
from helpers import ROOT, main_inprocess

import bounds
import models
from bench.core import gate
from bench.core.store import load
from bench.report import figures
from bench.report.panels import Panel, Plot, bound_trace, pgd_trace, present, sweep
from bounds import lofast, registry
from bounds.base import Bound
from bounds.network.record import Step
from bounds.network.zonotope import DeviationSet

PAGE = ROOT / "docs" / "contributing.md"
NAME = "toy_naive"


def toy_naive(layer, X, eps, *, ledger=None):
    """1% above naive: a certified bound because naive is one (the recipe's step 2); the certified
    norms it uses record their certificates in ``ledger``."""
    return lofast.naive(layer, X, eps, ledger=ledger) * 1.01


# the recipe's step 3, keywords only
TOY = Bound(name=NAME, fn=toy_naive, paper="docs/contributing.md", equation="1.01 × naive",
            certified=True, kinds=registry.DOT, stack="propagate", biases=True, display="toy naive")


@pytest.fixture
def toy_bound(monkeypatch):
    """The toy bound as an entry of BOUNDS (monkeypatched: gone after the test)."""
    monkeypatch.setattr(registry, "BOUNDS", (*registry.BOUNDS, TOY))
    monkeypatch.setitem(registry.REGISTRY, NAME, TOY)
    return TOY


def toy_figure(df: pd.DataFrame) -> Plot:
    """The figure recipe's study function: the toy bound and PGD over ε, from sweep ``my_sweep``."""
    sub = sweep(df, "my_sweep")
    traces = present(bound_trace(sub, "eps", NAME), bound_trace(sub, "eps", "naive"), pgd_trace(sub, "eps"))
    return Plot([[Panel("(a) the toy bound", "ε", "‖ΔF‖_F", traces, xscale="log")]],
                "The toy bound of docs/contributing.md against naive and PGD, over ε.", (4.0, 3.0))


SWEEP = """
[run]
pgd_steps = 3
pgd_restarts = 1
[[sweep]]
name = "my_sweep"
kind = "dot"
n = 3
d = 4
h = 2
eps = [0.01, 0.05]
"""


def test_the_page_is_linked_and_every_path_it_names_exists():
    text = PAGE.read_text()
    assert "docs/contributing.md" in (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:bounds|bench|tests|docs)/[\w/.*-]+\.(?:py|md|toml))`", text))
    named |= {f"docs/{p}" for p in re.findall(r"\]\(((?:guide/|examples/)?[\w-]+\.(?:md|py))\)", text)}
    assert len(named) > 15
    for path in sorted(named):
        matches = list(ROOT.glob(path))
        assert matches, f"docs/contributing.md names {path}, which does not exist"


def test_a_bound_added_to_the_registry_runs_in_point(toy_bound, tmp_path, capsys):
    layer, x = tmp_path / "layer.safetensors", tmp_path / "x.safetensors"
    models.save_layer(layer, models.random_dot(d=8, h=2, seed=0, v_norm=0.5, o_norm=0.5, residual=True))
    models.save_input(x, models.random_input(n=4, d=8, norm=1.0, seed=1)[0])
    code, out, err = main_inprocess(capsys, "point", "--layer", layer, "--input", x, "--eps", "0.05",
                                    "--pgd-steps", "5", "--pgd-restarts", "1", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res[NAME] == pytest.approx(1.01 * res["naive"], rel=1e-12)
    assert res["meta"]["certified"][NAME] is True and res[NAME] >= res["pgd"] * (1 - 1e-6)
    # best takes it among its ingredients (a certified end-to-end bound): at most its value
    assert res["best"] == min(res["best"], res[NAME])


def test_a_bound_a_sweep_and_a_figure_go_through_run_report_and_the_gate(toy_bound, monkeypatch,
                                                                          tmp_path, capsys):
    monkeypatch.setitem(figures.FIGURES, "my_figure", toy_figure)
    profile = tmp_path / "p.toml"
    profile.write_text(SWEEP)
    out = tmp_path / "r"
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", out)
    assert code == 0, err
    df = load(out)  # every reader of a table runs the gate (bench.core.gate.check)
    gate.check(df, out)
    mine = df[(df["bound"] == NAME) & (df["role"] == "bound")]
    assert set(mine["sweep"]) == {"my_sweep"} and len(mine) == 2
    assert not mine["violation"].any() and set(mine["certificate"]) <= set(gate.CERTIFIED_KINDS)
    code, _, err = main_inprocess(capsys, "report", out)
    assert code == 0, err
    report = out / "report"
    assert (report / "my_figure.png").exists() and (report / "my_figure.pdf").exists()
    assert "my_figure" in (report / "README.md").read_text()
    assert NAME in (report / "summary.md").read_text()


def test_a_plugin_adds_a_bound_without_an_edit():
    """The no-edit route: the same Bound in a file of one's own (docs/guide/plugins.md)."""
    from bench.core.plugins import load as load_plugins
    from bench.core.plugins import using

    example = ROOT / "docs" / "examples" / "plugin_half_lofast.py"
    layer = models.random_dot(d=8, h=2, seed=0)
    X = models.random_input(n=4, d=8, norm=1.0, seed=1)
    with using(load_plugins([example])):
        v = bounds.evaluate("half_lofast_or_naive", layer, X, 0.05)
    assert torch.equal(v, torch.minimum(bounds.evaluate("lofast_M_half", layer, X, 0.05),
                                        bounds.evaluate("naive", layer, X, 0.05)))
    assert "half_lofast_or_naive" not in bounds.REGISTRY


# --- the stage recipe (docs/guide/add-a-stage.md), on a toy stage: x ↦ x + α·sin(x) per entry. Its
# Jacobian at x0 is diag(1 + α cos x0); |sin(x0 + δ) − sin(x0) − cos(x0)δ| ≤ ½δ², so its remainder is
# ≤ ½α‖δ‖∞‖δ‖_F ≤ ½α r² on a ball of Frobenius radius r (step 1, the math)
ALPHA = 0.3


@dataclass(frozen=True)
class ToySineRecord:
    """Step 3: what the backward pass needs (its Jacobian's diagonal and its remainder's radius)."""

    name: str
    slope: torch.Tensor  # [B, n, d]
    rho: torch.Tensor  # [B]

    def step(self, Lam: torch.Tensor) -> Step:
        return Step(Lam * self.slope[:, None], charge=Lam.flatten(2).norm(dim=-1) * self.rho[:, None])


def toy_sine(S: DeviationSet, x0: torch.Tensor, eps: float, log: list | None = None) -> DeviationSet:
    """Step 2: the exact linear part on every part of the set (per_token), E's radii grown by its norm,
    the remainder on the set's radius as a new ball."""
    slope = 1 + ALPHA * torch.cos(x0)  # [B, n, d]
    top = slope.abs().flatten(1).amax(-1)  # the map's spectral norm, per image
    rest = 0.5 * ALPHA * S.radius(eps) ** 2
    out = S.per_token(torch.diag_embed(slope))
    out = dataclasses.replace(out, rho=S.rho * top[:, None], route=S.route * top + rest,
                              tok=None if S.tok is None else S.tok * top[:, None])
    if log is not None:
        log.append(ToySineRecord("toy_sine", slope, rest))
    return out.add_ball("toy_sine", rest)


def test_a_stage_added_by_the_recipe_holds_its_deviations_forward_and_backward(monkeypatch):
    """Step 6 on the toy stage: sampled true deviations lie in the set (its support in random
    directions), the backward pass crosses its record once the record is in backward.STAGES (and
    refuses it before), and its lower bounds hold every sampled deviation."""
    from bounds.network import backward as back

    g = torch.Generator().manual_seed(0)
    B, n, d, P, eps = 2, 3, 4, 5, 0.5
    G0 = torch.randn(n, d, P, generator=g, dtype=torch.float64)
    x0 = torch.randn(B, n, d, generator=g, dtype=torch.float64)
    G = G0.expand(B, -1, -1, -1)
    start = DeviationSet.ball_of(G, eps * torch.linalg.matrix_norm(G0.reshape(n * d, P), 2).expand(B))
    log: list = []
    out = toy_sine(start, x0, eps, log)
    slope = 1 + ALPHA * torch.cos(x0)

    def true(delta):  # [S, B, P] → the toy stage's true deviations [S, B, n, d]
        moved = torch.einsum("ndp,sbp->sbnd", G0, delta)
        return (moved + ALPHA * torch.sin(x0 + moved)) - ALPHA * torch.sin(x0)

    def worst(c):  # the pixel deviations where the linear part attains its support along ±c [B, n, d]
        v = torch.einsum("bnd,ndp->bp", c * slope, G0)
        return torch.stack([eps * v / v.norm(dim=-1, keepdim=True), -eps * v / v.norm(dim=-1, keepdim=True)])

    rand = torch.randn(200, B, P, generator=g, dtype=torch.float64)
    rand = eps * rand / rand.norm(dim=-1, keepdim=True)
    rand = rand * torch.rand(200, B, 1, generator=g, dtype=torch.float64)
    for _ in range(20):
        c = torch.randn(B, n, d, generator=g, dtype=torch.float64)
        seen = (true(torch.cat([rand, worst(c)])) * c).sum((-1, -2))
        assert (seen <= out.support(c, eps) * (1 + 1e-12) + 1e-12).all()
    Lam = torch.randn(B, 2, n, d, generator=g, dtype=torch.float64)
    points = torch.cat([rand, worst(Lam[:, 0]), worst(Lam[:, 1])])
    with pytest.raises(ValueError, match="unknown stage record"):
        back.backward(log, Lam, G0, eps)
    monkeypatch.setattr(back, "STAGES", (*back.STAGES, ToySineRecord))
    lower, _ = back.backward(log, Lam, G0, eps)
    attained = torch.einsum("bcnd,sbnd->sbc", Lam, true(points)).amin(0)
    assert (lower <= attained + 1e-12).all()
