"""Appending to a paged KV cache: FlashInfer's ``flashinfer.page`` functions.

- :func:`append_paged_kv_cache` writes new tokens' keys and values into their slots of a paged cache, in
  place: token ``i`` goes to position ``positions[i]`` of request ``batch_indices[i]``, i.e. page
  ``kv_indices[kv_indptr[b] + positions[i] // page_size]``, slot ``positions[i] % page_size``. The page
  table must already hold the appended tokens (as FlashInfer's). A float16 / bfloat16 cache (the dtype of
  the keys) gets the values as they are; an fp8 cache (``float8_e4m3fn``, ``float8_e5m2``, and AMD's
  ``float8_e4m3fnuz``, ``float8_e5m2fnuz``) gets ``(x.float() / scale).clamp(-max, max).to(fp8)``: saturated
  to the format's largest finite value (never inf), rounded to nearest even, NaN kept NaN.
- :func:`get_batch_indices_positions` turns a ragged batch (``append_indptr``) and the requests' lengths
  after the append into those batch indices and positions.

Neither reads device memory on the host: both can be captured in a CUDA graph. A token of batch index -1 is
padding (what :func:`get_batch_indices_positions` returns past the batch): written nowhere, on every backend.
A GPU cannot check a token's request, position or page without that read, so the kernel writes nothing for a
token whose batch index is outside the batch, whose position is negative or past its request's pages, or
whose page is outside the cache; the CPU implementation raises ValueError for such a token (padding aside).
A scale tensor is checked on the host where it is on the CPU (ValueError for a scale that is not a number
> 0 finite in float32); on a GPU it is not read there, and a head whose scale is bad gets NaN codes.
fp8 keys and values (a cache of their dtype) are copied as they are, as FlashInfer's callers fill an fp8
cache; no scale applies to them. Two tokens that name the same slot (a
repeated position, or a page shared through ``kv_indices``) race on a GPU, 16 bytes at a time, so the slot may
end up holding parts of both: give each slot one token per call.
"""

import numbers

import torch

from . import _backend, _validate, ref
from ._paged_attention import check_kv_layout, kv_cache_views
from ._validate import FP8_DTYPES, check_kv_scale_values, check_tensor, nan_where_bad

_ops = torch.ops.flashkern
INDEX_DTYPES = (torch.int32, torch.int64)


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None, positions=None):
    """Batch indices and positions of a ragged batch's entries, for :func:`append_paged_kv_cache`.

    ``append_indptr`` ``[batch_size + 1]``: request b's entries are ``append_indptr[b] ..
    append_indptr[b + 1]`` (non-decreasing from 0); ``seq_lens`` ``[batch_size]``: each request's length in
    the KV cache, the appended entries included (at least their count), so that entry ``i`` of request b
    sits at position ``seq_lens[b] - (append_indptr[b + 1] - i)``. Returns ``(batch_indices, positions)``,
    int32 ``[nnz]`` on append_indptr's device, written into ``batch_indices`` / ``positions`` where given
    (FlashInfer's outputs: int32 ``[nnz]`` on that device); entries at or past ``append_indptr[-1]`` are
    padding: batch index -1 and position 0, as FlashInfer's, which append_paged_kv_cache skips. No host
    synchronization: the table's values are checked where it is on the CPU (ValueError), not on a GPU
    (there a short seq_lens gives negative positions, which the kernel skips)."""
    op = "get_batch_indices_positions"
    for name, t in (("append_indptr", append_indptr), ("seq_lens", seq_lens)):
        check_tensor(op, name, t)
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    if append_indptr.dim() != 1 or append_indptr.shape[0] < 1:
        raise ValueError(f"{op}: append_indptr must be 1-D with batch_size + 1 entries, got shape "
                         f"{tuple(append_indptr.shape)}")
    batch = append_indptr.shape[0] - 1
    if seq_lens.shape != (batch,):
        raise ValueError(f"{op}: seq_lens must have shape ({batch},) (one length per request), got "
                         f"{tuple(seq_lens.shape)}")
    if seq_lens.device != append_indptr.device:
        raise ValueError(f"{op}: seq_lens is on {seq_lens.device} but append_indptr is on {append_indptr.device}")
    if isinstance(nnz, bool) or not isinstance(nnz, numbers.Integral) or nnz < 0:
        raise ValueError(f"{op}: nnz must be an int >= 0, got {nnz!r}")
    device = append_indptr.device
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        if t is not None:
            check_tensor(op, name, t)
            if t.dtype != torch.int32 or tuple(t.shape) != (int(nnz),) or t.device != device:
                raise ValueError(f"{op}: {name} must be an int32 tensor of shape ({int(nnz)},) on {device}, got "
                                 f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if device.type == "cpu" and not torch.compiler.is_compiling():  # the host sees the values: check them
        indptr, lens = append_indptr.long(), seq_lens.long()
        counts = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or bool((counts < 0).any()):
            raise ValueError(f"{op}: append_indptr must start at 0 and be non-decreasing, got {indptr.tolist()}")
        if bool((lens < counts).any()):
            b = int((lens < counts).nonzero()[0])
            raise ValueError(f"{op}: seq_lens[{b}] = {int(lens[b])} is shorter than the {int(counts[b])} entries "
                             f"request {b} appends (seq_lens are the lengths after the append)")
    if batch == 0:
        b = torch.full((int(nnz),), -1, dtype=torch.int32, device=device)
        pos = torch.zeros((int(nnz),), dtype=torch.int32, device=device)
    else:
        ends = append_indptr[1:].contiguous()
        i = torch.arange(int(nnz), dtype=ends.dtype, device=device)
        b = torch.searchsorted(ends, i, right=True)  # the requests that end at or before entry i: its request
        inside = b < batch
        b_in = b.clamp(max=batch - 1)
        pos = i.long() + seq_lens.long()[b_in] - ends.long()[b_in]
        b, pos = torch.where(inside, b, -1).int(), torch.where(inside, pos, 0).int()
    if batch_indices is None and positions is None:
        return b, pos
    if batch_indices is not None:
        batch_indices.copy_(b)
    if positions is not None:
        positions.copy_(pos)
    return (b if batch_indices is None else batch_indices), (pos if positions is None else positions)


def _index(op, name, t):
    """An index tensor as the op takes it: int32 (an int64 one converted on its device, as FlashInfer's)."""
    check_tensor(op, name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    return t.int()


def _scale(op, name, scale, cache):
    """(tensor or None, value) for the op from None, a number or a float32 [num_kv_heads] tensor."""
    if scale is None:
        return None, 1.0
    if cache.dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: k_scale and v_scale are for an fp8 cache; k_cache is {cache.dtype}")
    if isinstance(scale, torch.Tensor):
        check_tensor(op, name, scale)
        check_kv_scale_values(op, name, scale)
        if scale.dtype == torch.float32 and scale.is_contiguous():  # else the op refuses it as it is
            scale = nan_where_bad(scale)
        return scale, 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{op}: {name} must be None, a float or a float32 tensor [num_kv_heads], got "
                        f"{type(scale).__name__}")
    return None, float(scale)


def _fp8_codes(op, append_key, append_value, k_cache, v_cache, k_scale, v_scale):
    """fp8 keys and values into a cache of their dtype: the codes copied as they are, through the 16-bit copy
    (every tensor viewed as float16 words of two codes, no copy): the same checks, the same kernel."""
    check_tensor(op, "append_value", append_value)
    if {k_cache.dtype, v_cache.dtype, append_value.dtype} != {append_key.dtype}:
        raise TypeError(f"{op}: fp8 keys and values are copied into a cache of their own dtype; got append_key "
                        f"{append_key.dtype}, append_value {append_value.dtype}, k_cache {k_cache.dtype} and "
                        f"v_cache {v_cache.dtype} (16-bit keys and values are quantized into an fp8 cache)")
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"{op}: k_scale and v_scale quantize float16 / bfloat16 keys and values; fp8 ones are "
                         f"copied as they are (give no scale)")
    if append_key.dim() != 3 or append_key.shape[-1] % 16:
        raise ValueError(f"{op}: fp8 append_key must be 3-D [nnz, num_kv_heads, head_dim] with head_dim a multiple "
                         f"of 16, got shape {tuple(append_key.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):  # before the views halve it
        if cache.dim() != 4 or cache.shape[-1] != append_key.shape[-1]:
            raise ValueError(f"{op}: {name} must be 4-D with head_dim {append_key.shape[-1]} (append_key's), got "
                             f"shape {tuple(cache.shape)}")
    views = []
    for name, t in (("append_key", append_key), ("append_value", append_value), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        try:
            views.append(t.view(torch.float16))
        except RuntimeError:
            raise ValueError(f"{op}: {name} must have its last dimension contiguous and even strides (the codes "
                             f"move two at a time), got strides {t.stride()}") from None
    return views


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout="NHD", *, k_scale=None, v_scale=None):
    """Append a batch of keys and values to a paged KV cache, in place (see the module docstring).

    ``append_key``, ``append_value``: ``[nnz, num_kv_heads, head_dim]`` float16 or bfloat16 (head_dim a
    multiple of 8, the last dimension contiguous), or fp8 codes for a cache of their dtype (copied as they
    are, no scale; head_dim a multiple of 16). ``batch_indices``, ``positions``: ``[nnz]`` (int32, or
    int64 converted). ``paged_kv_cache``: ``[pages, 2, page_size, num_kv_heads, head_dim]`` (NHD) or
    ``[pages, 2, num_kv_heads, page_size, head_dim]`` (HND), or a ``(k_cache, v_cache)`` pair of 4-D
    tensors in that layout; float16 / bfloat16 as the keys, or fp8. ``kv_indices``, ``kv_indptr``,
    ``kv_last_page_len``: the page table, already holding the appended tokens. ``k_scale``, ``v_scale``
    (fp8 caches only): None (1.0), a float, or a float32 tensor ``[num_kv_heads]`` on the cache's device
    (read on the device): the cache holds ``x / scale``. Returns None."""
    op = "append_paged_kv_cache"
    check_kv_layout(op, kv_layout)
    k_cache, v_cache = kv_cache_views(op, paged_kv_cache, kv_layout)
    batch_indices, positions = _index(op, "batch_indices", batch_indices), _index(op, "positions", positions)
    kv_indices, kv_indptr = _index(op, "kv_indices", kv_indices), _index(op, "kv_indptr", kv_indptr)
    kv_last_page_len = _index(op, "kv_last_page_len", kv_last_page_len)
    if isinstance(append_key, torch.Tensor) and append_key.dtype in FP8_DTYPES:
        append_key, append_value, k_cache, v_cache = _fp8_codes(op, append_key, append_value, k_cache, v_cache,
                                                                k_scale, v_scale)
        k_scale = v_scale = None
    k_tensor, k_value = _scale(op, "k_scale", k_scale, k_cache)
    v_tensor, v_value = _scale(op, "v_scale", v_scale, k_cache)
    args = (append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
            kv_last_page_len, k_tensor, v_tensor, k_value, v_value)
    if _backend.use_reference(k_cache.device):  # GPU tensors without kernels
        _append_paged_kv_cache_cpu(*args)
    else:
        _ops.append_paged_kv_cache(*args)


# ---- CPU implementation and fake function of the op ----


@_backend.register_cpu("append_paged_kv_cache")
def _append_paged_kv_cache_cpu(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices,
                               kv_indptr, kv_last_page_len, k_scale=None, v_scale=None, k_scale_value=1.0,
                               v_scale_value=1.0):
    _validate.check_append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                                          kv_indices, kv_indptr, kv_last_page_len, k_scale, v_scale, k_scale_value,
                                          v_scale_value)
    _validate.check_append_targets("append_paged_kv_cache", batch_indices.cpu(), positions.cpu(), kv_indptr.cpu(),
                                   kv_indices.cpu(), k_cache.shape[0], k_cache.shape[1])
    ref.page.append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices,
                                   kv_indptr, kv_last_page_len, k_scale, v_scale, k_scale_value, v_scale_value)


@torch.library.register_fake("flashkern::append_paged_kv_cache")
def _append_paged_kv_cache_fake(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices,
                                kv_indptr, kv_last_page_len, k_scale=None, v_scale=None, k_scale_value=1.0,
                                v_scale_value=1.0):
    _validate.check_append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                                          kv_indices, kv_indptr, kv_last_page_len, k_scale, v_scale, k_scale_value,
                                          v_scale_value, addresses=False)


__all__ = ["append_paged_kv_cache", "get_batch_indices_positions"]
