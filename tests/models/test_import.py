"""``python -m bench import`` (issue #30): every attention of an ONNX model or a torch.export program,
read as a DotMHA, equals an independent float64 construction from the torch module's own weights at
the very inputs the runtime captured; what the layer math does not cover is refused by name.

Models are written here with plain torch (tests/import_models.py) and exported once per module into
a temporary directory: ONNX by torch.onnx.export(dynamo=True), programs by torch.export.save.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import main_inprocess
from import_models import Block, Fused, Net, Separate, dense
from torch import nn

from bench.cli.main import main
from models import InputError, load_input, load_layer

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

D, H, N = 16, 2, 5


def build(kind: str, seed: int = 0) -> tuple[nn.Module, list[tuple[nn.Module, bool]]]:
    """(the model, its attention modules with whether the layer is residual)."""
    torch.manual_seed(seed)
    if kind == "timm_sdpa":  # pre-norm LayerNorm, fused qkv with biases, SDPA, two blocks
        blocks = [Block(Fused(D, H), D) for _ in range(2)]
    elif kind == "timm_relu":  # the same with a ReLU MLP, for float64 ONNX
        blocks = [Block(Fused(D, H), D, act=nn.ReLU) for _ in range(2)]
    elif kind == "timm_explicit_bn":  # pre-norm BatchNorm, fused qkv, explicit softmax
        blocks = [Block(Fused(D, H, sdpa=False), D, norm="bn")]
    elif kind == "bert_post":  # post-norm, separate q/k/v with biases, explicit softmax
        blocks = [Block(Separate(D, H), D, post=True) for _ in range(2)]
    elif kind == "nobias":  # no biases anywhere in the attention, fused and separate
        blocks = [Block(Fused(D, H, bias=False), D), Block(Separate(D, H, bias=False), D, post=True)]
    elif kind == "no_op_mask":  # an all-True mask to SDPA, an all-zero term on explicit logits
        blocks = [Block(Fused(D, H, variant="no_op_mask"), D),
                  Block(Fused(D, H, sdpa=False, variant="no_op_mask"), D)]
    elif kind == "einsum":  # QKᵀ and P V as einsums, in a post-norm block
        blocks = [Block(Fused(D, H, sdpa=False, variant="einsum"), D, post=True)]
    elif kind == "one_head":
        blocks = [Block(Fused(D, 1), D), Block(Separate(D, 1), D, post=True)]
    else:
        raise ValueError(kind)
    model = Net(blocks, D).eval()
    return model, [(b.attn, b.post) for b in blocks]


def export(model: nn.Module, example: torch.Tensor, path, fmt: str):
    with torch.no_grad():
        if fmt == "onnx":
            torch.onnx.export(model, (example,), str(path), dynamo=True, verbose=False)
        else:
            torch.export.save(torch.export.export(model, (example,)), str(path))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(format, kind) → (source file, model, attentions, inputs file, the batch), built once."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(fmt: str, kind: str, n: int = N, dtype=torch.float32):
        key = (fmt, kind, n, dtype)
        if key not in cache:
            model, attns = build(kind)
            model = model.to(dtype)
            x = torch.randn(3, n, D, dtype=dtype, generator=torch.Generator().manual_seed(1))
            name = f"{kind}_{n}_{str(dtype)[6:]}"
            src = export(model, x[:1], root / f"{name}.{'onnx' if fmt == 'onnx' else 'pt2'}", fmt)
            torch.save(x, root / f"{name}_x.pt")
            cache[key] = (src, model, attns, root / f"{name}_x.pt", x)
        return cache[key]

    return get


def run_import(capsys, *args) -> tuple[int, str, str]:
    return main_inprocess(capsys, "import", *args)


def captured(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The input of every attention module, by forward pre-hooks on the torch model itself."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
             for m in model.modules() if isinstance(m, (Fused, Separate))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def check_dir(out, model, attns, x, fmt, dtype=torch.float32) -> dict:
    """Each imported layer equals ``dense`` at each imported input, that input equals what enters the
    torch module's attention, and the manifest says so."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["residual"] for e in manifest["layers"]] == [post for _, post in attns]
    xs = [torch.stack(t) for t in zip(*[captured(model, x[i:i + 1]) for i in range(len(x))], strict=True)]
    for k, ((attn, post), entry) in enumerate(zip(attns, manifest["layers"], strict=True)):
        layer = load_layer(out / entry["files"]["layer"])
        assert (layer.h, layer.d, layer.d_h, layer.residual) == (attn.h, D, D // attn.h, post)
        assert entry["max_rel_err"] <= 1e-6 and entry["dtype"] == "float64"
        tol = 1e-12 if fmt == "pt2" else 1e-10 if dtype == torch.float64 else 1e-5  # two runtimes' X
        # a float32 ONNX graph holds its scale as float32 constants (√(1/√d_h) on Q and on K for a
        # fused attention): the layer is that graph's, within float32's rounding of the module's
        exact = 1e-12 if fmt == "pt2" else 1e-10 if dtype == torch.float64 else 1e-6
        for i, name in enumerate(entry["files"]["inputs"]):
            X = load_input(out / name)
            want_x = xs[k][i].reshape(X.shape).double()
            assert float((X - want_x).abs().max() / want_x.abs().max()) <= tol
            F, ref = layer(X), dense(attn, X, post)
            assert float((F - ref).abs().max() / ref.abs().max()) <= exact
    return manifest


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
@pytest.mark.parametrize("kind", ["timm_sdpa", "timm_explicit_bn", "bert_post", "nobias", "one_head",
                                  "no_op_mask", "einsum"])
def test_import_equals_the_modules_own_attention(exported, tmp_path, capsys, fmt, kind):
    src, model, attns, xfile, x = exported(fmt, kind)
    code, _, err = run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "imp")
    assert code == 0, err
    manifest = check_dir(tmp_path / "imp", model, attns, x, fmt)
    assert len(manifest["layers"]) == len(attns)
    assert manifest["format"] == ("onnx" if fmt == "onnx" else "torch.export")
    for entry in manifest["layers"]:
        assert len(entry["files"]["inputs"]) == 3


def test_nobias_layers_have_no_bias(exported, tmp_path, capsys):
    src, *_ = exported("pt2", "nobias")
    _, _, xfile, _ = exported("pt2", "nobias")[1:]
    assert run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "o")[0] == 0
    layer = load_layer(tmp_path / "o" / "layer0.safetensors")
    assert not layer.has_biases


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_single_token_and_float64(exported, tmp_path, capsys, fmt):
    for n, dtype in ((1, torch.float32), (N, torch.float64)):
        src, model, attns, xfile, x = exported(fmt, "timm_sdpa" if n == 1 else "timm_relu", n=n, dtype=dtype)
        out = tmp_path / f"o{n}"
        code, _, err = run_import(capsys, src, "--inputs", xfile, "--out", out)
        assert code == 0, err
        manifest = check_dir(out, model, attns, x, fmt, dtype)
        assert manifest["layers"][0]["n"] == n


def test_transformer_encoder_layer(tmp_path, capsys):
    """nn.TransformerEncoderLayer (nn.MultiheadAttention inside), post-norm and pre-norm."""
    for norm_first in (False, True):
        torch.manual_seed(0)
        m = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
        x = torch.randn(2, N, D)
        torch.save(x, tmp_path / "x.pt")
        for fmt in ("onnx", "pt2"):
            src = export(m, x[:1], tmp_path / f"t{int(norm_first)}.{fmt}", fmt)
            out = tmp_path / f"o{int(norm_first)}{fmt}"
            code, _, err = run_import(capsys, src, "--inputs", tmp_path / "x.pt", "--out", out)
            assert code == 0, err
            layer = load_layer(out / "layer0.safetensors")
            assert layer.residual is not norm_first
            mha = m.self_attn
            X = load_input(out / "layer0_input1.safetensors")
            with torch.no_grad():
                want_x = m.norm1(x[1]) if norm_first else x[1]
                x32 = X[None].float()
                ref = mha(x32, x32, x32, need_weights=False)[0][0].double()
            assert float((X - want_x.double()).abs().max()) <= 1e-5
            # the module's float32 forward at the same X: float32's rounding bounds the agreement
            F = layer(X) - (X if layer.residual else 0)
            assert float((F - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_token_ids(tmp_path, capsys):
    """Integer token ids go to the model as they are."""
    torch.manual_seed(0)
    model = Net([Block(Separate(D, H), D, post=True)], D, vocab=11).eval()
    ids = torch.randint(0, 11, (2, N))
    torch.save(ids, tmp_path / "ids.pt")
    for fmt in ("onnx", "pt2"):
        src = export(model, ids[:1], tmp_path / f"m.{fmt}", fmt)
        code, _, err = run_import(capsys, src, "--inputs", tmp_path / "ids.pt", "--out", tmp_path / fmt)
        assert code == 0, err
        X = load_input(tmp_path / fmt / "layer0_input1.safetensors")
        want = model.embed(ids[1]).detach().double()
        assert float((X - want).abs().max()) <= 1e-6


REFUSED = {
    "causal": ("sdpa", "causal attention mask"),
    "causal_explicit": ("explicit", "causal attention mask"),
    "padding": ("explicit", "padding mask"),
    "relative": ("explicit", "relative-position bias"),
    "alibi": ("explicit", "ALiBi"),
    "rotary": ("sdpa", "rotary embeddings"),
    "qknorm": ("sdpa", "qk-norm"),
    "cross": ("sdpa", "cross-attention"),
    "talking": ("explicit", "talking heads"),
    "talking_einsum": ("explicit", "talking heads"),
}


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
@pytest.mark.parametrize("variant", list(REFUSED))
def test_refused_by_name(tmp_path, capsys, fmt, variant):
    how, name = REFUSED[variant]
    torch.manual_seed(0)
    attn = Fused(D, H, sdpa=how == "sdpa", variant=variant.removesuffix("_explicit"), n=N)
    model = Net([Block(attn, D)], D).eval()
    x = torch.randn(2, N, D)
    torch.save(x, tmp_path / "x.pt")
    src = export(model, x[:1], tmp_path / f"m.{fmt}", fmt)
    code, _, err = run_import(capsys, src, "--inputs", tmp_path / "x.pt", "--out", tmp_path / "o")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], err
    assert not (tmp_path / "o").exists()


def test_bad_files(exported, tmp_path, capsys):
    src, _, _, xfile, x = exported("pt2", "timm_sdpa")
    onnx_src = exported("onnx", "timm_sdpa")[0]
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    (tmp_path / "junk.pt2").write_bytes(b"not a program")
    torch.save(x[:, :, :3], tmp_path / "narrow.pt")
    torch.save(x.long(), tmp_path / "ints.pt")
    torch.save(x[0], tmp_path / "nobatch.pt")
    mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 2)).eval()
    export(mlp, x[:1], tmp_path / "mlp.pt2", "pt2")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    cases = [
        ((junk, "--inputs", xfile), "not a readable ONNX model"),
        ((tmp_path / "junk.pt2", "--inputs", xfile), "not a readable torch.export program"),
        ((tmp_path / "model.h5", "--inputs", xfile), "expected an ONNX model (.onnx)"),
        ((tmp_path / "mlp.pt2", "--inputs", xfile), "no softmax attention"),
        ((src, "--inputs", tmp_path / "narrow.pt"), "has shape [3, 5, 3]"),
        ((onnx_src, "--inputs", tmp_path / "narrow.pt"), "has shape [3, 5, 3]"),
        ((src, "--inputs", tmp_path / "nobatch.pt"), "has shape [5, 16]"),
        ((src, "--inputs", tmp_path / "ints.pt"), "the model's input takes floats"),
        ((src, "--inputs", tmp_path / "x.csv"), "expected a tensor file"),
        ((src, "--inputs", junk.with_suffix(".npy")), "no such file"),
    ]
    for args, message in cases:
        code, _, err = run_import(capsys, *args, "--out", tmp_path / "o")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, err)
        assert not (tmp_path / "o").exists()
    code, _, err = run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "full")
    assert code == 2 and "not empty" in err
    code, _, err = run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "full", "--force")
    assert code == 2 and "keep.txt" in err


def test_force_replaces_a_previous_import(exported, tmp_path, capsys):
    src, _, _, xfile, _ = exported("pt2", "timm_sdpa")
    one = exported("pt2", "timm_explicit_bn")
    assert run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "o")[0] == 0
    assert (tmp_path / "o" / "layer1.safetensors").exists()
    assert run_import(capsys, one[0], "--inputs", one[3], "--out", tmp_path / "o", "--force")[0] == 0
    # the previous import's second layer is gone with it: the directory is the new import alone
    assert not (tmp_path / "o" / "layer1.safetensors").exists()


def test_point_reads_the_imported_files(exported, tmp_path, capsys):
    src, _, _, xfile, _ = exported("onnx", "bert_post")
    assert run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "o")[0] == 0
    code = main(["point", "--layer", str(tmp_path / "o" / "layer1.safetensors"), "--input",
                 str(tmp_path / "o" / "layer1_input2.safetensors"), "--eps", "0.01", "--json",
                 "--bounds", "lofast_M_half,taylor", "--pgd-steps", "10", "--pgd-restarts", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["meta"]["residual"] is True and out["taylor"] >= out["pgd"] * (1 - 1e-9)


def test_input_formats_and_several_inputs(exported, tmp_path, capsys):
    """.npy and .safetensors batches; a model of two inputs takes one tensor per input name."""
    import numpy as np
    from safetensors.torch import save_file

    src, model, attns, _, x = exported("onnx", "timm_sdpa")
    np.save(tmp_path / "x.npy", x.numpy())
    save_file({"anything": x}, str(tmp_path / "x.safetensors"))
    for f in ("x.npy", "x.safetensors"):
        assert run_import(capsys, src, "--inputs", tmp_path / f, "--out", tmp_path / f"o_{f}")[0] == 0
        check_dir(tmp_path / f"o_{f}", model, attns, x, "onnx")

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net([Block(Fused(D, H), D)], D)

        def forward(self, a, b):
            return self.net(a + 0.5 * b)

    torch.manual_seed(0)
    two = Two().eval()
    b = torch.randn(3, N, D)
    with torch.no_grad():
        torch.export.save(torch.export.export(two, (x[:1], b[:1])), str(tmp_path / "two.pt2"))
    save_file({"a": x, "b": b}, str(tmp_path / "ab.safetensors"))
    assert run_import(capsys, tmp_path / "two.pt2", "--inputs", tmp_path / "ab.safetensors", "--out",
                      tmp_path / "two")[0] == 0
    X = load_input(tmp_path / "two" / "layer0_input2.safetensors")
    with torch.no_grad():
        want = two.net.blocks[0].n1(two.net.embed(x[2] + 0.5 * b[2])).double()
    assert float((X - want).abs().max()) <= 1e-6
    code, _, err = run_import(capsys, tmp_path / "two.pt2", "--inputs", tmp_path / "x.npy", "--out",
                              tmp_path / "two1")
    assert code == 2 and "takes 2 inputs (a, b)" in err
    save_file({"a": x}, str(tmp_path / "a.safetensors"))
    code, _, err = run_import(capsys, tmp_path / "two.pt2", "--inputs", tmp_path / "a.safetensors", "--out",
                              tmp_path / "two2")
    assert code == 2 and "no tensor for the model's input 'b'" in err


def test_onnx_is_imported_only_when_used(tmp_path):
    """onnx and onnxruntime are the optional ``import`` extra: importing the suite, its CLI or the
    importer itself must not load them (helpers.loaded_packages, tests/project/test_layout.py's check, in a
    fresh interpreter)."""
    from helpers import loaded_packages

    loaded = loaded_packages(tmp_path, ["models", "models.imported", "bench.cli.main",
                                        "bench.cli.import_cmd"])
    assert "models" in loaded
    assert not loaded & {"onnx", "onnxruntime", "onnxscript", "transformers"}
    # and models/imported/ is part of models/: it imports none of the packages built on it
    assert not loaded_packages(tmp_path, ["models.imported"]) & {"bounds", "attacks", "bench"}


def test_missing_onnx_is_one_error_line(exported, tmp_path, capsys, monkeypatch):
    src, _, _, xfile, _ = exported("onnx", "timm_sdpa")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    code, _, err = run_import(capsys, src, "--inputs", xfile, "--out", tmp_path / "o")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'attnbounds[import]'" in err


def test_a_symbolic_batch(tmp_path, capsys):
    """A model exported with a symbolic batch size runs one input at a time, its sizes read off the
    model's own run where a probe does not give them."""
    model, attns = build("bert_post")
    x = torch.randn(3, N, D, generator=torch.Generator().manual_seed(2))
    torch.save(x, tmp_path / "x.pt")
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        torch.onnx.export(model, (x[:2],), str(tmp_path / "m.onnx"), dynamo=True, verbose=False,
                          dynamic_shapes=({0: batch},))
        torch.export.save(torch.export.export(model, (x[:2],), dynamic_shapes=({0: batch},)),
                          str(tmp_path / "m.pt2"))
    for fmt in ("onnx", "pt2"):
        code, _, err = run_import(capsys, tmp_path / f"m.{fmt}", "--inputs", tmp_path / "x.pt", "--out",
                                  tmp_path / fmt)
        assert code == 0, err
        check_dir(tmp_path / fmt, model, attns, x, fmt)


def test_the_onnx_attention_op(tmp_path, capsys):
    """Opset 23 writes SDPA as ONNX's own Attention op: imported (onnxruntime's kernel keeps float32
    rounding somewhere inside even on float64 inputs: agreement within 1e-6), its is_causal refused."""
    model, attns = build("timm_sdpa")
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.onnx.export(model, (x[:1],), str(tmp_path / "m.onnx"), dynamo=True, verbose=False,
                          opset_version=23)
    code, _, err = run_import(capsys, tmp_path / "m.onnx", "--inputs", tmp_path / "x.pt", "--out",
                              tmp_path / "o")
    assert code == 0, err
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert len(manifest["layers"]) == 2
    for (attn, post), entry in zip(attns, manifest["layers"], strict=True):
        layer = load_layer(tmp_path / "o" / entry["files"]["layer"])
        X = load_input(tmp_path / "o" / entry["files"]["inputs"][1])
        F, ref = layer(X), dense(attn, X, post)
        assert float((F - ref).abs().max() / ref.abs().max()) <= 1e-6
    torch.manual_seed(0)
    causal = Net([Block(Fused(D, H, variant="causal"), D)], D).eval()
    with torch.no_grad():
        torch.onnx.export(causal, (x[:1],), str(tmp_path / "c.onnx"), dynamo=True, verbose=False,
                          opset_version=23)
    code, _, err = run_import(capsys, tmp_path / "c.onnx", "--inputs", tmp_path / "x.pt", "--out",
                              tmp_path / "c")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "causal attention mask" in err


class Pooled(nn.Module):
    """One block, then attention pooling by a learned query (``pool``) or a classifier's softmax."""

    def __init__(self, pool: bool):
        super().__init__()
        self.net, self.pool = Net([Block(Fused(D, H), D)], D), pool
        self.query, self.key = nn.Parameter(torch.randn(1, 1, D)), nn.Linear(D, D)

    def forward(self, x):
        x = self.net.embed(x)
        x = self.net.blocks[0](x)
        if self.pool:  # softmax(q Kᵀ) V with a constant q: cross-attention from a learned query
            a = (self.query @ self.key(x).transpose(1, 2)).softmax(-1)
            x = a @ x
        return self.net.head(x.mean(1)).softmax(-1)


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_classifiers_softmax_is_no_attention_and_a_learned_query_is_refused(tmp_path, capsys, fmt):
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(4))
    torch.save(x, tmp_path / "x.pt")
    for pool in (False, True):
        torch.manual_seed(0)
        src = export(Pooled(pool).eval(), x[:1], tmp_path / f"m{int(pool)}.{fmt}", fmt)
        code, _, err = run_import(capsys, src, "--inputs", tmp_path / "x.pt", "--out", tmp_path / f"o{pool}")
        if pool:
            assert code == 2 and len(err.strip().splitlines()) == 1 and "learned query" in err, err
        else:
            assert code == 0, err
            assert len(json.loads((tmp_path / "oFalse" / "manifest.json").read_text())["layers"]) == 1


class SeqFirst(nn.Module):
    """A BatchNorm pre-norm block around nn.MultiheadAttention in its default [n, B, d] layout."""

    def __init__(self):
        super().__init__()
        self.bn, self.mha = nn.BatchNorm1d(D), nn.MultiheadAttention(D, H)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.bn(x.transpose(1, 2)).permute(2, 0, 1)
        return x + self.mha(y, y, y, need_weights=False)[0].transpose(0, 1)


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_sequence_first_attention_in_a_static_batch_of_two(tmp_path, capsys, fmt):
    """X in [n, B, d] (nn.MultiheadAttention's default) is read token-major, and a program exported at
    a batch of 2 runs the 4 inputs two at a time."""
    torch.manual_seed(0)
    model = SeqFirst().eval()
    x = torch.randn(4, N, D, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp_path / "x.pt")
    src = export(model, x[:2], tmp_path / f"m.{fmt}", fmt)
    code, _, err = run_import(capsys, src, "--inputs", tmp_path / "x.pt", "--out", tmp_path / "o")
    assert code == 0, err
    layer = load_layer(tmp_path / "o" / "layer0.safetensors")
    assert not layer.residual
    W, b = model.mha.in_proj_weight.detach().double(), model.mha.in_proj_bias.detach().double()
    Wo, bo = model.mha.out_proj.weight.detach().double(), model.mha.out_proj.bias.detach().double()
    e = D // H
    for i in range(4):
        X = load_input(tmp_path / "o" / f"layer0_input{i}.safetensors")
        with torch.no_grad():
            want_x = model.bn(x[i:i + 1].transpose(1, 2))[0].T.double()
        assert float((X - want_x).abs().max()) <= 1e-5
        Q, K, V = (X @ W[j * D:(j + 1) * D].T + b[j * D:(j + 1) * D] for j in range(3))
        ctx = torch.cat([torch.softmax(Q[:, s] @ K[:, s].T / e ** 0.5, -1) @ V[:, s]
                         for s in (slice(h * e, (h + 1) * e) for h in range(H))], -1)
        ref = ctx @ Wo.T + bo
        exact = 1e-12 if fmt == "pt2" else 1e-6
        assert float((layer(X) - ref).abs().max() / ref.abs().max()) <= exact


def test_a_view_traced_at_other_strides_still_runs():
    """torch 2.11's export of nn.MultiheadAttention reshapes with aten.view what was contiguous at the
    traced batch only; fed other strides (another batch, a probe's own layout) it raised "view size is
    not compatible" (an H100 lease, torch 2.11). The runtime reshapes, which is that view where one
    exists: here the view's input is handed in transposed."""
    from models.imported.export_source import from_module

    class Flat(nn.Module):
        def forward(self, x):
            return (x * 2.0).view(-1)

    graph = from_module(Flat(), (torch.randn(3, 4),))
    names = {op.kind: op.name for op in graph.ops}
    given = torch.arange(12.0).reshape(4, 3).t()  # [3, 4], not contiguous
    for float64 in (False, True):
        got = graph.run({names["mul"]: given}, [names["layout"]], float64)[names["layout"]]
        assert torch.equal(got, given.reshape(-1).to(got.dtype))


def test_a_models_digest_covers_its_external_data(tmp_path):
    """An ONNX model whose tensors live in a file beside it (external data) is named by both: new weights
    behind the same .onnx give another digest; without external data the digest is the file's sha256."""
    import hashlib

    import onnx

    from models.imported.importer import digest
    from models.imported.onnx_source import external_files

    model = Net([Block(Fused(D, H), D)], D).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.rand(1, N, D),), str(path), dynamo=False)
    assert external_files(path) == [] and digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    proto = onnx.load(str(path))
    outside = tmp_path / "outside"
    outside.mkdir()
    onnx.save_model(proto, str(outside / "m.onnx"), save_as_external_data=True, location="m.weights",
                    size_threshold=0)
    (weights,) = external_files(outside / "m.onnx")
    assert weights == outside / "m.weights"
    before = digest(outside / "m.onnx")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert digest(outside / "m.onnx") != before
    weights.unlink()
    with pytest.raises(InputError, match=r"m\.weights, which is not beside it"):
        digest(outside / "m.onnx")
    # a location lost: named, no traceback
    bare = onnx.load(str(outside / "m.onnx"), load_external_data=False)
    for t in bare.graph.initializer:
        kept = [e for e in t.external_data if e.key != "location"]
        del t.external_data[:]
        t.external_data.extend(kept)
    onnx.save_model(bare, str(outside / "bare.onnx"))
    with pytest.raises(InputError, match="names no location"):
        digest(outside / "bare.onnx")
