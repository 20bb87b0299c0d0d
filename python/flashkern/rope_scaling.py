"""Rotary frequencies for every base-frequency scaling a model config can name, value for value as
Hugging Face transformers computes them (its `rope_type`): default, linear, dynamic (NTK), yarn,
llama3 and longrope. All math in float32 like transformers, so the kernels see the same bits.

    inv_freq, attention_factor = rope_frequencies(head_dim=128, rope_theta=5e5,
                                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, ...})
    cache = cos_sin_cache(inv_freq, max_position=131072, attention_factor=attention_factor)
    q, k = flashkern.apply_rope_with_cos_sin_cache(positions, q, k, 128, cache)
"""

import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _base_inv_freq(base, dim, device=None):
    """1 / base^(2i / dim), i < dim / 2, in float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _yarn(base, dim, factor, p, original_max, device):
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in original_max
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def rope_frequencies(head_dim, rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=1.0,
                     max_position_embeddings=None, seq_len=None, device=None):
    """(inv_freq [rotary_dim / 2] float32, attention_factor) for a rope_type and its parameters.

    rope_scaling: None or a dict as in a Hugging Face config (`rope_type` or `type`, `factor`,
    `original_max_position_embeddings`, `low_freq_factor`, `high_freq_factor`, `beta_fast`,
    `beta_slow`, `mscale`, `mscale_all_dim`, `attention_factor`, `short_factor`, `long_factor`).
    seq_len: the current length, for dynamic (NTK) and longrope, which change with it.
    attention_factor multiplies cos and sin (yarn, longrope); it is 1 otherwise.
    """
    p = dict(rope_scaling or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {rope_type!r}")
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"the rotary dimension head_dim * partial_rotary_factor must be even and >= 2, got {dim}")
    base = float(p.get("rope_theta", rope_theta))
    factor = p.get("factor")
    original_max = p.get("original_max_position_embeddings") or max_position_embeddings

    if rope_type == "default":
        return _base_inv_freq(base, dim, device), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim, device) / factor, 1.0
    if rope_type == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("rope_type 'dynamic' needs max_position_embeddings")
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim, device), 1.0
    if original_max is None:
        raise ValueError(f"rope_type {rope_type!r} needs original_max_position_embeddings")
    if factor is None:
        factor = max_position_embeddings / original_max
    if rope_type == "yarn":
        return _yarn(base, dim, factor, p, original_max, device)
    if rope_type == "longrope":
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        ext = p["long_factor"] if seq_len and seq_len > original_max else p["short_factor"]
        ext = torch.tensor(ext, dtype=torch.float32, device=device)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (ext * base**exponent), attention_factor
    # llama3: low frequencies (long wavelengths) divided by factor, high ones kept, a smooth ramp between
    inv_freq = _base_inv_freq(base, dim, device)
    low_ff, high_ff = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    low_freq_wavelen, high_freq_wavelen = original_max / low_ff, original_max / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def rope_frequencies_from_config(config, seq_len=None, device=None):
    """rope_frequencies() for a Hugging Face config object (rope_parameters or rope_scaling, rope_theta,
    head_dim or hidden_size / num_attention_heads, partial_rotary_factor, max_position_embeddings)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    partial = params.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", 1.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rope_frequencies(head_dim, theta, params, partial, getattr(config, "max_position_embeddings", None),
                            seq_len, device)


def cos_sin_cache(inv_freq, max_position, attention_factor=1.0):
    """[max_position, rotary_dim] float32: cos of every position's angles, then sin, times attention_factor."""
    angle = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :].float()
    return torch.cat([angle.cos(), angle.sin()], dim=-1) * attention_factor


def theta_inv_freq(rotary_dim, rope_theta=1e4, rope_scale=1.0, llama31=None, device=None):
    """FlashInfer's parametrization: inv_freq of rope_theta with positions divided by rope_scale, and for
    llama31 = (low_freq_factor, high_freq_factor, old_context_len) Llama 3.1's smoothing."""
    if llama31 is None:
        return _base_inv_freq(float(rope_theta), rotary_dim, device) / rope_scale
    low, high, old = llama31
    params = {"rope_type": "llama3", "factor": rope_scale, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": old}
    return rope_frequencies(rotary_dim, rope_theta, params, device=device)[0]
