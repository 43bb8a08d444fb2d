"""The Triton kernels compile for a GPU (sm_90: Triton's lowering and its own ptxas) on this CPU-only machine, at the
default tuning's tile sizes: the interpreter checks what they compute, not that a GPU's compiler takes them.

A process of its own: the kernels must be decorated with the interpreter off, and a test process that has run
interpreted kernels keeps parts of triton.language patched for the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INT32_TABLES = {"block_table_ptr", "context_lens_ptr", "query_rows_ptr", "chunks_ptr", "programs_ptr"}


def compile_for_sm90(kernel, constexprs: dict) -> None:
    """Compiles `kernel` to a cubin for an H100/H200, for bf16 data and int32 tables."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def type_of(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*i32" if name in INT32_TABLES else "*fp32" if name.startswith("part_") else "*bf16"
        return "fp32" if name in ("scale", "soft_cap") else "i32"

    signature = {name: type_of(name) for name in kernel.arg_names}
    compiled = compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


def compile_every_kernel() -> None:
    """Each kernel with every option on, a GQA group and a head dimension that are not powers of two, at the
    default tuning's tile sizes."""
    from gpu_runtime.attention import triton_kernels as kernels
    from gpu_runtime.attention.triton_plan import TritonTuning

    tuning = TritonTuning()
    options = dict(USE_SOFT_CAP=True, USE_WINDOW=True, DOT_PRECISION="tf32")
    head = dict(HEAD_DIM=80, BLOCK_D=128, PAGE_SIZE=16)
    compile_for_sm90(kernels.decode_partition_kernel, dict(NUM_HEADS=28, GROUP=7, BLOCK_G=16,
                     BLOCK_N=tuning.decode_block_n, ONE_PARTITION=False, **head, **options))  # fmt: skip
    compile_for_sm90(kernels.decode_combine_kernel, dict(NUM_HEADS=28, HEAD_DIM=80, BLOCK_D=128, BLOCK_P=64,
                                                         USE_WINDOW=True))  # fmt: skip
    compile_for_sm90(kernels.prefill_kernel, dict(GROUP=7, BLOCK_Q=9, BLOCK_M=tuning.prefill_block_m,
                     BLOCK_N=tuning.prefill_block_n, **head, **options))  # fmt: skip


def check_the_backend_refuses_a_cpu() -> None:
    """Kernels compiled for a GPU, as here: the backend refuses a CPU naming why, and auto never picks it there."""
    import torch

    from gpu_runtime.attention.backend import make_attention_backend

    try:
        make_attention_backend("triton", torch.device("cpu"))
    except ValueError as error:
        assert "triton needs a CUDA device, not cpu" in str(error), error
    else:
        raise AssertionError("the triton backend was made for a CPU without the interpreter")
    assert make_attention_backend("auto", torch.device("cpu")).name in ("cpu_paged", "torch")


if __name__ == "__main__":
    compile_every_kernel()
    check_the_backend_refuses_a_cpu()
    sys.exit(0)

import pytest  # noqa: E402

pytestmark = pytest.mark.daemon


def test_the_kernels_compile_for_a_gpu_and_refuse_a_cpu(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed (pip install triton --no-deps)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, never from a cache
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
