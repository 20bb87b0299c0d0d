"""Source build of flashkern.

The kernels (csrc/cuda or csrc/hip, torch-free) are built by CMake into a static library, then
linked with the thin torch glue (csrc/torch) into the extension flashkern._C. Which kernels:
  CUDA  when torch was built with CUDA (torch.version.cuda) and nvcc is found; a GPU is not needed
  HIP   when torch was built with ROCm (torch.version.hip)
  none  otherwise: a CPU-only build that still registers every op (the CPU reference runs them)
Always (unless FLASHKERN_BUILD_EMULATE=0), with the C++ compiler alone: the CUDA launchers and the
HIP launchers compiled for the CPU emulation (emulate.h), as flashkern._emulate and
flashkern._emulate_wave64, the kernels behind FLASHKERN_BACKEND=emulate and emulate-wave64.
Environment:
  FLASHKERN_BUILD_BACKEND   force "cuda", "hip" or "cpu"
  FLASHKERN_BUILD_EMULATE   "0": no emulate backends
  FLASHKERN_CUDA_ARCHS      CMake CUDA architectures, default "80;90" (SASS and PTX of each)
  FLASHKERN_HIP_ARCHS       AMD targets, default "gfx90a;gfx942;gfx1100"
  MAX_JOBS                  parallel compile jobs
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = {"cuda": "80;90", "hip": "gfx90a;gfx942;gfx1100"}  # cuda: SASS and PTX of each


def find_cuda_home():
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or the one around the nvcc on PATH."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists():
            return Path(home)
    return None


def find_nvcc():
    home = find_cuda_home()
    return home / "bin" / "nvcc" if home else None


def choose_backend():
    forced = os.environ.get("FLASHKERN_BUILD_BACKEND")
    if forced:
        if forced not in ("cuda", "hip", "cpu"):
            sys.exit(f"FLASHKERN_BUILD_BACKEND must be cuda, hip or cpu, got {forced!r}")
        return forced
    if torch.version.hip:
        return "hip"
    if torch.version.cuda and find_nvcc():
        return "cuda"
    return "cpu"


BACKEND = choose_backend()
ARCHS = os.environ.get(f"FLASHKERN_{BACKEND.upper()}_ARCHS", DEFAULT_ARCHS.get(BACKEND, ""))
EMULATE = os.environ.get("FLASHKERN_BUILD_EMULATE", "1") != "0"
EMULATED = {"_emulate": "cuda", "_emulate_wave64": "hip"}  # module -> the launchers it runs


class BuildKernelsThenExtension(BuildExtension):
    """Build the kernel library with CMake, then the extension that links it."""

    def build_extensions(self):
        libraries = {}
        if BACKEND != "cpu":
            libraries["_C"] = self.cmake(f"kernels-{BACKEND}", f"-DFLASHKERN_{BACKEND.upper()}=ON",
                                         f"-DFLASHKERN_{BACKEND.upper()}_ARCHS={ARCHS}",
                                         # ptxas's report: tests/test_kernel_build.py's build of the same
                                         # flags is then a ccache hit, the report replayed
                                         *([f"-DCMAKE_CUDA_COMPILER={find_nvcc()}", "-DFLASHKERN_RESOURCE_USAGE=ON"]
                                           if BACKEND == "cuda" else []))
            libraries["_C"] = libraries["_C"] / f"libflashkern_{BACKEND}.a"
        if EMULATE:
            build = self.cmake("kernels-emulate", "-DFLASHKERN_EMULATE=ON")
            for module, flavor in EMULATED.items():
                libraries[module] = build / f"libflashkern_emulate_{flavor}.a"
        for ext in self.extensions:
            library = libraries.get(ext.name.split(".")[-1])
            if library:
                ext.extra_objects.append(str(library))
        super().build_extensions()

    def cmake(self, name, *options):
        """Configures and builds build/<name> with `options`; returns the build directory."""
        build = ROOT / "build" / name
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        start = time.time()
        # ccache keys with paths relative to the tree: another copy of it (scripts/check_oldest_torch.sh's) hits
        env = {**os.environ, "CCACHE_BASEDIR": str(ROOT), "CCACHE_NOHASHDIR": "1"}
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                               *options], env=env)
        subprocess.check_call(["cmake", "--build", str(build), "--parallel", jobs], env=env)
        print(f"flashkern: {name} built in {time.time() - start:.1f} s", flush=True)
        return build


CXX_FLAGS = ["-O2", "-std=c++20", "-fvisibility=hidden"]
GLUE_HEADERS = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "torch").rglob("*.h"))]  # rebuild on edits


def extension():
    sources = ["csrc/torch/registration.cpp"]
    libraries, library_dirs = [], []
    if BACKEND == "cuda":
        sources.append("csrc/torch/gpu_ops.cpp")
        cuda_home = find_cuda_home()
        libraries.append("cudart")
        library_dirs += [str(cuda_home / "lib64"), str(cuda_home / "lib")]
    elif BACKEND == "hip":
        sources.append("csrc/torch/gpu_ops.cpp")
        rocm = Path(os.environ.get("ROCM_PATH", "/opt/rocm"))
        libraries.append("amdhip64")
        library_dirs.append(str(rocm / "lib"))
    return CppExtension(
        "flashkern._C",
        sources,
        include_dirs=[str(ROOT / "csrc" / "include")],
        define_macros=[("FLASHKERN_BACKEND", f'"{BACKEND}"'), ("FLASHKERN_ARCHS", f'"{ARCHS}"')],
        extra_compile_args={"cxx": CXX_FLAGS},
        depends=GLUE_HEADERS,
        libraries=libraries,
        library_dirs=library_dirs,
    )


def emulated_extensions():
    """flashkern._emulate[_wave64]: the torch glue over the launchers compiled for the CPU emulation."""
    if not EMULATE:
        return []
    return [CppExtension(f"flashkern.{module}", [f"csrc/torch/emulated_ops{module[len('_emulate'):]}.cpp"],
                         include_dirs=[str(ROOT / "csrc" / "include")], extra_compile_args={"cxx": CXX_FLAGS},
                         depends=["csrc/torch/gpu_ops.cpp", *GLUE_HEADERS])
            for module in EMULATED]


setup(
    name="flashkern",
    version="0.1.0",
    description="Hand-written CUDA and HIP kernels for LLM inference and training, as PyTorch ops",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension(), *emulated_extensions()],
    cmdclass={"build_ext": BuildKernelsThenExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["flashkern = flashkern.cli:main"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.11"],
    extras_require={
        "test": ["pytest", "numpy", "expecttest"],
        "bench": ["pytest-benchmark", "matplotlib"],
        "transformers": ["transformers>=4.50"],
        "cupy": ["cupy"],
    },
)
