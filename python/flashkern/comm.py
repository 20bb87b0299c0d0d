"""Tensor parallelism on torch.distributed: the all-reduce that ends a row-parallel layer, fused with the
residual add and the RMSNorm that follow it.

- :func:`fused_allreduce_add_rmsnorm` ``(input, residual, weight, eps, group, workspace)``, in place, for
  every rank of the group: ``residual += all_reduce(input)``, then ``input = rmsnorm(residual)``. The sum
  over the ranks and the residual add are float32; ``residual`` gets the sum rounded once to its dtype and
  the norm is taken of the unrounded float32 sum (flashkern's ``fused_add_rmsnorm`` contract).
- FlashInfer's names: :func:`create_allreduce_fusion_workspace` and :func:`allreduce_fusion` with the
  patterns ``kAllReduce`` and ``kARResidualRMSNorm`` (:class:`AllReduceFusionPattern`).

Engines (a workspace's ``engine``):
  ``"symm_mem"``  flashkern's one-shot and two-shot kernels (csrc/include/flashkern/kernels/allreduce.cuh,
                 ``torch.ops.flashkern.allreduce_fusion``) over a workspace in torch.distributed's symmetric
                 memory, mapped into every rank: float16 / bfloat16, hidden a multiple of 8 up to 16384,
                 up to 8 ranks on one host. Every flag and count is on the device: a call needs no host
                 work and CUDA graphs capture and replay it. On CPU tensors under FLASHKERN_BACKEND=emulate
                 the same kernels run on the emulator over files in shared memory mapped into every rank.
  ``"nccl"``      ``dist.all_reduce`` over the group's own backend (NCCL, RCCL, or gloo on the CPU), then
                 flashkern's norm; it works wherever torch.distributed does.
``backend="auto"`` takes ``"symm_mem"`` where every rank can (GPUs with flashkern's kernels, not RDNA, on
one host, a group of 2 to 8), and a call there takes one-shot for small messages, two-shot for medium ones
and ``"nccl"`` past the workspace's size (8 MB by default) or for float32; ``"symm_mem"`` and ``"nccl"``
force one (a call the forced kernels cannot take raises).

A workspace is collective: every rank of the group creates it with the same arguments, which it checks
(a rank that disagrees raises on every rank instead of hanging later). Calls are collective too, and
on one workspace they must come in the same order on every rank, from one stream (the kernels' flags
count calls); the per-call shapes are checked against the workspace, and across ranks only with
``debug=True`` (one more small all-gather a call, not capturable).
"""

import math
import os
import socket
import tempfile

import torch
import torch.distributed as dist

from . import _backend, norm
from ._validate import check_enable_pdl

ENGINES = ("auto", "nccl", "symm_mem")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# csrc/include/flashkern/ops.h: kCommMaxRanks, kCommHeaderBytes, the widest row (kCommThreads * 8 *
# kCommMaxVecsPerThread elements); CommLayout: a header, then two regions of 3 messages each
KERNEL_MAX_RANKS, KERNEL_MAX_HIDDEN, WORKSPACE_HEADER_BYTES = 8, 16384, 4096
# "auto" leaves larger messages to dist.all_reduce: vLLM's default cap for its custom all-reduce (past it a
# ring all-reduce's bandwidth wins); no measurement of flashkern's kernels exists yet (docs/benchmarks.md)
AUTO_MAX_MESSAGE_BYTES = 8 << 20


def workspace_bytes(message_bytes):
    """The bytes of a kernel workspace that holds messages of up to ``message_bytes`` (ops.h's CommLayout)."""
    return WORKSPACE_HEADER_BYTES + 6 * ((message_bytes + 15) // 16 * 16)


def one_shot_wins(world, message_bytes):
    """auto's choice between the kernels. One-shot reads every peer's whole message (world x the bytes, one
    barrier); two-shot reads about twice the message over two barriers. vLLM's rule on NVLink: one-shot for 2
    ranks, and up to 512 KB on 4 ranks, 256 KB on 8; unmeasured for flashkern's kernels."""
    return world <= 2 or message_bytes < ((512 << 10) if world <= 4 else (256 << 10))


class AllReduceFusionPattern:
    """FlashInfer's pattern codes; flashkern implements kAllReduce and kARResidualRMSNorm."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5


SUPPORTED_PATTERNS = (AllReduceFusionPattern.kAllReduce, AllReduceFusionPattern.kARResidualRMSNorm)


class AllReduceFusionWorkspace:
    """What a fused all-reduce needs on a group: its engine (``"symm_mem"`` or ``"nccl"``; ``fallback_reason``
    says why ``"auto"`` did not take the kernels), the largest message it was made for (``max_token_num x
    hidden_dim`` of ``dtype``) and, for the kernels, this rank's workspace ``buffer`` (uint8, on ``device``)
    and every rank's address of its own (``peers``)."""

    def __init__(self, group, backend, engine, max_token_num, hidden_dim, dtype, device, debug=False,
                 fallback_reason=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend, self.engine, self.fallback_reason = backend, engine, fallback_reason
        self.max_token_num, self.hidden_dim, self.dtype, self.debug = max_token_num, hidden_dim, dtype, debug
        self.device = device
        self.message_bytes = 0  # the largest message the kernels take; 0: every call goes to dist.all_reduce
        self.buffer, self.peers, self._mapping = None, [], None
        self._destroyed = False

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype, use_oneshot=None):
        """Whether a call of num_tokens x hidden_dim of dtype fits (FlashInfer's check)."""
        return (tp_size == self.world_size and num_tokens * hidden_dim * dtype.itemsize <=
                self.max_token_num * self.hidden_dim * self.dtype.itemsize)

    def destroy(self):
        """Drops the kernels' workspace, collective as its creation: after every rank's last call ended (a
        peer may still be writing flags into it); the workspace refuses calls after."""
        if self.buffer is not None:
            if self.buffer.is_cuda:
                torch.cuda.synchronize(self.buffer.device)
            dist.barrier(group=self.group)
        self.buffer, self.peers, self._mapping = None, [], None
        self._destroyed = True


def _group_of(op, group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized (dist.init_process_group)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be None (the world) or a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__} {group!r}")
    return group if group is not None else dist.group.WORLD


def _check_eps(op, name, eps):
    """The norm's epsilon, before anything is written (the sum is written first otherwise)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: {name} must be a finite number >= 0, got {eps!r}")


def _check_use_oneshot(op, use_oneshot):
    if use_oneshot is not None and not isinstance(use_oneshot, bool):
        raise TypeError(f"{op}: use_oneshot must be None or a bool, got {use_oneshot!r}")


def _positive_int(op, name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")


def _all_gather(group, value):
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _kernel_obstacle(device, dtype, hidden_dim, world):
    """Why this rank cannot run the symmetric-memory kernels, or None."""
    if dtype not in KERNEL_DTYPES:
        return f"the kernels take float16 and bfloat16, not {dtype}"
    if hidden_dim % 8 or hidden_dim > KERNEL_MAX_HIDDEN:
        return f"the kernels take a hidden_dim that is a multiple of 8 up to {KERNEL_MAX_HIDDEN}, not {hidden_dim}"
    if world > KERNEL_MAX_RANKS:
        return f"the kernels take up to {KERNEL_MAX_RANKS} ranks, not {world}"
    running = _backend.backend_for(device)
    if device.type == "cpu":
        if running not in _backend.EMULATED:
            return "CPU tensors: the kernels run on GPUs, or on the CPU emulation (FLASHKERN_BACKEND=emulate)"
        return None
    if running == "reference":
        return f"this flashkern has no kernels for {device} ({_backend.BUILT} build)"
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
    if arch.startswith(("gfx10", "gfx11", "gfx12")):
        return f"{arch} is an RDNA GPU: no peer access to map the ranks' workspaces"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this torch has no torch.distributed._symmetric_memory ({e})"
    return None


def _device_identity(device):
    """(host, the device's identity on it): two ranks on one host can map each other's memory; two on one GPU
    gain nothing from it."""
    if device.type == "cpu":
        return socket.gethostname(), None
    return socket.gethostname(), str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))


def _map_symmetric_memory(group, nbytes, device):
    """(this rank's zeroed workspace, every rank's address of its own, what keeps them mapped). GPUs:
    torch.distributed._symmetric_memory. CPU (the emulated kernels): a file a rank in shared memory, each
    mapped into every rank, removed once all are mapped."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if device.type != "cpu":
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = symm_mem.rendezvous(buffer, group)
        bases = [int(p) for p in handle.buffer_ptrs]
        offset = buffer.data_ptr() - bases[rank]  # the tensor's place in its allocation, the same on every rank
        torch.cuda.synchronize(device)  # every rank's zeros are written before any rank's first call
        dist.barrier(group=group)
        return buffer, [b + offset for b in bases], handle
    where = _all_gather(group, tempfile.mkdtemp(prefix="flashkern-comm-", dir="/dev/shm" if
                                                os.path.isdir("/dev/shm") else None) if rank == 0 else None)[0]
    path = os.path.join(where, f"rank{{}}")
    buffer = torch.from_file(path.format(rank), shared=True, size=nbytes, dtype=torch.uint8)  # made, zeroed
    dist.barrier(group=group)
    mapped = [buffer if r == rank else torch.from_file(path.format(r), shared=True, size=nbytes, dtype=torch.uint8)
              for r in range(world)]
    dist.barrier(group=group)
    if rank == 0:
        for r in range(world):
            os.remove(path.format(r))
        os.rmdir(where)
    return buffer, [t.data_ptr() for t in mapped], mapped


def create_allreduce_fusion_workspace(backend="auto", world_size=None, rank=None, max_token_num=None,
                                      hidden_dim=None, dtype=None, gpus_per_node=None, comm_backend=None,
                                      force_oneshot_support=False, group=None, debug=False, device=None):
    """A workspace for :func:`allreduce_fusion` and :func:`fused_allreduce_add_rmsnorm` on ``group``
    (default: the world), collective: every rank calls it with the same ``max_token_num``, ``hidden_dim``
    and ``dtype``. ``world_size`` and ``rank``, if given, must be the group's. ``backend``: ``"auto"``,
    ``"symm_mem"`` or ``"nccl"`` (the module's docstring); FlashInfer's ``"trtllm"`` and ``"mnnvl"`` name
    NVIDIA-only engines and are refused. ``device``: where the calls' tensors are (default: the current
    CUDA device if there is one, else the CPU). ``gpus_per_node``, ``comm_backend`` and
    ``force_oneshot_support`` are accepted and unused. ``debug=True``: every call checks that the ranks
    agree on its shapes (an all-gather) instead of hanging or reading past a peer's message."""
    op = "create_allreduce_fusion_workspace"
    group = _group_of(op, group)
    if backend not in ENGINES:
        raise ValueError(f"{op}: backend must be one of {ENGINES}, got {backend!r}")
    for name, value in (("max_token_num", max_token_num), ("hidden_dim", hidden_dim)):
        _positive_int(op, name, value)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    world = dist.get_world_size(group)
    if world_size is not None and world_size != world:
        raise ValueError(f"{op}: world_size={world_size} but the group has {world} ranks")
    if rank is not None and rank != dist.get_rank(group):
        raise ValueError(f"{op}: rank={rank} but this process is rank {dist.get_rank(group)} of the group")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    wanted = backend != "nccl" and (backend == "symm_mem" or world > 1)  # auto: a group of one has nothing to send
    obstacle = _kernel_obstacle(device, dtype, hidden_dim, world) if wanted else None
    mine = (backend, max_token_num, hidden_dim, str(dtype), bool(debug))
    everyone = _all_gather(group, (mine, obstacle, _device_identity(device) if wanted else None))
    if any(other != mine for other, _, _ in everyone):
        raise ValueError(f"{op}: the ranks disagree on (backend, max_token_num, hidden_dim, dtype, debug): "
                         f"{[other for other, _, _ in everyone]}")
    reasons = sorted({f"rank {r}: {why}" for r, (_, why, _) in enumerate(everyone) if why})
    places = [place for _, _, place in everyone]
    if wanted and not reasons and len({host for host, _ in places}) > 1:
        reasons = ["the ranks are on more than one host"]
    if wanted and not reasons and device.type != "cpu" and len(set(places)) < world:
        reasons = ["two ranks share a GPU"]
    if backend == "symm_mem" and reasons:
        raise ValueError(f"{op}: backend='symm_mem' cannot run here: {'; '.join(reasons)}")
    if not wanted or reasons:
        why = "; ".join(reasons) if reasons else ("backend='nccl'" if backend == "nccl" else "a group of one")
        return AllReduceFusionWorkspace(group, backend, "nccl", max_token_num, hidden_dim, dtype, device, debug, why)
    ws = AllReduceFusionWorkspace(group, backend, "symm_mem", max_token_num, hidden_dim, dtype, device, debug)
    message = max_token_num * hidden_dim * dtype.itemsize
    ws.message_bytes = (min(message, AUTO_MAX_MESSAGE_BYTES) if backend == "auto" else message) // 16 * 16
    ws.buffer, ws.peers, ws._mapping = _map_symmetric_memory(group, workspace_bytes(ws.message_bytes), device)
    return ws


def _check_2d(op, name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, input on {device}")


def _check_weight(op, weight, hidden, dtype, device):
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: the norm weight must be a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (hidden,) or weight.dtype not in (dtype, torch.float32) or weight.device != device:
        raise ValueError(f"{op}: the norm weight must be [{hidden}] of the input's dtype or float32 on {device}, "
                         f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")


def _check_fits(op, workspace, input):
    if workspace._destroyed:
        raise ValueError(f"{op}: the workspace was destroyed")
    if input.shape[1] != workspace.hidden_dim or input.shape[0] > workspace.max_token_num:
        raise ValueError(f"{op}: input {tuple(input.shape)} does not fit the workspace (at most "
                         f"{workspace.max_token_num} tokens of hidden_dim {workspace.hidden_dim})")
    if input.element_size() > workspace.dtype.itemsize:
        raise ValueError(f"{op}: input is {input.dtype}, wider than the workspace's {workspace.dtype}")
    if workspace.debug:
        everyone = _all_gather(workspace.group, (tuple(input.shape), str(input.dtype)))
        if any(other != everyone[0] for other in everyone):
            raise ValueError(f"{op}: the ranks called with different shapes or dtypes: {everyone}")


def _kernel_choice(op, workspace, input, use_oneshot):
    """None: this call goes to dist.all_reduce; else whether the kernels run two-shot. A function of the
    workspace and the call's shapes and dtype only, so every rank of a collective call chooses the same."""
    if workspace is None or workspace.engine != "symm_mem":
        return None
    if input.device != workspace.device:
        raise ValueError(f"{op}: input is on {input.device}, the workspace on {workspace.device}")
    message = input.numel() * input.element_size()
    if input.dtype not in KERNEL_DTYPES or message > workspace.message_bytes:
        if workspace.backend == "symm_mem":
            raise ValueError(f"{op}: backend='symm_mem' takes float16 / bfloat16 messages up to "
                             f"{workspace.message_bytes} bytes, got {input.dtype} {tuple(input.shape)}")
        return None
    return not (one_shot_wins(workspace.world_size, message) if use_oneshot is None else use_oneshot)


def _ready(t):
    """Whether the op takes t as it is: contiguous (the glue copies a tensor that is not 16-byte aligned). Anything
    else is copied here, on this rank alone: a check that failed on one rank would leave its peers waiting."""
    return t.is_contiguous()


def _readied(t):
    return t if t is None or _ready(t) else t.clone(memory_format=torch.contiguous_format)


def _run_kernels(workspace, two_shot, input, residual_in, weight, out, residual_out, norm_out, eps, weight_offset,
                 pdl):
    torch.ops.flashkern.allreduce_fusion(input, residual_in, weight, out, residual_out, norm_out, workspace.buffer,
                                         workspace.peers, workspace.rank, two_shot, eps, weight_offset, pdl)


def _sum_over_ranks(input, group, fp32):
    """all_reduce(input) in a new tensor: float32 when fp32 (the sum of the ranks' values in float32),
    else in input's dtype (the engine's own accumulation)."""
    total = input.to(torch.float32 if fp32 else input.dtype, copy=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def _add_rmsnorm(total32, residual_in, weight, eps, weight_offset, residual_out, norm_out):
    """residual_out = round(residual_in + total), norm_out = rmsnorm of the unrounded float32 sum."""
    summed = residual_in.float() + total32
    normed = (norm.gemma_rmsnorm if weight_offset else norm.rmsnorm)(summed, weight.float(), eps)
    residual_out.copy_(summed)  # after the norm read it: residual_out may be residual_in
    norm_out.copy_(normed)


def fused_allreduce_add_rmsnorm(input, residual, weight, eps=1e-6, group=None, workspace=None, weight_offset=0.0,
                                enable_pdl=None):
    """In place on every rank of ``group``: ``residual += all_reduce(input)``, ``input = rmsnorm(residual,
    weight, eps)`` (``weight_offset=1``: Gemma's ``1 + weight``). input and residual ``[tokens, hidden]``
    float16, bfloat16 or float32 (the same), weight ``[hidden]`` of their dtype or float32. float32 sum and
    add; residual rounded once, the norm of the unrounded sum. ``workspace``: from
    :func:`create_allreduce_fusion_workspace` (its group, its engine and checks), else ``dist.all_reduce``
    on ``group`` (default: the world). ``enable_pdl``: as the norms' (the kernels only)."""
    op = "fused_allreduce_add_rmsnorm"
    if workspace is not None:
        group = workspace.group
    group = _group_of(op, group)
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        raise ValueError(f"{op}: input must be a 2-D tensor [tokens, hidden]")
    if input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: input must be float16, bfloat16 or float32, got {input.dtype}")
    _check_2d(op, "residual", residual, input.shape, input.dtype, input.device)
    _check_weight(op, weight, input.shape[1], input.dtype, input.device)
    if weight_offset not in (0, 0.0, 1, 1.0):
        raise ValueError(f"{op}: weight_offset must be 0 (RMSNorm) or 1 (Gemma), got {weight_offset!r}")
    _check_eps(op, "eps", eps)
    pdl = check_enable_pdl(op, enable_pdl)
    if workspace is not None:
        _check_fits(op, workspace, input)
    two_shot = _kernel_choice(op, workspace, input, None)
    if two_shot is None:
        total = _sum_over_ranks(input, group, fp32=True)
        _add_rmsnorm(total, residual, weight, eps, float(weight_offset), residual, input)
        return
    x, res = _readied(input), _readied(residual)
    _run_kernels(workspace, two_shot, x, res, _readied(weight), None, res, x, eps, float(weight_offset), pdl)
    if x is not input:
        input.copy_(x)
    if res is not residual:
        residual.copy_(res)


def allreduce_fusion(input, workspace, pattern, launch_with_pdl=False, trigger_completion_at_end=True, output=None,
                     residual_out=None, norm_out=None, quant_out=None, scale_out=None, residual_in=None,
                     rms_gamma=None, rms_eps=1e-6, scale_factor=None, layout_code=None, use_oneshot=None,
                     fp32_acc=False, weight_bias=0.0, **unsupported):
    """FlashInfer's fused all-reduce on ``workspace``'s group. ``pattern`` kAllReduce: ``output`` (allocated
    if None) = the sum over the ranks of ``input`` ``[tokens, hidden]``; kARResidualRMSNorm: also
    ``residual_out`` = ``residual_in`` + that sum (rounded once) and ``norm_out`` = RMSNorm of the float32
    sum with ``rms_gamma`` (``weight_bias=1``: Gemma's ``1 + gamma``), ``output`` then optional. Returns
    norm_out (kARResidualRMSNorm) or output. ``fp32_acc``: the kernels always sum in float32 (in rank order,
    the same bits on every rank); ``dist.all_reduce`` does with ``fp32_acc=True``, else in input's dtype;
    the residual add and the norm are float32 either way. ``use_oneshot``: None (auto's choice) or force
    one-shot / two-shot; ``launch_with_pdl``: programmatic dependent launch of the kernels (the GPU must
    have it). ``trigger_completion_at_end`` is accepted and unused; the quantizing patterns and MoE
    arguments raise."""
    op = "allreduce_fusion"
    if not isinstance(workspace, AllReduceFusionWorkspace):
        raise TypeError(f"{op}: workspace must come from flashkern.comm.create_allreduce_fusion_workspace, got "
                        f"{type(workspace).__name__}")
    if pattern not in SUPPORTED_PATTERNS:
        raise ValueError(f"{op}: pattern {pattern!r} is not supported by flashkern (kAllReduce = 0 and "
                         f"kARResidualRMSNorm = 1 are)")
    used = {k: v for k, v in unsupported.items() if v is not None}
    if used or quant_out is not None or scale_out is not None or scale_factor is not None or layout_code is not None:
        raise ValueError(f"{op}: quantized outputs and MoE arguments are not supported by flashkern, got "
                         f"{sorted(used) or 'quant_out / scale_out / scale_factor / layout_code'}")
    if not isinstance(input, torch.Tensor) or input.dim() != 2 or not input.is_contiguous():
        raise ValueError(f"{op}: input must be a contiguous 2-D tensor [token_num, hidden_dim]")
    if input.dtype != workspace.dtype:
        raise TypeError(f"{op}: input is {input.dtype}, the workspace was made for {workspace.dtype}")
    pdl = check_enable_pdl(op, launch_with_pdl)
    _check_fits(op, workspace, input)
    shape, dtype, device = input.shape, input.dtype, input.device
    if output is not None:
        _check_2d(op, "output", output, shape, dtype, device)
    norm_pattern = pattern == AllReduceFusionPattern.kARResidualRMSNorm
    if norm_pattern:
        for name, t in (("residual_in", residual_in), ("residual_out", residual_out), ("norm_out", norm_out)):
            if t is None:
                raise ValueError(f"{op}: kARResidualRMSNorm needs {name}")
            _check_2d(op, name, t, shape, dtype, device)
        _check_weight(op, rms_gamma, shape[1], dtype, device)
        if weight_bias not in (0, 0.0, 1, 1.0):
            raise ValueError(f"{op}: weight_bias must be 0.0 (RMSNorm) or 1.0 (Gemma), got {weight_bias!r}")
        _check_eps(op, "rms_eps", rms_eps)
    _check_use_oneshot(op, use_oneshot)
    two_shot = _kernel_choice(op, workspace, input, use_oneshot)
    if two_shot is not None:
        return _allreduce_fusion_kernels(workspace, two_shot, input, output, norm_pattern, residual_in, rms_gamma,
                                         residual_out, norm_out, rms_eps, float(weight_bias), pdl)
    total = _sum_over_ranks(input, workspace.group, bool(fp32_acc))
    if not norm_pattern:
        if output is None:
            return total.to(dtype)
        output.copy_(total)
        return output
    if output is not None:
        output.copy_(total)
    _add_rmsnorm(total.float(), residual_in, rms_gamma, rms_eps, float(weight_bias), residual_out, norm_out)
    return norm_out


def _allreduce_fusion_kernels(workspace, two_shot, input, output, norm_pattern, residual_in, gamma, residual_out,
                              norm_out, eps, weight_bias, pdl):
    """allreduce_fusion on the kernels: any layout and alignment of the tensors (copies where needed)."""
    input = _readied(input)
    if not norm_pattern:
        out = output if output is not None and _ready(output) else torch.empty_like(input)
        _run_kernels(workspace, two_shot, input, None, None, out, None, None, eps, weight_bias, pdl)
        return out if output is None or out is output else output.copy_(out)
    res_out = residual_out if _ready(residual_out) else torch.empty_like(input)
    normed = norm_out if _ready(norm_out) else torch.empty_like(input)
    if output is not None:  # the fused kernel writes the residual and the norm only: the sum takes a call of its own
        _allreduce_fusion_kernels(workspace, two_shot, input, output, False, None, None, None, None, eps, weight_bias,
                                  pdl)
    _run_kernels(workspace, two_shot, input, _readied(residual_in), _readied(gamma), None, res_out, normed, eps,
                 weight_bias, pdl)
    for mine, given in ((res_out, residual_out), (normed, norm_out)):
        if mine is not given:
            given.copy_(mine)
    return norm_out


# ---- torch.ops.flashkern.allreduce_fusion on CPU tensors and in tracing ----


@_backend.register_cpu("allreduce_fusion")
def _allreduce_fusion_cpu(input, residual_in, weight, out, residual_out, norm_out, workspace, peers, rank, two_shot,
                          eps, weight_offset, enable_pdl=False):
    """The reference, for a group of one: a peer's workspace is reachable by the kernels alone (on GPUs, or
    emulated: FLASHKERN_BACKEND=emulate). The glue's checks that a reference can make."""
    op = "allreduce_fusion"
    if len(peers) != 1 or rank != 0:
        raise ValueError(f"{op}: the CPU reference runs a group of one, got {len(peers)} peers; a group needs "
                         f"the kernels (GPUs, or FLASHKERN_BACKEND=emulate)")
    if input.dim() != 2 or input.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: input must be a 2-D float16 or bfloat16 tensor, got {input.dtype} {tuple(input.shape)}")
    if input.numel() * 2 > max(0, (workspace.numel() - WORKSPACE_HEADER_BYTES) // 6 // 16 * 16):
        raise ValueError(f"{op}: a message of {input.numel() * 2} bytes does not fit the workspace")
    if residual_in is None:
        if out is None or residual_out is not None or norm_out is not None:
            raise ValueError(f"{op}: give out alone (all-reduce), or residual_in, weight, residual_out and norm_out")
        out.copy_(input)
        return
    if out is not None or residual_out is None or norm_out is None or weight is None:
        raise ValueError(f"{op}: give out alone (all-reduce), or residual_in, weight, residual_out and norm_out")
    _check_weight(op, weight, input.shape[1], input.dtype, input.device)
    _add_rmsnorm(input.float(), residual_in, weight, eps, weight_offset, residual_out, norm_out)


@torch.library.register_fake("flashkern::allreduce_fusion")
def _allreduce_fusion_fake(input, residual_in, weight, out, residual_out, norm_out, workspace, peers, rank, two_shot,
                           eps, weight_offset, enable_pdl=False):
    return None  # writes only the tensors it is given
