"""The C++ quantized-matmul kernel for the CPU (csrc/quant_matmul_cpu.cpp): built once per machine, then loaded.

Built like the paged-attention kernel (gpu_runtime/attention/cpu_kernel.py): torch's JIT extension builder, for
this CPU's instruction set, into the kernels cache, keyed by the CPU's features, torch's version and the source.
`python -m gpu_runtime.quant.kernel` builds it ahead of time. Where it cannot be built the engine serves the
dequantized float32 weights instead and says why, once (gpu_runtime/quant/plan.py).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import structlog
import torch

# Built with cpu_kernel's flags: -march=native (AVX2 + FMA + F16C where the machine has them; the source falls back
# to float dot products without AVX2), -fopenmp (at::parallel_for uses torch's OpenMP threads).
_SOURCE = Path(__file__).with_name("csrc") / "quant_matmul_cpu.cpp"


@functools.cache
def load_quant_kernel():
    """torch.ops.tokend_quant once the library is built and loaded, or None if it cannot be built here."""
    try:
        from gpu_runtime.attention.cpu_kernel import build_library

        build_library("tokend_quant_matmul", _SOURCE)
        return torch.ops.tokend_quant
    except Exception as error:  # a missing compiler, ninja or header; a read-only directory; a build error
        reason = f"{type(error).__name__}: {str(error).strip()[:300]}"
        if structlog.is_configured():
            structlog.get_logger().warning("cpu_quant_kernel_unavailable", reason=reason, fallback="dequantized")
        else:
            print(f"tokend: no CPU quantized-matmul kernel ({reason}); serving dequantized weights", file=sys.stderr)
        return None


if __name__ == "__main__":
    ops = load_quant_kernel()
    print(f"tokend: CPU quantized-matmul kernel {'ready' if ops else 'unavailable'}", file=sys.stderr)
    sys.exit(0 if ops else 1)
