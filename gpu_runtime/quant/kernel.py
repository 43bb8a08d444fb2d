"""The C++ quantized-matmul kernel for the CPU (csrc/quant_matmul_cpu.cpp, with csrc/rms_norm_cpu.cpp): built
once per machine, then loaded.

Built like the paged-attention kernel (gpu_runtime/attention/cpu_kernel.py): torch's JIT extension builder, for
this CPU's instruction set, into the kernels cache, keyed by the CPU's features, torch's version and the source.
`python -m gpu_runtime.quant.kernel` builds it ahead of time. Where it cannot be built the engine serves the
dequantized float32 weights instead and says why, once (gpu_runtime/quant/plan.py).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from gpu_runtime.attention.cpu_kernel import load_library

# Built with cpu_kernel's flags: -march=native (AVX2 + FMA + F16C where the machine has them; the source falls back
# to float dot products without AVX2), -fopenmp (at::parallel_for uses torch's OpenMP threads).
# The matmuls, and the norm that runs between them on a model served in blocks (gpu_runtime/quant/norm.py).
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("quant_matmul_cpu.cpp", "rms_norm_cpu.cpp")]


@functools.cache
def load_quant_kernel():
    """torch.ops.tokend_quant once the library is built and loaded, or None if it cannot be built here."""
    return load_library("tokend_quant_matmul", _SOURCES, lambda: torch.ops.tokend_quant,
                        "cpu_quant_kernel_unavailable", "dequantized")  # fmt: skip


if __name__ == "__main__":
    ops = load_quant_kernel()
    print(f"tokend: CPU quantized-matmul kernel {'ready' if ops else 'unavailable'}", file=sys.stderr)
    sys.exit(0 if ops else 1)
