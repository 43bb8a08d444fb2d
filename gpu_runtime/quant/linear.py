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
# The decode path rounds each 32 values of x to this many bits before the integer dot products: 16 (int16 x int16
# pairs, each value off by at most amax/65534: SmolLM2's teacher-forced top-1 equals the float path's) or 32 (x kept
# in float32, each weight block converted to floats: exact up to summation order, and slower). llama.cpp's 8 bits
# (q8_1) were measured and dropped: SmolLM2's activation outliers crush a block's other values and top-1 agreement
# falls to 97-98% (docs/BENCHMARKS.md).
DECODE_ACTIVATION_BITS = 16
# From this many rows x stays float32 whatever the setting above: there the float path (each weight block converted
# once for eight rows) is the faster. A decode pass over SmolLM2's weights, one thread, rows 1/4/8/16: 16 bits
# 21.5/36.1/68.7/125.4 ms, float 42.4/45.5/55.7/84.5 ms (and oneDNN on the dequantized matrices 68.5-121 ms).
FLOAT_ACTIVATION_ROWS = 8


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
        # Looked up once: a decode step calls the 121 layers of a small model ~25 times a second, each call's few
        # microseconds of lookups add up to a few percent of the step.
        self._ops, self._type_id = load_quant_kernel(), int(block.type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        rows, kind, k = x2.shape[0], self._type_id, self.in_features
        if rows <= MAX_DECODE_ROWS:
            bits = DECODE_ACTIVATION_BITS if rows < FLOAT_ACTIVATION_ROWS else 32
            y = self._ops.matmul_decode(x2, self.weight, kind, k, bits)
        else:  # the whole matrix dequantized once for one GEMM: a prefill chunk's rows amortise it
            y = _gemm(x2, self._ops.dequantize(self.weight, kind, k))
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
