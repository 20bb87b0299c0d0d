"""Tensor parallelism on torch.distributed: the all-reduce that ends a row-parallel layer, fused with the
residual add and the RMSNorm that follow it.

- :func:`fused_allreduce_add_rmsnorm` ``(input, residual, weight, eps, group)``, in place, for every
  rank of ``group``: ``residual += all_reduce(input)``, then ``input = rmsnorm(residual)``. The sum over
  the ranks and the residual add are float32; ``residual`` gets the sum rounded once to its dtype and
  the norm is taken of the unrounded float32 sum (flashkern's ``fused_add_rmsnorm`` contract).
- FlashInfer's names: :func:`create_allreduce_fusion_workspace` and :func:`allreduce_fusion` with the
  patterns ``kAllReduce`` and ``kARResidualRMSNorm`` (:class:`AllReduceFusionPattern`).

Engines. ``"nccl"``: ``dist.all_reduce`` over the group's own backend (NCCL, RCCL, or gloo on the CPU),
then flashkern's norm kernels; it works wherever torch.distributed does, and NCCL captures it in CUDA
graphs. The one-shot and two-shot kernels over symmetric memory (csrc/include/flashkern/kernels/
allreduce.cuh, ``torch.ops.flashkern.allreduce_fusion``) are built; the workspace through
torch.distributed's symmetric memory that routes calls to them is not written yet: ``"symm_mem"``
raises ``ValueError`` and ``"auto"`` is ``"nccl"`` until it is.

A workspace is collective: every rank of the group creates it with the same arguments, which it checks
(a rank that disagrees raises on every rank instead of hanging later). Calls are collective too; the
per-call shapes are checked against the workspace, and across ranks only with ``debug=True`` (one more
small all-gather a call).
"""

import torch
import torch.distributed as dist

from . import norm

ENGINES = ("auto", "nccl", "symm_mem")


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
    """What a fused all-reduce needs on a group: its engine, and the largest message it was sized for
    (``max_token_num x hidden_dim`` of ``dtype``)."""

    def __init__(self, group, backend, max_token_num, hidden_dim, dtype, debug=False):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = backend
        self.max_token_num, self.hidden_dim, self.dtype, self.debug = max_token_num, hidden_dim, dtype, debug
        self._destroyed = False

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype, use_oneshot=None):
        """Whether a call of num_tokens x hidden_dim of dtype fits (FlashInfer's check)."""
        return (tp_size == self.world_size and num_tokens * hidden_dim * dtype.itemsize <=
                self.max_token_num * self.hidden_dim * self.dtype.itemsize)

    def destroy(self):
        self._destroyed = True


def _group_of(op, group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized (dist.init_process_group)")
    return group if group is not None else dist.group.WORLD


def _positive_int(op, name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")


def create_allreduce_fusion_workspace(backend="auto", world_size=None, rank=None, max_token_num=None,
                                      hidden_dim=None, dtype=None, gpus_per_node=None, comm_backend=None,
                                      force_oneshot_support=False, group=None, debug=False):
    """A workspace for :func:`allreduce_fusion` on ``group`` (default: the world), collective: every rank
    calls it with the same ``max_token_num``, ``hidden_dim`` and ``dtype``. ``world_size`` and ``rank``,
    if given, must be the group's. ``backend``: ``"auto"``, ``"nccl"`` (``dist.all_reduce``) or
    ``"symm_mem"`` (not wired yet: ``ValueError``); FlashInfer's ``"trtllm"`` and ``"mnnvl"`` name
    NVIDIA-only engines and are refused. ``gpus_per_node``, ``comm_backend`` and
    ``force_oneshot_support`` are accepted and unused. ``debug=True``: every call checks that the ranks
    agree on its shapes (an all-gather) instead of hanging or reading past a peer's message."""
    op = "create_allreduce_fusion_workspace"
    group = _group_of(op, group)
    if backend not in ENGINES:
        raise ValueError(f"{op}: backend must be one of {ENGINES}, got {backend!r}")
    if backend == "symm_mem":
        raise ValueError(f"{op}: the symmetric-memory workspace for the one-shot / two-shot kernels is not wired yet; use "
                         f"backend='nccl' or 'auto'")
    for name, value in (("max_token_num", max_token_num), ("hidden_dim", hidden_dim)):
        _positive_int(op, name, value)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    if world_size is not None and world_size != dist.get_world_size(group):
        raise ValueError(f"{op}: world_size={world_size} but the group has {dist.get_world_size(group)} ranks")
    if rank is not None and rank != dist.get_rank(group):
        raise ValueError(f"{op}: rank={rank} but this process is rank {dist.get_rank(group)} of the group")
    mine = (max_token_num, hidden_dim, str(dtype), bool(debug))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != mine for other in everyone):
        raise ValueError(f"{op}: the ranks disagree on (max_token_num, hidden_dim, dtype, debug): {everyone}")
    return AllReduceFusionWorkspace(group, "nccl", max_token_num, hidden_dim, dtype, debug)


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


def _check_ranks_agree(op, group, key):
    """debug: the ranks' (shape, dtype, pattern) must agree (else a peer would hang or read past a message)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, key, group=group)
    if any(other != key for other in everyone):
        raise ValueError(f"{op}: the ranks called with different shapes or dtypes: {everyone}")


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


def fused_allreduce_add_rmsnorm(input, residual, weight, eps=1e-6, group=None, workspace=None, weight_offset=0.0):
    """In place on every rank of ``group``: ``residual += all_reduce(input)``, ``input = rmsnorm(residual,
    weight, eps)`` (``weight_offset=1``: Gemma's ``1 + weight``). input and residual ``[tokens, hidden]``
    float16, bfloat16 or float32 (the same), weight ``[hidden]`` of their dtype or float32. float32 sum and
    add; residual rounded once, the norm of the unrounded sum. ``workspace``: from
    :func:`create_allreduce_fusion_workspace` (its group and checks), else ``group`` (default: the world)."""
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
    if workspace is not None:
        _check_fits(op, workspace, input)
    total = _sum_over_ranks(input, group, fp32=True)
    _add_rmsnorm(total, residual, weight, eps, float(weight_offset), residual, input)


def _check_fits(op, workspace, input):
    if workspace._destroyed:
        raise ValueError(f"{op}: the workspace was destroyed")
    if input.shape[1] != workspace.hidden_dim or input.shape[0] > workspace.max_token_num:
        raise ValueError(f"{op}: input {tuple(input.shape)} does not fit the workspace (at most "
                         f"{workspace.max_token_num} tokens of hidden_dim {workspace.hidden_dim})")
    if input.element_size() > workspace.dtype.itemsize:
        raise ValueError(f"{op}: input is {input.dtype}, wider than the workspace's {workspace.dtype}")
    if workspace.debug:
        _check_ranks_agree(op, workspace.group, (tuple(input.shape), str(input.dtype)))


def allreduce_fusion(input, workspace, pattern, launch_with_pdl=False, trigger_completion_at_end=True, output=None,
                     residual_out=None, norm_out=None, quant_out=None, scale_out=None, residual_in=None,
                     rms_gamma=None, rms_eps=1e-6, scale_factor=None, layout_code=None, use_oneshot=None,
                     fp32_acc=False, weight_bias=0.0, **unsupported):
    """FlashInfer's fused all-reduce on ``workspace``'s group. ``pattern`` kAllReduce: ``output`` (allocated
    if None) = the sum over the ranks of ``input`` ``[tokens, hidden]``; kARResidualRMSNorm: also
    ``residual_out`` = ``residual_in`` + that sum (rounded once) and ``norm_out`` = RMSNorm of the float32
    sum with ``rms_gamma`` (``weight_bias=1``: Gemma's ``1 + gamma``), ``output`` then optional. Returns
    norm_out (kARResidualRMSNorm) or output. ``fp32_acc``: the sum over the ranks in float32 (else in
    input's dtype, as the engine reduces it; the residual add and the norm are float32 either way).
    ``use_oneshot``, ``launch_with_pdl`` and ``trigger_completion_at_end`` choose among kernels that are
    not wired yet and are accepted as hints; the quantizing patterns and MoE arguments raise."""
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
    _check_fits(op, workspace, input)
    shape, dtype, device = input.shape, input.dtype, input.device
    if output is not None:
        _check_2d(op, "output", output, shape, dtype, device)
    total = _sum_over_ranks(input, workspace.group, bool(fp32_acc))
    if pattern == AllReduceFusionPattern.kAllReduce:
        if output is None:
            return total.to(dtype)
        output.copy_(total)
        return output
    for name, t in (("residual_in", residual_in), ("residual_out", residual_out), ("norm_out", norm_out)):
        if t is None:
            raise ValueError(f"{op}: kARResidualRMSNorm needs {name}")
        _check_2d(op, name, t, shape, dtype, device)
    _check_weight(op, rms_gamma, shape[1], dtype, device)
    if weight_bias not in (0, 0.0, 1, 1.0):
        raise ValueError(f"{op}: weight_bias must be 0.0 (RMSNorm) or 1.0 (Gemma), got {weight_bias!r}")
    if output is not None:
        output.copy_(total)
    _add_rmsnorm(total.float(), residual_in, rms_gamma, rms_eps, float(weight_bias), residual_out, norm_out)
    return norm_out
