"""GGML tensor types to float32 torch tensors: the plain float types and the block quantizations tokend reads.

Each function takes a tensor's raw bytes as (n_blocks, bytes per block) uint8 and returns (n_blocks, values per
block) float32. The arithmetic follows ggml's reference dequantizers (and the `gguf` package's numpy ports of
them) operation for operation, so the values are bit-identical to what llama.cpp and transformers compute. In
torch rather than through `gguf.quants.dequantize` because torch spreads the work over every core (numpy runs
one) and can run it on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values in a k-quant super-block


class UnsupportedTensorType(ValueError):
    """A GGUF tensor stored in a type tokend does not dequantize; the message names the type and the tensor."""


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    """A 2-byte little-endian field per block, as float32 (its value is exact in float32)."""
    return blocks.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Packed 4-bit values: in each run of `group` bytes, the low nibbles come first, then the high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(qs.shape[0], -1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    x = blocks[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:], 16).float() + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 high bits, one per value in order: value j's is bit j of the 4 little-endian bytes."""
    bits = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> bits) & 1).reshape(qh.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 6:], 16) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:], 16) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _k_scales_and_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and eight 6-bit mins packed into Q4_K's 12 bytes (ggml's get_scale_min_k4)."""
    scales = scales.reshape(-1, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, -1, 1)
    offset = (dmin * mins.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's scales and nibbles, plus a fifth bit per value: sub-block s (of 32 values) takes bit s of qh[l]."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, -1, 1)
    offset = (dmin * mins.float()).reshape(n, -1, 1)
    low = _nibbles(blocks[:, 48:], 32).reshape(n, -1, 32)
    bits = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> bits) & 1
    return (scale * (low | (high << 4)).float() - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales = blocks[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, -2:]) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, -1).float()).reshape(n, QK_K)


# Plain floats are kept in their own dtype: exact either way, and widening F16 would only double the checkpoint.
FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
SUPPORTED_TYPES = [t.name for t in [*FLOAT_TYPES, *DEQUANTIZERS]]


def check_supported(tensor_type: int, name: str) -> GGMLQuantizationType:
    """The tensor's type; UnsupportedTensorType naming the type and the tensor when tokend cannot read it."""
    tensor_type = GGMLQuantizationType(tensor_type)
    if tensor_type not in FLOAT_TYPES and tensor_type not in DEQUANTIZERS:
        raise UnsupportedTensorType(
            f"model: GGUF tensor {name!r} is stored as {tensor_type.name}, which tokend cannot read; "
            f"supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    return tensor_type


def dequantize(raw: np.ndarray, tensor_type: int, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A GGUF tensor's data (as `gguf.GGUFReader` maps it) as a tensor of `shape` (rows first, as transformers
    has it): float32, or F16/BF16 as stored."""
    tensor_type = check_supported(tensor_type, name)
    _, type_size = GGML_QUANT_SIZES[tensor_type]
    # A copy: the reader's arrays map the file read-only, and the result must outlive the mapping.
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size).copy())
    if tensor_type in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[tensor_type]).reshape(shape)
    return DEQUANTIZERS[tensor_type](data).reshape(shape)
