"""merge_state, merge_state_in_place and merge_states against float64 attention math."""

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_close, rand

import flashkern
from flashkern import ref

NEG_INF = float("-inf")


def attention_state(q, keys, values):
    """The state (v, s) of queries q [tokens, heads, D] over keys/values [tokens, n, heads, D], float64."""
    logits = torch.einsum("thd,tnhd->thn", q.double(), keys.double()) / q.shape[-1] ** 0.5
    s = torch.logsumexp(logits, dim=-1)
    v = torch.einsum("thn,tnhd->thd", torch.softmax(logits, dim=-1), values.double())
    return v, s


def split_states(tokens, heads, head_dim, n_keys, dtype, device, seed=0):
    """Two states over disjoint halves of one key set, and the exact state over all of it."""
    q = rand((tokens, heads, head_dim), torch.float64, "cpu", seed=seed)
    keys = rand((tokens, n_keys, heads, head_dim), torch.float64, "cpu", seed=seed + 1)
    values = rand((tokens, n_keys, heads, head_dim), torch.float64, "cpu", seed=seed + 2)
    cut = n_keys // 3
    v_a, s_a = attention_state(q, keys[:, :cut], values[:, :cut])
    v_b, s_b = attention_state(q, keys[:, cut:], values[:, cut:])
    full = attention_state(q, keys, values)
    on = lambda v, s: (v.to(device=device, dtype=dtype), s.to(device=device, dtype=torch.float32))  # noqa: E731
    return on(v_a, s_a), on(v_b, s_b), full


@pytest.mark.parametrize("heads,head_dim", [(1, 64), (5, 128), (32, 256), (3, 7), (64, 256)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_merge_state_is_attention_over_the_union(device, heads, head_dim, dtype):
    (v_a, s_a), (v_b, s_b), (v, s) = split_states(37, heads, head_dim, 50, dtype, device)
    v_m, s_m = flashkern.merge_state(v_a, s_a, v_b, s_b)
    assert v_m.dtype == dtype and s_m.dtype == torch.float32
    assert_close(v_m, v, dtype)
    assert_close(s_m, s, torch.float32)


@pytest.mark.parametrize("num_states", [1, 2, 7, 33])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_merge_states(device, num_states, dtype):
    tokens, heads, head_dim = 5, 40, 128  # 40 heads x 128 dims: past FlashInfer's 1024-thread limit
    q = rand((tokens, heads, head_dim), torch.float64, "cpu", seed=3)
    keys = rand((tokens, num_states * 3, heads, head_dim), torch.float64, "cpu", seed=4)
    values = rand((tokens, num_states * 3, heads, head_dim), torch.float64, "cpu", seed=5)
    states = [attention_state(q, keys[:, 3 * i : 3 * i + 3], values[:, 3 * i : 3 * i + 3]) for i in range(num_states)]
    v = torch.stack([st[0] for st in states], dim=1).to(device=device, dtype=dtype)
    s = torch.stack([st[1] for st in states], dim=1).to(device=device, dtype=torch.float32)
    v_m, s_m = flashkern.merge_states(v, s)
    expected_v, expected_s = attention_state(q, keys, values)
    assert v_m.shape == (tokens, heads, head_dim) and s_m.shape == (tokens, heads)
    assert_close(v_m, expected_v, dtype)
    assert_close(s_m, expected_s, torch.float32)


def test_empty_states_merge_exactly(device):
    (v_a, s_a), (v_b, s_b), _ = split_states(6, 4, 64, 20, torch.float32, device, seed=6)
    empty_v, empty_s = torch.full_like(v_b, float("nan")), torch.full_like(s_b, NEG_INF)  # v of an empty set is unused
    v, s = flashkern.merge_state(v_a, s_a, empty_v.zero_(), empty_s)
    assert torch.equal(v, v_a) and torch.equal(s, s_a)
    v, s = flashkern.merge_state(empty_v, empty_s, empty_v, empty_s)
    assert torch.equal(v, torch.zeros_like(v)) and (s == NEG_INF).all()
    mixed_s = s_a.clone()
    mixed_s[2] = NEG_INF  # one token empty on both sides
    v, s = flashkern.merge_state(v_a, mixed_s, v_b, torch.where(torch.arange(6, device=device)[:, None] == 2, NEG_INF, s_b))
    assert not v.isnan().any() and (s[2] == NEG_INF).all() and (v[2] == 0).all()
    stacked_v = torch.stack([v_a, torch.zeros_like(v_a)], dim=1)
    stacked_s = torch.stack([s_a, torch.full_like(s_a, NEG_INF)], dim=1)
    v, s = flashkern.merge_states(stacked_v, stacked_s)
    assert_close(v, v_a.double())
    assert torch.equal(s, s_a)
    v, s = flashkern.merge_states(stacked_v[:, :0], stacked_s[:, :0])  # no states at all: the empty state
    assert v.shape == v_a.shape and s.shape == s_a.shape
    assert torch.equal(v, torch.zeros_like(v_a)) and bool((s == NEG_INF).all())


def test_nan_is_not_hidden(device):
    (v_a, s_a), (v_b, s_b), _ = split_states(3, 2, 64, 10, torch.float32, device, seed=7)
    s_a[1, 0] = float("nan")
    v, s = flashkern.merge_state(v_a, s_a, v_b, s_b)
    assert s[1, 0].isnan() and v[1, 0].isnan().all()
    assert not s[0].isnan().any()


def test_merge_is_commutative_and_associative(device):
    states = [split_states(9, 3, 128, 30, torch.float32, device, seed=10 + i)[0] for i in range(3)]
    (a, sa), (b, sb), (c, sc) = states
    ab = flashkern.merge_state(a, sa, b, sb)
    ba = flashkern.merge_state(b, sb, a, sa)
    assert_close(ab[0], ba[0].double())
    assert_close(ab[1], ba[1].double())
    left = flashkern.merge_state(*ab, c, sc)
    right = flashkern.merge_state(a, sa, *flashkern.merge_state(b, sb, c, sc))
    assert_close(left[0], right[0].double())
    assert_close(left[1], right[1].double())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_merge_state_in_place_with_mask(device, dtype):
    (v_a, s_a), (v_b, s_b), (v, s) = split_states(8, 4, 64, 20, dtype, device, seed=20)
    mask = torch.tensor([True, False, True, True, False, False, True, True], device=device)
    v_run, s_run = v_a.clone(), s_a.clone()
    flashkern.merge_state_in_place(v_run, s_run, v_b, s_b, mask)
    assert_close(v_run[mask], v[mask.cpu()], dtype)
    assert_close(s_run[mask], s[mask.cpu()], torch.float32)
    assert torch.equal(v_run[~mask], v_a[~mask]) and torch.equal(s_run[~mask], s_a[~mask])
    flashkern.merge_state_in_place(v_a, s_a, v_b, s_b)  # no mask: every token
    assert_close(v_a, v, dtype)


def test_strided_states(device):
    (v_a, s_a), (v_b, s_b), (v, s) = split_states(7, 4, 64, 20, torch.bfloat16, device, seed=30)
    wide = torch.zeros(7, 4, 96, dtype=torch.bfloat16, device=device)
    wide[..., 16:80] = v_b
    s_wide = torch.zeros(4, 7, device=device)
    s_wide.copy_(s_b.t())
    v_m, s_m = flashkern.merge_state(v_a, s_a, wide[..., 16:80], s_wide.t())
    assert_close(v_m, v, torch.bfloat16)
    assert_close(s_m, s, torch.float32)


def test_bad_states(device):
    (v_a, s_a), (v_b, s_b), _ = split_states(3, 2, 64, 10, torch.float16, device)
    with pytest.raises(TypeError, match=r"s_a \(the log-sum-exp\) must be float32, got torch.float16"):
        flashkern.merge_state(v_a, s_a.half(), v_b, s_b)
    with pytest.raises(ValueError, match=r"s_b must have shape \(3, 2\)"):
        flashkern.merge_state(v_a, s_a, v_b, s_b[:, :1])
    with pytest.raises(ValueError, match=r"v_b must have the shape of v_a"):
        flashkern.merge_state(v_a, s_a, v_b[:, :1], s_b[:, :1])
    with pytest.raises(TypeError, match=r"v_b must have the dtype of v_a"):
        flashkern.merge_state(v_a, s_a, v_b.float(), s_b)
    with pytest.raises(ValueError, match=r"v_a must be 3-D \[tokens, heads, head_dim\]"):
        flashkern.merge_state(v_a[0], s_a[0], v_b[0], s_b[0])
    with pytest.raises(ValueError, match=r"v must be 4-D \[tokens, num_states, heads, head_dim\]"):
        flashkern.merge_states(v_a, s_a)
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of shape \(3,\)"):
        flashkern.merge_state_in_place(v_a, s_a, v_b, s_b, torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"v_a must be contiguous in its last dimension"):
        flashkern.merge_state(v_a.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :2], s_a, v_b[:, :, :2], s_b)
