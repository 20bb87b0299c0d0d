"""Which implementation runs an op, chosen by the tensors' device.

  CPU tensors                       the reference, through torch.ops (registered under the CPU key)
  GPU tensors, kernels built        the CUDA or HIP kernels, through torch.ops (CUDA key)
  GPU tensors, no kernels built     the reference, called directly (quietly)
FLASHKERN_BACKEND (read at import; set_backend() at run time) forces a choice for GPU tensors:
"reference", or the name of a built backend ("cuda", "hip"); naming one that was not built raises.
"""

import os

import torch

from . import _C

BUILT = _C.BACKEND  # "cuda", "hip" or "cpu"
ARCHS = [a for a in _C.ARCHS.split(";") if a]
CHOICES = ("auto", "reference", "cuda", "hip")


def _runtime_gpu_backend():
    """The GPU backend this torch runs ("cuda", "hip") or None."""
    if torch.version.hip:
        return "hip"
    if torch.version.cuda:
        return "cuda"
    return None


def kernels_usable() -> bool:
    return BUILT != "cpu" and BUILT == _runtime_gpu_backend()


def _parse(name):
    name = (name or "auto").strip().lower()
    if name not in CHOICES:
        raise ValueError(f"FLASHKERN_BACKEND must be one of {', '.join(CHOICES)}, got {name!r}")
    if name in ("cuda", "hip") and not (BUILT == name and kernels_usable()):
        raise RuntimeError(
            f"FLASHKERN_BACKEND={name}, but this flashkern build has {BUILT} kernels "
            f"(torch: cuda={torch.version.cuda}, hip={torch.version.hip}); rebuild, or unset FLASHKERN_BACKEND"
        )
    return name


_forced = _parse(os.environ.get("FLASHKERN_BACKEND"))


def set_backend(name: str) -> str:
    """Force a backend for GPU tensors ("auto", "reference", "cuda", "hip"); returns the previous one."""
    global _forced
    previous, _forced = _forced, _parse(name)
    return previous


def get_backend() -> str:
    return _forced


def use_reference(device: torch.device) -> bool:
    """True when an op on `device` must call the Python reference directly instead of torch.ops."""
    if device.type in ("cpu", "meta"):
        return False  # torch.ops already runs the reference (CPU key) or the fake function (Meta)
    if _forced == "reference":
        return True
    return not kernels_usable()


def backend_for(device: torch.device) -> str:
    """The implementation that runs for tensors on `device`: "reference", "cuda" or "hip"."""
    if device.type == "cpu" or use_reference(device):
        return "reference"
    return BUILT
