"""Linear weights prepacked once for oneDNN, the CPU's fastest route for a decode step's matmuls.

A decode step multiplies a few rows by every weight of the model, so on a CPU it streams the weights from memory.
Reordered once at load into oneDNN's blocked layout (what torch.compile's freezing does on CPU), those weights run
a decode step's matmuls 25-40% faster than plain `F.linear` over the checkpoint's row-major tensors
(scripts/bench_roofline.py measures both in one run; docs/BENCHMARKS.md). A long prompt's prefill, compute-bound
rows by the thousand, runs some 5-10% slower than with MKL's plain GEMM: decode is the step a server runs most.

The packed tensor replaces the plain one (no second copy), except where lm_head shares the embedding table: the
embedding keeps its rows for lookups and lm_head gets a packed copy (vocabulary x hidden more memory).
float32 only: other dtypes, and builds of torch without oneDNN, keep the plain weights.
"""

from __future__ import annotations

import torch
from torch import nn


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered into oneDNN's blocked layout, for packed_matmul."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a weight made by pack_matrix."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout; the same numbers as nn.Linear up to summation order."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_matrix(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed_weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight as nn.Linear holds it (a copy): for benchmarks that compare against plain matmuls."""
        return self.packed_weight.to_dense()


def prepack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear under `model` with a PackedLinear, one at a time (each plain weight is freed as
    its packed one is made, so memory peaks at the weights plus one matrix), and packs the modules that hold stacked
    matrices of their own (an MoE block's experts: their `prepack()`); returns how many modules it packed."""
    places = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, nn.Linear)]  # fmt: skip
    for parent, name in places:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    stacked = [module for module in model.modules() if isinstance(module, StackedMatrices)]
    for module in stacked:
        module.prepack()
    return len(places) + len(stacked)


class StackedMatrices(nn.Module):
    """A module whose weights are [n, out, in] stacks of matrices (an MoE block's experts) rather than nn.Linear
    layers: prepack_linears calls its prepack(), which packs each matrix and drops the stacked parameters."""

    def prepack(self) -> None:
        raise NotImplementedError


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a plain tensor, packed or not."""
    return linear.dense_weight() if isinstance(linear, PackedLinear) else linear.weight
