"""Which implementation runs an op, chosen by the tensors' device.

  CPU tensors                       the reference, through torch.ops (registered under the CPU key)
  GPU tensors, kernels built        the CUDA or HIP kernels, through torch.ops (CUDA key)
  GPU tensors, no kernels built     the reference, called directly (quietly)
FLASHKERN_BACKEND (read at import; set_backend() at run time) forces a choice:
  "reference"        the reference on GPU tensors too
  "cuda", "hip"      the built GPU backend (naming one that was not built raises)
  "emulate"          CPU tensors run the CUDA kernels' own code on the CPU emulation
                     (csrc/include/flashkern/emulate.h, module flashkern._emulate): slow, for tests
  "emulate-wave64"   the same with the HIP launchers on a wave64 (CDNA) device
The emulate backends change what CPU tensors run; GPU tensors run as under "auto".
"""

import importlib
import os

import torch

from . import _C

BUILT = _C.BACKEND  # "cuda", "hip" or "cpu"
ARCHS = [a for a in _C.ARCHS.split(";") if a]
EMULATED = {"emulate": "flashkern_emulate", "emulate-wave64": "flashkern_emulate_wave64"}  # -> torch.ops namespace
CHOICES = ("auto", "reference", "cuda", "hip", *EMULATED)


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
    if name in EMULATED:
        module = EMULATED[name].replace("flashkern_", "flashkern._")
        try:
            importlib.import_module(module)  # registers torch.ops.flashkern_emulate[_wave64]
        except ImportError as e:
            raise RuntimeError(f"FLASHKERN_BACKEND={name}, but this flashkern build has no {module} "
                               f"(built with FLASHKERN_BUILD_EMULATE=0?): {e}") from None
    return name


# A wrong FLASHKERN_BACKEND is raised by the first op (and by `flashkern`'s commands, as a one-line error),
# not by the import, so that a program can still import flashkern and call set_backend().
try:
    _forced, STARTUP_ERROR = _parse(os.environ.get("FLASHKERN_BACKEND")), None
except (ValueError, RuntimeError) as e:
    _forced, STARTUP_ERROR = "auto", e


def _check_startup():
    if STARTUP_ERROR is not None:
        raise STARTUP_ERROR


def set_backend(name: str) -> str:
    """Force a backend (see the top of this module): "auto", "reference", "cuda", "hip", "emulate" or
    "emulate-wave64"; returns the previous one."""
    global _forced, STARTUP_ERROR
    previous, _forced, STARTUP_ERROR = _forced, _parse(name), None
    return previous


def get_backend() -> str:
    _check_startup()
    return _forced


def use_reference(device: torch.device) -> bool:
    """True when an op on `device` must call the Python reference directly instead of torch.ops."""
    _check_startup()
    if device.type in ("cpu", "meta"):
        return False  # torch.ops already runs the reference (CPU key) or the fake function (Meta)
    if _forced == "reference":
        return True
    return not kernels_usable()


def backend_for(device: torch.device) -> str:
    """The implementation that runs for tensors on `device`: "reference", "cuda", "hip", "emulate" or
    "emulate-wave64"."""
    if device.type == "cpu":
        return _forced if _forced in EMULATED else "reference"
    if use_reference(device):
        return "reference"
    return BUILT


def register_cpu(op):
    """Registers the decorated function as the CPU implementation of torch.ops.flashkern.<op>: the
    reference, or under an emulate backend the same op of the emulated kernels."""

    def register(reference):
        def cpu(*args):
            _check_startup()
            if _forced in EMULATED:
                return getattr(getattr(torch.ops, EMULATED[_forced]), op)(*args)
            return reference(*args)

        torch.library.impl(f"flashkern::{op}", "cpu")(cpu)
        return reference

    return register
