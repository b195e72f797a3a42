"""Loose ends of issue #23, each a behaviour that was wrong: ``train --zoo`` ignored the options of a
single model without a word; modules imported each other's private names; the runner, the tasks and
``compare`` asked in different ways whether an optional package is there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import main_inprocess, one_error

import bounds.crown as crown_
from bench.report.compare import absent_here
from bench.sweep import tasks
from bounds.registry import unavailable
from models import InputError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "bounds", "attacks", "models")


@pytest.mark.parametrize("extra,named", [(["--depth", "3"], "--depth"),
                                         (["--seed", "1", "--heads", "4"], "--heads, --seed"),
                                         (["--margin-eps", "0.01"], "--margin-eps")])
def test_train_zoo_refuses_the_options_of_one_model(capsys, tmp_path, extra, named):
    code, out, err = main_inprocess(capsys, "train", "--zoo", "--out", str(tmp_path / "zoo"), *extra)
    one_error(code, err, f"{named} appl")
    assert out == "" and not (tmp_path / "zoo").exists()


def _private_imports() -> list[str]:
    """``from X import _name`` across the project's modules (its own private names are its own)."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names():
    assert _private_imports() == []


def test_one_question_decides_what_is_absent_here(monkeypatch):
    """Without auto_LiRPA, compare's ``s`` rows and the tasks' CROWN rows come from the same answer."""
    def missing():
        raise InputError("auto_LiRPA is not installed")

    monkeypatch.setattr(crown_, "lirpa_module", missing)
    gone = unavailable()
    assert {"crown", "alpha_crown", "cascade_crown"} <= gone
    assert absent_here() == gone
    names = [n for n in tasks.CROWN_TASKS["crown"] if n not in gone]
    assert names == ["taylor", "lofast_xi", "best"]
