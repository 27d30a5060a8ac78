#!/usr/bin/env bash
# Incremental rebuild of pyengine._C in place (build/dev), for an editable install: only what
# changed recompiles. Serialised by a lock so that parallel callers never share a half-built tree.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec 9>"${TMPDIR:-/tmp}/pyengine-dev-build.lock"
flock 9
python_exe="$(command -v python3 || command -v python)"
cmake -S "$root" -B "$root/build/dev" -GNinja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$root/pyengine" -DPython_EXECUTABLE="$python_exe" \
  -Dpybind11_DIR="$("$python_exe" -m pybind11 --cmakedir)" \
  -DPYENGINE_KERNELS="${PYENGINE_KERNELS:-AUTO}" > /dev/null
cmake --build "$root/build/dev" --parallel "$(nproc)"
