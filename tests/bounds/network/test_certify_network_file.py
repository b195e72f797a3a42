"""Whole networks from another framework's file (#56): ``certify --model FILE.onnx|FILE.pt2 --data FILE.pt``
recovers the network as a standard ViT (models/imported/network.py) and certifies it. Each case is a
torch module written as other teams write ViTs (tests/import_models.py): VNN-COMP's BatchNorm ViT with a
class token and a ReLU MLP, exported by the TorchScript exporter at opset 9 with a dynamic batch; a
LayerNorm/GELU ViT with mean pooling through torch.export; nn.MultiheadAttention at opset 14. The
recovered network's logits equal the module's own; no image taylor_net or CROWN certifies on it is broken
by the independent attack; a normalization given as --mean/--std is folded in exactly; whatever is not a
stage is refused by name with one error line."""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
from helpers import main_inprocess
from import_models import BatchNormTokens, Block, ChannelFirst, Fused, ImageViT, TorchMHA
from test_taylor_net import ZOO, pgd, survives_attack
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from bounds.network.taylor_net import TaylorNet
from models.data import load_digits
from models.imported.importer import load
from models.imported.network import recover_network
from models.vit import ViT, ViTConfig
from models.vit_io import load_vit

D, H = 16, 2


class NormedViT(ImageViT):
    """ImageViT with a final norm, pooled by the class token or (``pool="mean"``, no class token) by the
    mean of the normalized tokens; ``mean``/``std``: the input normalized inside the module."""

    def __init__(self, blocks, d, norm, pool="cls", mean=0.0, std=1.0):
        super().__init__(blocks, d)
        self.norm, self.pool, self.mean, self.std = norm, pool, mean, std
        if pool == "mean":
            self.pos = nn.Parameter(self.pos[:, 1:].detach().clone())

    def forward(self, x):
        x = (x - self.mean) / self.std
        z = self.patch(x).flatten(2).transpose(1, 2)
        if self.pool == "cls":
            z = torch.cat([self.cls.expand(x.shape[0], -1, -1), z], 1)
        z = z + self.pos
        for b in self.blocks:
            z = b(z)
        z = self.norm(z)
        return self.head(z[:, 0] if self.pool == "cls" else z.mean(1))


def model(kind: str, qk: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bn":  # VNN-COMP's: BatchNorm for LayerNorm, a class token, a ReLU MLP, no final norm
        blocks = [Block(Fused(D, H, sdpa=False), D, norm="bn", act=nn.ReLU) for _ in range(2)]
        for b in blocks:
            b.n2 = BatchNormTokens(D)
        net = ImageViT(blocks, D)
    elif kind == "gelu_mean":
        net = NormedViT([Block(Fused(D, H), D) for _ in range(2)], D, nn.LayerNorm(D), pool="mean")
    elif kind == "gelu_tanh":  # GELU's tanh form, which an ONNX exporter before opset 20 writes as
        # x·½(1 + tanh(√(2/π)(x + 0.044715x³))) from Mul, Pow, Tanh and Add
        act = functools.partial(nn.GELU, approximate="tanh")
        net = NormedViT([Block(Fused(D, H), D, act=act) for _ in range(2)], D, nn.LayerNorm(D))
    elif kind == "suite":  # this suite's own standard ViT (models/vit.py): per-head weights, einsums
        cfg = ViTConfig(image=8, classes=10, d=D, depth=2, heads=H, patch=4, ffn=2 * D, variant="standard",
                        constraint=None, ffn_constraint=None, activation="gelu")
        net = ChannelFirst(ViT(cfg, constrained=False))
    elif kind == "mha":
        net = NormedViT([Block(TorchMHA(D, H), D, act=nn.ReLU) for _ in range(2)], D, nn.LayerNorm(D))
    elif kind == "post":
        net = NormedViT([Block(Fused(D, H), D, post=True)], D, nn.LayerNorm(D))
    elif kind == "no_final":  # LayerNorm in the blocks, none before the head: two kinds of norm
        net = ImageViT([Block(Fused(D, H), D, act=nn.ReLU)], D)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, Fused):
                m.qkv.weight[: 2 * D].mul_(qk)
    return net.eval()


def export(net: nn.Module, path, how: str) -> None:
    x = torch.rand(2, 1, 8, 8)
    if how == "pt2":
        ep = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        torch.export.save(ep, str(path))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), dynamo=False, opset_version=int(how.removeprefix("opset")),
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def data(net: nn.Module, count: int = 30, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [0, 1] and the module's own labels (so that every image is classified right)."""
    x = torch.rand(count, 8, 8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return x, net(x[:, None]).argmax(-1)


CASES = [("bn", "opset9", "batch", "relu", "cls"), ("gelu_mean", "pt2", "layer", "gelu", "mean"),
         ("mha", "opset14", "layer", "relu", "cls"),
         # the exporter writes the tanh form's constants in float32: recovered as such, not as torch's
         ("gelu_tanh", "opset14", "layer", "gelu_tanh_f32", "cls"),
         # the suite's own ViT through torch.export: its attention's output map is an einsum over the
         # heads' W^O, read as the linear map it is
         ("suite", "pt2", "layer", "gelu", "cls")]


@pytest.mark.parametrize("kind,how,norm,act,pool", CASES)
def test_the_recovered_network_is_the_modules(tmp_path, kind, how, norm, act, pool):
    net = model(kind)
    path = tmp_path / f"vit.{'pt2' if how == 'pt2' else 'onnx'}"
    export(net, path, how)
    x, _ = data(net)
    found = recover_network(load(path), x.double())
    cfg = found.net.cfg
    depth = len(net.net.blocks if isinstance(net, ChannelFirst) else net.blocks)
    assert (cfg.norm, cfg.activation, cfg.pool, cfg.depth, cfg.heads, cfg.d) == (norm, act, pool, depth, H, D)
    with torch.no_grad():
        want = net.double()(x.double()[:, None])
        err = float((found.net(x.double()) - want).abs().max() / want.abs().max())
    # torch.export runs in float64 (1e-6); onnxruntime has no float64 Conv: the model's float32 (1e-5)
    assert err <= (1e-6 if how == "pt2" else 1e-5) and found.max_rel_err <= 1e-5


@pytest.mark.parametrize("kind,how", [("bn", "opset9"), ("gelu_mean", "pt2"), ("gelu_tanh", "opset14"),
                                      ("suite", "pt2")])
def test_certify_a_network_file_soundly(tmp_path, capsys, kind, how):
    """The CLI end to end, then the independent attack on what taylor_net and CROWN certify."""
    net = model(kind, qk=0.5)
    path = tmp_path / f"vit.{'pt2' if how == 'pt2' else 'onnx'}"
    export(net, path, how)
    x, y = data(net)
    torch.save((x, y), tmp_path / "data.pt")
    code, out, err = main_inprocess(capsys, "certify", "--model", path, "--data", tmp_path / "data.pt",
                                    "--eps", "0.01", "--bounds", "taylor_net", "--limit", "10",
                                    "--pgd-steps", "20", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["violations"] == 0 and got["clean_accuracy"] == 1.0
    assert got["meta"]["card"]["max_rel_err"] <= 1e-5 and got["meta"]["architecture"]["variant"] == "standard"
    found = recover_network(load(path), x.double())
    survives_attack(found.net, x.double(), y, 0.003, crown=kind == "bn")


def test_a_standard_gelu_vit_from_torch_export_keeps_half_of_pgd_at_eps_001(tmp_path):
    """#56's bar on a pre-LayerNorm GELU ViT with a class token, trained here (the zoo's
    ``digits-d32-b2-h2-standard-q1-gelu``: every ‖W^Q_l‖₂, ‖W^K_l‖₂ ≤ 1) and exported as a user would,
    float32, through torch.export: at ε 0.01 taylor_net certifies at least half of the images the
    independent attack leaves unbroken, and none that it breaks. On the first 30 test images it certifies
    18 where an attack of 200 steps × 10 restarts leaves 28 (docs/results.md); here 6 images and a
    lighter attack, about 90 s."""
    vit, _ = load_vit(ZOO / "digits-d32-b2-h2-standard-q1-gelu.safetensors")
    path = tmp_path / "vit.pt2"
    export(ChannelFirst(vit).float().eval(), path, "pt2")
    _, _, x, y = load_digits()
    x, y = x[:6], y[:6]
    found = recover_network(load(path), x)
    cert = TaylorNet(found.net, x, y).certify(0.01)
    worst = pgd(found.net, x, y, 0.01, steps=100, restarts=4)
    assert not (cert.certified & (worst <= 0)).any()
    assert int(cert.certified.sum()) >= 0.5 * int((worst > 0).sum()) > 0


def test_the_input_normalization_is_folded_into_the_embedding(tmp_path):
    """A module that normalizes its input inside, exported without it: --mean/--std give it back."""
    inner = model("mha")
    inner.mean, inner.std = 0.0, 1.0
    path = tmp_path / "vit.onnx"
    export(inner, path, "opset14")
    x, _ = data(inner)
    found = recover_network(load(path), x.double(), mean=0.3, std=0.2)
    with torch.no_grad():
        want = inner.double()(((x.double() - 0.3) / 0.2)[:, None])
        assert float((found.net(x.double()) - want).abs().max() / want.abs().max()) <= 1e-5


@pytest.mark.parametrize("kind,says", [("post", "post-norm"), ("no_final", "norms differ")])
def test_what_is_not_a_stage_is_refused_by_name(tmp_path, capsys, kind, says):
    net = model(kind)
    export(net, tmp_path / "vit.onnx", "opset14")
    x, y = data(net)
    torch.save({"images": x, "labels": y}, tmp_path / "data.pt")
    code, out, err = main_inprocess(capsys, "certify", "--model", tmp_path / "vit.onnx", "--data",
                                    tmp_path / "data.pt", "--eps", "0.01", "--limit", "4")
    assert code == 2 and err.startswith("error:") and says in err and len(err.strip().splitlines()) == 1
    assert out == ""


@pytest.mark.parametrize("images,labels,says", [
    (torch.rand(4, 8, 8) * 2, torch.zeros(4, dtype=torch.long), "in [0, 1]"),
    (torch.rand(4, 8, 8), torch.zeros(3, dtype=torch.long), "labels must be integers"),
    (torch.rand(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), "one channel"),
    (torch.rand(4, 8, 8), torch.full((4,), 12), "not one of the model's 10 classes"),
])
def test_a_bad_data_file_is_one_error_line(tmp_path, capsys, images, labels, says):
    export(model("bn"), tmp_path / "vit.onnx", "opset9")
    torch.save((images, labels), tmp_path / "data.pt")
    code, out, err = main_inprocess(capsys, "certify", "--model", tmp_path / "vit.onnx", "--data",
                                    tmp_path / "data.pt", "--eps", "0.01")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and out == ""
