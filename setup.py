"""Source build of flashkern.

The kernels (csrc/cuda or csrc/hip, torch-free) are built by CMake into a static library, then
linked with the thin torch glue (csrc/torch) into the extension flashkern._C. Which kernels:
  CUDA  when torch was built with CUDA (torch.version.cuda) and nvcc is found; a GPU is not needed
  HIP   when torch was built with ROCm (torch.version.hip)
  none  otherwise: a CPU-only build that still registers every op (the CPU reference runs them)
Environment:
  FLASHKERN_BUILD_BACKEND   force "cuda", "hip" or "cpu"
  FLASHKERN_CUDA_ARCHS      CMake CUDA architectures, default "80-real;90"
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
DEFAULT_ARCHS = {"cuda": "80-real;90", "hip": "gfx90a;gfx942;gfx1100"}


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


class BuildKernelsThenExtension(BuildExtension):
    """Build the kernel library with CMake, then the extension that links it."""

    def build_extensions(self):
        if BACKEND != "cpu":
            library = self.build_kernels()
            for ext in self.extensions:
                ext.extra_objects.append(str(library))
        super().build_extensions()

    def build_kernels(self):
        build = ROOT / "build" / f"kernels-{BACKEND}"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            f"-DFLASHKERN_{BACKEND.upper()}=ON", f"-DFLASHKERN_{BACKEND.upper()}_ARCHS={ARCHS}",
        ]
        if BACKEND == "cuda":
            configure.append(f"-DCMAKE_CUDA_COMPILER={find_nvcc()}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        start = time.time()
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build), "--parallel", jobs])
        print(f"flashkern: {BACKEND} kernels for {ARCHS} built in {time.time() - start:.1f} s", flush=True)
        return build / f"libflashkern_{BACKEND}.a"


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
        extra_compile_args={"cxx": ["-O2", "-std=c++20", "-fvisibility=hidden"]},
        libraries=libraries,
        library_dirs=library_dirs,
    )


setup(
    name="flashkern",
    version="0.1.0",
    description="Hand-written CUDA and HIP kernels for LLM inference and training, as PyTorch ops",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildKernelsThenExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["flashkern = flashkern.cli:main"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        "test": ["pytest", "numpy", "expecttest"],
        "bench": ["pytest-benchmark", "matplotlib"],
        "transformers": ["transformers>=4.50"],
        "cupy": ["cupy"],
    },
)
