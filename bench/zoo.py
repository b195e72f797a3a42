"""The committed zoo of trained ViTs (``zoo/``): which models, how to retrain them, its README.

``python -m bench train --zoo`` retrains every model below into ``zoo/`` and rewrites
``zoo/README.md`` from the cards.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.data import SHAPES
from models.vit import ViTConfig
from models.vit_io import save_vit

from .train import DEFAULTS, command, model_name, train

# digits, d = 32, certifiable (logit weights capped at 1, Lipschitz-margin training at ε 0.003, 120
# epochs): depth {1,2,3} at h=2, c=0.5; heads {1,2,4} at depth 2, c=0.5; c {0.25,0.5,1} at depth 2,
# h=2 (7 models). The published recipe (logits uncapped, cross-entropy) at depth 2, h=2, c=0.5, for
# contrast: it is as accurate and certifies nothing at ε ≥ 1e-3 (docs/bounds.md §5). Vanilla at
# d=16 over depth {2,4} × heads {1,4} for the Cauchy rows; and a tiny model (2 epochs, a second or
# two) that tests/test_vit.py retrains bit for bit.
LOFAST = {"d": 32, "ffn": 64, "variant": "lofast", "ffn_constraint": 1.0}
CERTIFIABLE = {**LOFAST, "qk_constraint": 1.0}
MARGIN_EPS, CERTIFIABLE_EPOCHS = 0.003, 120
VANILLA = {"d": 16, "ffn": 32, "variant": "vanilla", "constraint": None, "ffn_constraint": None}
# (architecture, epochs or None for the default, name or None for model_name, margin eps)
ZOO: list[tuple[dict, int | None, str | None, float]] = [
    *(({**CERTIFIABLE, "depth": b, "heads": 2, "constraint": 0.5}, CERTIFIABLE_EPOCHS, None, MARGIN_EPS)
      for b in (1, 2, 3)),
    *(({**CERTIFIABLE, "depth": 2, "heads": h, "constraint": 0.5}, CERTIFIABLE_EPOCHS, None, MARGIN_EPS)
      for h in (1, 4)),
    *(({**CERTIFIABLE, "depth": 2, "heads": 2, "constraint": c}, CERTIFIABLE_EPOCHS, None, MARGIN_EPS)
      for c in (0.25, 1.0)),
    ({**LOFAST, "depth": 2, "heads": 2, "constraint": 0.5}, None, None, 0.0),
    *(({**VANILLA, "depth": b, "heads": h}, None, None, 0.0) for b in (2, 4) for h in (1, 4)),
    ({**LOFAST, "d": 16, "ffn": 32, "depth": 1, "heads": 1, "constraint": 0.5}, 2,
     "tiny-digits-d16-b1-h1-c0.5", 0.0),
]
TINY = ZOO[-1][2]

HEADER = """# The ViT zoo

Small ViTs (models/vit.py, docs/bounds.md §5) trained on scikit-learn's 8×8 digits (1,347 training,
450 test images; `models.data.load_digits`), on the CPU with one thread, float64, seed 0. Each model
is `NAME.safetensors` (the weights, capped ones as trained) and `NAME.json` (its card: dataset,
architecture, training settings, clean test accuracy, training seconds and device, suite version and
git commit). `models.vit_io.load_vit("zoo/NAME.safetensors")` returns the network and its card.

`lofast` models: patch 2 (16 tokens of 2×2 pixels), LayerProject R = 1 before every attention,
per-head ‖W^V_l‖₂, ‖W^O_l‖₂ ≤ c, FFN ‖W₁‖₂, ‖W₂‖₂ ≤ 1 (Lip(FFN) ≤ 2). Those ending in `-q1-m0.003`
are the certifiable ones: per-head ‖W^Q_l‖₂, ‖W^K_l‖₂ ≤ 1 too, and trained for 120 epochs on
Lipschitz-margin logits at ε = 0.003 (`bench/train.py: margin_loss`); `digits-d32-b2-h2-c0.5` is
LoFAST's recipe (logits uncapped, cross-entropy), as accurate and certified at no ε ≥ 1e-3
(docs/bounds.md §5). `vanilla` models: pre-LayerNorm instead of LayerProject, nothing capped (for
the Jacobian σ_max rows of the Cauchy view).
`tiny-…` is a 2-epoch model that `tests/test_vit.py` retrains and compares bit for bit.

Retrain everything (from the checkout's root; a few minutes on one core): `python -m bench train --zoo`.
On the same machine and torch build the weights come out bit-identical; elsewhere expect tiny
floating-point differences. Training seconds are wall-clock on a shared 2-core box: indicative only.
The commands below write over the committed model they name only with `--force` added (`train`
does not overwrite a file unless told to).

"""


def train_zoo(out_dir: Path, device: str = "cpu", only: str | None = None) -> Path:
    """Trains every model of ``ZOO`` (or the one named ``only``) into ``out_dir``; returns the README
    written there."""
    for arch, epochs, name, margin_eps in ZOO:
        image, classes = SHAPES["digits"]
        cfg = ViTConfig(image=image, classes=classes, patch=DEFAULTS["digits"]["patch"], **arch)
        name = name or model_name("digits", cfg, margin_eps)
        if only is not None and name != only:
            continue
        out = out_dir / f"{name}.safetensors"
        net, card = train(cfg, "digits", epochs=epochs or DEFAULTS["digits"]["epochs"],
                          margin_eps=margin_eps, device=device)
        save_vit(out, net, {**card, "command": command(cfg, card, out)})
    return write_readme(out_dir)


def write_readme(out_dir: Path) -> Path:
    """``out_dir/README.md``: one table row per card found there, then each model's command."""
    cards = [(p, json.loads(p.read_text())) for p in sorted(out_dir.glob("*.json"))]
    rows = ["| model | variant | depth | heads | d | c | q | margin ε | epochs | test acc. | train s | KB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    total = 0
    for p, c in cards:
        a, kb = c["architecture"], (p.with_suffix(".safetensors").stat().st_size + p.stat().st_size) / 1024
        total += kb
        cap = lambda v: "—" if v is None else f"{v:g}"
        rows.append(f"| `{p.stem}` | {a['variant']} | {a['depth']} | {a['heads']} | {a['d']} | "
                    f"{cap(a['constraint'])} | {cap(a.get('qk_constraint'))} | "
                    f"{c.get('margin_eps', 0.0):g} | "
                    f"{c['epochs']} | {c['test_accuracy']:.4f} | {c['train_seconds']:.1f} | {kb:.0f} |")
    seconds = sum(c["train_seconds"] for _, c in cards)
    rows.append(f"\n{len(cards)} models, {total:.0f} KB with their cards, {seconds:.0f} s of training in all "
                f"(on {cards[0][1]['device_name'] if cards else '—'}).")
    commands = "\n".join(c["command"] for _, c in cards)
    text = HEADER + "\n".join(rows) + f"\n\n## One model at a time\n\n```bash\n{commands}\n```\n"
    path = out_dir / "README.md"
    path.write_text(text)
    return path

