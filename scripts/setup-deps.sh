#!/usr/bin/env bash
# Install the Debian packages kiln builds against (idempotent; skips what is present).
set -euo pipefail
pkgs=(build-essential cmake clang libclang-rt-14-dev libcjson-dev libpcre2-dev libutf8proc-dev
      libssl-dev libmicrohttpd-dev pkg-config python3 python3-venv python3-pip unzip curl
      libopenmpi-dev openmpi-bin  # the MPI communicator (src/dist/) and ctest's mpirun runs
      chromium)  # chromium: tests/python/test_serve_load.py drives `kiln serve`'s chat page headless
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] apt-get install ${missing[*]}"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
