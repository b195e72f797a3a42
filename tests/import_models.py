"""Small transformers written with plain torch for tests/models/test_import.py, as third-party code would
write them (timm's fused qkv, BERT's separate projections, pre- and post-norm), and the variants the
importer must refuse by name; ``dense`` computes an attention sub-layer from a module's own weights in
float64, independently of the importer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Fused(nn.Module):
    """timm's Attention: one Linear(d, 3d), reshape and permute into heads, SDPA or an explicit
    softmax, and a projection. ``variant`` adds what the importer must refuse."""

    def __init__(self, d: int, h: int, bias: bool = True, sdpa: bool = True, variant: str = "", n: int = 5):
        super().__init__()
        self.h, self.sdpa, self.variant = h, sdpa, variant
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        e = d // h
        if variant == "relative":
            self.table = nn.Parameter(torch.randn(h, n, n) * 0.1)
        if variant == "alibi":
            i = torch.arange(n, dtype=torch.float32)
            slopes = torch.tensor([2.0 ** -(k + 1) for k in range(h)])[:, None, None]
            self.register_buffer("alibi", slopes * (i[None, :] - i[:, None]))
        if variant == "rotary":
            freq = 1.0 / 10000 ** (torch.arange(0, e, 2).float() / e)
            ang = torch.arange(n).float()[:, None] * freq[None, :]
            self.register_buffer("cos", torch.cat([ang.cos(), ang.cos()], -1))
            self.register_buffer("sin", torch.cat([ang.sin(), ang.sin()], -1))
        if variant == "qknorm":
            self.qn, self.kn = nn.LayerNorm(e), nn.LayerNorm(e)
        if variant.startswith("talking"):
            self.mix = nn.Linear(h, h, bias=False)
        if variant == "cross":
            self.memory = nn.Linear(d, d)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.variant == "cross":  # keys and values from another sequence than the queries
            kv = self.qkv(torch.relu(self.memory(x))).reshape(B, N, 3, self.h, C // self.h)
            k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)[1:]
        if self.variant == "rotary":
            def rot(t):
                a, b = t.chunk(2, -1)
                return t * self.cos + torch.cat([-b, a], -1) * self.sin
            q, k = rot(q), rot(k)
        if self.variant == "qknorm":
            q, k = self.qn(q), self.kn(k)
        if self.sdpa:
            # a mask that masks nothing (transformers passes one without padding) changes no value
            mask = torch.ones(N, N, dtype=torch.bool) if self.variant == "no_op_mask" else None
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.variant == "causal")
        else:
            if self.variant == "einsum":  # QKᵀ and P V written as einsums
                a = torch.einsum("bhid,bhjd->bhij", q, k) * (C // self.h) ** -0.5
                o = torch.einsum("bhij,bhjd->bhid", a.softmax(-1), v)
                return self.proj(o.transpose(1, 2).reshape(B, N, C))
            a = (q * (C // self.h) ** -0.5) @ k.transpose(-2, -1)
            if self.variant == "causal":
                a = a.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
            if self.variant == "no_op_mask":
                a = a + torch.zeros(N, N)
            if self.variant == "padding":
                a = a + (x[:, None, None, :, 0] < 0) * -1e9
            if self.variant == "relative":
                a = a + self.table
            if self.variant == "alibi":
                a = a + self.alibi
            if self.variant == "talking":
                a = self.mix(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            if self.variant == "talking_einsum":
                a = torch.einsum("bhij,hg->bgij", a, self.mix.weight)
            o = a.softmax(-1) @ v
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class Separate(nn.Module):
    """BERT's self-attention: query, key and value Linears, view/permute, QKᵀ/√d_h, softmax, P V,
    then a dense projection."""

    def __init__(self, d: int, h: int, bias: bool = True):
        super().__init__()
        self.h = h
        self.query, self.key, self.value = (nn.Linear(d, d, bias=bias) for _ in range(3))
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        B, N, C = x.shape
        e = C // self.h

        def heads(t):
            return t.view(B, N, self.h, e).permute(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        a = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(e)
        o = torch.matmul(nn.functional.softmax(a, dim=-1), v)
        return self.proj(o.permute(0, 2, 1, 3).reshape(B, N, C))


class BatchNormTokens(nn.Module):
    """BatchNorm1d over the channels of [B, n, d] tokens (in eval: running statistics)."""

    def __init__(self, d: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class Block(nn.Module):
    """A transformer block: pre-norm ``x + attn(norm(x))`` (LayerNorm or BatchNorm) or post-norm
    ``LN(x + attn(x))`` (BERT), then an MLP the same way (``act``: onnxruntime has no float64 Erf,
    so a float64 ONNX model takes ReLU)."""

    def __init__(self, attn: nn.Module, d: int, post: bool = False, norm: str = "ln", act=nn.GELU):
        super().__init__()
        self.attn, self.post = attn, post
        self.n1 = BatchNormTokens(d) if norm == "bn" else nn.LayerNorm(d)
        self.n2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), act(), nn.Linear(2 * d, d))

    def forward(self, x):
        if self.post:
            x = self.n1(x + self.attn(x))
            return self.n2(x + self.mlp(x))
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Net(nn.Module):
    """Blocks on a linear patch embedding (float inputs) or a token embedding (token ids), then mean
    pooling and a head."""

    def __init__(self, blocks: list[nn.Module], d: int, vocab: int = 0, d_in: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d) if vocab else nn.Linear(d_in or d, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


class TorchMHA(nn.Module):
    """torch's own nn.MultiheadAttention as self-attention on [B, n, d] tokens."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.mha = nn.MultiheadAttention(d, h, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class ImageViT(nn.Module):
    """A ViT on [B, 1, side, side] images as a timm-style file holds one: a conv patch embedding, a
    class token expanded to the batch size read off the input (what makes an older exporter write
    Shape, Gather and ConstantOfShape), positions, blocks, and the class token's head."""

    def __init__(self, blocks: list[nn.Module], d: int, side: int = 8, patch: int = 4, classes: int = 10):
        super().__init__()
        n = (side // patch) ** 2 + 1
        self.patch = nn.Conv2d(1, d, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, n, d) * 0.1)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        z = self.patch(x).flatten(2).transpose(1, 2)
        z = torch.cat([self.cls.expand(x.shape[0], -1, -1), z], 1) + self.pos
        for b in self.blocks:
            z = b(z)
        return self.head(z[:, 0])


class ChannelFirst(nn.Module):
    """A ViT of this suite (images [B, H, W]) behind the [B, 1, H, W] input an exported ViT takes."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x[:, 0])


def dense(attn: nn.Module, X: torch.Tensor, residual: bool) -> torch.Tensor:
    """The attention sub-layer of ``attn`` (Fused, Separate or TorchMHA) at X [n, d], in float64 from
    the module's own weights: per head softmax(Q Kᵀ/√d_h) V, heads concatenated, then the projection."""
    X = X.double()
    d = X.shape[-1]
    h = attn.h
    e = d // h

    def lin(m):
        W = m.weight.detach().double()
        return W, m.bias.detach().double() if m.bias is not None else torch.zeros(W.shape[0], dtype=W.dtype)

    if isinstance(attn, TorchMHA):
        W, b = attn.mha.in_proj_weight.detach().double(), attn.mha.in_proj_bias.detach().double()
        (Wq, Wk, Wv), (bq, bk, bv) = W.split(d), b.split(d)
    elif isinstance(attn, Fused):
        W, b = lin(attn.qkv)
        (Wq, Wk, Wv), (bq, bk, bv) = W.split(d), b.split(d)
    else:
        (Wq, bq), (Wk, bk), (Wv, bv) = lin(attn.query), lin(attn.key), lin(attn.value)
    ctx = []
    for head in range(h):
        s = slice(head * e, (head + 1) * e)
        Q, K, V = X @ Wq[s].T + bq[s], X @ Wk[s].T + bk[s], X @ Wv[s].T + bv[s]
        ctx.append(torch.softmax(Q @ K.T / math.sqrt(e), -1) @ V)
    Wo, bo = lin(attn.mha.out_proj if isinstance(attn, TorchMHA) else attn.proj)
    out = torch.cat(ctx, -1) @ Wo.T + bo
    return out + X if residual else out


def write_import(out, layers: int = 1, inputs: int = 1, n: int = 4, d: int = 8, h: int = 2, seed: int = 0,
                 residual: tuple[bool, ...] = (False, True)) -> dict:
    """An import directory as ``python -m bench import`` writes one (layer files, input files and a
    manifest), of random dot layers with biases instead of a model's: for the sweep and report tests,
    which read directories and need no export. ``seed`` stands for the model: its sha256 and weights."""
    import hashlib
    import json
    from pathlib import Path

    from models import random_input, random_layer, save_input, save_layer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for k in range(layers):
        res = residual[k % len(residual)]
        layer = random_layer("dot", d, h, seed=seed * 100 + k, residual=res, n=n, bias_norm=0.5)
        save_layer(out / f"layer{k}.safetensors", layer)
        xs = random_input(n, d, norm=3.0, seed=seed * 100 + k + 50, batch=inputs)
        names = []
        for i in range(inputs):
            names.append(f"layer{k}_input{i}.safetensors")
            save_input(out / names[-1], xs[i])
        entries.append({"node": f"softmax_{k}", "heads": h, "d": d, "d_h": d // h, "residual": res,
                        "input": f"x_{k}", "output": f"out_{k}", "n": n, "dtype": "float64",
                        "tolerance": 1e-6,
                        "max_rel_err": 1e-16, "max_rel_err_model_dtype": 1e-7,
                        "files": {"layer": f"layer{k}.safetensors", "inputs": names}})
    manifest = {"source": "model.onnx", "format": "onnx",
                "sha256": hashlib.sha256(f"model {seed}".encode()).hexdigest(), "layers": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
