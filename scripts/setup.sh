#!/usr/bin/env bash
# Sets up a fresh machine for flashkern and builds it from source, into ./.venv:
#   system packages  hipcc + ROCm device libraries (HIP compile checks), ccache, cmake, ninja
#   Python           a virtualenv with torch==2.14.1, the test tools, and flashkern itself
# The torch build follows the machine (scripts/torch_choice.sh): CUDA where an NVIDIA toolkit or driver is,
# ROCm where an AMD GPU driver is (from FLASHKERN_ROCM_INDEX, default PyTorch's rocm6.4 index), CPU-only
# elsewhere (PyTorch's cpu index); FLASHKERN_TORCH=cuda|rocm|cpu chooses. CUDA kernels are built when nvcc
# is found ($CUDA_HOME, /usr/local/cuda or PATH); a GPU is not needed to build. Safe to run again: what is
# there already is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  missing=()
  for pkg in hipcc libamdhip64-dev rocm-device-libs ccache cmake ninja-build g++; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
torch_build=$(bash scripts/torch_choice.sh)
case $torch_build in
  cuda) pip install torch==2.14.1 ;;
  rocm) pip install torch==2.14.1 --index-url "${FLASHKERN_ROCM_INDEX:-https://download.pytorch.org/whl/rocm6.4}" ;;
  cpu) pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/cpu ;;
esac
echo "setup: torch 2.14.1, the $torch_build build ($(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
pip install setuptools wheel numpy pytest==8.4.2 pytest-xdist==3.8.0 pytest-benchmark expecttest ninja matplotlib transformers==5.24.0
# the static report's disassembler (bench/sass.py, tests/test_kernel_build.py): cuobjdump and nvdisasm, no GPU needed
pip install nvidia-cuda-cuobjdump==13.4.92 nvidia-cuda-nvdisasm==13.5.37

start=$(date +%s)
PATH="$PWD/.venv/bin:$PATH" pip install --no-build-isolation .
.venv/bin/python -c "import flashkern" # fails loudly if the build did not install
echo "setup: flashkern built and installed in $(( $(date +%s) - start )) s (backend: $(.venv/bin/python -c 'import flashkern; print(flashkern.info()["built_backend"])'))"
