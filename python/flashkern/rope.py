"""Rotary position embedding: FlashInfer's apply_rope* family and the vLLM/SGLang cos-sin-cache op.

One op, torch.ops.flashkern.rope (and rope_ in place), serves all of them: it takes per-token
positions and a float32 frequency table, either inv_freq [rotary_dim / 2] (cos and sin computed in
the kernel from float32(position) * inv_freq) or a cos_sin_cache [max_position, rotary_dim].
Order in this file: public functions, CPU reference registration, fake functions, autograd.
"""

import torch

from . import _backend, ref
from ._validate import check_rope, check_tensor
from .rope_scaling import theta_inv_freq

_ops = torch.ops.flashkern
_inv_freq_cache = {}


def check_backend(op, backend):
    """FlashInfer's backend (which of its implementations runs): accepted, as flashkern has one."""
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend must be a str, got {backend!r}")


def _inv_freq(op, head_dim, rotary_dim, rope_theta, rope_scale, llama31, device):
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{op}: rotary_dim must be an even integer in [2, head_dim={head_dim}], got {rotary_dim!r}")
    if not rope_scale > 0 or not rope_theta > 0:
        raise ValueError(f"{op}: rope_scale and rope_theta must be positive, got {rope_scale!r} and {rope_theta!r}")
    # Computed on the CPU, then moved: torch's float32 pow differs by an ulp between devices, and at
    # position 40K one ulp of a frequency turns the angle by 5e-3 rad (seen on an H200)
    key = (rotary_dim, float(rope_theta), float(rope_scale), llama31, str(device))
    if torch.compiler.is_compiling():  # traced into the graph instead of cached
        return theta_inv_freq(rotary_dim, rope_theta, rope_scale, llama31).to(device)
    if key not in _inv_freq_cache:
        _inv_freq_cache[key] = theta_inv_freq(rotary_dim, rope_theta, rope_scale, llama31).to(device)
    return _inv_freq_cache[key]


def _positions(op, q, indptr, offsets):
    """Position of every token of a ragged batch: offsets[b] + (token - indptr[b]), on the device, no sync."""
    for name, t in (("indptr", indptr), ("offsets", offsets)):
        check_tensor(op, name, t)
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{op}: {name} must be a 1-D int32 or int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if indptr.shape[0] != offsets.shape[0] + 1:
        raise ValueError(f"{op}: indptr must have batch + 1 = {offsets.shape[0] + 1} entries, got {indptr.shape[0]}")
    if offsets.shape[0] == 0 and q.shape[0] > 0:
        raise ValueError(f"{op}: {q.shape[0]} tokens but no request (offsets is empty)")
    # The contract, checked where it needs no device synchronization (CPU tensors), not on a GPU:
    # indptr[0] == 0, indptr is non-decreasing and indptr[-1] == tokens.
    if indptr.device.type == "cpu" and not torch.compiler.is_compiling():
        steps = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or int(indptr[-1]) != q.shape[0] or bool((steps < 0).any()):
            raise ValueError(f"{op}: indptr must start at 0, never decrease and end at the {q.shape[0]} tokens of q, "
                             f"got {indptr.tolist() if indptr.numel() <= 16 else 'a table that does not'}")
    token = torch.arange(q.shape[0], device=q.device, dtype=indptr.dtype)
    # b = #{indptr[1:] <= token}, as the whole indptr: Inductor (torch 2.11) cannot lower a sliced boundary tensor
    batch = (torch.searchsorted(indptr, token, right=True) - 1).clamp_(0, max(offsets.shape[0] - 1, 0))
    return offsets.to(torch.int64)[batch] + (token - indptr[batch]).to(torch.int64)


def _rope(op, q, k, positions, freqs, interleave, inplace):
    check_tensor(op, "q", q)
    if _backend.use_reference(q.device):
        check_rope(op, q, k, positions, freqs, reference=True, check_positions=True)
        q_out, k_out = ref.rope(q, k, positions, freqs, interleave)
        if inplace:
            q.copy_(q_out)
            k.copy_(k_out)
            return None
        return q_out, k_out
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise RuntimeError(f"{op}(): in-place RoPE does not support automatic differentiation; use the out-of-place op")
        _ops.rope_(q, k, positions, freqs, interleave)
        return None
    return _ops.rope(q, k, positions, freqs, interleave, False)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4,
                       backend="cuda"):
    """RoPE of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] at positions pos_ids [tokens]
    (int32 or int64): pairs (i, i + rotary_dim/2) (NeoX) or, with interleave, (2i, 2i+1) (GPT-J) turn by
    float32(pos / rope_scale) * rope_theta^(-2i/rotary_dim); dimensions past rotary_dim are copied.
    Returns (q_rope, k_rope); differentiable in q and k."""
    check_backend("apply_rope_pos_ids", backend)
    inv_freq = _inv_freq("apply_rope_pos_ids", q.shape[-1], rotary_dim, rope_theta, rope_scale, None, q.device)
    return _rope("apply_rope_pos_ids", q, k, pos_ids, inv_freq, interleave, inplace=False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                               rope_theta=1e4, backend="cuda"):
    """apply_rope_pos_ids, writing q and k in place."""
    check_backend("apply_rope_pos_ids_inplace", backend)
    inv_freq = _inv_freq("apply_rope_pos_ids_inplace", q.shape[-1], rotary_dim, rope_theta, rope_scale, None, q.device)
    _rope("apply_rope_pos_ids_inplace", q, k, pos_ids, inv_freq, interleave, inplace=True)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4,
               backend="cuda"):
    """apply_rope_pos_ids for a ragged batch: request b owns tokens indptr[b]:indptr[b+1], at positions
    offsets[b], offsets[b] + 1, ..."""
    check_backend("apply_rope", backend)
    positions = _positions("apply_rope", q, indptr, offsets)
    return apply_rope_pos_ids(q, k, positions, rotary_dim, interleave, rope_scale, rope_theta)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4, backend="cuda"):
    """apply_rope, writing q and k in place."""
    check_backend("apply_rope_inplace", backend)
    positions = _positions("apply_rope_inplace", q, indptr, offsets)
    apply_rope_pos_ids_inplace(q, k, positions, rotary_dim, interleave, rope_scale, rope_theta)


def _llama31(op, q, rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len):
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"{op}: high_freq_factor must exceed low_freq_factor, got {high_freq_factor} <= {low_freq_factor}")
    params = (float(low_freq_factor), float(high_freq_factor), float(old_context_len))
    return _inv_freq(op, q.shape[-1], rotary_dim, rope_theta, rope_scale, params, q.device)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0, rope_theta=5e5,
                               low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192, backend="cuda"):
    """apply_rope_pos_ids with Llama 3.1's frequencies: long wavelengths divided by rope_scale, short ones
    kept, a smooth ramp between (Hugging Face's rope_type "llama3")."""
    check_backend("apply_llama31_rope_pos_ids", backend)
    inv_freq = _llama31("apply_llama31_rope_pos_ids", q, rotary_dim, rope_scale, rope_theta, low_freq_factor,
                        high_freq_factor, old_context_len)
    return _rope("apply_llama31_rope_pos_ids", q, k, pos_ids, inv_freq, interleave, inplace=False)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0,
                                       rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                                       old_context_len=8192, backend="cuda"):
    """apply_llama31_rope_pos_ids, writing q and k in place."""
    check_backend("apply_llama31_rope_pos_ids_inplace", backend)
    inv_freq = _llama31("apply_llama31_rope_pos_ids_inplace", q, rotary_dim, rope_scale, rope_theta, low_freq_factor,
                        high_freq_factor, old_context_len)
    _rope("apply_llama31_rope_pos_ids_inplace", q, k, pos_ids, inv_freq, interleave, inplace=True)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0, rope_theta=5e5,
                       low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192, backend="cuda"):
    """apply_llama31_rope_pos_ids for a ragged batch (see apply_rope)."""
    check_backend("apply_llama31_rope", backend)
    positions = _positions("apply_llama31_rope", q, indptr, offsets)
    return apply_llama31_rope_pos_ids(q, k, positions, rotary_dim, interleave, rope_scale, rope_theta,
                                      low_freq_factor, high_freq_factor, old_context_len)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0,
                               rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                               old_context_len=8192, backend="cuda"):
    """apply_llama31_rope, writing q and k in place."""
    check_backend("apply_llama31_rope_inplace", backend)
    positions = _positions("apply_llama31_rope_inplace", q, indptr, offsets)
    apply_llama31_rope_pos_ids_inplace(q, k, positions, rotary_dim, interleave, rope_scale, rope_theta,
                                       low_freq_factor, high_freq_factor, old_context_len)


def _as_heads(op, name, t, head_size):
    check_tensor(op, name, t)
    if t.dim() == 2 and head_size > 0 and t.shape[1] % head_size == 0:
        return t.view(t.shape[0], t.shape[1] // head_size, head_size)
    if t.dim() == 3 and t.shape[2] == head_size:
        return t
    raise ValueError(
        f"{op}: {name} must be [tokens, heads * {head_size}] or [tokens, heads, {head_size}], got shape {tuple(t.shape)}"
    )


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True, backend="cuda"):
    """vLLM/SGLang's rotary embedding: query [tokens, q_heads * head_size] (or 3-D), key likewise,
    cos_sin_cache [max_position, rotary_dim] float32 holding cos then sin. Returns (query, key) rotated,
    in their input shapes. is_neox=False rotates interleaved pairs (GPT-J)."""
    check_backend("apply_rope_with_cos_sin_cache", backend)
    op = "apply_rope_with_cos_sin_cache"
    q, k = _as_heads(op, "query", query, head_size), _as_heads(op, "key", key, head_size)
    q_out, k_out = _rope(op, q, k, positions, cos_sin_cache, not is_neox, inplace=False)
    return q_out.view(query.shape), k_out.view(key.shape)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                          backend="cuda"):
    """apply_rope_with_cos_sin_cache, writing query and key in place."""
    check_backend("apply_rope_with_cos_sin_cache_inplace", backend)
    op = "apply_rope_with_cos_sin_cache_inplace"
    q, k = _as_heads(op, "query", query, head_size), _as_heads(op, "key", key, head_size)
    _rope(op, q, k, positions, cos_sin_cache, not is_neox, inplace=True)


def rope_with_table(q, k, positions, freqs, interleave=False):
    """(q, k) rotated at `positions` by a frequency table: inv_freq [rotary_dim / 2] or a cos_sin_cache
    [rows, rotary_dim] (cos then sin, float32). Differentiable in q and k."""
    return _rope("rope", q, k, positions, freqs, interleave, inplace=False)


# ---- CPU: the reference, with the same checks as the kernels ----


@_backend.register_cpu("rope")
def _rope_cpu(q, k, positions, freqs, interleave, inverse):
    check_rope("rope", q, k, positions, freqs, reference=True, check_positions=True)
    q_out, k_out = ref.rope(q, k, positions, freqs, interleave, inverse)
    return q_out.contiguous(), k_out.contiguous()


@_backend.register_cpu("rope_")
def _rope_inplace_cpu(q, k, positions, freqs, interleave):
    check_rope("rope", q, k, positions, freqs, reference=True, check_positions=True)
    q_out, k_out = ref.rope(q, k, positions, freqs, interleave)
    q.copy_(q_out)
    k.copy_(k_out)


# ---- fake functions ----


@torch.library.register_fake("flashkern::rope")
def _rope_fake(q, k, positions, freqs, interleave, inverse):
    check_rope("rope", q, k, positions, freqs, reference=q.device.type == "cpu")
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("flashkern::rope_")
def _rope_inplace_fake(q, k, positions, freqs, interleave):
    check_rope("rope", q, k, positions, freqs, reference=q.device.type == "cpu")


# ---- autograd: the backward of a rotation is the inverse rotation ----


def _setup_context(ctx, inputs, output):
    _, _, positions, freqs, interleave, inverse = inputs
    ctx.save_for_backward(positions, freqs)
    ctx.interleave, ctx.inverse = interleave, inverse


def _contiguous_last(t):
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _backward(ctx, grad_q, grad_k):
    positions, freqs = ctx.saved_tensors
    grad_q, grad_k = _contiguous_last(grad_q), _contiguous_last(grad_k)
    dq, dk = _ops.rope(grad_q, grad_k, positions, freqs, ctx.interleave, not ctx.inverse)
    return dq, dk, None, None, None, None


torch.library.register_autograd("flashkern::rope", _backward, setup_context=_setup_context)
