"""The pure-torch references for paged-KV decode and cascade decode (the oracles the GPU kernels
will be tested against): page-table arithmetic, layouts, GQA, empty requests, cascade = attention
over the concatenated prefix and suffix."""

import pytest
import torch
from conftest import rand
from paged_kv import attention, i32, paged

from flashkern import ref


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("group", [1, 5, 7, 8])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_batch_decode_reference(page_size, group, kv_layout):
    kv_heads, head_dim, lengths = 2, 64, [1, 17, 37, 0, 130]
    kvs = [(rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=10 + i),
            rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=20 + i)) for i, n in enumerate(lengths)]
    cache, indptr, indices, last = paged(kvs, page_size, kv_layout)
    q = rand((len(lengths), kv_heads * group, head_dim), torch.float64, "cpu", seed=30)
    o, lse = ref.batch_decode(q, cache, indptr, indices, last, kv_layout)
    for b, (k, v) in enumerate(kvs):
        if k.shape[0] == 0:
            assert (o[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        eo, e_lse = attention(q[b], k, v)
        torch.testing.assert_close(o[b], eo)
        torch.testing.assert_close(lse[b], e_lse)
    k_cache, v_cache = (cache[:, 0], cache[:, 1])
    o_tuple, _ = ref.batch_decode(q, (k_cache, v_cache), indptr, indices, last, kv_layout)
    torch.testing.assert_close(o_tuple, o)


def test_cascade_reference_is_attention_over_prefix_and_suffix():
    kv_heads, group, head_dim, page_size = 2, 4, 64, 16
    prefix_len, suffix_lens = 70, [5, 0, 33, 16]  # one request with an empty suffix
    prefix = (rand((prefix_len, kv_heads, head_dim), torch.float64, "cpu", seed=1),
              rand((prefix_len, kv_heads, head_dim), torch.float64, "cpu", seed=2))
    suffixes = [(rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=3 + i),
                 rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=13 + i)) for i, n in enumerate(suffix_lens)]
    cache, indptr, indices, last = paged([prefix, *suffixes], page_size, "NHD", seed=5)
    batch = len(suffix_lens)
    q = rand((batch, kv_heads * group, head_dim), torch.float64, "cpu", seed=40)
    # level 0: one group (the whole batch) sharing the prefix's pages; level 1: one group per request
    level0 = (i32([0, batch]), indptr[:2], indices[: indptr[1]], last[:1])
    level1 = (i32(list(range(batch + 1))), indptr[1:] - indptr[1], indices[indptr[1] :], last[1:])
    o, lse = ref.cascade_decode(q, cache, [level0[0], level1[0]], [level0[1], level1[1]], [level0[2], level1[2]],
                                [level0[3], level1[3]])
    for b, (k, v) in enumerate(suffixes):
        eo, e_lse = attention(q[b], torch.cat([prefix[0], k]), torch.cat([prefix[1], v]))
        torch.testing.assert_close(o[b], eo)
        torch.testing.assert_close(lse[b], e_lse)


def test_decode_reference_natural_log_and_scale():
    q = rand((4, 32), torch.float64, "cpu", seed=50)
    k, v = rand((9, 4, 32), torch.float64, "cpu", seed=51), rand((9, 4, 32), torch.float64, "cpu", seed=52)
    o, lse = ref.decode_attention(q, k, v, sm_scale=0.3)
    logits = torch.einsum("hd,lhd->hl", q, k) * 0.3
    torch.testing.assert_close(lse, torch.log(torch.exp(logits).sum(-1)))  # natural log, not base 2
    torch.testing.assert_close(o, torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v))
