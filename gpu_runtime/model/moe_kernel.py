"""The C++ grouped-matmul kernel for MoE experts on the CPU (csrc/grouped_matmul_cpu.cpp): built once per machine,
then loaded.

Built like the paged-attention and quantized-matmul kernels (gpu_runtime/attention/cpu_kernel.py: torch's JIT
extension builder, this CPU's instruction set, the kernels cache). `python -m gpu_runtime.model.moe_kernel` builds
it ahead of time (scripts/bootstrap.sh does). Where it cannot be built, each expert's matrices are packed for oneDNN
instead (moe.Experts.prepack), and the engine says why, once.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from gpu_runtime.attention.cpu_kernel import load_library

_SOURCE = Path(__file__).with_name("csrc") / "grouped_matmul_cpu.cpp"


@functools.cache
def load_grouped_matmul():
    """torch.ops.tokend_moe.grouped_matmul once the library is built and loaded, or None if it cannot be built."""
    return load_library("tokend_moe_grouped_matmul", _SOURCE, lambda: torch.ops.tokend_moe.grouped_matmul,
                        "cpu_moe_kernel_unavailable", "onednn")  # fmt: skip


if __name__ == "__main__":
    op = load_grouped_matmul()
    print(f"tokend: CPU MoE grouped-matmul kernel {'ready' if op else 'unavailable'}", file=sys.stderr)
    sys.exit(0 if op else 1)
