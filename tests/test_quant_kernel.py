"""The CPU quantized-matmul kernel (gpu_runtime/quant/csrc/quant_matmul_cpu.cpp) against dequantize-then-matmul,
for every block type it serves, on odd shapes (output rows no multiple of the threads' chunks) and batches 1..40.

The 16-bit-activation path rounds each 32 values of x to int16 with the scale amax/32767, so each value is off by
at most amax/65534; a row's result is then off by at most the sum over blocks of (sum |w| over the block) x that
error, the bound each result is checked against (plus float32 rounding). The float paths are checked to float32
rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from gpu_runtime.gguf.dequantize import dequantize
from gpu_runtime.quant.blocks import BlockFormat
from gpu_runtime.quant.kernel import load_quant_kernel
from gpu_runtime.quant.linear import (
    DECODE_ACTIVATION_BITS,
    FLOAT_ACTIVATION_ROWS,
    MAX_DECODE_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
)

pytestmark = pytest.mark.engine

Q = GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
# (output rows, input features): K a multiple of 32 only for the simple types, of 256 for the k-quants.
SHAPES = {Q.Q8_0: (67, 96), Q.Q4_0: (131, 288), Q.Q4_1: (67, 608), Q.Q4_K: (67, 512), Q.Q6_K: (131, 256)}
BATCHES = [1, 2, 3, 4, 5, 8, 17, 40]


@pytest.fixture(scope="module")
def ops():
    ops = load_quant_kernel()
    if ops is None:
        pytest.skip("the quantized-matmul kernel cannot be built here (the engine then serves dequantized weights)")
    return ops


def _blocks(tensor_type: GGMLQuantizationType, rows: int, k: int, seed: int) -> np.ndarray:
    """A (rows, bytes) tensor of `tensor_type`: gguf's own quantizer, or for the k-quants (gguf has none) random
    bytes with sane f16 scales."""
    rng = np.random.default_rng(seed)
    if tensor_type not in (Q.Q4_K, Q.Q6_K):
        return quantize(rng.normal(size=(rows, k)).astype(np.float32), tensor_type)
    block_values, block_bytes = GGML_QUANT_SIZES[tensor_type]
    raw = rng.integers(0, 256, size=(rows, k // block_values * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for offset in (0, 2) if tensor_type is Q.Q4_K else (208,):
        blocks[:, offset : offset + 2] = rng.normal(0, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw


def _int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[rows of x, rows of w]: the most rounding x to int16 can move each result (see the module docstring)."""
    amax = x.reshape(x.shape[0], -1, 32).abs().amax(-1)  # [m, blocks]
    w_l1 = w.reshape(w.shape[0], -1, 32).abs().sum(-1)  # [n, blocks]
    return (amax / 65534) @ w_l1.T


@pytest.mark.parametrize("tensor_type", TYPES, ids=lambda t: t.name)
def test_the_kernel_equals_dequantize_then_matmul(ops, tensor_type):
    rows, k = SHAPES[tensor_type]
    raw = _blocks(tensor_type, rows, k, seed=int(tensor_type))
    blocks = torch.from_numpy(raw.copy())
    w = dequantize(raw, tensor_type, (rows, k), "blk.0.ffn_up.weight")
    assert torch.equal(ops.dequantize(blocks, int(tensor_type), k), w)  # bit for bit, as gguf's dequantizers
    generator = torch.Generator().manual_seed(0)
    for m in BATCHES:
        x = torch.randn(m, k, generator=generator)
        x[:, 3] *= 40  # an activation outlier, as real models have: the integer paths' bound scales with it
        expected = x.double() @ w.double().T
        scale = expected.abs().max().item()
        rounding = 1e-5 * scale + 1e-6
        rounded = ops.matmul_decode(x, blocks, int(tensor_type), k, 16).double()
        bound = _int16_bound(x, w).double() + rounding
        assert ((rounded - expected).abs() <= bound).all(), (tensor_type.name, m)
        as_float = ops.matmul_decode(x, blocks, int(tensor_type), k, 32).double()
        torch.testing.assert_close(as_float, expected, atol=rounding, rtol=0)
        tiled = ops.matmul_tiled(x, blocks, int(tensor_type), k, 16).double()  # 16 rows a tile: a ragged last one
        torch.testing.assert_close(tiled, expected, atol=rounding, rtol=0)


def test_an_unknown_activation_width_is_refused(ops):
    blocks = torch.from_numpy(_blocks(Q.Q8_0, 4, 32, seed=5).copy())
    with pytest.raises(RuntimeError, match="activation_bits must be 16 or 32, not 8"):
        ops.matmul_decode(torch.randn(1, 32), blocks, int(Q.Q8_0), 32, 8)


def test_a_nan_in_x_reaches_that_rows_outputs_as_in_the_float_path(ops):
    """Rounding x to int16 must not turn a broken activation into finite garbage (the engine notices NaN logits)."""
    rows, k = SHAPES[Q.Q4_1]
    blocks = torch.from_numpy(_blocks(Q.Q4_1, rows, k, seed=3).copy())
    x = torch.randn(3, k)
    x[1, 7] = float("nan")
    for bits in (16, 32):
        y = ops.matmul_decode(x, blocks, int(Q.Q4_1), k, bits)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all(), bits


def test_the_kernels_rms_norm_equals_torchs_to_float32_rounding(ops):
    generator = torch.Generator().manual_seed(4)
    for shape in [(1, 576), (5, 3, 64), (40, 96)]:  # a decode row, Qwen3's per-head norms, a prefill chunk
        x = torch.randn(shape, generator=generator) * 3
        x[..., 1] *= 50  # an outlier, as in real activations
        weight = torch.randn(shape[-1], generator=generator)
        expected = torch.nn.functional.rms_norm(x.double(), (shape[-1],), weight.double(), 1e-6)
        got = ops.rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    strided = torch.randn(4, 128)[:, ::2]  # a view: the kernel reads it as it is laid out
    torch.testing.assert_close(
        ops.rms_norm(strided, torch.ones(64), 1e-5), torch.nn.functional.rms_norm(strided, (64,), eps=1e-5)
    )


def test_quantized_linear_takes_the_decode_path_for_decode_batches_and_the_gemm_beyond(ops):
    rows, k = SHAPES[Q.Q4_1]
    raw = _blocks(Q.Q4_1, rows, k, seed=1)
    linear = QuantizedLinear(k, rows, BlockFormat.of("Q4_1"), bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(raw.copy()))
        linear.bias.copy_(torch.arange(rows, dtype=torch.float32))
    w = dequantize(raw, Q.Q4_1, (rows, k), "blk.0.ffn_up.weight")
    for m in (1, FLOAT_ACTIVATION_ROWS, MAX_DECODE_ROWS + 1):
        x = torch.randn(m, k)
        if m < FLOAT_ACTIVATION_ROWS:  # the kernel's decode path, x rounded as it rounds it
            decoded = ops.matmul_decode(x, linear.weight, int(Q.Q4_1), k, DECODE_ACTIVATION_BITS) + linear.bias
            assert torch.equal(linear(x), decoded)
        else:  # x kept in float32 (the decode path's float variant, then the GEMM on the dequantized matrix)
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, w, linear.bias), atol=1e-4, rtol=1e-5)


def test_a_quantized_embedding_gathers_exactly_the_dequantized_rows(ops):
    raw = _blocks(Q.Q8_0, 50, 64, seed=2)
    embedding = QuantizedEmbedding(50, 64, BlockFormat.of("Q8_0"))
    with torch.no_grad():
        embedding.weight.copy_(torch.from_numpy(raw.copy()))
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    table = dequantize(raw, Q.Q8_0, (50, 64), "token_embd.weight")
    assert torch.equal(embedding(ids), table[ids])
