"""The C++ paged-decode kernel for the CPU (csrc/paged_decode_cpu.cpp): built once per machine, then loaded.

Built with torch's own JIT extension builder (g++ and ninja, about a minute on 2 cores), for this CPU's
instruction set, into $TORCH_EXTENSIONS_DIR if set, else the tokend cache's kernels/ directory; later starts load
the built library in well under a second. `python -m gpu_runtime.attention.cpu_kernel` builds it ahead of time
(scripts/bootstrap.sh does). Where it cannot be built (no compiler, a read-only cache) the CPU falls back to the
per-sequence torch backend and says why, once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
# -march=native: the library is built on, and for, the machine that runs it (its name carries the CPU's
# features, so a cache shared by different machines keeps one build each). -fopenmp: at::parallel_for spreads the
# sequences over torch's threads (the same OpenMP runtime torch uses) and the `omp simd` loops are vectorised,
# without -ffast-math's looser float rules.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def kernel_directory() -> Path:
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from gpu_runtime.default_model import cache_dir

    return cache_dir() / "kernels"


@functools.cache
def load_cpu_kernel():
    """torch.ops.tokend.paged_decode once the library is built and loaded, or None if it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load_inline

        name = f"tokend_paged_decode_{build_fingerprint()}"
        directory = kernel_directory() / name
        directory.mkdir(parents=True, exist_ok=True)
        load_inline(
            name=name,
            cpp_sources=[_SOURCE.read_text()],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,  # loaded into torch: the source registers its operator itself
            verbose=False,
        )
        return torch.ops.tokend.paged_decode
    except Exception as error:  # a missing compiler, ninja or header; a read-only directory; a build error
        reason = f"{type(error).__name__}: {str(error).strip()[:300]}"
        if structlog.is_configured():  # a tokend process: one JSON line; elsewhere (the offline API) plain stderr
            structlog.get_logger().warning("cpu_attention_kernel_unavailable", reason=reason, fallback="torch")
        else:
            print(f"tokend: no CPU attention kernel ({reason}); using the torch backend", file=sys.stderr)
        return None


def build_library(prefix: str, sources: Path | Sequence[Path]) -> None:
    """Builds C++ sources that register their own torch operators (once per machine, CPU, torch and source: the
    directory's name keys them in) into the kernels cache as one library, and loads it into torch; raises what the
    build raised."""
    from torch.utils.cpp_extension import load_inline

    text = "\n".join(path.read_text() for path in ([sources] if isinstance(sources, Path) else sources))
    name = f"{prefix}_{build_fingerprint(text)}"
    directory = kernel_directory() / name
    directory.mkdir(parents=True, exist_ok=True)
    load_inline(
        name=name,
        cpp_sources=[text],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,  # loaded into torch: the source registers its operators itself
        verbose=False,
    )


def load_library(
    prefix: str, sources: Path | Sequence[Path], operators: Callable[[], Any], event: str, fallback: str
) -> Any | None:
    """build_library, then `operators()` (what the library registered); None where it cannot be built, said once:
    a JSON warning `event` in a tokend process, a plain line on stderr elsewhere (the offline API)."""
    try:
        build_library(prefix, sources)
        return operators()
    except Exception as error:  # a missing compiler, ninja or header; a read-only directory; a build error
        reason = f"{type(error).__name__}: {str(error).strip()[:300]}"
        if structlog.is_configured():
            structlog.get_logger().warning(event, reason=reason, fallback=fallback)
        else:
            print(f"tokend: {event} ({reason}); falling back to {fallback}", file=sys.stderr)
        return None


def build_fingerprint(extra: str = "") -> str:
    """What a built library depends on besides its source: the CPU's instruction set, torch's version and where torch
    is installed (and `extra`, for a kernel that keys its source in too). The place matters because the build file
    names torch's headers by path: two virtual environments sharing one cache would otherwise rebuild the library
    in turn, a minute at each one's next start."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    torch_place = Path(torch.__file__).parent
    key = f"{platform.machine()}|{flags}|{torch.__version__}|{torch_place}{'|' + extra if extra else ''}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


if __name__ == "__main__":
    module = load_cpu_kernel()
    print(f"tokend: CPU paged-attention kernel {'ready in ' + str(kernel_directory()) if module else 'unavailable'}",
          file=sys.stderr)  # fmt: skip
    sys.exit(0 if module else 1)
