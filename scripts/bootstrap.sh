#!/usr/bin/env bash
# Creates .venv on first use (torch==2.13.0 first, then tokend and its extras) and refreshes it when
# pyproject.toml changes. Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh dev
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="$root/.venv"
python="${PYTHON:-python3}"
stamp="$venv/.tokend-installed-${extras:-base}"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  "$venv/bin/python" "$root/scripts/gen_protos.py"  # a no-op unless protos/ changed
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "tokend: creating $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
fi
# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
"$venv/bin/pip" install --quiet "torch==2.13.0"
# The gRPC stubs exist before the install, so that it packages them (tokend.v1).
"$venv/bin/pip" install --quiet "grpcio-tools>=1.62"
"$venv/bin/python" "$root/scripts/gen_protos.py"
spec="$root"
[ -n "$extras" ] && spec="$root[$extras]"
"$venv/bin/pip" install --quiet -e "$spec"
echo "$want" > "$stamp"
