"""The layers of docs/bounds.md §1, their seeded builders and safetensors files, their linear maps
(operators) and the spectral-norm estimator (spectral) that both bounds and attacks use; bundled
image data and the tiny ViT built from those layers (docs/bounds.md §5)."""

from .build import (
    projected_input,
    random_dot,
    random_input,
    random_l2,
    random_layer,
    random_olsa,
    random_orthogonal,
    random_stack,
)
from .data import load_dataset
from .errors import InputError, as_batch, check_eps, check_heads
from .io import load_input, load_layer, save_input, save_layer
from .layers import L2MHA, OLSA, DotMHA, Layer, Stack, layer_project
from .vit import ViT, ViTConfig
from .vit_io import load_vit, save_vit

__all__ = [
    "L2MHA",
    "OLSA",
    "DotMHA",
    "InputError",
    "Layer",
    "Stack",
    "ViT",
    "ViTConfig",
    "as_batch",
    "check_eps",
    "check_heads",
    "layer_project",
    "load_dataset",
    "load_input",
    "load_layer",
    "load_vit",
    "projected_input",
    "random_dot",
    "random_input",
    "random_l2",
    "random_layer",
    "random_olsa",
    "random_orthogonal",
    "random_stack",
    "save_input",
    "save_layer",
    "save_vit",
]
