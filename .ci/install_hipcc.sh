#!/usr/bin/env bash
# Installs Debian's hipcc (ROCm 5.2 era) so that CI can run scripts/compile_kernels.sh hip.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends hipcc >/dev/null
hipcc --version | sed -n 1p  # sed reads everything: no SIGPIPE under pipefail
