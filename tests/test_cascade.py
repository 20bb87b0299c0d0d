"""Cascade decode (MultiLevelCascadeAttentionWrapper): the output of every query equals attention
over the concatenation of its KV at every level (prefix shared by many requests, suffix of its
own), in float64; two and three levels, empty suffixes, a group with no pages at a level, GQA
groups and head dims, NaN in every unused cache slot and in the outputs; argument checks;
torch.compile and (GPU) CUDA graph replay after a new plan."""

import pytest
import torch
from conftest import assert_close, poisoned, rand, requires_gpu
from paged_kv import attention, i32, paged, random_kv, rounded

from flashkern import MultiLevelCascadeAttentionWrapper
from flashkern.tolerances import tolerance


def workspace(device, mib=32):
    return torch.empty(mib << 20, dtype=torch.uint8, device=device)


def cascade(device, groups_per_level, lengths_per_level, kv_heads, group, head_dim, dtype, page_size=16, seed=0,
            min_chunk=None, sinks=None, causal=False):
    """groups_per_level[i]: the number of queries in each group of level i (their sum is the batch);
    lengths_per_level[i]: each group's KV length. One paged cache holds every level's pages. sinks:
    run()'s, one logit per q head; causal: the last level's groups see their KV up to each query's
    diagonal (a group's n queries are its last n tokens)."""
    batch = sum(groups_per_level[0])
    all_kvs, tables, start = [], [], 0
    for sizes, lengths in zip(groups_per_level, lengths_per_level):
        all_kvs += random_kv(lengths, kv_heads, head_dim, seed + 10 * len(all_kvs))
    cache, indptr, indices, last = paged(all_kvs, page_size, "NHD", dtype, device, seed=seed)
    for sizes, lengths in zip(groups_per_level, lengths_per_level):
        n = len(lengths)
        kv_indptr = indptr[start : start + n + 1] - indptr[start]
        kv_indices = indices[indptr[start] : indptr[start + n]]
        qo_indptr = i32([0] + torch.tensor(sizes).cumsum(0).tolist())
        tables.append((qo_indptr, kv_indptr, kv_indices, last[start : start + n]))
        start += n
    q = rand((batch, kv_heads * group, head_dim), dtype, device, seed=seed + 99)
    wrapper = MultiLevelCascadeAttentionWrapper(len(tables), workspace(device))
    if min_chunk is not None:
        wrapper._core._min_chunk = min_chunk
    wrapper.plan(*[list(t) for t in zip(*tables)], kv_heads * group, kv_heads, head_dim, page_size, causal=causal,
                 q_data_type=dtype)
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse, sinks=sinks)

    kvs = rounded(all_kvs, dtype)
    expected, first = [], 0
    for t in range(batch):  # query t's KV: its group's at every level, concatenated
        ks, vs, first = [], [], 0
        for level, (sizes, lengths) in enumerate(zip(groups_per_level, lengths_per_level)):
            ends = torch.tensor(sizes).cumsum(0)
            g = int((ends <= t).sum())
            k, v = kvs[first + g]
            if causal and level == len(groups_per_level) - 1:  # token i of the group's n sees up to L - n + i
                n, i = sizes[g], t - (int(ends[g]) - sizes[g])
                k, v = k[: max(k.shape[0] - n + 1 + i, 0)], v[: max(k.shape[0] - n + 1 + i, 0)]
            ks.append(k)
            vs.append(v)
            first += len(lengths)
        expected.append(attention(q[t], torch.cat(ks), torch.cat(vs), sinks=sinks))
    assert_close(out, torch.stack([o for o, _ in expected]), dtype)
    torch.testing.assert_close(lse.double().cpu(), torch.stack([s for _, s in expected]), **tolerance(torch.float32))
    return wrapper


@pytest.mark.parametrize("group", [1, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shared_prefix_and_suffixes(device, group, head_dim, dtype):
    """Level 0: one prefix for all 6 requests; level 1: each request's own suffix (one empty)."""
    cascade(device, [[6], [1] * 6], [[1000], [5, 0, 33, 16, 1, 300]], 2, group, head_dim, dtype, min_chunk=64)


@pytest.mark.parametrize("group", [1, 8])
def test_head_dim_512(device, group):
    """head_dim 512 (16-row tiles only): a shared prefix and each request's suffix."""
    cascade(device, [[6], [1] * 6], [[300], [5, 0, 33, 16, 1, 100]], 2, group, 512, torch.bfloat16, min_chunk=64)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_three_levels(device, page_size):
    """A system prompt for all, a document for each of two request groups, then each request's suffix."""
    cascade(device, [[5], [2, 3], [1] * 5], [[257], [64, 129], [3, 70, 1, 0, 12]], 2, 4, 128, torch.bfloat16,
            page_size=page_size, seed=1)


def test_sinks(device):
    """A sink logit per head counts once in each query's softmax over all its levels, however many
    states are merged; a query without any key (no prefix, empty suffix) gets 0 and lse = the sink."""
    sinks = rand((10,), torch.float32, device, seed=7) * 3
    cascade(device, [[3, 2], [1] * 5], [[700, 0], [10, 0, 30, 0, 45]], 2, 5, 64, torch.bfloat16, seed=3,
            min_chunk=64, sinks=sinks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 5])
def test_many_query_tokens_per_request(device, causal, group):
    """The last level with several query tokens per request (speculative verification, an append to a
    shared prefix), causal or not; upper levels seen whole: 3, 1, 7, 13 and 9 tokens over suffixes of 40,
    1, 7 (as many as its queries), 100 and 4 (fewer: causal, its first 5 queries see only the prefix)."""
    cascade(device, [[33], [3, 1, 7, 13, 9]], [[300], [40, 1, 7, 100, 4]], 2, group, 64, torch.bfloat16, seed=4,
            min_chunk=64, causal=causal)


def test_group_without_pages_at_a_level(device):
    """Requests 0-1 share a prefix, requests 2-3 share none."""
    cascade(device, [[2, 2], [1] * 4], [[90, 0], [10, 20, 30, 40]], 1, 8, 64, torch.float16, seed=2)


def test_long_prefix_many_requests(device):
    """A 4097-token prefix read by 40 requests (160 rows: several 64-row tiles), split and merged."""
    cascade(device, [[40], [1] * 40], [[4097], list(range(1, 41))], 2, 4, 64, torch.bfloat16, seed=3)


def test_single_level_is_batch_decode(device):
    cascade(device, [[1, 1, 1]], [[17, 1, 300]], 2, 2, 128, torch.float16, seed=4, min_chunk=64)


# ---------------------------------------------------------------- argument checks


def tables():
    return ([i32([0, 3]), i32([0, 1, 2, 3])], [i32([0, 2]), i32([0, 1, 2, 2])], [i32([0, 1]), i32([2, 3])],
            [i32([5]), i32([4, 9, 0])])


def test_plan_checks(device):
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device, 4))
    qo, kv, idx, last = tables()
    wrapper.plan(qo, kv, idx, last, 8, 2, 64, 16)  # the valid tables plan
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[0\]\[-1\] must be the number of queries 4, got 3"):
        wrapper.plan([qo[0], i32([0, 1, 3, 4])], kv, idx, last, 8, 2, 64, 16)  # the last level names the queries
    with pytest.raises(TypeError, match="plan: causal must be a bool"):
        wrapper.plan(qo, kv, idx, last, 8, 2, 64, 16, causal="yes")
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[0\]\[-1\] must be the number of queries 3, got 2"):
        wrapper.plan([i32([0, 2]), qo[1]], kv, idx, last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match=r"paged_kv_indptr_arr\[1\] must be non-decreasing"):
        wrapper.plan(qo, [kv[0], i32([0, 2, 1, 2])], idx, last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[1\]\[2\] must be 0 for a request without pages"):
        wrapper.plan(qo, kv, idx, [last[0], i32([4, 9, 1])], 8, 2, 64, 16)
    with pytest.raises(TypeError, match=r"paged_kv_indices_arr\[0\] must be int32"):
        wrapper.plan(qo, kv, [idx[0].long(), idx[1]], last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="paged_kv_indptr_arr must be a list of 2 tensors"):
        wrapper.plan(qo, kv[:1], idx, last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="window_left=128 is not supported"):
        wrapper.plan(qo, kv, idx, last, 8, 2, 64, 16, window_left=128)
    with pytest.raises(ValueError, match="num_levels must be an int from 1 to 8"):
        MultiLevelCascadeAttentionWrapper(9, workspace(device, 1))


def test_reset_workspace_buffer_needs_a_new_plan(device):
    """FlashInfer's member, with a 1-byte workspace of another dtype (int8)."""
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device, 4))
    wrapper.plan(*tables(), 8, 2, 64, 16, q_data_type=torch.bfloat16)
    cache = torch.randn(4, 2, 16, 2, 64, dtype=torch.bfloat16, device=device)
    q = rand((3, 8, 64), torch.bfloat16, device)
    expected = wrapper.run(q, cache)
    wrapper.reset_workspace_buffer(torch.empty(4 << 20, dtype=torch.int8, device=device), None)
    with pytest.raises(RuntimeError, match="call plan"):
        wrapper.run(q, cache)
    wrapper.plan(*tables(), 8, 2, 64, 16, q_data_type=torch.bfloat16)
    assert torch.equal(wrapper.run(q, cache), expected)


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device, 4))
    qo, kv, idx, last = tables()
    wrapper.plan(qo, kv, idx, last, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    cache = torch.randn(4, 2, 16, 2, 64, dtype=torch.bfloat16, device=device)
    q = rand((3, 8, 64), torch.bfloat16, device)
    expected = wrapper.run(q, cache)
    compiled = torch.compile(lambda q, cache: wrapper.run(q, cache), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, cache), expected)


@requires_gpu
def test_cuda_graph_replay_after_replan():
    kv_heads, group, head_dim, page_size, batch = 2, 4, 128, 16, 8
    buffers = [[torch.empty(n, dtype=torch.int32, device="cuda") for n in sizes]
               for sizes in ((2, batch + 1), (2, batch + 1), (1024, 1024), (1, batch))]
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace("cuda"), use_cuda_graph=True, qo_indptr_buf_arr=buffers[0],
                                                paged_kv_indptr_buf_arr=buffers[1], paged_kv_indices_buf_arr=buffers[2],
                                                paged_kv_last_page_len_buf_arr=buffers[3])
    cache = torch.randn(900, 2, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q = rand((batch, kv_heads * group, head_dim), torch.bfloat16, "cuda")
    out = torch.empty_like(q)

    def plan(prefix, suffixes, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = [prefix] + suffixes
        pages = [-(-n // page_size) for n in lengths]
        indices = torch.randperm(900, generator=g)[: sum(pages)].int()
        last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)]
        wrapper.plan([i32([0, batch]), i32(list(range(batch + 1)))],
                     [i32([0, pages[0]]), i32([0] + torch.tensor(pages[1:]).cumsum(0).tolist())],
                     [indices[: pages[0]], indices[pages[0]:]], [i32(last[:1]), i32(last[1:])],
                     kv_heads * group, kv_heads, head_dim, page_size, q_data_type=torch.bfloat16)
        kv = cache.double()
        expected = []
        for b in range(batch):
            rows = []
            for level, (first, count, n) in enumerate(((0, pages[0], lengths[0]),
                                                       (pages[0] + sum(pages[1 : b + 1]), pages[b + 1], lengths[b + 1]))):
                ids = indices[first : first + count].long()
                rows.append(kv[ids].transpose(0, 1).reshape(2, -1, kv_heads, head_dim)[:, :n])
            k, v = (torch.cat([r[i] for r in rows]) for i in (0, 1))
            expected.append(attention(q[b], k, v)[0])
        return torch.stack(expected)

    plan(1000, [3] * batch, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run(q, cache, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache, out=out)
    for prefix, suffixes, seed in ((1000, [3] * batch, 0), (5000, list(range(0, 800, 100)), 1), (16, [1] * batch, 2)):
        expected = plan(prefix, suffixes, seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected, torch.bfloat16)
