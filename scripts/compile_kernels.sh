#!/usr/bin/env bash
# Compiles every kernel source under hipkernels/ (its family folders, recursively) to an object file, for NVIDIA (nvcc, sm_90a) or AMD
# (hipcc, gfx90a). Usage: scripts/compile_kernels.sh cuda|hip [out_dir]. Exits non-zero on failure.
set -euo pipefail
target="${1:-}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${2:-$(mktemp -d "${TMPDIR:-/tmp}/pyengine_kernels.XXXXXX")}"
mkdir -p "$out/$target"
case "$target" in
  cuda)
    NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
    compile() { "$NVCC" -x cu -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
                  -I"$root/hipkernels" -Xcompiler -fPIC -c "$1" -o "$2"; }
    ;;
  hip)
    HIPCC="${HIPCC:-$(command -v hipcc || echo /opt/rocm/bin/hipcc)}"
    export HIP_PLATFORM=amd
    compile() { "$HIPCC" --offload-arch=gfx90a -O3 -std=c++17 -I"$root/hipkernels" -fPIC -c "$1" -o "$2"; }
    ;;
  *)
    echo "usage: $0 cuda|hip [out_dir]" >&2
    exit 2
    ;;
esac
mapfile -t sources < <(cd "$root" && find hipkernels -name '*.hip' | sort)
if [ ${#sources[@]} -eq 0 ]; then
  echo "no kernel sources in $root/hipkernels" >&2
  exit 1
fi
status=0
for src in "${sources[@]}"; do
  obj="$out/$target/$(echo "${src#hipkernels/}" | tr / _ | sed 's/\.hip$/.o/')"
  if compile "$root/$src" "$obj"; then
    echo "compiled ($target) $src -> $obj"
  else
    echo "FAILED ($target) $src" >&2
    status=1
  fi
done
exit $status
