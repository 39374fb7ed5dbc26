#!/usr/bin/env bash
# Create (or reuse) the Python venv with kiln's test oracles, pinned in requirements-test.txt.
# The venv lives outside the tree ($KILN_VENV, default ~/.cache/kiln-venv) so fresh clones and
# CI runs reuse it; pip only installs what is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KILN_VENV:-$HOME/.cache/kiln-venv}"
if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating venv $venv" >&2
    python3 -m venv "$venv"
fi
stamp="$venv/.kiln-requirements"
if ! cmp -s "$here/requirements-test.txt" "$stamp" 2>/dev/null; then
    echo "[setup] pip install -r requirements-test.txt (torch is large: first time takes minutes)" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$here/requirements-test.txt" >&2
    cp "$here/requirements-test.txt" "$stamp"
fi
echo "$venv"
