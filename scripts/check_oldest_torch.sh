#!/usr/bin/env bash
# The oldest torch flashkern supports (TORCH_FLOOR, the version in setup.py's install_requires): builds
# flashkern against it in a throw-away virtualenv, from a copy of the tracked tree, then imports it and runs
# the CPU tests of the norms and the op registration. Run by .ci/run after the main set-up (it borrows the
# CUDA libraries of .venv's torch wheels, which torch needs to import even on a machine without a GPU).
# The build is the CUDA backend without the emulator modules: the glue that includes torch's headers is what
# differs between torch versions. The kernels, torch-free, are setup.sh's build's: the same architectures and
# flags, so ccache (keyed on paths relative to the tree, setup.py) hands back its objects.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=$(sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' setup.py)
WORK=${TMPDIR:-/tmp}/flashkern-torch-$FLOOR
rm -rf "$WORK" && mkdir -p "$WORK/src"
git ls-files -z | xargs -0 cp --parents -t "$WORK/src"
start=$(date +%s)
python3 -m venv "$WORK/venv"
pip() { "$WORK/venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location\|which is not installed\|dependency conflicts" || true; }; }
pip install --no-deps "torch==$FLOOR"
pip install filelock typing-extensions sympy networkx jinja2 fsspec numpy pytest expecttest setuptools wheel ninja cmake
site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/zz_cuda_libs.pth"
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
(cd "$WORK/src" && FLASHKERN_BUILD_EMULATE=0 PATH="$WORK/venv/bin:$PATH" \
  "$WORK/venv/bin/python" -m pip --disable-pip-version-check -q install --no-build-isolation --no-deps .)
(cd "$WORK/src" && FLASHKERN_TEST_EMULATE= "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_norm.py tests/test_ops_registration.py -k "not gradcheck" | tail -3)
"$WORK/venv/bin/python" -c 'import flashkern, torch; i = flashkern.info(); print("torch", torch.__version__, "built", i["built_backend"], i["built_archs"])'
echo "check_oldest_torch: torch $FLOOR in $(( $(date +%s) - start )) s"
rm -rf "$WORK"
