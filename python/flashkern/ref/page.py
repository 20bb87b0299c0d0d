"""Reference of appending to a paged KV cache (torch.ops.flashkern.append_paged_kv_cache): the CPU
implementation and the test oracle, bit for bit what the kernel writes."""

import torch

from .._validate import FP8_DTYPES
from .attention import valid_scales


def quantize(x, dtype, scale=None, scale_value=1.0):
    """x [nnz, kv_heads, head_dim] as the cache stores it: the same bits for a 16-bit cache; for an fp8 one
    (x.float() / scale).clamp(-max, max).to(dtype), scale a float32 [kv_heads] tensor or scale_value
    rounded to float32 (saturating to the format's finite range, round to nearest even, NaN stays NaN). A
    tensor's scale that is not a positive finite number gives NaN codes, as the op gives the kernel
    (_validate.nan_where_bad)."""
    if dtype not in FP8_DTYPES:
        return x
    if scale is None:
        scale = torch.full((1,), scale_value, dtype=torch.float32, device=x.device)  # a tensor: a true division
    else:
        scale = torch.where(valid_scales(scale), scale.to(torch.float32), float("nan"))
    largest = torch.finfo(dtype).max
    return (x.float() / scale.reshape(-1, 1)).clamp(-largest, largest).to(dtype)


def _bits(t):
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                          kv_last_page_len=None, k_scale=None, v_scale=None, k_scale_value=1.0, v_scale_value=1.0):
    """Token i of append_key / append_value [nnz, kv_heads, head_dim] into the views k_cache / v_cache
    [pages, page_size, kv_heads, head_dim] (in place) at page kv_indices[kv_indptr[b] + p // page_size], slot
    p % page_size, b = batch_indices[i], p = positions[i]. kv_last_page_len is not read (the positions say
    where each token goes). A token of batch index -1 is padding (get_batch_indices_positions' entries past
    the batch): not written."""
    page_size = k_cache.shape[1]
    real = batch_indices.long() != -1
    if not bool(real.all()):
        append_key, append_value = append_key[real], append_value[real]
        batch_indices, positions = batch_indices[real], positions[real]
    b, pos = batch_indices.long(), positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    slot = pos % page_size
    for cache, x, scale, value in ((k_cache, append_key, k_scale, k_scale_value),
                                   (v_cache, append_value, v_scale, v_scale_value)):
        _bits(cache)[page, slot] = _bits(quantize(x, cache.dtype, scale, value))
