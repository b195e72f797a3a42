"""A tiny ViT made of the suite's own layers, so that the bounds apply to it block by block.

docs/bounds.md §5 (LoFAST §5.2): images [B, H, W] → non-overlapping p×p patches (a permutation of the
pixels) → linear embedding E → + a learned positional embedding (a constant: it cancels in
differences) → N blocks ``X ↦ FFN(F(Proj_R(X)))`` with F the residual dot-product attention of §1.1,
computed by ``models.DotMHA`` itself, and FFN the row-wise residual ``x + W₂ relu(W₁x + b₁) + b₂`` →
mean over tokens → linear head. The ``vanilla`` variant puts a pre-LayerNorm where LayerProject is
and constrains nothing (for the Cauchy-view rows, docs/bounds.md §3.4).

The ``lofast`` variant caps every per-head ‖W^V_l‖₂ and ‖W^O_l‖₂ at c, and the FFN's ‖W₁‖₂, ‖W₂‖₂ at
``ffn_constraint``, by :class:`SpectralCap`, a ``torch.nn.utils.parametrize`` parametrization with
the exact spectral norm. A network rebuilt from a file holds the capped weights as plain parameters.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .errors import InputError, check_heads
from .layers import DotMHA, layer_project

VARIANTS = ("lofast", "vanilla", "standard")
# the FFN's activation: relu, or GELU exact (x·Φ(x)) or in its tanh approximation ½x(1 + tanh(c(x + ax³))),
# as torch names them; ``gelu_tanh_f32``: the tanh form with c and a rounded to float32, as an ONNX
# exporter before opset 20 writes it (Mul, Pow, Tanh and Add nodes with float32 constants)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "gelu_tanh_f32")
# the tanh form's (c, a) per activation: torch's, and the same rounded to float32
TANH_FORMS = {"gelu_tanh": (math.sqrt(2 / math.pi), 0.044715),
              "gelu_tanh_f32": (float(torch.tensor(math.sqrt(2 / math.pi), dtype=torch.float32)),
                                float(torch.tensor(0.044715, dtype=torch.float32)))}
# max |GELU'(x)| = GELU'(√2) = Φ(√2) + √2·φ(√2) = 1.128904..., rounded up (GELU'' = φ(x)(2 − x²) vanishes
# at ±√2; GELU' > 0 is at its largest there, and its least, −0.1289 at −√2, is smaller in size); the tanh
# approximation's is 1.128993... at x ≈ 1.42, also below (with its constants rounded to float32 too:
# they move it by under 1e-7)
GELU_LIPSCHITZ = 1.1300


def activate(activation: str, Z: Tensor) -> Tensor:
    """The FFN's ``activation`` (:data:`ACTIVATIONS`) of Z."""
    if activation == "relu":
        return torch.relu(Z)
    if activation == "gelu":
        return torch.nn.functional.gelu(Z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(Z, approximate="tanh")
    c, a = TANH_FORMS[activation]
    return 0.5 * Z * (1 + torch.tanh(c * (Z + a * Z * Z * Z)))
# the standard variant's norms (LayerNorm, or BatchNorm as the VNN-COMP ViTs have it: affine in eval)
# and its pooling (the class token, or the mean of the normalized tokens)
NORMS = ("layer", "batch")
POOLS = ("cls", "mean")


def _cap(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise InputError(f"{name} must be a finite number > 0 or none, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ViTConfig:
    """The architecture; ``image`` is the side of the square input, ``ffn`` the FFN's hidden width."""

    image: int
    classes: int
    d: int = 32
    depth: int = 2
    heads: int = 2
    patch: int = 2
    ffn: int = 64
    variant: str = "lofast"
    constraint: float | None = 0.5  # cap on every per-head ‖W^V_l‖₂, ‖W^O_l‖₂ (None: unconstrained)
    ffn_constraint: float | None = 1.0  # cap on ‖W₁‖₂, ‖W₂‖₂, so Lip(FFN) ≤ 1 + cap²
    # cap on every per-head ‖W^Q_l‖₂, ‖W^K_l‖₂ (None: uncapped, as LoFAST). Uncapped logits let
    # training sharpen attention until ‖W^Q_l W^K_lᵀ‖ ~ 100 and no bound certifies anything at ε ≥ 1e-3.
    qk_constraint: float | None = None
    R: float = 1.0  # LayerProject radius (lofast variant only)
    activation: str = "relu"  # the FFN's (ACTIVATIONS); a card without it is a relu model
    # the standard variant only (a card without them has today's defaults): its norms (NORMS) and their
    # eps, its pooling (POOLS), and biases on the attention's queries, keys, values and output (as a
    # network imported from another framework has them: docs/bounds.md §1.5)
    norm: str = "layer"
    norm_eps: float = 1e-5
    pool: str = "cls"
    bias: bool = False

    def __post_init__(self):
        for name in ("image", "classes", "d", "depth", "heads", "patch", "ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
        if self.classes < 2:
            raise InputError(f"classes must be at least 2, got {self.classes}")
        check_heads(self.d, self.heads)
        if self.image % self.patch:
            raise InputError(f"patch {self.patch} does not divide the image side {self.image}")
        if self.variant not in VARIANTS:
            raise InputError(f"unknown variant {self.variant!r}; expected one of {', '.join(VARIANTS)}")
        if self.activation not in ACTIVATIONS:
            raise InputError(f"unknown activation {self.activation!r}; expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        if self.norm not in NORMS:
            raise InputError(f"unknown norm {self.norm!r}; expected one of {', '.join(NORMS)}")
        if self.pool not in POOLS:
            raise InputError(f"unknown pooling {self.pool!r}; expected one of {', '.join(POOLS)}")
        _cap(self.norm_eps, "norm_eps")
        if not isinstance(self.bias, bool):
            raise InputError(f"bias must be true or false, got {self.bias!r}")
        custom = (self.norm, self.norm_eps, self.pool, self.bias) != ("layer", 1e-5, "cls", False)
        if custom and self.variant != "standard":
            raise InputError("norm, norm_eps, pool and bias are options of the standard variant")
        _cap(self.constraint, "constraint")
        _cap(self.ffn_constraint, "ffn_constraint")
        _cap(self.qk_constraint, "qk_constraint")
        _cap(self.R, "R")
        if self.variant == "vanilla" and (self.constraint, self.ffn_constraint, self.qk_constraint) != (
                None, None, None):
            raise InputError("the vanilla variant is unconstrained: constraint, ffn_constraint and "
                             "qk_constraint must be none")

    @property
    def n_tokens(self) -> int:
        """The sequence's length: the patches, and the class token of the standard variant."""
        return (self.image // self.patch) ** 2 + self.class_token

    @property
    def class_token(self) -> bool:
        """Whether the sequence starts with a class token (the standard variant pooling by it)."""
        return self.variant == "standard" and self.pool == "cls"

    def to_dict(self) -> dict:
        out = asdict(self)
        # the cards written before these options, unchanged
        for key, default in (("activation", "relu"), ("norm", "layer"), ("norm_eps", 1e-5), ("pool", "cls"),
                             ("bias", False)):
            if out[key] == default:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise InputError(f"unknown architecture keys {sorted(unknown)}; expected {sorted(names)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required key missing
            raise InputError(f"architecture: {e}") from None


class SpectralCap(nn.Module):
    """``W ↦ W / max(1, ‖W‖₂/c)`` for each trailing matrix: the exact, differentiable spectral norm
    (an SVD; ``torch.nn.utils.parametrizations.spectral_norm`` estimates it by power iteration and
    sets it to 1 rather than capping it)."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, W: Tensor) -> Tensor:
        # The full SVD in every mode: matrix_norm/svdvals call a different LAPACK routine without
        # grad, whose last bits differ, and the weights evaluated, stored and certified must be the
        # same bits as those trained.
        sigma = torch.linalg.svd(W, full_matrices=False).S[..., 0]
        return W / torch.clamp(sigma / self.c, min=1.0)[..., None, None]


class Attention(nn.Module):
    """The weights of one ``models.DotMHA`` (residual unless the block adds its own; with ``bias``, the
    biases b_q, b_k, b_v [h, d_h] and b_o [d]) as trainable parameters."""

    def __init__(self, d: int, heads: int, residual: bool = True, bias: bool = False):
        super().__init__()
        self.residual = residual
        d_h = d // heads
        # 1/√d keeps the initial logits and values O(1) for tokens of norm ≤ R
        self.W_q = nn.Parameter(torch.randn(heads, d, d_h) / math.sqrt(d))
        self.W_k = nn.Parameter(torch.randn(heads, d, d_h) / math.sqrt(d))
        self.W_v = nn.Parameter(torch.randn(heads, d, d_h) / math.sqrt(d))
        self.W_o = nn.Parameter(torch.randn(heads, d_h, d) / math.sqrt(d_h))
        self.bias = bias
        if bias:
            for name, shape in (("b_q", (heads, d_h)), ("b_k", (heads, d_h)), ("b_v", (heads, d_h)),
                                ("b_o", (d,))):
                setattr(self, name, nn.Parameter(torch.zeros(shape)))

    def biases(self) -> dict[str, Tensor]:
        """The biases as DotMHA takes them (none without ``bias``)."""
        return {n: getattr(self, n) for n in ("b_q", "b_k", "b_v", "b_o")} if self.bias else {}

    def layer(self) -> DotMHA:
        """The suite's layer on the current (capped) weights; gradients flow through it."""
        return DotMHA(self.W_q, self.W_k, self.W_v, self.W_o, residual=self.residual, **self.biases())

    def forward(self, X: Tensor) -> Tensor:
        return self.layer()(X)


class FFN(nn.Module):
    """Row-wise ``x + W₂ σ(W₁x + b₁) + b₂``, σ relu (1-Lipschitz) or GELU (:data:`GELU_LIPSCHITZ`); the
    biases cancel in differences, so Lip = 1 + Lip(σ)‖W₂‖₂‖W₁‖₂ per row, hence also from Frobenius to
    Frobenius."""

    def __init__(self, d: int, width: int, activation: str = "relu"):
        super().__init__()
        self.up = nn.Linear(d, width)
        self.down = nn.Linear(width, d)
        self.activation = activation

    def act(self, Z: Tensor) -> Tensor:
        return activate(self.activation, Z)

    def branch(self, X: Tensor) -> Tensor:
        """``W₂ σ(W₁x + b₁) + b₂``, the part a residual adds."""
        return self.down(self.act(self.up(X)))

    def forward(self, X: Tensor) -> Tensor:
        return X + self.branch(X)

    def lipschitz(self, residual: bool = True) -> float:
        """``1 + Lip(σ)‖W₂‖₂‖W₁‖₂`` (without ``residual``: the branch's, no 1 +) from the exact singular
        values of the current weights, in float64."""
        norms = [torch.linalg.matrix_norm(m.weight.detach().double(), ord=2) for m in (self.up, self.down)]
        lip = (1.0 if self.activation == "relu" else GELU_LIPSCHITZ) * norms[0] * norms[1]
        return float(residual + lip)


class TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the features of every token ([..., d]), as a ViT with BatchNorm in place of
    LayerNorm has it (VNN-COMP's): in eval an affine map per feature, x ↦ a ⊙ x + b."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__(d, eps=eps)
        # no batch counter: momentum is set, so it is never read, and a file holds float tensors only
        self.register_buffer("num_batches_tracked", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # nn.Module's own: _NormBase's adds a batch counter to a state without a version
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def forward(self, X: Tensor) -> Tensor:
        return super().forward(X.reshape(-1, X.shape[-1])).reshape(X.shape)

    def scale_shift(self) -> tuple[Tensor, Tensor]:
        """(a, b) [d] in float64 with eval's output a ⊙ x + b: a = γ/√(var + eps), b = β − a·mean."""
        a = self.weight.detach().double() / (self.running_var.double() + self.eps).sqrt()
        return a, self.bias.detach().double() - a * self.running_mean.double()


def make_norm(cfg: ViTConfig) -> nn.Module:
    """The norm of a vanilla or standard block: LayerNorm, or the standard variant's BatchNorm."""
    if cfg.norm == "batch":
        return TokenBatchNorm(cfg.d, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d, eps=cfg.norm_eps)


class Block(nn.Module):
    """``X ↦ FFN(F(prepare(X)))``, prepare = LayerProject_R (lofast) or LayerNorm (vanilla); the
    standard variant's pre-LayerNorm block ``X ← X + A(LN₁(X)); X ← X + M(LN₂(X))`` with A the
    attention without its residual and M the FFN's branch (the residuals around the norms)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.R = cfg.R if cfg.variant == "lofast" else None
        self.norm = make_norm(cfg) if cfg.variant != "lofast" else None
        self.standard = cfg.variant == "standard"
        self.norm2 = make_norm(cfg) if self.standard else None
        self.attn = Attention(cfg.d, cfg.heads, residual=not self.standard, bias=cfg.bias)
        self.ffn = FFN(cfg.d, cfg.ffn, cfg.activation)

    def prepare(self, X: Tensor) -> Tensor:
        return layer_project(X, self.R) if self.norm is None else self.norm(X)

    def forward(self, X: Tensor) -> Tensor:
        if self.standard:
            X = X + self.attn(self.norm(X))
            return X + self.ffn.branch(self.norm2(X))
        return self.ffn(self.attn(self.prepare(X)))


@dataclass(frozen=True)
class Trace:
    """One forward pass: ``inputs[k]`` is block k's input after Proj_R (or LayerNorm), the tensor
    its ``DotMHA`` sees; ``features`` the pooled [B, d] vector; ``logits`` [B, classes]."""

    inputs: list[Tensor]
    features: Tensor
    logits: Tensor


class ViT(nn.Module):
    """The network of docs/bounds.md §5. ``constrained=False`` skips the caps: a network loaded from
    a file already holds capped weights, and capping them again could move them by an ulp."""

    def __init__(self, cfg: ViTConfig, constrained: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.patch * cfg.patch, cfg.d, bias=False)  # E (its bias would be a constant)
        self.pos = nn.Parameter(torch.randn(cfg.n_tokens, cfg.d) / math.sqrt(cfg.d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.d, cfg.classes)
        # the standard variant: a class token first in the sequence, a final norm, and the head on the
        # class token (ViT's own pooling; with pool "mean", the mean of the normalized tokens) where the
        # others take the tokens' mean
        self.standard = cfg.variant == "standard"
        self.cls = nn.Parameter(torch.randn(1, cfg.d) * 0.02) if cfg.class_token else None
        self.norm = make_norm(cfg) if self.standard else None
        if constrained:
            for block in self.blocks:
                for name, c in (("W_v", cfg.constraint), ("W_o", cfg.constraint),
                                ("W_q", cfg.qk_constraint), ("W_k", cfg.qk_constraint)):
                    if c is not None:
                        parametrize.register_parametrization(block.attn, name, SpectralCap(c))
                for lin in (block.ffn.up, block.ffn.down):
                    if cfg.ffn_constraint is not None:
                        parametrize.register_parametrization(lin, "weight", SpectralCap(cfg.ffn_constraint))

    def patches(self, images: Tensor) -> Tensor:
        """[B, H, W] → [B, n, p²], patches row-major: a permutation of the pixels, so ℓ2 is kept."""
        if images.dim() != 3 or images.shape[1:] != (self.cfg.image, self.cfg.image):
            raise InputError(f"images must be [B, {self.cfg.image}, {self.cfg.image}], "
                             f"got shape {list(images.shape)}")
        B, p, g = images.shape[0], self.cfg.patch, self.cfg.image // self.cfg.patch
        return images.reshape(B, g, p, g, p).permute(0, 1, 3, 2, 4).reshape(B, g * g, p * p)

    def tokens(self, images: Tensor) -> Tensor:
        """The first block's raw input ``patches·E + pos`` (the class token first in the standard
        variant), [B, n, d]."""
        X = self.embed(self.patches(images))
        if self.cls is not None:
            X = torch.cat([self.cls.expand(X.shape[0], 1, -1), X], -2)
        return X + self.pos

    def pool(self, X: Tensor) -> Tensor:
        """The features of the last block's output: the mean token, or the standard variant's class
        token after the final norm (with pool "mean": the mean of the normalized tokens)."""
        if not self.standard:
            return X.mean(dim=-2)
        return self.norm(X[..., 0, :]) if self.cls is not None else self.norm(X).mean(dim=-2)

    def trace(self, images: Tensor) -> Trace:
        X, inputs = self.tokens(images), []
        for block in self.blocks:
            inputs.append(block.prepare(X))
            X = block(X)
        features = self.pool(X)
        return Trace(inputs, features, self.head(features))

    def forward(self, images: Tensor) -> Tensor:
        return self.trace(images).logits

    # What a certificate (docs/bounds.md §5) needs, all detached and in float64.

    @property
    def R(self) -> float | None:
        """LayerProject radius in front of every attention (None for the vanilla variant)."""
        return self.cfg.R if self.cfg.variant == "lofast" else None

    @property
    def pool_lipschitz(self) -> float:
        """Mean pooling over n tokens is 1/√n-Lipschitz from Frobenius to ℓ2 (Cauchy–Schwarz)."""
        return 1.0 / math.sqrt(self.cfg.n_tokens)

    def embedding_matrix(self) -> Tensor:
        """E as [p², d] (tokens = patches @ E + pos); its spectral norm maps an ℓ2 ball on the image
        into a Frobenius ball on the tokens."""
        return self.embed.weight.detach().double().T.contiguous()

    def pixel_map(self) -> Tensor:
        """[H·W, n, d] in float64: pixel k's contribution to every token, patching (a permutation)
        folded with E, on the weights' device (the linear part of ``tokens``)."""
        pixels = self.cfg.image ** 2
        basis = torch.eye(pixels, dtype=torch.float64, device=self.embed.weight.device)
        basis = basis.reshape(pixels, self.cfg.image, self.cfg.image)
        with torch.no_grad():
            out = self.patches(basis) @ self.embedding_matrix()
        if self.cls is not None:  # the class token moves with no pixel
            out = torch.cat([out.new_zeros(pixels, 1, self.cfg.d), out], 1)
        return out

    def embedding_norm(self) -> float:
        return float(torch.linalg.matrix_norm(self.embedding_matrix(), ord=2))

    def attention_layers(self) -> tuple[DotMHA, ...]:
        """Each block's attention as a float64 ``models.DotMHA`` (residual=True), weights detached."""
        return tuple(DotMHA(*(getattr(b.attn, n).detach().double() for n in ("W_q", "W_k", "W_v", "W_o")),
                            residual=not b.standard,
                            **{k: v.detach().double() for k, v in b.attn.biases().items()})
                     for b in self.blocks)

    def ffn_lipschitz(self) -> list[float]:
        """Lip(FFN_k) = 1 + ‖W₂‖₂‖W₁‖₂ from exact float64 singular values, one per block."""
        return [b.ffn.lipschitz() for b in self.blocks]

    def head_matrix(self) -> Tensor:
        """W [classes, d]; the head's bias shifts every logit by a constant and cancels in differences."""
        return self.head.weight.detach().double()

    def head_bias(self) -> Tensor:
        return self.head.bias.detach().double()

    def weights(self) -> dict[str, Tensor]:
        """Every effective (capped) tensor under its unparametrized name, as a file stores it."""
        out = {}
        for key in self.state_dict():
            # a capped tensor is stored as <module>.parametrizations.<name>.original
            name = re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", key)
            owner, _, attr = name.rpartition(".")
            out[name] = getattr(self.get_submodule(owner) if owner else self, attr).detach()
        return out
