"""CROWN and α-CROWN on a whole ViT's margins (docs/bounds.md §5): the network from pixels to logits
traced for auto_LiRPA, and the specification ``logit_y − logit_j > 0`` for every j ≠ y given as its
C matrix (rows e_y − e_j), over the joint ℓ2 ball ‖γ‖₂ ≤ ε on the whole image (no pixel box, as the
margin attack). An image is certified iff every lower bound is > 0 (beyond rounding): a direct
verification of the margin, with no δ_features in between, so it is the verdict of both of
``bench certify``'s tests. Certificate ``relaxation``, as :mod:`bounds.crown`.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from tqdm import tqdm

from models.vit import TANH_FORMS, TokenBatchNorm, ViT

from ..crown import RELAXATION, float64_lirpa, intersect, lirpa_module, nan_as
from .propagated import ROUNDING, check_stages

METHODS = {"crown": "CROWN", "alpha_crown": "alpha-CROWN"}
# Images bounded at once. auto_LiRPA's tensors grow with the batch: CROWN is fastest at 1–2 images
# and α-CROWN, which keeps its slopes per image, runs out of memory at 10 (docs/scale.md)
BATCH = {"crown": 2, "alpha_crown": 1}


class _Gelu(torch.autograd.Function):
    """GELU as one node auto_LiRPA relaxes (``custom::Gelu``, its BoundGelu): traced as F.gelu it
    becomes an Erf, which auto_LiRPA has no bound for."""

    @staticmethod
    def symbolic(g, x):
        return g.op("custom::Gelu", x)

    @staticmethod
    def forward(ctx, x):
        return torch.nn.functional.gelu(x)


class TracedViT(nn.Module):
    """A lofast ViT as ops auto_LiRPA traces, on the flattened image [B, H·W] → logits [B, C].

    Patching is a permutation of the pixels, so it is folded with the embedding into one constant
    matrix. LayerProject ``x·min(1, R/‖x‖)`` is written ``x · R / (R + relu(‖x‖ − R))`` with
    ``‖x‖ = sqrt(Σ x²)``: the same function, from ops with CROWN relaxations (a product, a sum, sqrt,
    relu, reciprocal) where ``torch.clamp`` of a norm ratio has none. The row softmax is
    exp / Σ exp (not ``torch.softmax``, for the reason :class:`bounds.crown.Traced` gives); it
    needs no shift here, as every projected token has norm ≤ R and the query and key weights of a
    certifiable zoo model are capped, so |logits| stays far from exp's overflow. Where they are not
    (``digits-d32-b2-h2-c0.5``, LoFAST's recipe) the relaxation overflows: its bounds are NaN or
    auto_LiRPA cannot compute them, and they certify nothing (:func:`crown_lower`).
    """

    def __init__(self, net: ViT):
        super().__init__()
        check_stages(net)
        cfg = net.cfg
        self.n, self.d, self.R = cfg.n_tokens, cfg.d, float(cfg.R)
        # LayerNorm where the vanilla variant has it: (x − μ)/(σ² + e)^½·γ + β from a mean, products,
        # a sum, sqrt and a division (auto_LiRPA relaxes each; its sqrt needs σ² + e ≥ 0 over the box)
        # (BatchNorm in eval: x·a + b, kept as (None, a, b))
        kept = lambda m: None if m is None else (
            (None, *(t.clone() for t in m.scale_shift())) if isinstance(m, TokenBatchNorm)
            else (float(m.eps), m.weight.detach().double().clone(), m.bias.detach().double().clone()))
        self.norms = [kept(b.norm) for b in net.blocks]
        # the standard variant's second norm per block, final norm and class token (in ``pos``: the
        # tokens' constant part, as the pixel map gives the class token no pixel)
        self.standard, self.cls = net.standard, net.cls is not None
        self.norms2 = [kept(b.norm2) for b in net.blocks]
        self.final = kept(net.norm)
        pixels = cfg.image * cfg.image
        self.register_buffer("M", net.pixel_map().reshape(pixels, self.n * self.d))
        pos = net.pos.detach().double().clone()
        if self.cls:
            pos[0] += net.cls.detach().double()[0]
        self.register_buffer("pos", pos)
        self.scale = 1 / math.sqrt(cfg.d // cfg.heads)
        self.blocks = []
        for k, block in enumerate(net.blocks):
            names = {"W_q": block.attn.W_q, "W_k": block.attn.W_k, "W_v": block.attn.W_v,
                     "W_o": block.attn.W_o, "W_1": block.ffn.up.weight, "b_1": block.ffn.up.bias,
                     "W_2": block.ffn.down.weight, "b_2": block.ffn.down.bias, **block.attn.biases()}
            for name, value in names.items():
                self.register_buffer(f"{name}_{k}", value.detach().double().clone())
            self.blocks.append(k)
        self.heads = cfg.heads
        self.act = cfg.activation
        self.register_buffer("W", net.head_matrix().clone())
        self.register_buffer("b", net.head_bias().clone())

    def bounded(self, device: torch.device, keep: bool = True):
        """auto_LiRPA's BoundedModule of this network on ``device``: with ``keep`` traced once (≈ 0.1 s
        a trace, a fifth of CROWN's time per image on the 1-block digits model) and kept for later
        batches of CROWN. α-CROWN takes a fresh one (``keep=False``): its optimised slopes stay on
        the module, shaped by their batch, and CROWN on a later batch of another size fails on them."""
        held = getattr(self, "_bounded", None)
        if held is None or held[0] != device or not keep:
            lirpa = lirpa_module()
            with float64_lirpa():
                self.to(device)
                like = torch.zeros(1, self.M.shape[0], dtype=torch.float64, device=device)
                held = (device, lirpa.BoundedModule(self, like, device=device, verbose=0))
            if keep:
                object.__setattr__(self, "_bounded", held)  # not a submodule: it holds this module
        return held[1]

    def _w(self, name: str, k: int) -> Tensor:
        return getattr(self, f"{name}_{k}")

    def _norm(self, X: Tensor, params: tuple) -> Tensor:
        e, gamma, beta = params
        if e is None:  # BatchNorm in eval
            return X * gamma.to(X) + beta.to(X)
        Z = X - X.mean(-1, keepdim=True)
        return Z / torch.sqrt((Z * Z).mean(-1, keepdim=True) + e) * gamma.to(X) + beta.to(X)

    def _attention(self, X: Tensor, k: int) -> Tensor:
        out = self._w("b_o", k) if hasattr(self, f"b_o_{k}") else 0
        bias = (lambda name, head: self._w(name, k)[head]) if hasattr(self, f"b_q_{k}") else (lambda *_: 0)
        for head in range(self.heads):
            Q = X.matmul(self._w("W_q", k)[head]) + bias("b_q", head)
            K = X.matmul(self._w("W_k", k)[head]) + bias("b_k", head)
            V = X.matmul(self._w("W_v", k)[head]) + bias("b_v", head)
            E = torch.exp(Q.matmul(K.transpose(1, 2)) * self.scale)
            P = E / E.sum(-1, keepdim=True)
            out = out + P.matmul(V).matmul(self._w("W_o", k)[head])
        return out

    def _branch(self, X: Tensor, k: int) -> Tensor:
        pre = X.matmul(self._w("W_1", k).T) + self._w("b_1", k)
        if self.act in TANH_FORMS:  # its formula from ops auto_LiRPA bounds (tanh, products)
            c, a = TANH_FORMS[self.act]
            hidden = 0.5 * pre * (1 + torch.tanh(c * (pre + a * pre * pre * pre)))
        else:
            hidden = torch.relu(pre) if self.act == "relu" else _Gelu.apply(pre)
        return hidden.matmul(self._w("W_2", k).T) + self._w("b_2", k)

    def forward(self, x: Tensor) -> Tensor:
        X = x.matmul(self.M).reshape(-1, self.n, self.d) + self.pos
        for k in self.blocks:
            if self.standard:  # X + A(LN₁X), then + M(LN₂·)
                X = X + self._attention(self._norm(X, self.norms[k]), k)
                X = X + self._branch(self._norm(X, self.norms2[k]), k)
                continue
            if self.norms[k] is not None:
                X = self._norm(X, self.norms[k])
            else:
                norms = torch.sqrt((X * X).sum(-1, keepdim=True))
                X = X * (self.R / (self.R + torch.relu(norms - self.R)))
            out = X + self._attention(X, k)
            X = out + self._branch(out, k)
        if not self.standard:
            features = X.mean(1)
        else:  # the class token after the final norm, or the mean of the normalized tokens
            features = self._norm(X[:, 0], self.final) if self.cls else self._norm(X, self.final).mean(1)
        return features.matmul(self.W.T) + self.b


def spec(labels: Tensor, classes: int) -> Tensor:
    """C [B, classes − 1, classes], row j: e_y − e_j for each j ≠ y (in order)."""
    eye = torch.eye(classes, dtype=torch.float64, device=labels.device)
    rows = eye[labels][:, None, :] - eye[None, :, :]  # [B, C, C]
    keep = ~torch.eye(classes, dtype=torch.bool, device=labels.device)[labels]  # drop j = y
    return rows[keep].reshape(len(labels), classes - 1, classes)


@dataclass(frozen=True)
class BatchStore(Protocol):
    """Where :func:`verify` keeps each batch's bounds, so that a cell cut short (its process stopped)
    resumes at the first batch not yet bounded (bench/core/partial.py: on disk, in a run directory).
    Keys name everything the bounds depend on but the code, which the store's own salt names."""

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, value: dict) -> None: ...


def net_digest(net: nn.Module) -> str:
    """sha256 of a network's configuration (a ViT's ``cfg``: R, the activation, the norms' ε, the
    pooling, which the weights do not say) and of its parameters and buffers (names, dtypes, shapes
    and bytes), in order."""
    cfg = getattr(net, "cfg", None)
    h = hashlib.sha256(repr(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg).encode())
    for name, t in net.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()


def batch_key(digest: str, method: str, eps: float, x: Tensor, labels: Tensor) -> str:
    """The key of one batch's bounds: the network's digest, the method, ε, the device's kind, and the
    images' and labels' bytes."""
    h = hashlib.sha256(f"{digest}|{method}|{float(eps)!r}|{x.device.type}|{tuple(x.shape)}|".encode())
    h.update(x.detach().cpu().contiguous().numpy().tobytes())
    h.update(labels.detach().cpu().to(torch.int64).numpy().tobytes())
    return h.hexdigest()


@dataclass
class MarginVerification:
    """Per image: the lower bounds of logit_y − logit_j (j ≠ y) over the ball, and the verdict."""

    lower: Tensor  # [B, C − 1]
    certified: Tensor  # [B] bool
    seconds: float  # the whole batch, tracing included


def crown_lower(bounded, xb, C: Tensor, method: str) -> Tensor:
    """auto_LiRPA's lower bounds of C·logits, or −inf where it cannot bound them. Two failures are
    auto_LiRPA's own, and mean "no bound", never a wrong one:

    - its sqrt relaxation asserts a nonnegative input, and a relaxed Σx² can have a negative lower
      bound (met with α-CROWN's optimised intermediate bounds on the tiny zoo model);
    - where exp's input bounds are so wide that its relaxation overflows, auto_LiRPA's NaN handler
      (``_check_nan``) raises a RuntimeError of its own (a ``view`` of a non-contiguous bias; met on
      the uncapped zoo model ``digits-d32-b2-h2-c0.5`` at ε = 0.02).

    No bound certifies nothing; α-CROWN's is intersected with CROWN's, so there it falls back to
    CROWN's. Any other error is raised: a failure of the traced model is a bug, not a verdict."""
    try:
        with torch.enable_grad() if method == "CROWN-Optimized" else torch.no_grad():
            lb, _ = bounded.compute_bounds(x=(xb,), C=C, method=method, bound_upper=False)
    except AssertionError:
        return _no_bound(C)
    except RuntimeError as e:
        if not _in_nan_handler(e):
            raise
        return _no_bound(C)
    return lb.detach()


def _no_bound(C: Tensor) -> Tensor:
    return torch.full(C.shape[:2], -math.inf, dtype=C.dtype, device=C.device)


def _note(line: str) -> None:
    """A note on stderr on a line of its own, above a progress bar where ``certify`` draws one."""
    tqdm.write(line, file=sys.stderr)


def _in_nan_handler(error: BaseException) -> bool:
    """Whether ``error`` was raised inside auto_LiRPA's NaN handler for exp's relaxation."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].name == "_check_nan" and "auto_LiRPA" in frames[-1].filename


def verify(net: ViT, images: Tensor, labels: Tensor, eps: float, name: str = "crown",
           traced: TracedViT | None = None, store: BatchStore | None = None,
           digest: str | None = None) -> MarginVerification:
    """CROWN (``name`` = ``crown``) or α-CROWN (``alpha_crown``; auto_LiRPA's CROWN-Optimized,
    intersected with CROWN's bounds) on the margins of ``images`` [B, H, W] over ‖γ‖₂ ≤ ``eps``.
    A bound that is NaN (an overflow inside the relaxation) or that auto_LiRPA cannot compute
    (:func:`crown_lower`) certifies nothing. A misclassified image is not sent to auto_LiRPA (its margin
    is negative at the image itself, so no sound bound certifies it): its bounds are −∞, and the
    seconds are those of the others. With a ``store``, a batch whose bounds it holds is read from it,
    with the seconds it took then; every other batch's bounds and seconds are put there (``digest``:
    the network's :func:`net_digest`, where the caller has it)."""
    lirpa = lirpa_module()
    from auto_LiRPA.perturbations import PerturbationLpNorm

    start = time.perf_counter()
    B = len(images)
    x = images.to(torch.float64).reshape(B, -1)
    classes = net.cfg.classes
    model = traced if traced is not None else TracedViT(net)
    C = spec(labels.to(x.device), classes)
    with torch.no_grad():
        logits = model(x)
    sent = (logits.argmax(-1) == labels.to(x.device)).nonzero()[:, 0]
    lb = torch.full(C.shape[:2], -math.inf, dtype=torch.float64, device=x.device)
    if store is not None and digest is None:
        digest = net_digest(net)
    batches = measured = 0.0  # the batches' seconds as measured (now or when stored); now alone
    with float64_lirpa():
        for i in range(0, len(sent), BATCH[name]):
            at = sent[i:i + BATCH[name]]
            key = batch_key(digest, name, eps, x[at], labels.to(x.device)[at]) if store is not None else ""
            kept = store.get(key) if store is not None else None
            if kept is not None:
                lb[at] = kept["lower"].to(device=lb.device, dtype=lb.dtype)
                batches += float(kept["seconds"])
                continue
            began = time.perf_counter()
            bounded = model.bounded(x.device, keep=METHODS[name] == "CROWN")
            xb = lirpa.BoundedTensor(x[at], PerturbationLpNorm(norm=2, eps=float(eps)))
            Ci = C[at]
            lower = nan_as(crown_lower(bounded, xb, Ci, "CROWN"), -math.inf)
            if METHODS[name] == "alpha-CROWN":
                optimised = crown_lower(bounded, xb, Ci, "CROWN-Optimized")
                # said, so that CROWN's verdict is not read as α-CROWN's
                if (nan_as(optimised, -math.inf) == -math.inf).all():
                    _note(f"note: α-CROWN could not bound {len(Ci)} image(s) at ε = {eps:g} (a relaxed "
                          "Σx² under LayerProject's sqrt went below 0, or its optimisation gave NaN); "
                          "their alpha_crown verdict is CROWN's")
                lower = intersect(lower, optimised, lower=True)
            lb[at] = lower.to(lb.dtype)
            took = time.perf_counter() - began
            batches, measured = batches + took, measured + took
            if store is not None:
                store.put(key, {"lower": lower.to(torch.float64).cpu(), "seconds": took})
    unbounded = int((lb[sent] == -math.inf).all(-1).sum())
    if unbounded:  # said, so that "not certified" is not read as a loose bound
        _note(f"note: {name} could not bound {unbounded} of {len(sent)} image(s) at ε = {eps:g} "
              "(auto_LiRPA's relaxation overflowed or failed, e.g. exp on wide logit bounds); "
              "they are not certified")
    # the same room for float64 rounding as the suite's own tests (bounds.network.propagated._beats)
    slack = ROUNDING * (C.abs() @ logits.abs()[:, :, None])[..., 0]
    certified = (lb > slack).all(-1)
    # this call's time outside the batches, plus each batch's own (read from the store where kept)
    around = time.perf_counter() - start - measured
    return MarginVerification(lb.cpu(), certified.cpu(), around + batches)


__all__ = ["METHODS", "RELAXATION", "BatchStore", "MarginVerification", "TracedViT", "batch_key",
           "net_digest", "spec", "verify"]
