"""Seconds to import a small ViT (issue #30: ≤ 10 s on the 2-core CPU the suite is sized for): three
pre-norm blocks (fused qkv with biases, SDPA in one block's place of an explicit softmax in another,
a BatchNorm pre-norm in the third), 17 tokens (16 patches and a cls token), d 48, 4 heads, 3 inputs,
from an ONNX file and from a torch.export program. Each round reads the file, runs the model, finds and
probes every attention, checks each layer against the runtime at every input and writes the files of
``python -m bench import``.

    pytest benchmarks/test_import_speed.py --benchmark-enable --benchmark-only --benchmark-columns=mean
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.imported import load, run, write
from tests.import_models import Block, Fused  # the test models: written as third-party code would

torch.set_num_threads(1)
D, H, PATCHES = 48, 4, 16


class ViT(nn.Module):
    """Patch embedding, a cls token, position embeddings, three blocks, cls pooling and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, PATCHES + 1, D) * 0.1)
        self.blocks = nn.ModuleList([Block(Fused(D, H), D), Block(Fused(D, H, sdpa=False), D),
                                     Block(Fused(D, H), D, norm="bn")])
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x)], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(x[:, 0])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    model = ViT().eval()
    x = torch.randn(3, PATCHES, 12)
    with torch.no_grad():
        torch.onnx.export(model, (x[:1],), str(root / "vit.onnx"), dynamo=True, verbose=False)
        torch.export.save(torch.export.export(model, (x[:1],)), str(root / "vit.pt2"))
    return root, x


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_import(benchmark, sources, fmt, tmp_path):
    pytest.importorskip("onnxruntime")
    root, x = sources

    def once():
        result = run(load(root / f"vit.{fmt}"), x)
        write(tmp_path / "out", root / f"vit.{fmt}", result)
        return result

    result = benchmark.pedantic(once, rounds=3, iterations=1)
    assert len(result.layers) == 3 and all(imp.max_rel_err <= 1e-6 for imp in result.layers)
    benchmark.extra_info["layers"] = len(result.layers)
