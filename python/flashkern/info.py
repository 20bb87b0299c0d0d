"""What this flashkern build has and what runs where: flashkern.info() and `flashkern info`."""

import torch

from . import _backend

OPS = (
    "rmsnorm",
    "fused_add_rmsnorm",
    "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "act_mul",
    "apply_rope (all variants)",
    "merge_state, merge_states",
    "batch decode, cascade, single decode",
    "prefill (ragged, paged, single)",
    "sampling, renorm, softmax",
    "speculative sampling, tree verification",
    "optim.AdamW, clip_grad_norm_",
    "append_paged_kv_cache",
)


def _modules():
    """The extension modules this build has: the kernels (or the CPU-only registration) and the emulate backends."""
    import importlib.util

    return {f"_C ({_backend.BUILT})": True,
            **{f"_{name.replace('-', '_')}": importlib.util.find_spec(f"flashkern._{name.replace('-', '_')}") is not None
               for name in _backend.EMULATED}}


def _arch_warp_size(arch: str) -> int:
    """32 on NVIDIA and RDNA (gfx10+), 64 on CDNA/GCN (gfx9 and older)."""
    if arch.startswith("gfx"):
        return 64 if len(arch.split(":")[0]) == 6 else 32  # gfx9xx: 3 characters, gfx1xxx: 4
    return 32


def _rocm_details(index, props):
    """gcnArchName, wavefront size and compute units of a ROCm device: from HIP Python when installed,
    else from torch; and which of flashkern's kernel widths runs there (the HIP launchers pick it from
    the same wavefront size)."""
    details = {
        "arch": getattr(props, "gcnArchName", None),
        "warp_size": getattr(props, "warp_size", None),
        "multiprocessors": props.multi_processor_count,
        "source": "torch",
    }
    try:
        from hip import hip  # HIP Python

        err, hip_props = hip.hipGetDeviceProperties(index)
        if err == hip.hipError_t.hipSuccess:
            arch = hip_props.gcnArchName
            details.update(
                arch=arch.decode() if isinstance(arch, bytes) else str(arch),
                warp_size=int(hip_props.warpSize),
                multiprocessors=int(hip_props.multiProcessorCount),
                source="hip-python",
            )
    except ImportError:
        pass
    if details["warp_size"]:
        details["kernels"] = f"wave{details['warp_size']}"
    return details


def _gpu_devices():
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        device = {
            "device": f"cuda:{i}",
            "name": props.name,
            "arch": f"sm_{props.major}{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "warp_size": getattr(props, "warp_size", None),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "backend": _backend.backend_for(torch.device("cuda", i)),
        }
        if torch.version.hip:
            device.update(_rocm_details(i, props))
        devices.append(device)
    return devices


def info() -> dict:
    """Build (backend, architectures, warp sizes), torch, visible devices and which backend runs each op."""
    devices = [{"device": "cpu", "name": "host", "backend": _backend.backend_for(torch.device("cpu"))}]
    devices += _gpu_devices()
    from . import __version__

    return {
        "flashkern": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "built_backend": _backend.BUILT,
        "built_archs": _backend.ARCHS,
        "modules": _modules(),
        "warp_sizes": {arch: _arch_warp_size(arch) for arch in _backend.ARCHS},
        "forced_backend": _backend.get_backend(),
        "devices": devices,
        "ops": {op: {d["device"]: d["backend"] for d in devices} for op in OPS},
    }
