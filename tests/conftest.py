"""Shared test setup: one torch thread (2-core CI), float64 by default for exact comparisons."""

import torch

torch.set_num_threads(1)
