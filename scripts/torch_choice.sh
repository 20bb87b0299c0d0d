#!/usr/bin/env bash
# Which build of torch this machine should get, printed as cuda, rocm or cpu (scripts/setup.sh installs it):
#   cuda  an NVIDIA toolkit or driver: nvcc (on PATH or $CUDA_HOME/bin), nvidia-smi, /proc/driver/nvidia
#   rocm  an AMD GPU driver: /dev/kfd (the hipcc that setup.sh itself installs for compile checks does not count)
#   cpu   neither: no 3 GB of GPU libraries on a machine that cannot use them
# FLASHKERN_TORCH=cuda|rocm|cpu overrides the probes (auto: probe). FLASHKERN_PROBE_ROOT prefixes the
# device paths probed (tests/test_setup_choice.py stubs them).
set -euo pipefail
choice=${FLASHKERN_TORCH:-auto}
case $choice in
  cuda | rocm | cpu) echo "$choice"; exit 0 ;;
  auto) ;;
  *) echo "FLASHKERN_TORCH must be cuda, rocm, cpu or auto, got '$choice'" >&2; exit 2 ;;
esac
root=${FLASHKERN_PROBE_ROOT:-}
if command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || command -v nvidia-smi >/dev/null ||
  [ -e "$root/proc/driver/nvidia/version" ]; then
  echo cuda
elif [ -e "$root/dev/kfd" ]; then
  echo rocm
else
  echo cpu
fi
