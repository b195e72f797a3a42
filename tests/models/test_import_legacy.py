"""ONNX files of an older exporter import (#56): torch.onnx's TorchScript exporter (``dynamo=False``,
what PyTorch 2.0 and other teams' pipelines write) at opset 9 and 14, with a dynamic batch dimension
whose size the graph reads off its input (Shape, Gather, ConstantOfShape, Expand for the class token,
Reshape targets), Gemm projections and BatchNormalization. Each imported layer equals an independent
float64 construction from the torch module's weights at the inputs the module itself saw."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import main_inprocess
from import_models import BatchNormTokens, Block, Fused, ImageViT, TorchMHA, dense
from torch import nn

from models import load_input, load_layer

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

D, H = 16, 2


def legacy(kind: str) -> tuple[nn.Module, list[nn.Module], int]:
    """(the model, its attention modules, the opset its exporter writes)."""
    torch.manual_seed(0)
    if kind == "bn_opset9":  # VNN-COMP's style: BatchNorm in place of LayerNorm, ReLU MLP, explicit softmax
        blocks = [Block(Fused(D, H, sdpa=False), D, norm="bn", act=nn.ReLU) for _ in range(2)]
        for b in blocks:
            b.n2 = BatchNormTokens(D)
        opset = 9
    else:  # torch's nn.MultiheadAttention with LayerNorm and GELU, as most ViT code writes it
        blocks = [Block(TorchMHA(D, H), D) for _ in range(2)]
        opset = 14
    model = ImageViT(blocks, D).eval()
    return model, [b.attn for b in blocks], opset


def seen_inputs(model: nn.Module, attns: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """What enters each attention module, image by image ([images, n, d] per attention)."""
    seen: dict[int, list[torch.Tensor]] = {id(a): [] for a in attns}
    hooks = [a.register_forward_pre_hook(lambda m, args: seen[id(m)].append(args[0].detach()))
             for a in attns]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return [torch.cat(seen[id(a)]) for a in attns]


@pytest.mark.parametrize("kind", ["bn_opset9", "mha_opset14"])
def test_an_older_exporters_file_with_a_dynamic_batch_imports(tmp_path, capsys, kind):
    model, attns, opset = legacy(kind)
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    src = tmp_path / "vit.onnx"
    with warnings.catch_warnings():  # not under no_grad: there nn.MultiheadAttention takes a fused
        warnings.simplefilter("ignore")  # kernel the exporter cannot write; and its deprecation notice
        torch.onnx.export(model, (x[:2],), str(src), dynamo=False, opset_version=opset,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    import onnx

    ops = {n.op_type for n in onnx.load(str(src)).graph.node}
    assert {"Shape", "Gather", "ConstantOfShape", "Expand"} <= ops  # the batch read off the input
    torch.save(x, tmp_path / "x.pt")
    code, _, err = main_inprocess(capsys, "import", src, "--inputs", tmp_path / "x.pt", "--out",
                                  tmp_path / "out")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert len(manifest["layers"]) == len(attns)
    for attn, entry, xs in zip(attns, manifest["layers"], seen_inputs(model, attns, x), strict=True):
        layer = load_layer(tmp_path / "out" / entry["files"]["layer"])
        assert (layer.h, layer.d, layer.residual) == (H, D, False)
        assert entry["max_rel_err"] <= 1e-6
        for i, name in enumerate(entry["files"]["inputs"]):
            X = load_input(tmp_path / "out" / name)
            assert float((X - xs[i].double()).abs().max() / xs[i].abs().max()) <= 1e-5
            F, ref = layer(X), dense(attn, X, False)
            assert float((F - ref).abs().max() / ref.abs().max()) <= 1e-6
