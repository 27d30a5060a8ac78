#!/usr/bin/env bash
# Builds pyengine._C with the GPU kernels (nvcc, sm_90a) for the device machine's Python 3.12 on this
# machine, into pyengine/_C.cpython-312-*.so (ignored): a device call that carries it skips the build
# there. Incremental (build/dev312) and serialised by a lock like dev_build.sh.
#   scripts/build_device_ext.sh && run(carry=["pyengine/_C.cpython-312-x86_64-linux-gnu.so"], ...)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYENGINE_DEVICE_PYTHON:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}"
exec 9>"${TMPDIR:-/tmp}/pyengine-dev312-build.lock"
flock 9
cmake -S "$root" -B "$root/build/dev312" -GNinja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$root/build/dev312/out" -DPython_EXECUTABLE="$py" \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" -DPYENGINE_KERNELS=ON > /dev/null
cmake --build "$root/build/dev312" --parallel "$(nproc)"
cp "$root/build/dev312/out/_C.cpython-312-x86_64-linux-gnu.so" "$root/pyengine/"
