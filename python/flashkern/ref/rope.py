import torch

from ._compute import compute_dtype


def cos_sin(positions, freqs):
    """cos and sin [tokens, rotary_dim / 2] of every token's angles, in float64.

    freqs is inv_freq [rotary_dim / 2] (angle = float32(position) * inv_freq, rounded to float32 as
    the kernels and Hugging Face models compute it) or a cos_sin_cache [positions, rotary_dim]
    holding cos in its first half and sin in its second.
    """
    if freqs.dim() == 1:
        angle = (positions.to(torch.float32)[:, None] * freqs.to(torch.float32)[None, :]).double()
        return angle.cos(), angle.sin()
    rows = freqs.double()[positions.long()]
    half = freqs.shape[1] // 2
    return rows[:, :half], rows[:, half:]


def _rotate(x, cos, sin, interleave):
    """Rotate the first 2 * cos.shape[-1] dimensions of x [tokens, heads, head_dim]."""
    rot = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.clone()
    if interleave:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        out[..., : rot // 2], out[..., rot // 2 : rot] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def rope(q, k, positions, freqs, interleave=False, inverse=False):
    """(q, k) with rotary position embedding applied; math in float32 (float64 for float64 input),
    rounded once to the input dtype. inverse rotates by the negative angle (the backward)."""
    cos, sin = cos_sin(positions, freqs)
    c = compute_dtype(q)
    cos, sin = cos.to(c), (-sin if inverse else sin).to(c)
    return tuple(_rotate(t.to(c), cos, sin, interleave).to(t.dtype) for t in (q, k))
