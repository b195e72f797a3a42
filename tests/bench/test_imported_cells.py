"""Imported layers in a sweep (issue #30 item 3): a profile's ``imported = ["DIR", …]`` runs every
end-to-end bound × ε over every layer and input that ``python -m bench import`` wrote, as the
pretrained cells do; its directories and manifests are checked before any work; its rows pass the gate
and load; a model imported anew makes other cells, which ``compare`` never takes for the old ones.

The rows of a real import (a torch.export program of a small pre-norm/post-norm model) are checked
against what the torch model itself computes, in float64 and by code that shares nothing with the
suite: the input entering each attention (forward pre-hooks), ‖X‖_F, the median token norm, the
radius, and σ_max of the attention sub-layer's dense Jacobian (torch.autograd on tests/import_models.py
``dense``) against the ``jacobian`` estimate.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import main_inprocess, one_error
from import_models import Block, Fused, Net, Separate, dense, write_import

from bench.core.store import load
from bench.report.compare import compare
from bench.sweep.cases import cell_from_id
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile
from models import InputError, random_input, save_input
from models.imported import load as load_graph
from models.imported import run as run_import
from models.imported import write

D, H, N = 16, 2, 5
PROFILE = """[run]
pgd_steps = 20
pgd_restarts = 2
[[sweep]]
name = "mine"
imported = [{dirs}]
eps = [0.01, 0.1]
"""


def profile(tmp_path, *dirs, extra: str = "") -> str:
    path = tmp_path / "p.toml"
    path.write_text(PROFILE.format(dirs=", ".join(f'"{d}"' for d in dirs)) + extra)
    return str(path)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A pre-norm block (fused qkv, SDPA) then a post-norm one (separate q/k/v, explicit softmax),
    exported by torch.export and imported at 2 inputs; its run at 2 ε; the inputs the torch model's
    attentions saw."""
    tmp = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    model = Net([Block(Fused(D, H), D), Block(Separate(D, H), D, post=True)], D).eval().double()
    x = torch.randn(2, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.export.save(torch.export.export(model, (x[:1],)), str(tmp / "m.pt2"))
    torch.save(x, tmp / "x.pt")
    write(tmp / "imp", tmp / "m.pt2", run_import(load_graph(tmp / "m.pt2"), x))  # `bench import`'s library
    seen = []
    attns = [b.attn for b in model.blocks]
    hooks = [a.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach())) for a in attns]
    with torch.no_grad():
        for i in range(len(x)):
            model(x[i:i + 1])
    for hk in hooks:
        hk.remove()
    xs = {(k, i): seen[i * len(attns) + k][0] for k in range(len(attns)) for i in range(len(x))}
    table = run_profile(load_profile(profile(tmp, tmp / "imp")), tmp / "run", "cpu")[0]
    return {"dir": tmp / "imp", "model": model, "attns": attns, "xs": xs, "df": load(table), "tmp": tmp}


def test_every_layer_input_and_eps_is_a_cell(real):
    cells = load_profile(profile(real["tmp"], real["dir"])).cells()
    assert len(cells) == 2 * 2 * 2  # ε × layers × inputs
    sha = json.loads((real["dir"] / "manifest.json").read_text())["sha256"]
    for _, c in cells:
        assert c.task == "imported" and c.imported_sha256 == sha and len(c.imported_data) == 16
        assert cell_from_id(c.id) == c
        assert c.id.startswith(f"imported[dir={real['dir']},layer={c.imported_layer},"
                               f"input={c.imported_input},sha256={sha},")
    assert {(c.imported_layer, c.imported_input, c.eps) for _, c in cells} == \
        {(k, i, e) for k in (0, 1) for i in (0, 1) for e in (0.01, 0.1)}


def test_rows_against_the_torch_model(real):
    df = real["df"]  # loaded through the store: the gate recomputed every row's soundness
    assert not df["violation"].any() and set(df["task"]) == {"imported"}
    for (k, i), X in real["xs"].items():
        at = df[(df["imported_layer"] == k) & (df["imported_input"] == i)]
        attn, post = real["attns"][k], k == 1
        assert set(at["residual"]) == {post} and set(at["d"]) == {D} and set(at["h"]) == {H}
        assert set(at["n"]) == {N}
        Xn = X.numpy()
        block = at[at["role"] == "block"].groupby("bound")["value"].first()
        assert block["x_fro"] == pytest.approx(np.linalg.norm(Xn), rel=1e-12)
        med = float(np.median(np.linalg.norm(Xn, axis=1)))
        assert block["median_token_norm"] == pytest.approx(med, rel=1e-12)
        J = torch.autograd.functional.jacobian(lambda z, a=attn, p=post: dense(a, z, p), X)
        J = J.reshape(N * D, N * D)
        sigma = float(np.linalg.svd(J.numpy(), compute_uv=False)[0])
        for eps in (0.01, 0.1):
            e = at[at["eps"] == eps]
            assert np.allclose(e["radius"], eps * med, rtol=1e-12, atol=0)
            jac = e[(e["role"] == "bound") & (e["bound"] == "jacobian")]["value"]
            assert float(jac.iloc[0]) == pytest.approx(sigma * eps * med, rel=1e-6)
            ends = e[(e["role"] == "bound") & (e["objective"] == "output") & e["certified"]]
            assert {"lofast_M", "taylor", "best", "naive"} <= set(ends["bound"])
            assert (ends["value"] >= ends["pgd"] * (1 - 1e-6)).all()


def test_a_model_imported_anew_is_never_compared_as_the_old(tmp_path):
    write_import(tmp_path / "imp", seed=1)
    shutil.copytree(tmp_path / "imp", tmp_path / "kept")
    old = run_profile(load_profile(profile(tmp_path, tmp_path / "imp")), tmp_path / "old", "cpu")[0]
    write_import(tmp_path / "imp", seed=2)  # another model in the same directory
    new = run_profile(load_profile(profile(tmp_path, tmp_path / "imp")), tmp_path / "new", "cpu")[0]
    with pytest.raises(InputError, match="no row in common"):
        compare(load(old), load(new))
    shutil.rmtree(tmp_path / "imp")
    shutil.copytree(tmp_path / "kept", tmp_path / "imp")  # the first import's files, byte for byte
    again = run_profile(load_profile(profile(tmp_path, tmp_path / "imp")), tmp_path / "again", "cpu")[0]
    j = compare(load(old), load(again))
    assert set(j["marker"]) <= {" ", "~"}


def test_changed_files_are_refused_by_a_cell(tmp_path):
    write_import(tmp_path / "imp", inputs=2)
    cell = load_profile(profile(tmp_path, tmp_path / "imp")).cells()[0][1]
    save_input(tmp_path / "imp" / "layer0_input0.safetensors", random_input(4, 8, seed=99)[0])
    with pytest.raises(InputError, match="files changed"):
        cell_from_id(cell.id)  # as a Dask worker rebuilds it, or a resumed run's cell
    with pytest.raises(InputError, match="files changed"):
        cell.build()


def _refused(capsys, tmp_path, prof: str, words: str) -> None:
    code, _, err = main_inprocess(capsys, "run", "--profile", prof, "--out", tmp_path / "out")
    one_error(code, err, words)
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_no_manifest(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "empty"), "holds no manifest.json")


def test_no_directory(capsys, tmp_path):
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "nowhere"), "no such directory")


def test_a_missing_file(capsys, tmp_path):
    write_import(tmp_path / "imp", inputs=2)
    (tmp_path / "imp" / "layer0_input1.safetensors").unlink()
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "imp"),
             "names 'layer0_input1.safetensors', which is not a file")


def test_a_layer_the_import_refused(capsys, tmp_path):
    write_import(tmp_path / "imp", layers=2)
    path = tmp_path / "imp" / "manifest.json"
    m = json.loads(path.read_text())
    m["layers"][1]["max_rel_err"] = 3e-4
    path.write_text(json.dumps(m))
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "imp"), "layer 1 (softmax_1): max_rel_err")


@pytest.mark.parametrize("extra, words", [
    ('n = 8\n', "does not read n = 8"),
    ('task = "bounds"\n', "read only by task 'imported'"),
    ('imported_layer = 1\n', "come from an import's manifest"),
])
def test_fields_an_imported_sweep_does_not_take(capsys, tmp_path, extra, words):
    write_import(tmp_path / "imp")
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "imp", extra=extra), words)


def test_bad_directory_names(capsys, tmp_path):
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "a,b"), "not a directory name a cell id")
    write_import(tmp_path / "imp")
    _refused(capsys, tmp_path, profile(tmp_path, tmp_path / "imp", tmp_path / "imp"), "twice")
    p = tmp_path / "q.toml"
    p.write_text('[[sweep]]\nname = "x"\ntask = "imported"\n')
    _refused(capsys, tmp_path, str(p), 'task imported needs imported = ["DIR", ...]')


def test_a_relative_directory_is_the_checkouts(tmp_path, monkeypatch):
    from bench.sweep import imported

    monkeypatch.setattr(imported, "ROOT", tmp_path)
    write_import(tmp_path / "results" / "imp")
    cell = load_profile(profile(tmp_path, "results/imp")).cells()[0][1]
    assert cell.imported == "results/imp" and cell.params()["d"] == 8
    layer, X = cell.build()
    assert X.shape == (1, 4, 8) and layer.d == 8 and math.isfinite(float(X.norm()))
