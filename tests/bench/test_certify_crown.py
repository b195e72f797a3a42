"""Whole-network CROWN in ``python -m bench certify`` (bounds/network/netcrown.py, docs/bounds.md §5): the
traced network is the ViT, CROWN-certified images are never broken by PGD, the cascade certifies
between its first bound and the union of both, and the CLI's refusals and JSON."""

from __future__ import annotations

import json
import math
import sys

import pandas as pd
import pytest
import torch
from helpers import ROOT, main_inprocess

from bench.cli.certify_cmd import summary
from bench.core import gate, store
from bench.core.partial import DiskStore, code_salt
from bench.core.store import PARTIAL
from bench.nets.accuracy import (
    CertifyRun,
    first_test_images,
    load_model,
    run_certify,
)
from bench.sweep.profiles import load_profile
from bench.sweep.rows import network_rows
from bench.sweep.runner import Interrupted, run_profile
from bounds import crown
from bounds.network import netcrown
from bounds.network.netcrown import TracedViT, spec, verify
from bounds.registry import CASCADE, CASCADE_FIRST

ZOO = ROOT / "zoo"
TINY = ZOO / "tiny-digits-d16-b1-h1-c0.5.safetensors"
DEPTH1 = ZOO / "digits-d32-b1-h2-c0.5-q1-m0.003.safetensors"
needs_lirpa = pytest.mark.skipif(not crown.available(),
                                 reason="auto_LiRPA is not installed (the crown extra)")


@pytest.mark.parametrize("path", [TINY, DEPTH1])
def test_the_traced_network_is_the_vit(path):
    net, _ = load_model(path)
    X, _ = first_test_images("digits", net, 20)
    with torch.no_grad():
        want = net(X.double())
        got = TracedViT(net)(X.double().reshape(len(X), -1))
    assert (want - got).abs().max() <= 1e-12
    # LayerProject is active on these images, so its rewritten form is what the equality tests
    assert (net.tokens(X.double()).norm(dim=-1) > net.cfg.R).any()


def test_the_spec_rows_are_e_y_minus_e_j():
    C = spec(torch.tensor([2, 0]), 4)
    assert C.shape == (2, 3, 4)
    logits = torch.tensor([[1.0, 2.0, 5.0, 3.0], [7.0, 1.0, 2.0, 0.5]], dtype=torch.float64)
    assert torch.equal(C @ logits[:, :, None], torch.tensor([[[4.0], [3.0], [2.0]], [[6.0], [5.0], [6.5]]],
                                                           dtype=torch.float64))


@pytest.fixture(scope="module")
def tiny_run():
    net, _ = load_model(TINY)
    X, y = first_test_images("digits", net, 8)
    return net, X, y, run_certify(net, X, y, [1e-3, 0.02, 0.05], ["naive", "crown"], steps=30, restarts=2,
                                  cascade=True)


@needs_lirpa
def test_crown_certified_images_are_never_broken_by_pgd(tiny_run):
    net, X, y, res = tiny_run
    s = summary(res)
    assert s["violations"] == 0
    certified = torch.stack([res.pairwise[("crown", e)] for e in res.eps])
    broken = torch.stack([res.pgd_broken[e] for e in res.eps])
    assert certified.any() and not (certified & broken).any()
    for e in res.eps:  # a direct verification: one verdict for both tests, no δ_features
        assert torch.equal(res.pairwise[("crown", e)], res.prop1[("crown", e)])
        assert res.delta[("crown", e)].isnan().all()
        # the lower bound of each logit difference is below what the clean image has
        v = verify(net, X, y, e)
        clean = (spec(y, net.cfg.classes) @ net(X.double())[:, :, None])[..., 0]
        assert (v.lower <= clean + 1e-9).all()
        assert torch.equal(v.certified, res.pairwise[("crown", e)])


@needs_lirpa
def test_the_cascade_lies_between_its_first_bound_and_the_union(tiny_run):
    _, _, _, res = tiny_run
    assert res.bounds == ["naive", "crown", CASCADE] and CASCADE_FIRST == "naive"
    for e in res.eps:
        first, both = res.pairwise[("naive", e)], res.pairwise[("crown", e)]
        cascade = res.pairwise[(CASCADE, e)]
        sent = res.sent[(CASCADE, e)]
        assert not (first & ~cascade).any() and not (cascade & ~(first | both)).any()
        assert torch.equal(sent, ~first & res.correct)
        assert not (cascade & ~first & ~sent).any()
    assert any((res.pairwise[(CASCADE, e)] & ~res.pairwise[("naive", e)]).any() for e in res.eps)


@needs_lirpa
def test_crown_certify_rows_pass_the_gate():
    net, _ = load_model(TINY)
    X, y = first_test_images("digits", net, 8)
    with torch.no_grad():
        right = net(X.double()).argmax(-1) == y
    X, y = X[right][:2], y[right][:2]  # (the tiny model misclassifies most of them)
    res = run_certify(net, X, y, [1e-3], ["crown", "naive"], steps=5, restarts=1)
    df = pd.DataFrame(network_rows(res)).assign(sweep="s", cell_id="c")
    gate.check(df, "rows")
    rows = df[(df["role"] == "certify") & (df["bound"] == "crown")]
    assert (rows["certificate"] == "relaxation").all() and rows["value"].isna().all()
    assert rows["certified_pairwise"].any()
    # a crown row that claims an image PGD breaks is a violation, as any other certify row's
    flipped = df.copy()
    at = rows.index[0]
    flipped.loc[at, "pgd_margin"] = -1.0
    flipped.loc[flipped["sample"] == flipped.loc[at, "sample"], ["pgd_margin", "pgd_broken"]] = [-1.0, True]
    assert gate.derive(flipped).loc[at, "violation"] == bool(flipped.loc[at, "certified_pairwise"])


def test_crown_without_auto_lirpa_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)  # import auto_LiRPA now raises ImportError
    for extra in (["--bounds", "crown"], ["--bounds", "naive", "--cascade"]):
        code, out, err = main_inprocess(capsys, "certify", "--model", TINY, "--limit", "2", *extra)
        assert code == 2 and out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith("error: auto_LiRPA is not installed")


@needs_lirpa
def test_certify_json_names_crown(capsys):
    code, out, err = main_inprocess(capsys, "certify", "--model", TINY, "--limit", "3", "--eps", "0.01",
                                    "--bounds", "crown,best", "--pgd-steps", "5", "--pgd-restarts", "1",
                                    "--cascade", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert set(got["certified_accuracy"]) == {"crown", "best", CASCADE}
    assert got["certificates"]["crown"]["kind"] == "relaxation" and got["violations"] == 0
    assert got["seconds_per_sample"]["crown"] > 0
    assert len(got["samples"]["sent_to_crown"][CASCADE]["0.01"]) == 3


@needs_lirpa
def test_cascade_rows_pass_the_gate_and_say_what_went_on(tiny_run):
    _, _, _, res = tiny_run
    at = res.eps[1]
    one = CertifyRun(res.labels, res.margin, res.correct, [at], res.bounds,
                     **{f: {k: v for k, v in getattr(res, f).items() if k[1] == at}
                        for f in ("delta", "prop1", "pairwise", "certificates", "seconds", "sent")},
                     **{f: {at: getattr(res, f)[at]} for f in ("pgd_margin", "pgd_broken", "pgd_features",
                                                                "pgd_seconds")})
    df = pd.DataFrame(network_rows(one)).assign(sweep="s", cell_id="c")
    gate.check(df, "rows")
    rows = df[(df["role"] == "certify") & (df["bound"] == CASCADE)]
    assert len(rows) == res.n and rows["value"].isna().all()
    assert rows["sent_to_crown"].tolist() == res.sent[(CASCADE, at)].tolist()
    assert df.loc[df["bound"] != CASCADE, "sent_to_crown"].isna().all()
    # the gate judges the cascade's verdict as any certify row's: certified and broken is a violation
    certified = rows.index[rows["certified_pairwise"].astype(bool)]
    assert len(certified)
    forged = df.copy()
    sample = forged.loc[certified[0], "sample"]
    forged.loc[forged["sample"] == sample, ["pgd_margin", "pgd_broken"]] = [-1.0, True]
    assert gate.derive(forged).loc[certified[0], "violation"]


def run_certify_crown_cell(tmp_path, capsys, samples: int, task: str = "certify_crown",
                           model: str = "tiny-digits-d16-b1-h1-c0.5", eps: float = 0.02):
    """A one-cell run of task ``task`` on ``model`` (the tiny one): (its table, the run's stderr)."""
    profile = tmp_path / "p.toml"
    profile.write_text('[run]\npgd_steps = 5\npgd_restarts = 1\n[[sweep]]\nname = "c"\n'
                       f'task = "{task}"\nmodel = "{model}"\n'
                       f'eps = {eps}\nsamples = {samples}\n')
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "out")
    assert code == 0, err
    return store.load(tmp_path / "out"), err


@needs_lirpa
def test_a_crown_cascade_cell_runs_crown_and_the_cascades_with_their_first_bounds_only(tmp_path, capsys):
    """Task crown_cascade (CROWN on a subset of the images a certify sweep covers): CROWN, both
    cascades, and only the bounds they start from, with the verdicts of a certify_crown cell."""
    df, _ = run_certify_crown_cell(tmp_path, capsys, 4, task="crown_cascade")
    cert = df[df["role"] == "certify"]
    assert set(cert["bound"]) == {"crown", CASCADE, "naive", "taylor_net", "cascade_taylor_net_crown"}
    (tmp_path / "full").mkdir()
    full, _ = run_certify_crown_cell(tmp_path / "full", capsys, 4)
    key = ["bound", "sample"]
    both = cert.merge(full[full["role"] == "certify"], on=key, suffixes=("", "_full"))
    assert len(both) == len(cert)
    assert (both["certified_pairwise"] == both["certified_pairwise_full"]).all()
    assert not gate.derive(df)["violation"].any()


@needs_lirpa
@pytest.mark.parametrize("task", ["crown_cascade", "certify_crown"])
def test_a_crown_cell_on_a_vanilla_vit_runs_taylor_nets_cascade_alone(tmp_path, capsys, task):
    """On a pre-LayerNorm ViT naive (and its cascade) has no norm route: a CROWN cell runs the bounds
    that take it and taylor_net's cascade, which lies between taylor_net and taylor_net ∪ CROWN (the
    paper run's CROWN sweep stopped at its standard ViT after hours of other cells before this)."""
    df, _ = run_certify_crown_cell(tmp_path, capsys, 6, task=task, model="digits-d16-b2-h1-vanilla",
                                   eps=0.005)
    cert = df[df["role"] == "certify"]
    assert CASCADE not in set(cert["bound"]) and "naive" not in set(cert["bound"])
    assert {"crown", "taylor_net", "cascade_taylor_net_crown"} <= set(cert["bound"])
    v = cert.pivot(index="sample", columns="bound", values="certified_pairwise").astype(bool)
    tn, both, cascade = v["taylor_net"], v["crown"], v["cascade_taylor_net_crown"]
    assert not (tn & ~cascade).any() and not (cascade & ~(tn | both)).any()
    assert cascade.any()
    assert not gate.derive(df)["violation"].any()


@needs_lirpa
def test_a_certify_crown_cell_adds_crown_and_the_cascade(tmp_path, capsys):
    df, _ = run_certify_crown_cell(tmp_path, capsys, 6)
    cert = df[df["role"] == "certify"]
    assert {"crown", CASCADE, "naive", "best"} <= set(cert["bound"])
    assert cert.groupby("bound").size().eq(6).all()
    assert not gate.derive(df)["violation"].any()


def test_a_certify_crown_cell_without_auto_lirpa_is_a_certify_cell(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)
    df, err = run_certify_crown_cell(tmp_path, capsys, 2)
    assert [ln for ln in err.splitlines() if "auto_LiRPA" in ln] == [f"note: the CROWN rows are left out: "
                                                                      f"{crown.INSTALL}"]
    cert = df.query("role == 'certify'")
    assert not {"crown", "alpha_crown", CASCADE} & set(cert["bound"]) and "best" in set(cert["bound"])


@needs_lirpa
def test_the_cascade_named_as_a_bound_is_the_cascade_flag(capsys):
    common = ["certify", "--model", TINY, "--limit", "2", "--eps", "0.01", "--pgd-steps", "2",
              "--pgd-restarts", "1", "--json"]
    code, out, err = main_inprocess(capsys, *common, "--bounds", CASCADE)
    assert code == 0, err
    named = json.loads(out)
    code, out, err = main_inprocess(capsys, *common, "--bounds", CASCADE_FIRST, "--cascade")
    assert code == 0, err
    flagged = json.loads(out)
    assert named["certified_accuracy"] == flagged["certified_accuracy"]
    assert set(named["certified_accuracy"]) == {CASCADE_FIRST, CASCADE}


@needs_lirpa
@pytest.mark.parametrize("failed", [math.nan, -math.inf])  # a NaN bound; one auto_LiRPA could not compute
def test_a_failed_alpha_crown_falls_back_to_crowns_bound_and_says_so(failed, monkeypatch, capsys):
    from bounds.network import netcrown

    net, _ = load_model(TINY)
    X, y = first_test_images("digits", net, 4)
    crown_only = verify(net, X, y, 1e-3, "crown")
    real = netcrown.crown_lower
    monkeypatch.setattr(netcrown, "crown_lower", lambda b, xb, C, method: torch.full_like(
        real(b, xb, C, "CROWN"), failed) if method == "CROWN-Optimized" else real(b, xb, C, method))
    capsys.readouterr()
    got = verify(net, X, y, 1e-3, "alpha_crown")
    # (batches of 1 against CROWN's 2: the same bounds up to the order of float sums)
    assert torch.allclose(got.lower, crown_only.lower, rtol=1e-12, atol=1e-12)
    assert torch.equal(got.certified, crown_only.certified)
    assert crown_only.certified.any()  # (so that a NaN carried into the maximum would show)
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: α-CROWN could not")]
    with torch.no_grad():
        correct = net(X.double()).argmax(-1) == y
    assert 0 < int(correct.sum()) < len(y)  # (so that both kinds of image are seen)
    assert len(notes) == int(correct.sum())  # one per batch of one image, misclassified ones not sent
    assert (got.lower[~correct] == -math.inf).all() and not got.certified[~correct].any()


def test_the_intersection_drops_nans_and_keeps_infinities():
    crown_lb = torch.tensor([1.0, -math.inf, 2.0, -math.inf], dtype=torch.float64)
    optimised = torch.tensor([math.nan, math.nan, 3.0, -math.inf], dtype=torch.float64)
    assert crown.intersect(crown_lb, optimised, lower=True).tolist() == [1.0, -math.inf, 3.0, -math.inf]
    assert crown.intersect(-crown_lb, -optimised, lower=False).tolist() == [-1.0, math.inf, -3.0, math.inf]


class _Raises:
    """A stand-in for auto_LiRPA's BoundedModule whose compute_bounds fails in a function named
    ``name`` of a file at ``filename``."""

    def __init__(self, name: str, filename: str):
        scope: dict = {}
        exec(compile(f"def {name}():\n    raise RuntimeError('view size is not compatible')\n",
                     filename, "exec"), scope)
        self.fail = scope[name]

    def compute_bounds(self, **kwargs):
        self.fail()


def test_only_auto_lirpas_nan_handler_failing_means_no_bound():
    """auto_LiRPA's ``_check_nan`` raising is its overflow of exp, so no bound (−∞); the same error
    from anywhere else (the traced model, say) is a bug and is raised."""
    from bounds.network import netcrown

    C = spec(torch.tensor([1, 0]), 3)
    handler = _Raises("_check_nan", "/site-packages/auto_LiRPA/operators/convex_concave.py")
    got = netcrown.crown_lower(handler, None, C, "CROWN")
    assert got.shape == (2, 2) and (got == -math.inf).all()
    for name, filename in [("_check_nan", "/work/models/mine.py"), ("forward", "/auto_LiRPA/x.py")]:
        with pytest.raises(RuntimeError, match="view size"):
            netcrown.crown_lower(_Raises(name, filename), None, C, "CROWN")


@needs_lirpa
def test_crown_on_a_model_whose_exp_overflows_certifies_nothing_and_says_so(capsys):
    """The uncapped zoo model (no cap on W^Q, W^K): CROWN's exp relaxation overflows at ε = 0.02 and
    auto_LiRPA's NaN handler fails; the verdict is "not certified" with a note, not a traceback."""
    net, _ = load_model(ZOO / "digits-d32-b2-h2-c0.5.safetensors")
    X, y = first_test_images("digits", net, 2)
    capsys.readouterr()
    got = verify(net, X.double(), y, 0.02, "crown")
    assert (got.lower == -math.inf).all() and not got.certified.any()
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: crown could not")]
    assert notes == ["note: crown could not bound 2 of 2 image(s) at ε = 0.02 (auto_LiRPA's relaxation "
                     "overflowed or failed, e.g. exp on wide logit bounds); they are not certified"]


# --- CROWN's bounds kept batch by batch: a cell cut short resumes ---------------------------------------


class DictStore:
    """A BatchStore in memory."""

    def __init__(self):
        self.kept: dict[str, dict] = {}

    def get(self, key):
        return self.kept.get(key)

    def put(self, key, value):
        self.kept[key] = value


@needs_lirpa
def test_verify_keeps_each_batch_and_reads_it_back(monkeypatch):
    """Each batch's bounds go to the store as they are made; a second call on the same network,
    images and ε reads every batch back (auto_LiRPA is not called) with the same bounds, verdicts and
    the seconds they took; another ε, image or network is another key."""
    net, _ = load_model(DEPTH1)
    X, y = first_test_images("digits", net, 5)
    kept = DictStore()
    first = verify(net, X, y, 0.02, store=kept)
    sent = int((net(X.double()).argmax(-1) == y).sum())
    assert len(kept.kept) == math.ceil(sent / netcrown.BATCH["crown"]) >= 2

    def refuse(*args, **kwargs):
        raise AssertionError("auto_LiRPA called for a batch the store holds")

    monkeypatch.setattr(netcrown, "crown_lower", refuse)
    again = verify(net, X, y, 0.02, store=kept)
    assert torch.equal(again.lower, first.lower) and torch.equal(again.certified, first.certified)
    assert again.seconds >= sum(v["seconds"] for v in kept.kept.values())
    for images, eps in ((X, 0.03), (X.flip(-1), 0.02)):
        with pytest.raises(AssertionError, match="auto_LiRPA called"):
            verify(net, images, y, eps, store=kept)
    moved, _ = load_model(DEPTH1)
    with torch.no_grad():
        moved.head.bias.add_(1e-9)
    assert netcrown.net_digest(moved) != netcrown.net_digest(net)


def test_the_salt_is_the_code_on_disk(tmp_path):
    """An edit of any of the suite's .py files, committed or not, is another salt: a result kept
    before it is not read back after it."""
    for pkg in ("attacks", "bench", "bounds", "models"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    before = code_salt(tmp_path)
    assert code_salt(tmp_path) == before
    (tmp_path / "bounds" / "a.py").write_text("x = 2\n")
    assert code_salt(tmp_path) != before
    assert code_salt() != before  # this checkout's own code


def test_the_disk_store_is_keyed_by_its_salt_and_ignores_foreign_files(tmp_path):
    one, two = DiskStore(tmp_path, "commit-a"), DiskStore(tmp_path, "commit-b")
    one.put("k", {"lower": torch.tensor([[1.5, -math.inf]]), "seconds": 2.0})
    got = one.get("k")
    assert torch.equal(got["lower"], torch.tensor([[1.5, -math.inf]])) and got["seconds"] == 2.0
    assert two.get("k") is None and one.get("other") is None
    (path,) = tmp_path.rglob("*.pt")
    path.write_bytes(b"not a torch file")
    assert one.get("k") is None


@needs_lirpa
def test_a_crown_cell_cut_short_resumes_at_its_first_batch_not_bounded(tmp_path, monkeypatch):
    """A run stopped inside a CROWN cell keeps the batches bounded before the stop (in the run
    directory's partial/), and the same command bounds only the rest: the same rows' verdicts as an
    uninterrupted run, and partial/ gone once every cell is finished."""
    profile = tmp_path / "p.toml"
    profile.write_text('[run]\npgd_steps = 5\npgd_restarts = 1\n[[sweep]]\nname = "c"\n'
                       'task = "crown_cascade"\nmodel = "digits-d32-b1-h2-c0.5-q1-m0.003"\n'
                       'eps = 0.02\nsamples = 6\n')
    real, calls = netcrown.crown_lower, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def cut(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return counted(*args, **kwargs)

    monkeypatch.setattr(netcrown, "crown_lower", counted)
    whole, _ = run_profile(load_profile(str(profile)), tmp_path / "whole", "cpu")
    batches = len(calls)
    calls.clear()
    out = tmp_path / "cut"
    monkeypatch.setattr(netcrown, "crown_lower", cut)
    with pytest.raises(Interrupted):
        run_profile(load_profile(str(profile)), out, "cpu")
    # the two batches bounded before the stop (and the chunk results made before them: taylor_net's)
    kept = [torch.load(f, weights_only=True) for f in (out / PARTIAL).rglob("*.pt")]
    assert sum("lower" in k for k in kept) == 2 and not list((out / "cells").glob("*.csv"))
    calls.clear()
    monkeypatch.setattr(netcrown, "crown_lower", counted)
    table, _ = run_profile(load_profile(str(profile)), out, "cpu")
    assert len(calls) == batches - 2 > 0
    key = ["bound", "sample"]
    a, b = (pd.read_csv(t).query("role == 'certify'").sort_values(key) for t in (whole, table))
    assert a["certified_pairwise"].tolist() == b["certified_pairwise"].tolist() and len(a) == len(b)
    assert not (out / PARTIAL).exists()


@needs_lirpa
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_certify_run_reads_back_every_kept_result(where, tmp_path, monkeypatch):
    """With a store, taylor_net's and PGD's chunk results are kept as CROWN's batches are: a second run
    on the same network, images and ε computes none of them (TaylorNet, PGD and auto_LiRPA refuse)
    and gives the same verdicts, attack results, diagnostics and seconds; on disk (a run's
    ``partial/``) as in memory, so every kept result survives its file's round trip."""
    import bench.nets.accuracy as accuracy
    from bounds.network.taylor_net import TaylorNet as TN

    net, _ = load_model(DEPTH1)
    X, y = first_test_images("digits", net, 5)
    kept = DictStore() if where == "memory" else DiskStore(tmp_path, code_salt())
    args = dict(steps=5, restarts=1, cascade=True, store=kept)
    first = run_certify(net, X, y, [0.02, 0.05], ["taylor_net", "taylor_net_best", "crown"], **args)
    # per ε: taylor_net, its best split, PGD (and CROWN's batches)
    assert (len(kept.kept) if where == "memory" else len(list(tmp_path.rglob("*.pt")))) >= 2 * 3

    def refuse(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(netcrown, "crown_lower", refuse)
    monkeypatch.setattr(accuracy, "attack_margin", refuse)
    monkeypatch.setattr(TN, "certify", refuse)
    again = run_certify(net, X, y, [0.02, 0.05], ["taylor_net", "taylor_net_best", "crown"], **args)
    for field in ("pairwise", "pgd_margin", "pgd_broken", "pgd_features"):
        a, b = getattr(first, field), getattr(again, field)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), field
    assert first.pgd_seconds == again.pgd_seconds  # CROWN's add this call's own time around its batches
    assert all(first.seconds[k] == again.seconds[k] for k in first.seconds if k[0].startswith("taylor_net"))
    for k, cols in first.diagnostics.items():
        assert cols.keys() == again.diagnostics[k].keys()
        assert all(torch.equal(v, again.diagnostics[k][c]) for c, v in cols.items() if v is not None)
    assert first.certificates == again.certificates
    # each result under its own key: another PGD setting or another split is not served by these
    for other in (dict(args, steps=6), args):
        names = ["taylor_net"] if other is not args else ["taylor_net_lofast"]
        with pytest.raises(AssertionError, match="computed again"):
            run_certify(net, X, y, [0.02], names, **other)


@needs_lirpa
def test_certify_json_stays_one_object_where_auto_lirpa_prints(capsys):
    """auto_LiRPA prints ``[Interval Warning] NaN detected …`` where a relaxation overflows (the
    BatchNorm ViT's images 10–11 at ε 0.05): on stdout it came before ``--json``'s object and made it
    unreadable. It goes to stderr; stdout is the object alone."""
    bn = ZOO / "digits-d32-b2-h2-standard-bn-bias.safetensors"
    code, out, err = main_inprocess(capsys, "certify", "--model", bn, "--eps", "0.05", "--offset", "10",
                                    "--limit", "2", "--bounds", "crown", "--json", "--pgd-steps", "2",
                                    "--pgd-restarts", "1")
    assert code == 0, err
    assert "[Interval Warning]" in err  # the case still overflows: the test tests something
    assert json.loads(out)["certified_accuracy"]["crown"]["0.05"] == 0.0
