#!/usr/bin/env bash
# The GPU check's entry point (issues 16 and 21): runs scripts/gpu_check.py with the machine's own Python and torch,
# which a GPU box has preinstalled (the project's pinned torch cannot be installed there), the repository on its path.
#
#   scripts/gpu_check.sh [--dry-run] [--sections a,b]
#
# The Python: $TOKEND_GPU_CHECK_PYTHON, else the first of python3, /opt/torch/.venv/bin/python3 and this checkout's
# .venv/bin/python that imports torch. Packages the machine lacks (msgspec and structlog, which the engine imports)
# can come as wheels in $TOKEND_WHEELS (default: .whl/ in the repository): they are installed into a temporary
# directory put on PYTHONPATH, never into the machine's Python. One JSON line per section goes to stdout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PYTHON=""
for candidate in "${TOKEND_GPU_CHECK_PYTHON:-}" python3 /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python"; do
    if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" 2>/dev/null; then
        PYTHON="$candidate"
        break
    fi
done
if [[ -z "$PYTHON" ]]; then
    echo "gpu_check.sh: no Python with torch found (set TOKEND_GPU_CHECK_PYTHON)" >&2
    exit 2
fi

PYTHONPATH_EXTRA=""
WHEELS="${TOKEND_WHEELS:-$ROOT/.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$(mktemp -d -t tokend-gpu-check-site.XXXXXX)"
    trap 'rm -rf "$SITE"' EXIT
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl >&2
    PYTHONPATH_EXTRA="$SITE:"
fi

echo "gpu_check.sh: $("$PYTHON" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)')" >&2
export PYTHONPATH="$PYTHONPATH_EXTRA$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT"
"$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
