"""flashkern's public ops on CuPy arrays: flashkern.cupy.rmsnorm(x, w), ... take and return
cupy.ndarray, zero-copy through DLPack, and run on CuPy's current stream.

CuPy is optional: without it this module still imports, and calling any op raises ImportError.
"""

import functools

import torch

import flashkern as _fk

try:
    import cupy as _cp
except ImportError:  # optional dependency
    _cp = None

OPS = (
    "rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm",
    "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "act_mul",
    "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
)


def _require_cupy():
    if _cp is None:
        raise ImportError(
            "flashkern.cupy needs CuPy, which is not installed: pip install cupy-cuda12x (or cupy-cuda13x, cupy-rocm-*)"
        )
    return _cp


def _to_torch(value):
    return torch.from_dlpack(value) if isinstance(value, _cp.ndarray) else value


def _to_cupy(value):
    if isinstance(value, torch.Tensor):
        return _cp.from_dlpack(value)
    if isinstance(value, tuple):
        return tuple(_to_cupy(v) for v in value)
    return value


def _wrap(name):
    op = getattr(_fk, name)

    @functools.wraps(op)
    def call(*args, **kwargs):
        cp = _require_cupy()
        args = [_to_torch(a) for a in args]
        kwargs = {k: _to_torch(v) for k, v in kwargs.items()}
        stream = torch.cuda.ExternalStream(cp.cuda.get_current_stream().ptr)
        with torch.cuda.stream(stream):  # flashkern launches on torch's current stream: make it CuPy's
            return _to_cupy(op(*args, **kwargs))

    call.__doc__ = f"flashkern.{name} on CuPy arrays (zero-copy, CuPy's current stream).\n\n{op.__doc__ or ''}"
    return call


for _name in OPS:
    globals()[_name] = _wrap(_name)

__all__ = list(OPS)
