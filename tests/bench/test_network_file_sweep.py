"""Your own ViTs in a sweep (#56 item 5): a profile's ``network = ["vit.pt2"]`` with ``data`` makes cells
of task ``certify_file``, whose rows are those of ``certify --model FILE --data FILE`` (the same
verdicts) with the files' hashes and the normalization, and whose report table recounts them; a file
changed after the cells were made is refused, as is any bad sweep, with one error line before any
work."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import main_inprocess, one_error
from import_models import ChannelFirst
from torch import nn

from bench.core.store import load
from bench.report.panels import Skip
from bench.report.tables import TABLES
from bench.sweep.cases import NetworkFileCell, cell_from_id, make_cell
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile
from models import InputError
from models.vit import ViT, ViTConfig

EPS = (0.002, 0.02)


def write_network(path: Path) -> nn.Module:
    """A small standard ViT (LayerNorm, GELU, class token) as a torch.export program at ``path``."""
    torch.manual_seed(3)
    cfg = ViTConfig(image=8, classes=10, d=16, depth=1, heads=2, patch=4, ffn=32, variant="standard",
                    constraint=None, ffn_constraint=None, activation="gelu")
    net = ChannelFirst(ViT(cfg, constrained=False)).eval()
    ep = torch.export.export(net, (torch.rand(2, 1, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(ep, str(path))
    return net


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("nf")
    net = write_network(tmp / "vit.pt2")
    x = torch.rand(6, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = net(x[:, None]).argmax(-1)
    torch.save({"images": x, "labels": y}, tmp / "data.pt")
    return tmp


def profile(tmp: Path, **sweep) -> Path:
    keys = {"name": '"imported_networks"', "network": f'["{tmp / "vit.pt2"}"]',
            "data": f'"{tmp / "data.pt"}"', "mean": "0.5", "std": "0.25",
            "eps": f"[{', '.join(map(str, EPS))}]", "samples": "4"} | sweep
    path = tmp / "p.toml"
    path.write_text("[run]\npgd_steps = 10\npgd_restarts = 1\n[[sweep]]\n"
                    + "".join(f"{k} = {v}\n" for k, v in keys.items() if v is not None))
    return path


@pytest.fixture(scope="module")
def run(files: Path) -> Path:
    return run_profile(load_profile(str(profile(files))), files / "run", "cpu")[0].parent


def test_a_cell_names_its_files_and_reads_back_from_its_id(files: Path):
    (cell,) = load_profile(str(profile(files, eps="0.01"))).sweeps["imported_networks"]
    assert isinstance(cell, NetworkFileCell) and cell.task == "certify_file"
    assert len(cell.network_sha256) == 16 and len(cell.data_sha256) == 16
    assert cell_from_id(cell.id) == cell
    p = cell.params()
    assert p["model"] == str(files / "vit.pt2") and p["dataset"] == str(files / "data.pt") and p["n"] is None


def test_the_rows_are_certifys_with_the_files_hashes(run: Path, files: Path, capsys):
    df = load(run)
    assert set(df["task"]) == {"certify_file"} and set(df["eps"]) == set(EPS)
    cert = df[df["role"] == "certify"]
    assert set(cert["bound"]) >= {"taylor_net"} and not cert["violation"].any()
    assert (cert["max_rel_err"] <= 1e-6).all() and set(cert["input_mean"]) == {0.5}
    assert set(cert["vit_depth"]) == {1} and cert["vit_test_accuracy"].isna().all()
    # the same verdicts as certify on the command line, at the same images and attack
    code, out, err = main_inprocess(capsys, "certify", "--model", files / "vit.pt2",
                                    "--data", files / "data.pt",
                                    "--mean", "0.5", "--std", "0.25", "--eps", ",".join(map(str, EPS)),
                                    "--bounds", "taylor_net", "--limit", "4", "--pgd-steps", "10",
                                    "--pgd-restarts", "1", "--json")
    assert code == 0, err
    got = json.loads(out)
    for e in EPS:
        rows = cert[(cert["bound"] == "taylor_net") & (cert["eps"] == e)].sort_values("sample")
        cli = got["samples"]["certified"]["taylor_net"][str(e)]
        assert list(rows["certified_pairwise"].astype(bool)) == cli


def test_the_table_recounts_the_rows(run: Path):
    df = load(run)
    t, caption = TABLES["imported_networks"](df)
    assert list(t["network"]) == [str(run.parent / "vit.pt2")] * len(EPS)
    assert list(t["images"]) == ["4"] * len(EPS)
    raw = pd.read_csv(run / "results.csv")
    for e, cell in zip(EPS, t["taylor_net (this suite)"], strict=True):
        r = raw[(raw["role"] == "certify") & (raw["bound"] == "taylor_net") & (raw["eps"] == e)]
        assert cell.startswith(f"{r['certified_pairwise'].astype(bool).mean():.3f} ")
    for needle in ("sha256", "(x − 0.5)/0.25", "runtime", "none does", "deterministic"):
        assert needle in caption, needle
    # the zoo models' tables do not take these rows, and say nothing of them
    with pytest.raises(Skip):
        TABLES["table1_certified"](df)


def test_one_file_on_two_normalizations_is_two_networks(run: Path):
    """Cells of one path but another normalization (or data file, or export) are never merged."""
    df = load(run)
    other = df.assign(input_mean=0.1, certified_pairwise=False, cell_id=df["cell_id"] + "'")
    t, caption = TABLES["imported_networks"](pd.concat([df, other], ignore_index=True))
    assert len(t) == 2 * len(EPS) and len(set(t["network"])) == 2
    assert all("(x − 0.5)/0.25" in n or "(x − 0.1)/0.25" in n for n in t["network"])
    assert "(x − 0.1)/0.25" in caption and "none does" in caption  # nothing counted twice, nothing above PGD


def test_hashes_read_back_as_text(run: Path, tmp_path: Path):
    """A 16-digit hash of decimal digits (or with one "e") is text, never a number, when a table is read."""
    df = pd.read_csv(run / "results.csv")
    df["network_sha256"] = "0412345678901234"
    df["data_sha256"] = "1234e56789012345"
    df.to_csv(tmp_path / "results.csv", index=False)
    back = load(tmp_path / "results.csv")
    assert set(back["network_sha256"]) == {"0412345678901234"}
    assert set(back["data_sha256"]) == {"1234e56789012345"}


def test_without_file_rows_the_table_is_not_listed(run: Path):
    with pytest.raises(Skip) as e:
        TABLES["imported_networks"](load(run).assign(task="certify"))
    assert not e.value.listed


def test_a_data_file_that_is_not_images_and_labels_is_named(files: Path, tmp_path: Path):
    bad = tmp_path / "bad.pt"
    torch.save({"images": torch.rand(4, 8, 8), "labels": torch.rand(4)}, bad)
    with pytest.raises(InputError, match=r"^data = '.*bad\.pt': labels must be integers"):
        make_cell(task="certify_file", network=str(files / "vit.pt2"), data=str(bad), eps=0.01)


def test_a_file_changed_after_the_cell_was_made_is_refused(files: Path, tmp_path: Path):
    data = tmp_path / "data.pt"
    data.write_bytes((files / "data.pt").read_bytes())
    cell = make_cell(task="certify_file", network=str(files / "vit.pt2"), data=str(data), eps=0.01)
    torch.save({"images": torch.zeros(2, 8, 8), "labels": torch.zeros(2, dtype=torch.long)}, data)
    with pytest.raises(InputError, match="changed since the cell was made"):
        cell_from_id(cell.id)


@pytest.mark.parametrize("sweep,says", [
    ({"network": '["nowhere.pt2"]'}, "no such file"),
    ({"network": '["vit.safetensors"]'}, "expected a .onnx or .pt2 file"),
    ({"data": '"d.npy"'}, "expected a .pt or .pth file"),
    ({"std": "0.0"}, "std finite and > 0"),
    ({"n": "16"}, "reads its network from its file and does not read n = 16"),
    ({"network_sha256": '"abc"'}, "taken from the files"),
    ({"samples": "7"}, "holds 6 images, fewer than samples = 7"),
    ({"data": '"vit.pt2"'}, "expected a .pt or .pth file"),
    ({"network": None, "task": '"certify_file"'}, 'needs network = ["FILE.onnx", ...]'),
])
def test_a_bad_sweep_is_one_error_line_before_any_work(files: Path, tmp_path: Path, capsys, sweep, says):
    path = profile(files, **sweep)
    out = tmp_path / "out"
    code, _, err = main_inprocess(capsys, "run", "--profile", path, "--out", out)
    one_error(code, err, says)
    assert not out.exists()


def test_certify_file_crown_without_auto_lirpa_says_so(files: Path, tmp_path: Path, capsys, monkeypatch):
    """As a certify_crown cell: the run's one note, and certify_file's rows."""
    import sys

    from bounds import crown

    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)
    path = profile(files, task='"certify_file_crown"', eps="0.01", samples="2")
    code, _, err = main_inprocess(capsys, "run", "--profile", path, "--out", tmp_path / "out")
    assert code == 0, err
    assert [ln for ln in err.splitlines() if "auto_LiRPA" in ln] == [f"note: the CROWN rows are left out: "
                                                                      f"{crown.INSTALL}"]
    assert "crown" not in set(load(tmp_path / "out")["bound"])
