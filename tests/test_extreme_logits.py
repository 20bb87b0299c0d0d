"""Attention at logits far from zero (+-5e5, and -46,000: FlashInfer's fixture for its issue 4450) on every
device, for decode, prefill and the cascade. Every key is the same, so every logit is exactly the same
number whatever the arithmetic: a query's output is the mean of the values it sees, exactly 1 for values of
1, and its lse is the logit plus log(keys seen). A softmax that forms exp(logit - lse) in float32 instead of
subtracting the max loses 0.2 % of each weight at -46,000 (1.00195 instead of 1 in float16).

Random values are checked where a query has one state: merging states, each with a float32 lse, costs
up to an ulp of the lse (0.03 at 5e5) in the weights, for the kernels and the reference alike; values of
1 stay exact through merges."""

import math

import pytest
import torch
from conftest import assert_close, poisoned, rand
from paged_kv import i32, paged

import flashkern
from flashkern import BatchDecodeWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper

LOGITS = [5e5, -5e5, -46000.0]
HEAD_DIM, KV_HEADS, GROUP = 128, 2, 4


def workspace(device):
    return torch.empty(32 << 20, dtype=torch.uint8, device=device)


def same_keys(lengths, ones, seed):
    """[(k, v)] per request, float64: every key all ones; values all ones or random."""
    return [(torch.ones(n, KV_HEADS, HEAD_DIM, dtype=torch.float64),
             torch.ones(n, KV_HEADS, HEAD_DIM, dtype=torch.float64) if ones
             else rand((n, KV_HEADS, HEAD_DIM), torch.float64, "cpu", seed=seed + i)) for i, n in enumerate(lengths)]


def query(batch, logit, dtype, device):
    """q of +-1 and the sm_scale that makes every logit `logit` (q . k = +-HEAD_DIM, exact in every dtype)."""
    q = torch.full((batch, KV_HEADS * GROUP, HEAD_DIM), math.copysign(1.0, logit), dtype=dtype, device=device)
    return q, abs(logit) / HEAD_DIM


def check(out, lse, values, logit, ones, dtype):
    """out [tokens, qo_heads, D] against the mean of each token's values [n, kv_heads, D]; lse against
    logit + log(n)."""
    expected = torch.stack([v.double().mean(0).repeat_interleave(GROUP, 0) for v in values])
    if ones:
        assert torch.equal(out.double().cpu(), torch.ones_like(expected)), out.double().cpu().unique()
    else:
        assert_close(out, expected, dtype)
    n = torch.tensor([v.shape[0] for v in values], dtype=torch.float64)
    expected_lse = (logit + n.log())[:, None].expand(-1, KV_HEADS * GROUP)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ones", [True, False])
@pytest.mark.parametrize("logit", LOGITS)
def test_decode(device, logit, ones, dtype):
    lengths = [2, 37, 300]
    kvs = same_keys(lengths, ones, seed=1)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device)
    q, sm_scale = query(len(lengths), logit, dtype, device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr, indices, last, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, 16, q_data_type=dtype, sm_scale=sm_scale,
                 disable_split_kv=not ones)
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse)
    check(out, lse, [v.to(dtype) for _, v in kvs], logit, ones, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ones", [True, False])
@pytest.mark.parametrize("logit", LOGITS)
def test_prefill(device, logit, ones, dtype):
    """Causal: query i of the last 7 tokens sees kv_len - 7 + i + 1 keys (fewer than a split's 256)."""
    qo_len, kv_len = 7, 77
    ((k, v),) = same_keys([kv_len], ones, seed=2)
    q, sm_scale = query(qo_len, logit, dtype, device)
    k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
    out, lse = flashkern.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=sm_scale, return_lse=True)
    check(out, lse, [v[: kv_len - qo_len + i + 1].cpu() for i in range(qo_len)], logit, ones, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("logit", LOGITS)
def test_cascade(device, logit, dtype):
    """A prefix of 100 tokens shared by 3 requests, then their own 1, 20 and 45 tokens: two states merged."""
    own, ones = [1, 20, 45], True
    kvs = same_keys([100, *own], ones, seed=3)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device)
    levels = [(i32([0, 3]), indptr[:2], indices[: indptr[1]], last[:1]),
              (i32([0, 1, 2, 3]), indptr[1:] - indptr[1], indices[indptr[1] :], last[1:])]
    q, sm_scale = query(len(own), logit, dtype, device)
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device))
    wrapper.plan(*[list(t) for t in zip(*levels)], KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, 16, q_data_type=dtype,
                 sm_scale=sm_scale)
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse)
    values = [torch.cat([kvs[0][1], kvs[1 + b][1]]).to(dtype) for b in range(len(own))]
    check(out, lse, values, logit, ones, dtype)
