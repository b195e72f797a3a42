"""What a whole-network certificate needs of the network's weights alone, computed once per network
and passed to every certificate of it while its weights stay as they were (docs/bounds.md §5.1,
"Speed of the first pass").

A sweep certifies the same network at many batches and radii; each `taylor_net` pass asked again for
the same weight norms, the pixels-to-tokens map and its patch columns (≈ 3 ms of a 30 ms pass on the
1-block digits model, 8 images). A caller keeps the :class:`NetConstants` and passes it on
(:func:`net_constants`); it carries a stamp of every parameter and buffer (storage, in-place version
counter, dtype, device, shape), so that after any change to a weight, in place (an optimiser's step,
``load_state_dict``) or by replacing it, the kept constants are refused and computed anew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.layers import KeptNormsMHA
from models.vit import ViT

__all__ = ["NetConstants", "net_constants", "patch_columns", "patch_span"]


@dataclass(frozen=True)
class NetConstants:
    layers: tuple[KeptNormsMHA, ...]  # each block's attention, its weight-only norms kept
    lip: list[float]  # Lip(FFN_k)
    embed: Tensor  # [n, d, P]: G₀, pixels to tokens
    embed_norm: float  # ‖E‖: the tokens' ball is ‖E‖ε
    patch: Tensor | None  # each token's pixels' columns of G₀, where separable
    span: Tensor | None  # where the first block's deviations lie, per token
    stamp: tuple = field(default=(), compare=False, repr=False)  # the weights they were computed from

    def holds_for(self, net: ViT) -> bool:
        """Whether these were computed from ``net``'s present weights."""
        return self.stamp == _stamp(net)


def _stamp(net: ViT) -> tuple:
    tensors = [*net.parameters(), *net.buffers()]
    return (net.cfg, *((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in tensors))


def net_constants(net: ViT, kept: NetConstants | None = None) -> NetConstants:
    """The weight-only constants of ``net``: ``kept`` where it was computed from its present weights
    (:meth:`NetConstants.holds_for`), else computed anew."""
    if kept is not None and kept.holds_for(net):
        return kept
    embed = net.pixel_map().permute(1, 2, 0).contiguous()
    patch = patch_columns(embed)
    return NetConstants(tuple(KeptNormsMHA.of(layer) for layer in net.attention_layers()),
                        net.ffn_lipschitz(), embed, net.embedding_norm(), patch, patch_span(patch),
                        _stamp(net))


def patch_columns(embed: Tensor) -> Tensor | None:
    """The nonzero columns [n, d, m] of the pixels-to-tokens map G₀ = ``embed`` [n, d, P] at each token
    (its patch's pixels), where every pixel moves one token at most and every token m pixels; else
    None."""
    live = embed.abs().amax(1) > 0  # [n, P]
    m = live.sum(-1)
    if not len(m) or bool((m != m[0]).any()) or bool((live.sum(0) > 1).any()):
        return None
    order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[:, :int(m[0])]  # [n, m]
    return embed.gather(2, order[:, None, :].expand(-1, embed.shape[1], -1))


def patch_span(cols: Tensor | None) -> Tensor | None:
    """The columns [n, d, m] whose range holds each first-block token's deviation: its patch's
    columns (:func:`patch_columns`) scaled to unit norm; None where there are none or m + 1 ≥ d (no
    columns to save)."""
    if cols is None or cols.shape[-1] + 1 >= cols.shape[1]:
        return None
    return cols / cols.norm(dim=1, keepdim=True)
