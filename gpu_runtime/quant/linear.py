"""QuantizedLinear and QuantizedEmbedding: a linear layer and an embedding table whose weight stays in its GGUF
blocks (uint8 [rows, bytes per row]), multiplied or gathered by the CPU kernel (csrc/quant_matmul_cpu.cpp)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.quant.blocks import BlockFormat
from gpu_runtime.quant.kernel import load_quant_kernel

# Up to this many rows of x (a decode batch) the kernel's GEMV path runs, each weight block dequantized in registers
# and met by every row; more rows (a prefill chunk) dequantize W (one matrix, briefly) for oneDNN's GEMM.
MAX_DECODE_ROWS = 16
# The block types whose decode path also quantizes x to 8 bits per 32 values (llama.cpp's way: integer dot
# products). None by default: on SmolLM2 it moves the logits by ~3% (its activations have outliers that crush a
# block's other values) and top-1 agreement with the float32 path falls to ~98%, where float activations agree
# exactly, for a decode step some 1.3-1.6x slower (docs/BENCHMARKS.md).
INT8_ACTIVATION_TYPES: frozenset = frozenset()


def _block_weight(rows: int, in_features: int, block: BlockFormat) -> nn.Parameter:
    if in_features % block.block_values:
        raise ValueError(f"in_features {in_features} is not a multiple of {block.type.name}'s {block.block_values}")
    data = torch.empty(rows, block.row_bytes(in_features), dtype=torch.uint8)
    return nn.Parameter(data, requires_grad=False)


def _gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN where torch has it: twice plain F.linear's speed for a prefill chunk on one thread
    here (a [3200, 576] x [576, 3072] GEMM: 71 ms against 128 ms), with no prepacking needed."""
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


class QuantizedLinear(nn.Module):
    """y = x W^T + b, W in GGUF blocks. The loader fills `weight` with the checkpoint's block rows (fused layers'
    pieces stacked along the rows, as nn.Linear's are)."""

    def __init__(self, in_features: int, out_features: int, block: BlockFormat, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = _block_weight(out_features, in_features, block)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = load_quant_kernel()
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        kind, k = int(self.block.type), self.in_features
        if x2.shape[0] <= MAX_DECODE_ROWS:
            y = ops.matmul_decode(x2, self.weight, kind, k, self.block.type in INT8_ACTIVATION_TYPES)
        else:  # the whole matrix dequantized once for one GEMM: a prefill chunk's rows amortise it
            y = _gemm(x2, ops.dequantize(self.weight, kind, k))
        if self.bias is not None:
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.block.type.name}"


class QuantizedEmbedding(nn.Module):
    """An embedding table in GGUF blocks: the rows a batch looks up are dequantized as they are gathered (the same
    float32 values as the dequantized table's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, block: BlockFormat):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.block = num_embeddings, embedding_dim, block
        self.weight = _block_weight(num_embeddings, embedding_dim, block)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        values = load_quant_kernel().dequantize(rows, int(self.block.type), self.embedding_dim)
        return values.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.block.type.name}"
