"""Argument checks for every op, shared by the CPU reference, the fake (meta) functions and the
reference fallback on GPU tensors. csrc/torch/glue/ makes the same checks for the GPU
kernels, so each path raises the same TypeError or ValueError naming the argument and value."""

import math
import struct

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
# an fp8 KV cache's dtypes (q stays 16-bit): OCP's formats (NVIDIA and AMD), AMD's fnuz ones (MI300)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
HEAD_DIMS = (64, 128, 256)  # KV compression's kernels (kv_scores, kv_compress)
ATTENTION_HEAD_DIMS = HEAD_DIMS + (512,)  # attention: 512 in 16-row tiles (attention_work.h: kMaxWideHeadDim)
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


def check_head_dim(op, head_dim, allowed=HEAD_DIMS):
    if head_dim not in allowed:
        names = ", ".join(str(d) for d in allowed[:-1]) + f" or {allowed[-1]}"
        raise ValueError(f"{op}: head_dim must be {names}, got {head_dim}")


def check_aligned(op, name, t, alignment):
    """The kernels read plans and write results 16 bytes at a time."""
    if t.data_ptr() % alignment:
        raise ValueError(f"{op}: {name} must start on a {alignment}-byte boundary")


MIN_SOFT_CAP = 1e-6  # smaller caps would overflow the kernels' float scale (sm_scale / cap)


def check_batch_attention(op, q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale, sinks=None,
                          out_scale=1.0, custom_mask=None, logits_soft_cap=0.0, addresses=True, logits=None,
                          k_scale=None, v_scale=None):
    """torch.ops.flashkern.batch_attention's arguments: q [batch, qo_heads, D], k_cache and v_cache
    [pages, page_size, kv_heads, D] (any strides, D contiguous), kv_indices a list of 1-D int32
    tensors, a uint8 workspace, out [batch, qo_heads, D] (float16 or bfloat16) and lse [batch,
    qo_heads] float32, both contiguous, grid four non-negative ints, a finite sm_scale, sinks None or
    [qo_heads] float32, a finite out_scale, custom_mask None or 1-D uint8 (packed bits), a finite
    logits_soft_cap >= 0, logits None or [batch, qo_heads, L] float32 contiguous; an fp8 cache (q's dtype
    otherwise) with k_scale / v_scale None or [kv_heads] float32 contiguous. addresses=False (fake
    tensors, which have none): skip the alignment of workspace and out."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("workspace", workspace), ("out", out),
                    ("lse", lse)):
        check_tensor(op, name, t)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be 3-D [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: q must be float16 or bfloat16, got {q.dtype}")
    check_last_dim_contiguous(op, "q", q)
    check_head_dim(op, q.shape[2], ATTENTION_HEAD_DIMS)
    if k_cache.dtype in FP8_DTYPES:
        if k_cache.device != q.device:
            raise ValueError(f"{op}: k_cache is on {k_cache.device} but q is on {q.device}")
    else:
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
    if q.shape[2] > _C.MAX_WIDE_HEAD_DIM and (grid[0] or grid[2]):
        raise ValueError(f"{op}: head_dim {q.shape[2]} runs 16-row tiles only (its plans have no other items): "
                         f"grid[0] and grid[2] must be 0, got {list(grid)}")
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
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        check_tensor(op, name, scale)
        if k_cache.dtype not in FP8_DTYPES:
            raise ValueError(f"{op}: {name} as a tensor needs an fp8 cache (a 16-bit one takes a number)")
        if scale.dtype != torch.float32 or tuple(scale.shape) != (kv_heads,) or not scale.is_contiguous() or \
                scale.device != k_cache.device:
            raise ValueError(f"{op}: {name} must be a contiguous float32 tensor of shape ({kv_heads},) (one per KV "
                             f"head) on {k_cache.device}")
    if logits is not None:
        check_logits(op, logits, q, 0)
        if len(kv_indices) != 1 or custom_mask is not None or grid[2] != 0:
            raise ValueError(f"{op}: logits need a plan of one level, no custom mask and no 64-row tiles (grid[2] "
                             f"== 0): the kernels write a key's logit at its position in that level")


def check_logits(op, logits, q, min_len):
    """The attention's logits for kv_scores: float32 [q rows, qo_heads, >= min_len], contiguous, on q's device."""
    check_tensor(op, "logits", logits)
    if logits.dtype != torch.float32 or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(q.shape[:2]) or \
            logits.shape[2] < min_len or not logits.is_contiguous() or logits.device != q.device:
        raise ValueError(f"{op}: logits must be a contiguous float32 tensor [{q.shape[0]}, {q.shape[1]}, >= {min_len}] "
                         f"on {q.device}")


# ---- sampling, renormalization, speculative verification (csrc/torch/glue/sampling.h) ----

SAMPLE_FILTERS = ("none", "top_k", "top_p", "min_p", "top_k_top_p")
RENORM_KINDS = ("top_k_probs", "top_p_probs", "top_k_logits")


def check_probs(op, name, probs):
    check_tensor(op, name, probs)
    if probs.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be torch.float32, got {probs.dtype}")
    if probs.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D (batch, vocab), got shape {tuple(probs.shape)}")
    if not 0 < probs.shape[1] < 2**31:
        raise ValueError(f"{op}: {name} must have between 1 and 2^31 - 1 columns, got {probs.shape[1]}")
    check_last_dim_contiguous(op, name, probs)


def check_row_param(op, name, t, ref, batch, dtype):
    """A per-row parameter tensor: [batch] of dtype on ref's device, contiguous (or None)."""
    if t is None:
        return
    check_tensor(op, name, t)
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but probs is on {ref.device}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous tensor of shape ({batch},), got {tuple(t.shape)}")


def check_random(op, ref, batch, seed_arr, offset_arr):
    for name, t in (("seed", seed_arr), ("offset", offset_arr)):
        if t is None:
            continue
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the input is on {ref.device}")
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: a {name} tensor must be torch.int64, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] not in (1, batch) or not t.is_contiguous():
            raise ValueError(f"{op}: a {name} tensor must be contiguous of shape (1,) or ({batch},), got {tuple(t.shape)}")


def check_sampling(probs, indices, filter, top_k_arr, top_p_arr, min_p_arr, seed_arr, offset_arr):
    """The sampling op's arguments; returns the number of output rows."""
    op = "sampling"
    check_probs(op, "probs", probs)
    batch = probs.shape[0]
    if indices is not None:
        if indices.device != probs.device:
            raise ValueError(f"{op}: indices is on {indices.device} but probs is on {probs.device}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: indices must be torch.int32 or torch.int64, got {indices.dtype}")
        if indices.dim() != 1 or not indices.is_contiguous():
            raise ValueError(f"{op}: indices must be a contiguous 1-D tensor, got shape {tuple(indices.shape)}")
        batch = indices.shape[0]
    if filter not in SAMPLE_FILTERS:
        raise ValueError(f"{op}: filter must be 'none', 'top_k', 'top_p', 'min_p' or 'top_k_top_p', got '{filter}'")
    check_row_param(op, "top_k", top_k_arr, probs, batch, torch.int32)
    check_row_param(op, "top_p", top_p_arr, probs, batch, torch.float32)
    check_row_param(op, "min_p", min_p_arr, probs, batch, torch.float32)
    check_random(op, probs, batch, seed_arr, offset_arr)
    return batch


def renorm_op_name(kind):
    return {"top_k_logits": "top_k_mask_logits", "top_p_probs": "top_p_renorm_probs"}.get(kind, "top_k_renorm_probs")


def check_renorm(input, kind, top_k_arr, top_p_arr):
    op = renorm_op_name(kind)
    if kind not in RENORM_KINDS:
        raise ValueError(f"{op}: kind must be 'top_k_probs', 'top_p_probs' or 'top_k_logits', got '{kind}'")
    check_tensor(op, "input", input)
    if input.dtype not in KERNEL_DTYPES:
        name = "logits" if kind == "top_k_logits" else "probs"
        raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {input.dtype}")
    if input.dim() != 2:
        raise ValueError(f"{op}: input must be 2-D (batch, vocab), got shape {tuple(input.shape)}")
    if input.shape[1] >= 2**31:
        raise ValueError(f"{op}: at most 2^31 - 1 columns, got {input.shape[1]}")
    check_last_dim_contiguous(op, "input", input)
    check_row_param(op, "top_k", top_k_arr, input, input.shape[0], torch.int32)
    check_row_param(op, "top_p", top_p_arr, input, input.shape[0], torch.float32)


def check_softmax(logits, temperature_arr, temperature):
    op = "softmax"
    check_tensor(op, "logits", logits)
    if logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    check_last_dim_contiguous(op, "logits", logits)
    check_row_param(op, "temperature", temperature_arr, logits, logits.shape[0], torch.float32)
    t = torch.tensor(temperature, dtype=torch.float32)  # the kernel's float
    if not (bool(torch.isfinite(t)) and float(t) > 0):
        raise ValueError(f"{op}: temperature must be a finite float32 number > 0, got {temperature!r}")


def check_speculative(target, draft, candidates, first_candidate, parents, mode, seed_arr, offset_arr):
    op = "verify_tree_greedy" if mode == "greedy" else "speculative_sampling"
    if mode not in ("greedy", "sample"):
        raise ValueError(f"{op}: mode must be 'greedy' or 'sample', got '{mode}'")
    name = "target_logits" if mode == "greedy" else "target_probs"
    check_tensor(op, name, target)
    if mode == "greedy" and target.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {target.dtype}")
    if mode == "sample" and target.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be torch.float32, got {target.dtype}")
    if target.dim() != 3:
        raise ValueError(f"{op}: {name} must be 3-D (batch, nodes, vocab), got shape {tuple(target.shape)}")
    check_last_dim_contiguous(op, name, target)
    batch, nodes, vocab = target.shape
    if not 1 <= nodes <= 1024:
        raise ValueError(f"{op}: between 1 and 1024 tree nodes, got {nodes}")
    if not 1 <= vocab < 2**31:
        raise ValueError(f"{op}: vocab must be between 1 and 2^31 - 1, got {vocab}")
    if first_candidate not in (0, 1):
        raise ValueError(f"{op}: first_candidate must be 0 or 1")
    if candidates.device != target.device:
        raise ValueError(f"{op}: candidates are on {candidates.device} but {name} is on {target.device}")
    if candidates.dtype != torch.int32:
        raise TypeError(f"{op}: candidate token ids must be torch.int32, got {candidates.dtype}")
    shape = (batch, nodes - first_candidate)
    if tuple(candidates.shape) != shape or (candidates.numel() and candidates.stride(1) != 1):
        raise ValueError(f"{op}: candidate token ids must have shape {shape} (contiguous rows), got "
                         f"{tuple(candidates.shape)}")
    if draft is not None:
        if mode == "greedy":
            raise ValueError(f"{op}: greedy verification takes no draft probabilities")
        check_same(op, "draft_probs", draft, name, target, same_shape=False)
        if draft.dim() != 3 or draft.shape[0] != batch or draft.shape[1] < nodes - 1 or draft.shape[2] != vocab:
            raise ValueError(f"{op}: draft_probs must have shape ({batch}, {nodes - 1}, {vocab}) or more nodes, got "
                             f"{tuple(draft.shape)}")
        check_last_dim_contiguous(op, "draft_probs", draft)
    if parents is not None:
        if parents.device != target.device:
            raise ValueError(f"{op}: parents are on {parents.device} but {name} is on {target.device}")
        if parents.dtype != torch.int32:
            raise TypeError(f"{op}: parents must be torch.int32, got {parents.dtype}")
        if tuple(parents.shape) not in ((nodes,), (batch, nodes)):
            raise ValueError(f"{op}: parents must have shape ({nodes},) or ({batch}, {nodes}), got "
                             f"{tuple(parents.shape)}")
        if parents.shape[-1] > 1 and parents.stride(-1) != 1:
            raise ValueError(f"{op}: parents must be contiguous in its last dimension")
    check_random(op, target, batch, seed_arr, offset_arr)


# ---- the training step (csrc/torch/glue/optim.h makes the same checks) ----


def _check_listed(op, lst, i, t, ref):
    check_tensor(op, f"{lst}[{i}]", t)
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {lst}[{i}] is sparse; sparse gradients are not supported")
    if t.device != ref.device:
        raise ValueError(f"{op}: {lst}[{i}] is on {t.device} but {lst}[0] is on {ref.device} (one device per call)")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {lst}[{i}] must be contiguous")


def _check_fp32_like(op, lst, i, t, param):
    _check_listed(op, lst, i, t, param)
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {lst}[{i}] must be torch.float32, got {t.dtype}")
    if t.numel() != param.numel():
        raise ValueError(f"{op}: {lst}[{i}] must have {param.numel()} elements (its parameter's), got {t.numel()}")


def _check_scalar(op, name, t, ref, numel=1):
    check_tensor(op, name, t)
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but the tensors are on {ref.device}")
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be torch.float32, got {t.dtype}")
    if t.numel() != numel or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous tensor of {numel} element(s), got shape {tuple(t.shape)}")


def _check_table(op, table, table_host, ref, entries):
    need = entries * _C.OPTIM_TABLE_ENTRY_BYTES
    if table.dtype != torch.uint8 or not table.is_contiguous() or table.numel() < need or table.device != ref.device:
        raise ValueError(f"{op}: table must be a contiguous torch.uint8 tensor of at least {need} bytes on {ref.device}")
    if (table_host.dtype != torch.uint8 or not table_host.is_contiguous() or table_host.numel() < need
            or table_host.device.type != "cpu"):
        raise ValueError(f"{op}: table_host must be a contiguous torch.uint8 CPU tensor of at least {need} bytes")


def check_grad_norm(tensors, norm_type, table, table_host):
    op = "grad_norm"
    if len(tensors) == 0:
        raise ValueError(f"{op}: no tensors")
    if not norm_type > 0:
        raise ValueError(f"{op}: norm_type must be positive or inf, got {norm_type}")
    for i, t in enumerate(tensors):
        _check_listed(op, "tensors", i, t, tensors[0])
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{op}: tensors[{i}] must be float16, bfloat16 or float32, got {t.dtype}")
    _check_table(op, table, table_host, tensors[0], len(tensors))


def check_adamw(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, clip_coef, per_tensor_clip,
                found_inf, table, table_host):
    op = "adamw"
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n and len(masters) in (0, n)):
        raise ValueError(f"{op}: params, grads, exp_avgs, exp_avg_sqs and steps (and masters, unless empty) must be "
                         "lists of the same length")
    if n == 0:
        return
    ref = params[0]
    for i, p in enumerate(params):
        _check_listed(op, "params", i, p, ref)
        if p.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{op}: params[{i}] must be float16, bfloat16 or float32, got {p.dtype}")
        _check_listed(op, "grads", i, grads[i], ref)
        if grads[i].dtype != p.dtype:
            raise TypeError(f"{op}: grads[{i}] must have its parameter's dtype ({p.dtype}), got {grads[i].dtype}")
        if grads[i].shape != p.shape:
            raise ValueError(f"{op}: grads[{i}] must have its parameter's shape {tuple(p.shape)}, got "
                             f"{tuple(grads[i].shape)}")
        _check_fp32_like(op, "exp_avgs", i, exp_avgs[i], p)
        _check_fp32_like(op, "exp_avg_sqs", i, exp_avg_sqs[i], p)
        if masters and masters[i].numel() > 0:
            _check_fp32_like(op, "masters", i, masters[i], p)
        _check_scalar(op, "steps[i]", steps[i], ref)
    if lr_tensor is not None:
        _check_scalar(op, "lr", lr_tensor, ref)
    if clip_coef is not None:
        _check_scalar(op, "clip_coef", clip_coef, ref, n if per_tensor_clip else 1)
    if found_inf is not None:
        _check_scalar(op, "found_inf", found_inf, ref)
    _check_table(op, table, table_host, ref, n)


# ---- KV-cache compression (csrc/torch/glue/kv_compress.h) ----

MAX_SCORE_BATCH = 65535  # kv_scores: a request a grid row


def check_index(op, name, t, ref, length=None):
    """An int32 CSR array or index list: contiguous 1-D on ref's device, `length` entries when given."""
    check_tensor(op, name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous() or t.device != ref.device:
        raise ValueError(f"{op}: {name} must be a contiguous 1-D tensor on {ref.device}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{op}: {name} must have {length} entries, got {t.shape[0]}")


def check_cache_view(op, name, t, addresses=True, reference=False):
    """A paged cache view [pages, page_size, kv_heads, head_dim], read 16 bytes at a time (the reference:
    float32 and float64 too)."""
    check_tensor(op, name, t)
    if t.dtype not in ATTENTION_DTYPES + ((torch.float32, torch.float64) if reference else ()):
        raise TypeError(f"{op}: {name} must be float16 or bfloat16, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{op}: {name} must be 4-D [pages, page_size, num_kv_heads, head_dim], got shape "
                         f"{tuple(t.shape)}")
    check_head_dim(op, t.shape[3])
    check_last_dim_contiguous(op, name, t)
    if addresses and (t.data_ptr() % 16 or any(t.shape[d] > 1 and t.stride(d) % 8 for d in range(3))):
        raise ValueError(f"{op}: {name} must start on a 16-byte boundary and have strides that are multiples of 8 "
                         f"elements, got strides {t.stride()}")
    if not (0 < t.shape[1] < 2**31 and 0 < t.shape[2] <= 65535):
        raise ValueError(f"{op}: {name} must have a page_size in [1, 2^31) and 1 to 65535 KV heads, got shape "
                         f"{tuple(t.shape)}")


def check_scores(op, scores, cache):
    shape = (cache.shape[0], cache.shape[2], cache.shape[1])
    check_tensor(op, "scores", scores)
    if scores.dtype != torch.float32 or tuple(scores.shape) != shape or not scores.is_contiguous() or \
            scores.device != cache.device:
        raise ValueError(f"{op}: scores must be a contiguous float32 tensor of shape {shape} ([num_pages, "
                         f"num_kv_heads, page_size]) on {cache.device}, got {scores.dtype} {tuple(scores.shape)}")


def check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, ref):
    check_index(op, "kv_indptr", kv_indptr, ref)
    batch = kv_indptr.shape[0] - 1
    if not 0 <= batch <= MAX_SCORE_BATCH:
        raise ValueError(f"{op}: kv_indptr must have batch_size + 1 entries, batch_size <= {MAX_SCORE_BATCH}")
    check_index(op, "kv_indices", kv_indices, ref)
    check_index(op, "kv_last_page_len", kv_last_page_len, ref, batch)
    return batch


def check_kv_scores(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, max_kv_len, sm_scale,
                    scale, window_left, logits_soft_cap, addresses=True, reference=False, logits=None):
    op = "kv_scores"
    check_cache_view(op, "k_cache", k_cache, addresses, reference)
    check_tensor(op, "q", q)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"{op}: q must be 3-D [tokens, num_qo_heads, head_dim] with k_cache's head_dim, got shape "
                         f"{tuple(q.shape)}")
    check_same(op, "q", q, "k_cache", k_cache, same_shape=False)
    check_last_dim_contiguous(op, "q", q)
    if addresses and (q.data_ptr() % 16 or any(q.shape[d] > 1 and q.stride(d) % 8 for d in range(2))):
        raise ValueError(f"{op}: q must start on a 16-byte boundary and have strides that are multiples of 8")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{op}: num_qo_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    check_tensor(op, "lse", lse)
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:2]) or not lse.is_contiguous() or \
            lse.device != q.device:
        raise ValueError(f"{op}: lse must be a contiguous float32 tensor of shape {tuple(q.shape[:2])}")
    batch = check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, q)
    check_index(op, "qo_indptr", qo_indptr, q, batch + 1)
    check_scores(op, scores, k_cache)
    if not 0 <= max_kv_len <= 2**30:
        raise ValueError(f"{op}: max_kv_len must be in [0, 2^30], got {max_kv_len}")
    if not -1 <= window_left < 2**30:
        raise ValueError(f"{op}: window_left must be -1 (none) or in [0, 2^30), got {window_left}")
    if not (math.isfinite(sm_scale) and math.isfinite(scale)):
        raise ValueError(f"{op}: sm_scale and scale must be finite")
    if not math.isfinite(logits_soft_cap) or not (logits_soft_cap == 0 or logits_soft_cap >= MIN_SOFT_CAP):
        raise ValueError(f"{op}: logits_soft_cap must be 0 (none) or a finite number >= 1e-6, got {logits_soft_cap}")
    if logits is not None:
        check_logits(op, logits, q, max_kv_len)
        if reference and addresses:  # the host sees the lengths (the kernel skips keys past max_kv_len)
            indptr, last = kv_indptr.cpu().long(), kv_last_page_len.cpu().long()
            pages = indptr[1:] - indptr[:-1]
            longest = int(torch.where(pages > 0, (pages - 1) * k_cache.shape[1] + last, 0).max()) if batch else 0
            if longest > max_kv_len:
                raise ValueError(f"{op}: a request holds {longest} keys, past max_kv_len ({max_kv_len}) of the logits")


def check_kv_select(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window, keep_first,
                    kernel_size):
    op = "kv_select"
    check_tensor(op, "scores", scores)
    if scores.dtype != torch.float32 or scores.dim() != 3 or not scores.is_contiguous() or \
            not 0 < scores.shape[1] <= 65535 or scores.shape[2] == 0:
        raise ValueError(f"{op}: scores must be a contiguous float32 tensor [num_pages, num_kv_heads, page_size], "
                         f"got {scores.dtype} {tuple(scores.shape)}")
    batch = check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, scores)
    check_index(op, "kept_indptr", kept_indptr, scores, batch + 1)
    if not 0 <= num_kept < 2**31:
        raise ValueError(f"{op}: num_kept must be in [0, 2^31), got {num_kept}")
    if not (0 <= window < 2**30 and 0 <= keep_first < 2**30):
        raise ValueError(f"{op}: window and keep_first must be in [0, 2^30), got {window} and {keep_first}")
    if not (1 <= kernel_size <= 63 and kernel_size % 2 == 1):  # each key's pooled score is re-read per pass
        raise ValueError(f"{op}: kernel_size must be an odd int in [1, 63], got {kernel_size}")


def check_kv_compact(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr, out_indices,
                     addresses=True, reference=False):
    op = "kv_compact"
    check_cache_view(op, "k_cache", k_cache, addresses, reference)
    check_same(op, "v_cache", v_cache, "k_cache", k_cache)
    check_cache_view(op, "v_cache", v_cache, addresses, reference)
    if scores is not None:
        check_scores(op, scores, k_cache)
    check_index(op, "kv_indptr", kv_indptr, k_cache)
    batch = kv_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError(f"{op}: kv_indptr must have batch_size + 1 entries")
    check_index(op, "kv_indices", kv_indices, k_cache)
    check_index(op, "kept_indptr", kept_indptr, k_cache, batch + 1)
    check_index(op, "out_indptr", out_indptr, k_cache, batch + 1)
    check_index(op, "out_indices", out_indices, k_cache)
    check_tensor(op, "kept", kept)
    if kept.dtype != torch.int32:
        raise TypeError(f"{op}: kept must be int32, got {kept.dtype}")
    if kept.dim() != 2 or kept.shape[1] != k_cache.shape[2] or not kept.is_contiguous() or kept.device != k_cache.device:
        raise ValueError(f"{op}: kept must be a contiguous int32 tensor [num_kept, num_kv_heads] on {k_cache.device}, "
                         f"got shape {tuple(kept.shape)}")


# ---- appending to a paged KV cache (csrc/torch/glue/page.h) ----

MAX_APPEND_VECTORS = 2**30  # nnz * num_kv_heads * head_dim / 8: the kernel's 32-bit thread index


def check_vector_rows(op, name, t, addresses=True):
    """Rows of 8-element vectors: 8-element aligned data (addresses: where it has an address), every stride
    but the last a multiple of 8."""
    check_last_dim_contiguous(op, name, t)
    nbytes = 8 * t.element_size()
    if (addresses and t.data_ptr() % nbytes) or any(t.shape[d] > 1 and t.stride(d) % 8 for d in range(t.dim() - 1)):
        raise ValueError(f"{op}: {name} must start on a {nbytes}-byte boundary and have strides that are multiples of "
                         f"8 elements, got strides {t.stride()}")


def check_kv_scale_number(op, name, value):
    """An fp8 cache's k_scale / v_scale (or any cache's, as a number): a number > 0 that is finite in float32
    (the kernels' scale), as a float. ValueError otherwise (0 would divide by zero, a negative flip signs)."""
    f = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:  # rounded to float32 in Python (no tensor: the wrappers' run() is traced by torch.compile)
            f = struct.unpack("f", struct.pack("f", float(value)))[0]
        except OverflowError:  # past float32's range: inf
            f = math.inf
    if not (math.isfinite(f) and f > 0):
        raise ValueError(f"{op}: {name} must be None or a finite number > 0 (in float32), or for an fp8 cache a "
                         f"float tensor of scales, got {value!r}")
    return float(value)


def check_kv_scale_values(op, name, t):
    """A tensor of fp8 scales: on the host (a CPU tensor) every element must be > 0 and finite in float32,
    else ValueError. A GPU tensor is not read (that would need a host synchronization): nan_where_bad
    turns a bad scale into NaN on the device, so what it touches (the rows of its head) comes out NaN."""
    if t.device.type != "cpu" or torch.compiler.is_compiling() or not t.numel():
        return
    f = t.detach().to(torch.float32)
    bad = ~(torch.isfinite(f) & (f > 0))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(f"{op}: {name} must hold numbers > 0 that are finite in float32, got "
                         f"{f.reshape(-1)[i].item()} at index {i}")


def nan_where_bad(scales):
    """A float32 tensor of fp8 scales (attention's and append_paged_kv_cache's) with every element that is not a
    positive finite number made NaN, on its device (one small elementwise op: no host sync, capturable,
    traceable): a bad scale gives NaN outputs or NaN codes, never plausible numbers (the kernels apply the
    scales as they get them)."""
    return torch.where(torch.isfinite(scales) & (scales > 0), scales, torch.full_like(scales, math.nan))


def _check_scale(op, name, t, value, cache):
    if t is not None:
        check_tensor(op, name, t)
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be a float32 tensor, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != cache.shape[2] or not t.is_contiguous() or t.device != cache.device:
            raise ValueError(f"{op}: {name} must be a contiguous tensor of shape ({cache.shape[2]},) ([num_kv_heads]) "
                             f"on {cache.device}, got shape {tuple(t.shape)} on {t.device}")
    f = torch.tensor(value, dtype=torch.float32).item()  # the kernel's scale: the value as float32
    if not (math.isfinite(f) and f > 0):
        raise ValueError(f"{op}: {name} must be a number > 0 that is finite in float32, got {value}")


def check_append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices,
                                kv_indptr, kv_last_page_len, k_scale, v_scale, k_scale_value, v_scale_value,
                                addresses=True):
    op = "append_paged_kv_cache"
    check_tensor(op, "append_key", append_key)
    if append_key.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: append_key must be float16 or bfloat16, got {append_key.dtype}")
    if append_key.dim() != 3:
        raise ValueError(f"{op}: append_key must be 3-D [nnz, num_kv_heads, head_dim], got shape "
                         f"{tuple(append_key.shape)}")
    check_same(op, "append_value", append_value, "append_key", append_key)
    nnz, kv_heads, head_dim = append_key.shape
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"{op}: head_dim must be a positive multiple of 8, got {head_dim}")
    check_tensor(op, "k_cache", k_cache)
    if k_cache.dtype != append_key.dtype and k_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: k_cache must have the dtype of append_key ({append_key.dtype}) or an fp8 dtype "
                        f"(float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz), got {k_cache.dtype}")
    if k_cache.dim() != 4 or k_cache.shape[2] != kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: k_cache must be 4-D [pages, page_size, num_kv_heads, head_dim] with append_key's "
                         f"num_kv_heads and head_dim ({kv_heads}, {head_dim}), got shape {tuple(k_cache.shape)}")
    if k_cache.device != append_key.device:
        raise ValueError(f"{op}: k_cache is on {k_cache.device} but append_key is on {append_key.device}")
    check_same(op, "v_cache", v_cache, "k_cache", k_cache)
    if not 0 < k_cache.shape[1] < 2**31:
        raise ValueError(f"{op}: k_cache must have a page_size in [1, 2^31), got shape {tuple(k_cache.shape)}")
    for name, t in (("append_key", append_key), ("append_value", append_value), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        check_vector_rows(op, name, t, addresses)
    if nnz * kv_heads * (head_dim // 8) > MAX_APPEND_VECTORS:
        raise ValueError(f"{op}: append_key has too many elements (nnz * num_kv_heads * head_dim must be at most "
                         f"2^33), got shape {tuple(append_key.shape)}")
    check_index(op, "batch_indices", batch_indices, append_key, nnz)
    check_index(op, "positions", positions, append_key, nnz)
    check_index(op, "kv_indptr", kv_indptr, append_key)
    batch = kv_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError(f"{op}: kv_indptr must have batch_size + 1 entries, got none")
    check_index(op, "kv_indices", kv_indices, append_key)
    check_index(op, "kv_last_page_len", kv_last_page_len, append_key, batch)
    if k_cache.dtype in FP8_DTYPES:
        _check_scale(op, "k_scale", k_scale, k_scale_value, k_cache)
        _check_scale(op, "v_scale", v_scale, v_scale_value, k_cache)
    elif k_scale is not None or v_scale is not None or k_scale_value != 1.0 or v_scale_value != 1.0:
        raise ValueError(f"{op}: k_scale and v_scale are for an fp8 cache; k_cache is {k_cache.dtype}")


def check_append_targets(op, batch_indices, positions, kv_indptr, kv_indices, num_pages, page_size):
    """What the kernel cannot check without the host reading device memory (it skips such a token): each
    token's request in [0, batch), its position >= 0 and within its request's pages, its page in
    [0, num_pages). A token of batch index -1 is padding (get_batch_indices_positions' entries past the
    batch): skipped by the kernel and the reference alike, not checked. Host tensors only (the CPU reference)."""
    real = batch_indices.long() != -1
    b, pos = batch_indices.long()[real], positions.long()[real]
    if not b.numel():
        return
    tokens = real.nonzero()[:, 0]  # the real tokens' indices, for the messages
    indptr, indices = kv_indptr.long(), kv_indices.long()
    batch = indptr.shape[0] - 1
    bad = (b < 0) | (b >= batch)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{op}: batch_indices must lie in [0, {batch}) (the requests of kv_indptr), got "
                         f"{int(b[i])} for token {int(tokens[i])}")
    if (pos < 0).any():
        i = int((pos < 0).nonzero()[0])
        raise ValueError(f"{op}: positions must be >= 0, got {int(pos[i])} for token {int(tokens[i])}")
    pages = indptr[b + 1] - indptr[b]
    past = pos // page_size >= pages
    if past.any():
        i = int(past.nonzero()[0])
        raise ValueError(f"{op}: token {int(tokens[i])}'s position {int(pos[i])} is past the pages of request "
                         f"{int(b[i])} ({max(int(pages[i]), 0)} pages of {page_size}); kv_indptr, kv_indices and "
                         f"kv_last_page_len must already hold the appended tokens")
    entry = indptr[b] + pos // page_size
    outside = (entry < 0) | (entry >= indices.shape[0])
    if outside.any():
        i = int(outside.nonzero()[0])
        raise ValueError(f"{op}: kv_indptr points past kv_indices ({indices.shape[0]} entries) for token "
                         f"{int(tokens[i])}")
    page = indices[entry]
    wrong = (page < 0) | (page >= num_pages)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        raise ValueError(f"{op}: kv_indices must name pages in [0, {num_pages}), got {int(page[i])} for token "
                         f"{int(tokens[i])}")
