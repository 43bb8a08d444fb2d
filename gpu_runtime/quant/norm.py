"""KernelRMSNorm: RMSNorm in one C++ pass a row (csrc/rms_norm_cpu.cpp), for models whose linear layers are served
in GGUF blocks on a CPU.

Measured on the default model at batch 1, one thread: torch's rms_norm composite takes ~50 us a call between the
kernel's matmuls (61 calls a step, ~3 ms of a 28 ms step). The one-pass kernel sums the squares in another order
than torch, so its outputs differ from the float path's by float32 rounding, far below what the int16 activations
of the same model already move (tests/test_quantized_serving.py); the float path (quantization "none") keeps
torch's norm, which the exactness checks against transformers run on.
"""

from __future__ import annotations

import torch

from gpu_runtime.model.llama import RMSNorm
from gpu_runtime.quant.kernel import load_quant_kernel


class KernelRMSNorm(RMSNorm):
    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        self._ops = load_quant_kernel()  # once, as QuantizedLinear does: 61 calls a decode step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(x, self.weight, self.eps)
