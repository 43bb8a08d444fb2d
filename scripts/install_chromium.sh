#!/usr/bin/env bash
# Installs Debian's `chromium` for the playground's browser test, where this machine allows it (root, or
# passwordless sudo). A no-op when Chromium is already there; exits non-zero, saying why, when it cannot.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "tokend: no apt-get here; install Chromium yourself to run the browser test" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  sudo=""
elif sudo -n true 2>/dev/null; then
  sudo="sudo -n"
else
  echo "tokend: installing chromium needs root or passwordless sudo; the browser test will be skipped" >&2
  exit 1
fi
echo "tokend: installing Debian's chromium for the browser test" >&2
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
  || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
