"""Argument checks for every op, shared by the CPU reference, the fake (meta) functions and the
reference fallback on GPU tensors. csrc/torch/glue/ makes the same checks for the GPU
kernels, so each path raises the same TypeError or ValueError naming the argument and value."""

import math

import torch

from . import _C

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)  # float64: the reference only, for gradcheck
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _names(dtypes):
    names = [str(d).replace("torch.", "") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_float(op, name, t, reference):
    allowed = REFERENCE_DTYPES if reference else KERNEL_DTYPES
    if t.dtype not in allowed:
        raise TypeError(f"{op}: {name} must be {_names(allowed)}, got {t.dtype}")


def check_same(op, name, t, ref_name, ref, same_shape=True):
    check_tensor(op, name, t)
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if same_shape and t.shape != ref.shape:
        raise ValueError(f"{op}: {name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")


def check_last_dim_contiguous(op, name, t):
    if t.dim() < 1 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{op}: {name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_rmsnorm(op, input, weight, eps, reference):
    check_tensor(op, "input", input)
    check_tensor(op, "weight", weight)
    if input.dim() not in (2, 3):
        raise ValueError(
            f"{op}: input must be 2-D [tokens, hidden] or 3-D [tokens, heads, head_dim], got shape {tuple(input.shape)}"
        )
    check_float(op, "input", input, reference)
    if input.shape[-1] == 0:
        raise ValueError(f"{op}: the hidden size (last dimension of input) must be positive")
    if weight.device != input.device:
        raise ValueError(f"{op}: weight is on {weight.device} but input is on {input.device}")
    if weight.dtype not in (input.dtype, torch.float32):
        raise TypeError(f"{op}: weight must be float32 or the dtype of input ({input.dtype}), got {weight.dtype}")
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(
            f"{op}: weight must have shape [{input.shape[-1]}] to match the last dimension of input, "
            f"got {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous, got strides {weight.stride()}")
    check_last_dim_contiguous(op, "input", input)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def check_act_and_mul(op, input, reference):
    check_tensor(op, "input", input)
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension, got a scalar")
    check_float(op, "input", input, reference)
    if input.shape[-1] % 2 != 0:
        raise ValueError(
            f"{op}: the last dimension of input must be even (gate and up halves), got {input.shape[-1]}"
        )
    check_last_dim_contiguous(op, "input", input)


def check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be 'silu', 'gelu' or 'gelu_tanh', got {activation!r}")


def half_last_dim(shape):
    return (*shape[:-1], shape[-1] // 2)


def check_act_and_mul_output(op, name, t, input):
    check_tensor(op, name, t)
    if t.device != input.device:
        raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")
    if t.dtype != input.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of input ({input.dtype}), got {t.dtype}")
    expected = half_last_dim(input.shape)
    if tuple(t.shape) != expected:
        raise ValueError(
            f"{op}: {name} must have shape {expected} (input's with the last dimension halved), got {tuple(t.shape)}"
        )
    check_last_dim_contiguous(op, name, t)


def check_rope(op, q, k, positions, freqs, reference, check_positions=False):
    """q [tokens, q_heads, head_dim], k [tokens, k_heads, head_dim], positions [tokens] int32/int64,
    freqs: inv_freq [rotary_dim / 2] or cos_sin_cache [max_position, rotary_dim], float32."""
    for name, t in (("q", q), ("k", k), ("positions", positions), ("freqs", freqs)):
        check_tensor(op, name, t)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be 3-D [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    check_float(op, "q", q, reference)
    check_same(op, "k", k, "q", q, same_shape=False)
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"{op}: k must be [tokens, heads, head_dim] with q's tokens and head_dim {tuple(q.shape[::2])}, "
            f"got shape {tuple(k.shape)}"
        )
    check_last_dim_contiguous(op, "q", q)
    check_last_dim_contiguous(op, "k", k)
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: positions must be int32 or int64, got {positions.dtype}")
    if positions.device != q.device:
        raise ValueError(f"{op}: positions is on {positions.device} but q is on {q.device}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: positions must have shape [{q.shape[0]}] (one per token), got {tuple(positions.shape)}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"{op}: the frequency table (inv_freq or cos_sin_cache) must be float32, got {freqs.dtype}")
    if freqs.device != q.device:
        raise ValueError(f"{op}: the frequency table is on {freqs.device} but q is on {q.device}")
    if freqs.dim() not in (1, 2) or not freqs.is_contiguous():
        raise ValueError(
            f"{op}: the frequency table must be a contiguous inv_freq [rotary_dim / 2] or "
            f"cos_sin_cache [max_position, rotary_dim], got shape {tuple(freqs.shape)}"
        )
    rotary_dim = 2 * freqs.shape[0] if freqs.dim() == 1 else freqs.shape[1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > q.shape[2]:
        raise ValueError(
            f"{op}: rotary_dim must be even, positive and at most head_dim {q.shape[2]}, got {rotary_dim}"
        )
    # Only where reading positions costs no device sync (the CPU implementation): the GPU kernel
    # writes NaN for a token whose position is outside the cache instead.
    if check_positions and freqs.dim() == 2 and positions.device.type == "cpu" and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= freqs.shape[0]:
            raise ValueError(
                f"{op}: positions must lie in [0, {freqs.shape[0]}) for a cos_sin_cache of {freqs.shape[0]} rows, "
                f"got positions from {lo} to {hi}"
            )
    return rotary_dim


def check_act_mul(op, gate, up, reference):
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate must have at least one dimension, got a scalar")
    check_float(op, "gate", gate, reference)
    check_same(op, "up", up, "gate", gate)
    check_last_dim_contiguous(op, "gate", gate)
    check_last_dim_contiguous(op, "up", up)


def check_state(op, v_name, v, s_name, s, reference, stacked=False):
    """An attention state: v [tokens, (num_states,) heads, head_dim], s [tokens, (num_states,) heads] float32."""
    check_tensor(op, v_name, v)
    check_tensor(op, s_name, s)
    rank = 4 if stacked else 3
    layout = "[tokens, num_states, heads, head_dim]" if stacked else "[tokens, heads, head_dim]"
    if v.dim() != rank:
        raise ValueError(f"{op}: {v_name} must be {rank}-D {layout}, got shape {tuple(v.shape)}")
    check_float(op, v_name, v, reference)
    check_last_dim_contiguous(op, v_name, v)
    if v.shape[-1] == 0:
        raise ValueError(f"{op}: head_dim (last dimension of {v_name}) must be positive")
    if s.dtype != (torch.float64 if v.dtype == torch.float64 else torch.float32):
        raise TypeError(f"{op}: {s_name} (the log-sum-exp) must be float32, got {s.dtype}")
    if s.device != v.device:
        raise ValueError(f"{op}: {s_name} is on {s.device} but {v_name} is on {v.device}")
    if tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"{op}: {s_name} must have shape {tuple(v.shape[:-1])} ({v_name}'s without head_dim), got {tuple(s.shape)}")


ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
MAX_LEVELS = _C.MAX_LEVELS  # attention levels: kv_indices pointers travel in the kernels' parameters


def check_enable_pdl(op, enable_pdl):
    """FlashInfer's enable_pdl: None or a bool -> whether to launch with programmatic dependent launch
    (platform.h; the GPU must have it, else a plain launch). None is off until a GPU measurement shows
    that it helps (README)."""
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise TypeError(f"{op}: enable_pdl must be None or a bool, got {enable_pdl!r}")
    return bool(enable_pdl)


def check_positive_int(op, name, value, what=""):
    """A count (heads, page_size, tokens a request, pages a split): an int >= 1, never a bool."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int{what}, got {value!r}")


def check_head_dim(op, head_dim):
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be 64, 128 or 256, got {head_dim}")


def check_aligned(op, name, t, alignment):
    """The kernels read plans and write results 16 bytes at a time."""
    if t.data_ptr() % alignment:
        raise ValueError(f"{op}: {name} must start on a {alignment}-byte boundary")


MIN_SOFT_CAP = 1e-6  # smaller caps would overflow the kernels' float scale (sm_scale / cap)


def check_batch_attention(op, q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale, sinks=None,
                          out_scale=1.0, custom_mask=None, logits_soft_cap=0.0, addresses=True):
    """torch.ops.flashkern.batch_attention's arguments: q [batch, qo_heads, D], k_cache and v_cache
    [pages, page_size, kv_heads, D] (any strides, D contiguous), kv_indices a list of 1-D int32
    tensors, a uint8 workspace, out [batch, qo_heads, D] (float16 or bfloat16) and lse [batch,
    qo_heads] float32, both contiguous, grid four non-negative ints, a finite sm_scale, sinks None or
    [qo_heads] float32, a finite out_scale, custom_mask None or 1-D uint8 (packed bits), a finite
    logits_soft_cap >= 0. addresses=False (fake tensors, which have none): skip the alignment of
    workspace and out."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("workspace", workspace), ("out", out),
                    ("lse", lse)):
        check_tensor(op, name, t)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be 3-D [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: q must be float16 or bfloat16, got {q.dtype}")
    check_last_dim_contiguous(op, "q", q)
    check_head_dim(op, q.shape[2])
    check_same(op, "k_cache", k_cache, "q", q, same_shape=False)
    check_same(op, "v_cache", v_cache, "k_cache", k_cache)
    if k_cache.dim() != 4 or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"{op}: k_cache must be 4-D [pages, page_size, num_kv_heads, head_dim] with q's head_dim "
            f"{q.shape[2]}, got shape {tuple(k_cache.shape)}"
        )
    check_last_dim_contiguous(op, "k_cache", k_cache)
    check_last_dim_contiguous(op, "v_cache", v_cache)
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or q.shape[1] % kv_heads:
        raise ValueError(f"{op}: num_qo_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({kv_heads})")
    if not isinstance(kv_indices, (list, tuple)) or not 1 <= len(kv_indices) <= MAX_LEVELS:
        raise ValueError(f"{op}: kv_indices must be a list of 1 to {MAX_LEVELS} tensors (one per level)")
    for i, t in enumerate(kv_indices):
        check_tensor(op, f"kv_indices[{i}]", t)
        if t.dtype != torch.int32:
            raise TypeError(f"{op}: kv_indices[{i}] must be int32, got {t.dtype}")
        if t.dim() != 1 or t.device != q.device:
            raise ValueError(f"{op}: kv_indices[{i}] must be 1-D on {q.device}, got shape {tuple(t.shape)} on {t.device}")
    if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous() or workspace.device != q.device:
        raise ValueError(f"{op}: workspace must be a contiguous 1-D uint8 tensor on {q.device}")
    if addresses:
        check_aligned(op, "workspace", workspace, 16)
    if out.dtype not in ATTENTION_DTYPES or tuple(out.shape) != tuple(q.shape) or not out.is_contiguous() or \
            out.device != q.device:
        raise ValueError(f"{op}: out must be a contiguous float16 or bfloat16 tensor of shape {tuple(q.shape)} on "
                         f"{q.device}")
    if addresses:
        check_aligned(op, "out", out, 16)
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:2]) or not lse.is_contiguous() or lse.device != q.device:
        raise ValueError(f"{op}: lse must be a contiguous float32 tensor of shape {tuple(q.shape[:2])} on {q.device}")
    if len(grid) != 4 or any(int(g) < 0 for g in grid):
        raise ValueError(f"{op}: grid must be four non-negative block counts, got {list(grid)}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"{op}: sm_scale must be finite, got {sm_scale}")
    if not math.isfinite(out_scale):
        raise ValueError(f"{op}: out_scale must be finite, got {out_scale}")
    if sinks is not None:
        check_tensor(op, "sinks", sinks)
        if sinks.dtype != torch.float32 or tuple(sinks.shape) != (q.shape[1],) or not sinks.is_contiguous() or \
                sinks.device != q.device:
            raise ValueError(f"{op}: sinks must be a contiguous float32 tensor of shape ({q.shape[1]},) on {q.device}")
    if custom_mask is not None:
        check_tensor(op, "custom_mask", custom_mask)
        if custom_mask.dtype != torch.uint8 or custom_mask.dim() != 1 or not custom_mask.is_contiguous() or \
                custom_mask.device != q.device:
            raise ValueError(f"{op}: custom_mask must be a contiguous 1-D uint8 tensor (packed bits) on {q.device}")
    if not math.isfinite(logits_soft_cap) or not (logits_soft_cap == 0 or logits_soft_cap >= MIN_SOFT_CAP):
        raise ValueError(f"{op}: logits_soft_cap must be 0 (none) or a finite number >= 1e-6, got {logits_soft_cap}")
