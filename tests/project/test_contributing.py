"""docs/contributing.md's recipes, followed step by step: a bound added to the registry runs through
``point``, a sweep added to a profile runs, a figure added to FIGURES is drawn by ``report``, and the
gate judges the new rows; the plugin route adds a bound without an edit; every path the page names
exists."""

from __future__ import annotations

import json
import re

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
