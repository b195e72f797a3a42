"""An example plugin (docs/guide/plugins.md): the smaller of two certified bounds of this suite, LoFAST ½
(‖M‖) (docs/bounds.md §2.2) and naive (eq. 12 + 28), at each input. A minimum of upper bounds is an
upper bound, so it certifies whatever both certify; on a stack it is taken at every block, so each
block starts from the smaller radius (``stack="propagate"``).

    python -m bench point --layer L.safetensors --input X.safetensors --eps 0.05 \\
        --plugin docs/examples/plugin_half_lofast.py
"""

import torch

from bounds import lofast
from bounds.base import Bound


def half_lofast_or_naive(layer, X, eps):
    """min(LoFAST ½ (‖M‖), naive) per input of X [B, n, d]: a tensor [B]."""
    return torch.minimum(lofast.lofast_M_half(layer, X, eps), lofast.naive(layer, X, eps))


BOUNDS = (
    Bound(name="half_lofast_or_naive", fn=half_lofast_or_naive,
          paper="example plugin, on Havens et al. (LoFAST)", equation="min(LoFAST ½ (‖M‖), naive)",
          certified=True, kinds=frozenset({"dot"}), stack="propagate", biases=True,
          display="min(LoFAST ½, naive)"),
)
