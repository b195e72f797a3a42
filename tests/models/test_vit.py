"""The ViT zoo: bundled data, the network's pieces against the suite's layers, the caps, the files,
bit-for-bit retraining from a card, and `python -m bench train`'s bad input."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import torch
from helpers import ROOT, main_inprocess, one_error

import models
import models.data
from bench.core.env import cpu_kernels
from bench.nets.train import DEFAULTS, accuracy, lipschitz_surrogate, margin_loss, train_from_card
from bench.nets.zoo import TINY, ZOO
from models import InputError
from models.data import load_dataset, read_idx
from models.vit import ViT, ViTConfig
from models.vit_io import card_path, load_card, load_vit, save_vit

ZOO_DIR = ROOT / "zoo"
F64 = {"dtype": torch.float64}


def small_net(seed: int = 0, **kw) -> ViT:
    torch.manual_seed(seed)
    cfg = ViTConfig(**{"image": 8, "classes": 10, "d": 8, "depth": 2, "heads": 2, "ffn": 12, **kw})
    return ViT(cfg).double()


def test_digits_split_is_fixed_stratified_and_in_pixel_range():
    X_tr, y_tr, X_te, y_te = load_dataset("digits")
    assert X_tr.shape == (1347, 8, 8) and X_te.shape == (450, 8, 8)
    assert X_tr.dtype == torch.float64 and y_tr.dtype == torch.int64
    assert float(X_tr.min()) == 0.0 and float(X_tr.max()) == 1.0 and float(X_te.max()) <= 1.0
    # each class keeps its share (stratify=y): at most one image off the proportional count
    full = torch.cat([y_tr, y_te]).bincount()
    assert (y_te.bincount() - full * 0.25).abs().max() <= 1
    again = load_dataset("digits")
    assert all(torch.equal(a, b) for a, b in zip((X_tr, y_tr, X_te, y_te), again, strict=True))
    # pixels are the bundled 0..16 counts divided by 16, exactly
    assert torch.equal(X_tr * 16, (X_tr * 16).round())


def test_unknown_dataset():
    with pytest.raises(InputError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")


def test_fashion_mnist_absent_names_the_debian_package(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models.data, "FASHION_MNIST_DIR", tmp_path / "absent")
    with pytest.raises(InputError) as e:
        load_dataset("fashion-mnist")
    assert "apt-get install dataset-fashion-mnist" in str(e.value) and "\n" not in str(e.value)
    code, out, err = main_inprocess(capsys, "train", "--dataset", "fashion-mnist", "--out",
                                    tmp_path / "m.safetensors")
    assert code == 2 and out == "" and err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert "dataset-fashion-mnist" in err


def test_idx_reader_checks_the_header(tmp_path):
    good = tmp_path / "good.gz"
    with gzip.open(good, "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + np.array([2, 2, 3], dtype=">u4").tobytes() + bytes(range(12)))
    assert read_idx(good, 3).tolist() == np.arange(12).reshape(2, 2, 3).tolist()
    for name, body in (("short.gz", bytes([0, 0, 8, 3]) + np.array([2, 2, 3], dtype=">u4").tobytes()),
                       ("type.gz", bytes([0, 0, 13, 1, 0, 0, 0, 1, 0]))):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(body)
        with pytest.raises(InputError):
            read_idx(tmp_path / name, 3 if name == "short.gz" else 1)


@pytest.mark.skipif(not (models.data.FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_from_the_debian_files():
    X_tr, y_tr, X_te, y_te = load_dataset("fashion-mnist")
    assert X_tr.shape == (60000, 28, 28) and X_te.shape == (10000, 28, 28)
    assert float(X_tr.min()) == 0.0 and float(X_tr.max()) == 1.0
    assert y_te.bincount().tolist() == [1000] * 10 and y_tr.dtype == torch.int64


def test_patches_are_a_permutation_of_the_pixels():
    net = small_net()
    x = torch.rand(3, 8, 8, **F64)
    P = net.patches(x)
    assert P.shape == (3, 16, 4)
    assert torch.equal(P.flatten(1).sort().values, x.flatten(1).sort().values)
    assert torch.equal(P[0, 1], x[0, 0:2, 2:4].flatten())  # row-major patches, row-major pixels
    with pytest.raises(InputError, match="images must be"):
        net.patches(torch.rand(3, 7, 8, **F64))


@pytest.mark.parametrize("variant", ["lofast", "vanilla"])
def test_blocks_are_the_suites_dotmha_and_the_parts_compose_to_the_network(variant):
    caps = {} if variant == "lofast" else {"constraint": None, "ffn_constraint": None}
    net = small_net(variant=variant, **caps)
    x = torch.rand(5, 8, 8, **F64)
    tr = net.trace(x)
    layers = net.attention_layers()
    assert all(isinstance(L, models.DotMHA) and L.residual and L.W_q.dtype == torch.float64 for L in layers)
    for k, (block, L) in enumerate(zip(net.blocks, layers, strict=True)):
        X = tr.inputs[k]
        # the DotMHA built from the stored weights, and the formula of docs/bounds.md §1.1
        W = net.weights()
        ref = models.DotMHA(*(W[f"blocks.{k}.attn.{n}"] for n in ("W_q", "W_k", "W_v", "W_o")))
        P = torch.softmax(torch.einsum("bnd,hde,bme->bhnm", X, L.A(), X) / math.sqrt(L.d_h), -1)
        formula = X + torch.einsum("bhnm,bmd,hde->bne", P, X, L.C())
        with torch.no_grad():
            out = block.attn(X)
        assert (out - ref(X)).abs().max() <= 1e-12 and (out - L(X)).abs().max() <= 1e-12
        assert (out - formula).abs().max() <= 1e-12
    # images → E → Proj/LN → DotMHA → FFN → mean → W: the pieces a certificate uses give the logits
    with torch.no_grad():
        X = net.patches(x) @ net.embedding_matrix() + net.pos
        for k, (block, L) in enumerate(zip(net.blocks, layers, strict=True)):
            X = models.layer_project(X, net.R) if variant == "lofast" else block.norm(X)
            assert (X - tr.inputs[k]).abs().max() <= 1e-12  # nn.Linear sums in another order
            X = block.ffn(L(X))
        logits = X.mean(-2) @ net.head_matrix().T + net.head_bias()
    assert (logits - tr.logits).abs().max() <= 1e-12
    assert net.R == (1.0 if variant == "lofast" else None)
    assert net.pool_lipschitz == 0.25  # 1/√16


def test_caps_hold_after_training_steps_and_the_ffn_constant_is_exact():
    c = 0.3
    net = small_net(constraint=c, ffn_constraint=0.7)
    opt = torch.optim.Adam(net.parameters(), lr=0.5)  # large steps push every norm against its cap
    x, y = torch.rand(32, 8, 8, **F64), torch.arange(32) % 10
    for _ in range(10):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    norm = lambda W: torch.linalg.matrix_norm(W, ord=2)
    for L, block, lip in zip(net.attention_layers(), net.blocks, net.ffn_lipschitz(), strict=True):
        assert norm(L.W_v).max() <= c + 1e-9 and norm(L.W_o).max() <= c + 1e-9
        assert norm(L.W_v).max() >= c - 1e-9  # the cap binds, so the test tests something
        W1, W2 = block.ffn.up.weight.detach(), block.ffn.down.weight.detach()
        assert norm(W1) <= 0.7 + 1e-9 and norm(W2) <= 0.7 + 1e-9
        assert lip == pytest.approx(1 + float(norm(W1) * norm(W2)), rel=1e-15)
        assert lip <= 1 + 0.49 + 1e-9


def test_save_load_round_trip_is_bit_identical(tmp_path):
    net = small_net(seed=3)
    card = save_vit(tmp_path / "m.safetensors", net, {"dataset": "digits", "test_accuracy": 0.5})
    back, card2 = load_vit(tmp_path / "m.safetensors")
    assert card2 == card and card2["architecture"] == net.cfg.to_dict()
    assert back.weights().keys() == net.weights().keys()
    assert all(torch.equal(back.weights()[k], v) for k, v in net.weights().items())
    x = torch.rand(4, 8, 8, **F64)
    with torch.no_grad():
        assert torch.equal(back(x), net(x))
    # a changed weights file, a missing or foreign card: one InputError each
    (tmp_path / "m.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes()[:-8] + bytes(8))
    with pytest.raises(InputError, match="do not match the sha256"):
        load_vit(tmp_path / "m.safetensors")
    card_path(tmp_path / "m.safetensors").unlink()
    with pytest.raises(InputError, match="no card"):
        load_vit(tmp_path / "m.safetensors")
    card_path(tmp_path / "m.safetensors").write_text("{}")
    with pytest.raises(InputError, match="not a ViT card"):
        load_card(tmp_path / "m.safetensors")


def test_tiny_zoo_model_retrains_from_its_card():
    """Bit for bit on the CPU the card was trained on; on another CPU within 1e-12 (vectorised
    kernels of another instruction set round differently: measured 4e-15 after two epochs)."""
    net, card = load_vit(ZOO_DIR / f"{TINY}.safetensors")
    if card["torch_version"] != torch.__version__:
        pytest.skip(f"the zoo was trained with torch {card['torch_version']}, this is {torch.__version__}")
    threads = torch.get_num_threads()
    torch.set_num_threads(card["threads"])
    try:
        again, card2 = train_from_card(card, device="cpu")
    finally:
        torch.set_num_threads(threads)
    if card.get("cpu_kernels") == cpu_kernels():
        diff = [k for k, v in net.weights().items() if not torch.equal(v, again.weights()[k])]
        assert not diff, f"retrained weights differ in {diff} on the card's own CPU"
        assert card2["test_accuracy"] == card["test_accuracy"]
    for k, v in net.weights().items():
        assert torch.allclose(again.weights()[k], v, rtol=0, atol=1e-12), k


def test_zoo_cards_weights_and_readme_agree():
    readme = (ZOO_DIR / "README.md").read_text()
    _, _, X_te, y_te = load_dataset("digits")
    assert "python -m bench train --zoo" in readme
    norm = lambda W: torch.linalg.matrix_norm(W, ord=2)
    for e in ZOO:
        cfg, stem = e.config(), e.stem
        net, card = load_vit(ZOO_DIR / f"{stem}.safetensors")
        assert ViTConfig.from_dict(card["architecture"]) == cfg and card["dataset"] == e.dataset, stem
        assert card.get("margin_eps", 0.0) == e.margin_eps and card["batch_size"] == e.batch_size, stem
        assert card["epochs"] == (e.epochs or DEFAULTS[e.dataset]["epochs"]), stem
        assert f"`{stem}`" in readme and card["command"] in readme
        for L in net.attention_layers():
            for cap, Ws in ((cfg.constraint, (L.W_v, L.W_o)), (cfg.qk_constraint, (L.W_q, L.W_k))):
                if cap is not None:
                    assert max(float(norm(W).max()) for W in Ws) <= cap + 1e-9, stem
        if e.dataset != "digits":  # 10,000 Fashion-MNIST test images per model: too slow for a test
            continue
        assert accuracy(net, X_te, y_te) == card["test_accuracy"]  # the stored bits are the evaluated ones
        if e.epochs != 2:  # every full model is accurate; plain cross-entropy ones reach the 90%
            assert card["test_accuracy"] >= (0.85 if e.margin_eps else 0.9), (stem, card["test_accuracy"])


def test_margin_loss_is_cross_entropy_at_0_and_raises_every_wrong_logit_above():
    net = small_net(qk_constraint=1.0)
    x, y = torch.rand(16, 8, 8, **F64), torch.arange(16) % 10
    logits = net(x)
    assert margin_loss(net, x, y, 0.0) == torch.nn.functional.cross_entropy(logits, y)
    L = lipschitz_surrogate(net)
    assert L > 0 and L.requires_grad  # it is trained against
    # the offset of wrong logit j is eps·L·‖w_y − w_j‖, computed here from the head directly
    W = net.head.weight
    off = torch.stack([torch.stack([(W[y[i]] - W[j]).norm() for j in range(10)]) for i in range(16)])
    want = torch.nn.functional.cross_entropy(logits + 0.01 * L * off, y)
    assert float(margin_loss(net, x, y, 0.01)) == pytest.approx(float(want), rel=1e-12)
    assert margin_loss(net, x, y, 0.01) > margin_loss(net, x, y, 0.0)


def test_qk_cap_holds_after_training_steps():
    net = small_net(qk_constraint=0.4)
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    x, y = torch.rand(32, 8, 8, **F64), torch.arange(32) % 10
    for _ in range(10):
        loss = margin_loss(net, x, y, 0.01)
        opt.zero_grad()
        loss.backward()
        opt.step()
    norm = lambda W: torch.linalg.matrix_norm(W, ord=2)
    for L in net.attention_layers():
        assert norm(L.W_q).max() <= 0.4 + 1e-9 and norm(L.W_k).max() <= 0.4 + 1e-9
        assert norm(L.A()).max() <= 0.16 + 1e-9  # so ‖W^Q W^Kᵀ‖ ≤ 0.4²
    with pytest.raises(InputError, match="qk_constraint must be a finite number > 0"):
        ViTConfig(image=8, classes=10, d=8, heads=2, qk_constraint=0.0)
    with pytest.raises(InputError, match="vanilla variant is unconstrained"):
        ViTConfig(image=8, classes=10, d=8, heads=2, variant="vanilla", constraint=None, ffn_constraint=None,
                  qk_constraint=1.0)


@pytest.mark.parametrize("args, words", [
    (("--dataset", "nosuch"), "unknown dataset 'nosuch'"),
    (("--constraint", "0"), "constraint must be a finite number > 0"),
    (("--constraint", "-0.5"), "constraint must be a finite number > 0"),
    (("--constraint", "abc"), "a constraint must be a number > 0 or none"),
    (("--depth", "0"), "depth must be a positive integer"),
    (("--heads", "3"), "d % h != 0"),
    (("--variant", "nosuch"), "unknown variant 'nosuch'"),
    (("--variant", "vanilla", "--constraint", "0.5"), "vanilla variant is unconstrained"),
    (("--epochs", "0"), "epochs must be at least 1"),
    (("--depth", "two"), "invalid int value"),
    (("--qk-constraint", "-1"), "qk_constraint must be a finite number > 0"),
    (("--margin-eps", "-0.1"), "margin eps must be finite and >= 0"),
    (("--variant", "vanilla", "--margin-eps", "0.01"), "needs the lofast variant"),
])
def test_cli_train_bad_input_is_one_error_line(args, words, tmp_path, capsys):
    code, out, err = main_inprocess(capsys, "train", *args, "--out", tmp_path / "m.safetensors")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "error:" in err and words in err, err
    assert not (tmp_path / "m.safetensors").exists()


def test_cli_train_out_must_be_safetensors(tmp_path, capsys):
    code, _, err = main_inprocess(capsys, "train", "--out", tmp_path / "m.pt")
    assert code == 2 and "must end in .safetensors" in err and len(err.strip().splitlines()) == 1


def test_cli_trains_a_model_and_its_card_retrains_it(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    code, stdout, _ = main_inprocess(capsys, "train", "--d", "8", "--depth", "1", "--heads", "1",
                                     "--epochs", "1", "--seed", "5", "--device", "cpu", "--out", out)
    assert code == 0 and str(out) in stdout
    _, card = load_vit(out)
    assert (card["seed"], card["epochs"], card["dataset"], card["device"]) == (5, 1, "digits", "cpu")
    assert card["command"].startswith("python -m bench train --dataset digits")
    assert str(out) in card["command"]
    assert 0.0 <= card["test_accuracy"] <= 1.0 and card["train_seconds"] > 0
    assert card["suite_version"] and card["git_commit"]


def test_cli_margin_training_records_its_recipe_and_retrains_bit_for_bit(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    code, _, _ = main_inprocess(capsys, "train", "--d", "8", "--depth", "1", "--heads", "1", "--epochs", "1",
                                "--qk-constraint", "0.5", "--margin-eps", "0.01", "--device", "cpu",
                                "--out", out)
    assert code == 0
    net, card = load_vit(out)
    assert card["architecture"]["qk_constraint"] == 0.5 and card["margin_eps"] == 0.01
    assert "--qk-constraint 0.5 --margin-eps 0.01" in card["command"]
    again, _ = train_from_card(card)
    assert all(torch.equal(v, again.weights()[k]) for k, v in net.weights().items())


def test_an_interrupted_training_resumes_to_the_same_bits(tmp_path, monkeypatch):
    """A run stopped after its first epoch and started again from its checkpoint ends with the weights
    of a run never stopped (batch order, optimizer and schedule restored), keeps the first epoch's
    test accuracy, and refuses a checkpoint of another recipe by name."""
    import bench.nets.train as tr

    cfg = ViTConfig(image=8, classes=10, d=8, depth=1, heads=2, ffn=12, patch=2)
    kw = {"seed": 3, "epochs": 2, "batch_size": 256, "progress": False, "margin_eps": 0.01}
    whole, _ = tr.train(cfg, "digits", **kw)
    ckpt = tmp_path / "m.safetensors.ckpt"
    calls = []
    real = tr.accuracy

    def stop_in_epoch_two(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tr, "accuracy", stop_in_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        tr.train(cfg, "digits", checkpoint=ckpt, **kw)
    monkeypatch.setattr(tr, "accuracy", real)
    assert torch.load(ckpt, weights_only=False)["epoch"] == 1
    resumed, card = tr.train(cfg, "digits", checkpoint=ckpt, **kw)
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(card["epoch_test_accuracy"]) == 2
    assert card["epoch_test_accuracy"][-1] == round(card["test_accuracy"], 4)
    with pytest.raises(InputError, match=r"another recipe .*seed"):
        tr.train(cfg, "digits", checkpoint=ckpt, **{**kw, "seed": 4})


@pytest.mark.parametrize("extra,named", [(["--depth", "3"], "--depth"),
                                         (["--seed", "1", "--heads", "4"], "--heads, --seed"),
                                         (["--margin-eps", "0.01"], "--margin-eps")])
def test_train_zoo_refuses_the_options_of_one_model(capsys, tmp_path, extra, named):
    code, out, err = main_inprocess(capsys, "train", "--zoo", "--out", str(tmp_path / "zoo"), *extra)
    one_error(code, err, f"{named} appl")
    assert out == "" and not (tmp_path / "zoo").exists()
