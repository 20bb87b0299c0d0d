"""RoPE ops against a float64 reference written from the formulas, and against transformers'
own rotary functions and frequency computations when transformers is installed."""

import math

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_close, rand

import flashkern
from flashkern import ref
from flashkern.rope_scaling import cos_sin_cache, rope_frequencies, theta_inv_freq


def qk(tokens, q_heads, k_heads, head_dim, dtype, device, seed=0):
    return rand((tokens, q_heads, head_dim), dtype, device, seed=seed), rand((tokens, k_heads, head_dim), dtype, device, seed=seed + 1)


def rotate_formula(x, positions, inv_freq, rotary_dim, interleave, inverse=False):
    """The textbook rotation in float64, angles float32(position) * inv_freq rounded to float32."""
    x = x.double().cpu()
    angle = (positions.cpu().float()[:, None] * inv_freq.cpu().float()[None, :]).double()
    if inverse:
        angle = -angle
    out = x.clone()
    for i in range(rotary_dim // 2):
        a, b = (2 * i, 2 * i + 1) if interleave else (i, i + rotary_dim // 2)
        c, s = angle[:, i].cos()[:, None], angle[:, i].sin()[:, None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize(
    "head_dim,rotary_dim", [(64, 64), (128, 128), (128, 64), (256, 256), (80, 80), (128, 96), (72, 68), (10, 6)]
)  # (72, 68), (10, 6): not multiples of the vector width, the scalar path on a GPU
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_pos_ids(device, tokens, head_dim, rotary_dim, interleave, dtype):
    q, k = qk(tokens, 5, 2, head_dim, dtype, device)
    pos = torch.randint(0, 40000, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    q_out, k_out = flashkern.apply_rope_pos_ids(q, k, pos, rotary_dim=rotary_dim, interleave=interleave, rope_theta=5e5)
    inv_freq = theta_inv_freq(rotary_dim, 5e5)
    assert_close(q_out, rotate_formula(q, pos, inv_freq, rotary_dim, interleave), dtype)
    assert_close(k_out, rotate_formula(k, pos, inv_freq, rotary_dim, interleave), dtype)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])  # partial rotary: the rest is copied


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_inplace_matches_out_of_place(device, dtype, pos_dtype):
    q, k = qk(37, 8, 2, 128, dtype, device, seed=3)
    pos = torch.arange(100, 137, dtype=pos_dtype, device=device)
    q_out, k_out = flashkern.apply_rope_pos_ids(q, k, pos, rope_scale=4.0)
    flashkern.apply_rope_pos_ids_inplace(q, k, pos, rope_scale=4.0)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_apply_rope_ragged_batch(device, dtype):
    indptr = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32, device=device)  # a request with no token too
    offsets = torch.tensor([5, 0, 100, 7], dtype=torch.int32, device=device)
    q, k = qk(11, 4, 4, 64, dtype, device, seed=4)
    positions = torch.tensor([5, 6, 7, 100, 101, 102, 103, 104, 105, 106, 7], device=device)
    expected = flashkern.apply_rope_pos_ids(q, k, positions, rope_theta=1e4, rope_scale=2.0)
    got = flashkern.apply_rope(q, k, indptr, offsets, rope_theta=1e4, rope_scale=2.0)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    flashkern.apply_rope_inplace(q, k, indptr, offsets, rope_theta=1e4, rope_scale=2.0)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


@pytest.mark.parametrize("interleave", [False, True])
def test_llama31_rope(device, interleave):
    q, k = qk(37, 4, 2, 128, torch.bfloat16, device, seed=5)
    pos = torch.arange(0, 37 * 3000, 3000, device=device)  # up to 108K: past the original 8K context
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    inv_freq, _ = rope_frequencies(128, 5e5, params)
    q_out, k_out = flashkern.apply_llama31_rope_pos_ids(q, k, pos, interleave=interleave)
    assert_close(q_out, rotate_formula(q, pos, inv_freq, 128, interleave), torch.bfloat16)
    indptr, offsets = torch.tensor([0, 37], device=device), torch.tensor([0], device=device)
    q2, k2 = flashkern.apply_llama31_rope(q, k, indptr, offsets * 0, interleave=interleave)
    assert_close(q2, rotate_formula(q, torch.arange(37), inv_freq, 128, interleave), torch.bfloat16)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_with_cos_sin_cache(device, is_neox, dtype):
    head_size, rotary_dim = 128, 64
    inv_freq, scale = rope_frequencies(head_size, 1e6, {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 4096},
                                       partial_rotary_factor=0.5)
    cache = cos_sin_cache(inv_freq, 20000, scale).to(device)
    query = rand((37, 8 * head_size), dtype, device, seed=6)
    key = rand((37, 2 * head_size), dtype, device, seed=7)
    positions = torch.randint(0, 20000, (37,), generator=torch.Generator().manual_seed(8)).to(device)
    q_out, k_out = flashkern.apply_rope_with_cos_sin_cache(positions, query, key, head_size, cache, is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    c = cache.double().cpu()[positions.cpu()]
    cos, sin = c[:, : rotary_dim // 2], c[:, rotary_dim // 2 :]
    for x, out, heads in ((query, q_out, 8), (key, k_out, 2)):
        x3 = x.view(37, heads, head_size).double().cpu()
        expected = x3.clone()
        for i in range(rotary_dim // 2):
            a, b = (2 * i, 2 * i + 1) if not is_neox else (i, i + rotary_dim // 2)
            expected[..., a] = x3[..., a] * cos[:, i, None] - x3[..., b] * sin[:, i, None]
            expected[..., b] = x3[..., b] * cos[:, i, None] + x3[..., a] * sin[:, i, None]
        assert_close(out.view(37, heads, head_size), expected, dtype)
    flashkern.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cache, is_neox)
    assert torch.equal(query, q_out) and torch.equal(key, k_out)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_strided_heads(device, interleave):
    """q and k as views of a fused qkv buffer: token stride wider than heads * head_dim."""
    qkv = rand((37, (8 + 2 + 2) * 64), torch.bfloat16, device, seed=9)
    q = qkv[:, : 8 * 64].view(37, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(37, 2, 64)
    pos = torch.arange(37, device=device) * 7
    q_out, k_out = flashkern.apply_rope_pos_ids(q, k, pos, interleave=interleave)
    inv_freq = theta_inv_freq(64, 1e4)
    assert_close(q_out, rotate_formula(q, pos, inv_freq, 64, interleave))
    untouched = qkv[:, 10 * 64 :].clone()
    flashkern.apply_rope_pos_ids_inplace(q, k, pos, interleave=interleave)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)
    assert torch.equal(qkv[:, 10 * 64 :], untouched), "v must not be touched"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_misaligned_views(device, interleave, dtype):
    """q and k starting one element into a buffer: not 16-byte aligned, the scalar path on a GPU."""
    flat = rand((1 + 37 * 12 * 64,), dtype, device, seed=15)
    qkv = flat[1:].view(37, 12 * 64)
    q, k = qkv[:, : 8 * 64].view(37, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(37, 2, 64)
    pos = torch.arange(37, device=device) * 11
    inv_freq = theta_inv_freq(64, 1e4)
    q_out, k_out = flashkern.apply_rope_pos_ids(q, k, pos, interleave=interleave)
    assert_close(q_out, rotate_formula(q, pos, inv_freq, 64, interleave), dtype)
    assert_close(k_out, rotate_formula(k, pos, inv_freq, 64, interleave), dtype)
    flashkern.apply_rope_pos_ids_inplace(q, k, pos, interleave=interleave)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("cache", [False, True])
def test_rope_backward_is_the_inverse_rotation(device, interleave, cache):
    q, k = qk(9, 3, 1, 64, torch.float32, device, seed=10)
    q.requires_grad_(), k.requires_grad_()
    inv_freq = theta_inv_freq(48, 1e4).to(device)
    freqs = cos_sin_cache(inv_freq, 64).to(device) if cache else inv_freq
    pos = torch.arange(9, device=device) * 5
    q_out, k_out = torch.ops.flashkern.rope(q, k, pos, freqs, interleave, False)
    gq, gk = rand(q.shape, torch.float32, device, seed=11), rand(k.shape, torch.float32, device, seed=12)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    eq, ek = ref.rope(gq.double(), gk.double(), pos, freqs, interleave, inverse=True)
    assert_close(q.grad, eq, torch.float32)
    assert_close(k.grad, ek, torch.float32)


def test_rope_gradcheck_float64():
    q = rand((5, 2, 16), torch.float64, "cpu", seed=13).requires_grad_()
    k = rand((5, 1, 16), torch.float64, "cpu", seed=14).requires_grad_()
    pos = torch.tensor([0, 3, 9, 100, 7])
    assert torch.autograd.gradcheck(lambda a, b: flashkern.apply_rope_pos_ids(a, b, pos, rotary_dim=12), (q, k))
    assert torch.autograd.gradcheck(lambda a, b: flashkern.apply_rope_pos_ids(a, b, pos, interleave=True), (q, k))


# ---------------------------------------------------------------- bad input


def test_rope_bad_input(device):
    q, k = qk(4, 2, 1, 64, torch.float32, device)
    pos = torch.arange(4, device=device)
    with pytest.raises(ValueError, match=r"rotary_dim must be an even integer .* got 63"):
        flashkern.apply_rope_pos_ids(q, k, pos, rotary_dim=63)
    with pytest.raises(ValueError, match=r"rotary_dim must be an even integer .* got 128"):
        flashkern.apply_rope_pos_ids(q, k, pos, rotary_dim=128)
    with pytest.raises(ValueError, match=r"k must be \[tokens, heads, head_dim\] with q's tokens and head_dim"):
        flashkern.apply_rope_pos_ids(q, rand((4, 1, 32), torch.float32, device), pos)
    with pytest.raises(ValueError, match=r"k must be \[tokens, heads, head_dim\]"):
        flashkern.apply_rope_pos_ids(q, rand((5, 1, 64), torch.float32, device), pos)
    with pytest.raises(TypeError, match=r"positions must be int32 or int64, got torch.float32"):
        flashkern.apply_rope_pos_ids(q, k, pos.float())
    with pytest.raises(ValueError, match=r"positions must have shape \[4\]"):
        flashkern.apply_rope_pos_ids(q, k, torch.arange(5, device=device))
    with pytest.raises(ValueError, match=r"q must be 3-D"):
        flashkern.apply_rope_pos_ids(q[0], k, pos)
    with pytest.raises(TypeError, match=r"k must have the dtype of q"):
        flashkern.apply_rope_pos_ids(q, k.half(), pos)
    with pytest.raises(ValueError, match=r"high_freq_factor must exceed low_freq_factor"):
        flashkern.apply_llama31_rope_pos_ids(q, k, pos, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(TypeError, match=r"indptr must be a 1-D int32 or int64 tensor"):
        flashkern.apply_rope(q, k, torch.tensor([0.0, 4.0], device=device), torch.tensor([0], device=device))
    with pytest.raises(ValueError, match=r"indptr must have batch \+ 1 = 2 entries, got 3"):
        flashkern.apply_rope(q, k, torch.tensor([0, 2, 4], device=device), torch.tensor([0], device=device))
    if str(device) == "cpu":  # checked without a device synchronization only (on a GPU: the caller's contract)
        for bad in ([0, 3, 1, 4], [0, 2, 6], [1, 2, 4]):  # decreasing, past the tokens, not from 0
            for fn in (flashkern.apply_rope, flashkern.apply_rope_inplace):
                with pytest.raises(ValueError, match=r"indptr must start at 0, never decrease and end at the 4 tokens"):
                    fn(q, k, torch.tensor(bad, device=device), torch.zeros(len(bad) - 1, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"query must be \[tokens, heads \* 64\]"):
        flashkern.apply_rope_with_cos_sin_cache(pos, q.view(4, -1)[:, :100], k.view(4, -1), 64, torch.zeros(8, 64, device=device))
    with pytest.raises(TypeError, match=r"must be float32, got torch.float64"):
        flashkern.apply_rope_with_cos_sin_cache(pos, q.view(4, -1), k.view(4, -1), 64, torch.zeros(8, 64, dtype=torch.float64, device=device))


def test_rope_positions_on_another_device():
    q, k = qk(4, 2, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"positions is on meta but q is on cpu"):
        torch.ops.flashkern.rope(q, k, torch.empty(4, dtype=torch.int64, device="meta"), torch.ones(32), False, False)


def test_rope_cache_too_short_on_cpu():
    q, k = qk(4, 2, 1, 64, torch.float32, "cpu")
    cache = torch.zeros(10, 64)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\) .* got positions from 0 to 10"):
        flashkern.apply_rope_with_cos_sin_cache(torch.tensor([0, 1, 2, 10]), q.view(4, -1), k.view(4, -1), 64, cache)


# ---------------------------------------------------------------- Hugging Face transformers


transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")


def hf_inv_freq(rope_type, params, head_dim=128, theta=1e4, partial=1.0, max_pos=4096, seq_len=None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default":  # Llama's default ignores partial_rotary_factor: ask for the rotary part itself
        head_dim, partial = int(head_dim * partial), 1.0
    rope_parameters = {"rope_type": rope_type, "rope_theta": theta, "partial_rotary_factor": partial, **params}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=rope_parameters)
    fn = ROPE_INIT_FUNCTIONS.get(rope_type) if rope_type != "default" else None
    if fn is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return fn(config, None, seq_len)


HF_CASES = [
    ("default", {}, None),
    ("linear", {"factor": 4.0}, None),
    ("dynamic", {"factor": 2.0}, 16384),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 4096}, None),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2,
              "mscale": 1.0, "mscale_all_dim": 0.5}, None),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, None),
    ("longrope", {"factor": 8.0, "original_max_position_embeddings": 2048,
                  "short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [2.0 + i / 16 for i in range(64)]},
     8192),
]


@pytest.mark.parametrize("rope_type,params,seq_len", HF_CASES)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_frequencies_match_transformers(rope_type, params, seq_len, partial):
    if rope_type == "longrope" and partial != 1.0:
        params = {**params, "short_factor": params["short_factor"][:32], "long_factor": params["long_factor"][:32]}
    theirs, their_factor = hf_inv_freq(rope_type, params, partial=partial, seq_len=seq_len)
    ours, our_factor = rope_frequencies(128, 1e4, {"rope_type": rope_type, **params}, partial, 4096, seq_len)
    assert torch.equal(ours, theirs.float()), (ours - theirs).abs().max()
    assert our_factor == pytest.approx(their_factor)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rotation_matches_transformers(device, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, heads, head_dim = 37, 4, 128
    inv_freq, _ = rope_frequencies(head_dim, 5e5, HF_CASES[5][1] | {"rope_type": "llama3"})
    pos = torch.arange(0, tokens * 997, 997)
    angle = pos.float()[:, None] @ inv_freq[None, :].float()  # transformers: fp32 outer product
    emb = torch.cat([angle, angle], dim=-1)
    q, k = qk(tokens, heads, 2, head_dim, dtype, device, seed=20)
    q_hf, k_hf = apply_rotary_pos_emb(q.cpu().transpose(0, 1)[None].float(), k.cpu().transpose(0, 1)[None].float(),
                                      emb.cos()[None], emb.sin()[None])
    q_out, k_out = flashkern.apply_llama31_rope_pos_ids(q, k, pos.to(device))
    assert_close(q_out, q_hf[0].transpose(0, 1).double(), dtype)
    assert_close(k_out, k_hf[0].transpose(0, 1).double(), dtype)


def test_math_sanity():
    """Position 0 is the identity; a rotation keeps each pair's length."""
    q, k = qk(3, 2, 2, 64, torch.float64, "cpu")
    out, _ = flashkern.apply_rope_pos_ids(q, k, torch.zeros(3, dtype=torch.int64))
    assert torch.allclose(out, q)
    out, _ = flashkern.apply_rope_pos_ids(q, k, torch.tensor([1, 50, 1000]))
    norm = lambda x: (x[..., :32] ** 2 + x[..., 32:] ** 2)  # noqa: E731
    assert torch.allclose(norm(out), norm(q))
    assert not torch.allclose(out, q)
    assert math.isclose(float(theta_inv_freq(64, 1e4)[1]), 1e4 ** (-2 / 64), rel_tol=1e-6)
