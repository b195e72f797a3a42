"""A researcher's own bound as a plugin file (docs/guide/plugins.md): ``--plugin FILE.py`` on point,
run, certify, report and compare, and a profile's ``plugins = [...]``. Its rows go through the audit,
the gate and compare as any bound's, carry the file's sha256, and a bad plugin is one error line."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ONE, ROOT, main_inprocess, one_error

import attacks
import bounds
import models
from bench.core.store import load
from bench.report.panels import colour

EXAMPLE = ROOT / "docs" / "examples" / "plugin_half_lofast.py"
NAME = "half_lofast_or_naive"
# a plugin file's head: what every planted plugin below starts from
HEAD = "import torch\nfrom bounds.base import Bound\n"


def plugin(tmp_path, body: str, name: str = "mine.py"):
    path = tmp_path / name
    path.write_text(HEAD + body)
    return path


def bound_line(fn: str, name: str = "mine", certified: bool = True) -> str:
    """A plugin file's BOUNDS: one bound ``name`` of dot layers computing ``fn``'s expression."""
    return (f"def f(layer, X, eps):\n    return {fn}\n"
            f"BOUNDS = (Bound(name={name!r}, fn=f, paper='a test', equation='none', certified={certified}, "
            f"kinds=frozenset({{'dot'}})),)\n")


@pytest.fixture
def files(tmp_path):
    """A dot layer and an input, as the README's tour makes them (smaller)."""
    layer, x = tmp_path / "layer.safetensors", tmp_path / "x.safetensors"
    models.save_layer(layer, models.random_dot(d=8, h=2, seed=0, v_norm=0.5, o_norm=0.5, residual=True))
    models.save_input(x, models.random_input(n=4, d=8, norm=1.0, seed=1)[0])
    return layer, x


def point(capsys, files, *extra):
    layer, x = files
    return main_inprocess(capsys, "point", "--layer", layer, "--input", x, "--eps", "0.05",
                          "--pgd-steps", "5", "--pgd-restarts", "1", *extra)


def test_point_adds_the_plugin_row_and_leaves_the_registry_as_it_was(capsys, files):
    code, out, err = point(capsys, files, "--json", "--plugin", EXAMPLE)
    assert code == 0, err
    res = json.loads(out)
    assert NAME in res and res["meta"]["certified"][NAME] is True
    assert res["meta"]["plugins"] == {NAME: hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()}
    # the minimum of two certified bounds, at or above PGD
    assert res[NAME] == pytest.approx(min(res["lofast_M_half"], res["naive"]), rel=1e-12)
    assert res[NAME] >= res["pgd"] * (1 - 1e-6)
    assert NAME not in bounds.REGISTRY and not bounds.registry.PLUGINS  # joined for that command alone


def test_the_example_is_sound_on_a_stack():
    """Block by block (stack = propagate), as the suite's own certified bounds are audited."""
    from bench.core.plugins import load, using

    stack = models.random_stack("dot", 2, 8, 2, seed=3, R=1.0, n=4)
    X = models.random_input(n=4, d=8, norm=1.0, seed=4, batch=2)
    with using(load([EXAMPLE])):
        v = bounds.evaluate(NAME, stack, X, 0.05)
    assert v.shape == (2,)
    assert torch.all(v <= bounds.evaluate("lofast_M_half", stack, X, 0.05) * (1 + 1e-12))
    pgd = attacks.attack(stack, X.double(), 0.05, "output", steps=20, restarts=2)
    assert torch.all(v >= pgd * (1 - 1e-6))


def _profile(tmp_path, plugin_name: str = "plugin_half_lofast.py") -> str:
    """ONE (two tiny cells) with ``plugins = [...]``, the plugin beside the profile (relative path)."""
    path = tmp_path / "p.toml"
    path.write_text(f"plugins = [{plugin_name!r}]\n" + ONE)
    return str(path)


def test_a_profile_with_plugins_runs_reports_and_compares(tmp_path, capsys):
    shutil.copy(EXAMPLE, tmp_path / "plugin_half_lofast.py")
    out = tmp_path / "r"
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path), "--out", out)
    assert code == 0, err
    sha = hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["options"]["plugins"][0]["sha256"] == sha
    raw = pd.read_csv(out / "results.csv")
    mine = raw[raw["bound"] == NAME]
    assert len(mine) == 2 and set(mine["plugin_sha256"]) == {sha} and not mine["violation"].any()
    assert raw.loc[raw["bound"] != NAME, "plugin_sha256"].isna().all()  # built-in rows: none
    # reading needs the plugin: its file says whether the rows certify
    code, _, err = main_inprocess(capsys, "report", out)
    one_error(code, err, "--plugin")
    code, stdout, err = main_inprocess(capsys, "report", out, "--plugin", EXAMPLE)
    assert code == 0, err
    assert NAME in (out / "report" / "summary.md").read_text()
    code, stdout, err = main_inprocess(capsys, "compare", out, out, "--plugin", EXAMPLE)
    assert code == 0 and stdout.rstrip().endswith("OK"), stdout + err
    assert NAME not in bounds.REGISTRY


def test_a_plugin_bound_has_a_colour_of_its_own():
    from bench.core.plugins import load, using

    assert colour(NAME) is None  # not registered: not a bound
    with using(load([EXAMPLE])):
        first = colour(NAME)
    with using(load([EXAMPLE])):
        assert colour(NAME) == first is not None


def test_a_plugin_that_claims_a_certificate_below_pgd_fails_the_audit(tmp_path, capsys):
    plugin(tmp_path, bound_line("torch.zeros(X.shape[0], dtype=X.dtype)", "zero"), "zero.py")
    out = tmp_path / "r"
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path, "zero.py"), "--out", out)
    assert code == 0 and "SOUNDNESS VIOLATION: zero = 0 < PGD" in err and "SOUNDNESS VIOLATIONS: 2" in err
    code, stdout, err = main_inprocess(capsys, "compare", out, out, "--plugin", tmp_path / "zero.py")
    assert code == 1 and "`x` soundness violation: 2" in stdout and "FAILED" in stdout, stdout + err
    # the table states it honestly: the gate reads it, and judges it a violation from the registry
    from bench.core.gate import derive
    from bench.core.plugins import load as load_plugins
    from bench.core.plugins import using

    with using(load_plugins([tmp_path / "zero.py"])):
        df = load(out)
        assert derive(df).loc[df["bound"] == "zero", "violation"].all()
    # an estimate (certified=False) at the same value is no violation
    plugin(tmp_path, bound_line("torch.zeros(X.shape[0], dtype=X.dtype)", "zero", False), "zero.py")
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path, "zero.py"), "--out",
                                  tmp_path / "r2")
    assert code == 0 and "SOUNDNESS" not in err, err


def test_a_changed_plugin_file_is_never_compared_as_equal(tmp_path, capsys):
    shutil.copy(EXAMPLE, tmp_path / "plugin_half_lofast.py")
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path), "--out", tmp_path / "a")
    assert code == 0, err
    changed = tmp_path / "plugin_half_lofast.py"
    changed.write_text(changed.read_text() + "\n# the same bound, another file\n")
    # resuming the first run with the changed file would mix the two: refused
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path), "--out", tmp_path / "a")
    one_error(code, err, "other options")
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path), "--out", tmp_path / "b")
    assert code == 0, err
    code, stdout, _ = main_inprocess(capsys, "compare", tmp_path / "a", tmp_path / "b", "--plugin", changed)
    assert code == 1 and "`p` plugin file changed (another sha256): not compared: 2" in stdout, stdout
    assert "`!` missing in NEW: 0" in stdout and "`x` soundness violation: 0" in stdout
    code, stdout, _ = main_inprocess(capsys, "compare", tmp_path / "a", tmp_path / "b", "--plugin", changed,
                                     "--allow-missing")
    assert code == 0 and "| p | half_lofast_or_naive |" in stdout, stdout


BAD = {
    "missing": (None, "no such file"),
    "syntax": ("def f(:\n", "syntax error at line 3"),
    "import": ("import no_such_module_here\n", "failed to import: ModuleNotFoundError"),
    "raises_on_import": ("raise RuntimeError('boom')\n", "failed to import: RuntimeError: boom"),
    "no_bounds": ("X = 1\n", "defines no BOUNDS"),
    "not_a_bound": ("BOUNDS = ('naive',)\n", "BOUNDS holds a str, not a bounds.Bound"),
    "bad_kind": ("BOUNDS = (Bound(name='b', fn=lambda l, X, e: X, paper='p', equation='e', certified=True, "
                 "kinds=frozenset({'conv'})),)\n",
                 "kinds must be"),
    "clash_builtin": (bound_line("X.flatten(1).norm(dim=-1)", "lofast_M"), "already a built-in bound"),
    "shape": (bound_line("torch.zeros(X.shape[0], 2, dtype=X.dtype)"), "returned shape [1, 2]"),
    "nan": (bound_line("torch.full((X.shape[0],), float('nan'), dtype=X.dtype)"), "not finite"),
    "inf": (bound_line("torch.full((X.shape[0],), float('inf'), dtype=X.dtype)"), "not finite"),
    "raises": (bound_line("1 / 0"), "raised ZeroDivisionError"),
    "not_a_tensor": (bound_line("1.0"), "returned float, not a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_plugin_is_one_error_line(tmp_path, capsys, files, case):
    body, words = BAD[case]
    path = tmp_path / "mine.py" if body is None else plugin(tmp_path, body)
    code, _, err = point(capsys, files, "--plugin", path)
    one_error(code, err, words)
    assert not bounds.registry.PLUGINS and "mine" not in bounds.REGISTRY


def test_two_plugins_that_name_one_bound_are_refused(tmp_path, capsys, files):
    a = plugin(tmp_path, bound_line("X.flatten(1).norm(dim=-1)"), "a.py")
    b = plugin(tmp_path, bound_line("2 * X.flatten(1).norm(dim=-1)"), "b.py")
    code, _, err = point(capsys, files, "--plugin", a, "--plugin", b)
    one_error(code, err, f"bound 'mine' is already defined by the plugin {a}")
    code, _, err = point(capsys, files, "--plugin", a, "--plugin", a)  # the same file twice: once
    assert code == 0, err


def test_a_profile_names_a_bad_plugin_before_any_work(tmp_path, capsys):
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path, "absent.py"), "--out",
                                  tmp_path / "r")
    one_error(code, err, f"plugin {tmp_path / 'absent.py'}: no such file")
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="needs Dask (the dask extra)")
def test_dask_workers_run_the_plugin_and_say_its_failure(tmp_path, capsys):
    shutil.copy(EXAMPLE, tmp_path / "plugin_half_lofast.py")
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path), "--out", tmp_path / "w",
                                  "--workers", "1")
    assert code == 0, err
    df = pd.read_csv(tmp_path / "w" / "results.csv")
    assert (df["bound"] == NAME).sum() == 2
    plugin(tmp_path, bound_line("torch.full((X.shape[0],), float('nan'), dtype=X.dtype)"), "nan.py")
    code, _, err = main_inprocess(capsys, "run", "--profile", _profile(tmp_path, "nan.py"), "--out",
                                  tmp_path / "n", "--workers", "1")
    one_error(code, err, "not finite")


def test_certify_takes_a_plugin_bound(capsys):
    code, out, err = main_inprocess(capsys, "certify", "--model",
                                    ROOT / "zoo" / "digits-d32-b1-h2-c0.5-q1-m0.003.safetensors",
                                    "--eps", "0.02", "--bounds", f"naive,{NAME}", "--limit", "3",
                                    "--pgd-steps", "5", "--pgd-restarts", "1", "--json", "--plugin", EXAMPLE)
    assert code == 0, err
    s = json.loads(out)
    mine, naive = s["certified_accuracy"][NAME]["0.02"], s["certified_accuracy"]["naive"]["0.02"]
    assert mine >= naive and s["violations"] == 0
    assert s["meta"]["plugins"] == {NAME: hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()}


def test_the_resume_command_names_the_plugins(tmp_path):
    import shlex

    from bench.cli.main import build_parser, resume_command

    args = build_parser().parse_args(["run", "--profile", str(tmp_path / "p.toml"), "--plugin", "mine.py"])
    argv = shlex.split(resume_command(args, tmp_path / "r"))
    assert argv[argv.index("--plugin") + 1] == str(Path("mine.py").resolve())  # absolute: any directory
