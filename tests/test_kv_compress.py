"""KV-cache compression (flashkern.kv_compress): per-key scores against float64 attention written here,
selection exactly (an oracle sort written here), compaction bitwise, the policies, bad input."""

import pytest
import torch
from conftest import assert_close, emulated, rand
from paged_kv import i32, paged, random_kv

from flashkern import kv_compress
from flashkern.kv_compress import H2O, SnapKV, StreamingLLM, compact, key_scores, select_keys


def kv_views(cache, layout):
    k, v = cache[:, 0], cache[:, 1]
    return (k.transpose(1, 2), v.transpose(1, 2)) if layout == "HND" else (k, v)


def dense(cache, layout, indptr, indices, last, b):
    """Request b's keys and values [kv_len, kv_heads, D] in float64, in position order."""
    k, v = kv_views(cache, layout)
    pages = indices[indptr[b] : indptr[b + 1]].long()
    n = (len(pages) - 1) * k.shape[1] + int(last[b]) if len(pages) else 0
    j = torch.arange(n)
    page, slot = pages[j // k.shape[1]], j % k.shape[1]
    return k[page.to(k.device), slot.to(k.device)].double().cpu(), v[page.to(k.device), slot.to(k.device)].double().cpu()


def logits64(q, k, sm_scale, causal=True, window_left=-1, cap=0.0):
    """[n, qo_heads, kv_len] float64 logits of a request's last n queries, -inf where masked."""
    n, qo_heads, _ = q.shape
    kv_len, kv_heads = k.shape[:2]
    s = torch.einsum("nhd,lhd->nhl", q.double().cpu(), k.repeat_interleave(qo_heads // kv_heads, 1)) * sm_scale
    if cap:
        s = cap * torch.tanh(s / cap)
    pos = torch.arange(n)[:, None] + kv_len - n
    key = torch.arange(kv_len)[None, :]
    hide = (key > pos) if causal else torch.zeros(n, kv_len, dtype=torch.bool)
    if window_left >= 0:
        hide |= key < pos - window_left
    return s.masked_fill(hide[:, None, :], float("-inf"))


def setup(device, lengths, qo_lens, kv_heads, group, head_dim=64, page_size=16, layout="NHD", dtype=torch.float16,
          seed=0, causal=True, window_left=-1, cap=0.0):
    """A paged cache, queries and their float32 lse (from float64 here), and the float64 probabilities."""
    cache, indptr, indices, last = paged(random_kv(lengths, kv_heads, head_dim, seed), page_size, layout, dtype, device,
                                         seed=seed)
    qo_indptr = i32([0] + torch.tensor(qo_lens).cumsum(0).tolist())
    q = rand((sum(qo_lens), kv_heads * group, head_dim), dtype, device, seed=seed + 99)
    sm_scale = head_dim**-0.5
    lse, probs = [], []
    for b, n in enumerate(qo_lens):
        k, _ = dense(cache, layout, indptr, indices, last, b)
        s = logits64(q[qo_indptr[b] : qo_indptr[b + 1]], k, sm_scale, causal, window_left, cap)
        l = torch.logsumexp(s, -1)
        lse.append(l)
        probs.append(torch.exp(s - l[..., None]).nan_to_num(0.0))
    lse = torch.cat(lse).float().to(device)
    return cache, indptr, indices, last, qo_indptr, q, lse, probs


def paged_scores(scores, indptr, indices, last, b):
    """Request b's scores [kv_len, kv_heads] from the paged [pages, kv_heads, page_size] tensor."""
    pages = indices[indptr[b] : indptr[b + 1]].long()
    page_size = scores.shape[2]
    n = (len(pages) - 1) * page_size + int(last[b]) if len(pages) else 0
    j = torch.arange(n)
    return scores.cpu()[pages[j // page_size], :, j % page_size]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_key_scores(device, group, page_size, layout):
    """Window scores (the last 8 / 32 / 64 queries, causal) against float64 probabilities."""
    lengths, windows = [200, 77, 64, 150], [8, 32, 64, 40]
    if emulated(device):
        lengths, windows = [130, 77], [8, 33]
    cache, indptr, indices, last, qo_indptr, q, lse, probs = setup(device, lengths, windows, 2, group,
                                                                   page_size=page_size, layout=layout)
    scale = 0.25
    scores = key_scores(q, lse, cache, qo_indptr.to(device), indptr.to(device), indices.to(device), last.to(device),
                        kv_layout=layout, scale=scale)
    for b in range(len(lengths)):
        p = probs[b]  # [n, qo_heads, kv_len]
        expected = p.view(p.shape[0], 2, group, -1).sum((0, 2)).t() * scale
        assert_close(paged_scores(scores, indptr, indices, last, b), expected, torch.float32)


def test_key_scores_masks_and_soft_cap(device):
    lengths, qo = [90, 140], [20, 33]
    cache, indptr, indices, last, qo_indptr, q, lse, probs = setup(device, lengths, qo, 2, 4, window_left=17, cap=5.0,
                                                                   dtype=torch.bfloat16)
    scores = key_scores(q, lse, cache, qo_indptr.to(device), indptr.to(device), indices.to(device), last.to(device),
                        window_left=17, logits_soft_cap=5.0)
    for b in range(len(lengths)):
        p = probs[b]
        assert_close(paged_scores(scores, indptr, indices, last, b), p.view(p.shape[0], 2, 4, -1).sum((0, 2)).t(),
                     torch.float32)


def test_accumulate_adds_to_cached_keys_and_starts_new_ones(device):
    """accumulate=True: keys before the step's own (the last qo_len) add; the step's keys start from 0."""
    lengths, qo = [100, 45], [3, 1]
    cache, indptr, indices, last, qo_indptr, q, lse, probs = setup(device, lengths, qo, 1, 2)
    args = (q, lse, cache, qo_indptr.to(device), indptr.to(device), indices.to(device), last.to(device))
    scores = torch.full((cache.shape[0], 1, 16), 7.0, device=device)
    key_scores(*args, scores=scores, accumulate=True)
    for b, n in enumerate(lengths):
        expected = probs[b].sum((0, 1))[:, None]
        expected[: n - qo[b]] += 7.0
        assert_close(paged_scores(scores, indptr, indices, last, b), expected, torch.float32)


def quantized_scores(pages, kv_heads, page_size, seed=0):
    """Scores that are multiples of 1/64 in [-2, 2]: pooled sums are exact in float32 (the kernels' and the
    oracle's order cannot differ) and ties are frequent."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 129, (pages, kv_heads, page_size), generator=g).float() / 64


def select_oracle(s, budget, window, keep_first, kernel_size):
    """s [kv_len, kv_heads] float32 -> kept [min(budget, kv_len), kv_heads]: forced first (lower positions
    first), then by pooled score, ties to the lower position, ascending."""
    n, heads = s.shape
    if budget >= n:
        return torch.arange(n)[:, None].expand(n, heads)
    pooled = max(n - window, 0)
    p = s.clone()
    if kernel_size > 1 and pooled:
        x = torch.nn.functional.pad(s[:pooled].t()[None], (kernel_size // 2, kernel_size // 2))
        p[:pooled] = torch.nn.functional.avg_pool1d(x, kernel_size, stride=1)[0].t()
    kept = []
    for h in range(heads):
        forced = [j for j in range(n) if j < keep_first or j >= pooled]
        rest = sorted((j for j in range(n) if not (j < keep_first or j >= pooled)),
                      key=lambda j: (-(p[j, h].item() if p[j, h] == p[j, h] else float("-inf")), j))
        kept.append(sorted((forced + rest)[:budget]))
    return torch.tensor(kept).t()


@pytest.mark.parametrize("kernel_size", [1, 5])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [8, 32, 64])
def test_select_keys_exact(device, kernel_size, page_size, window):
    """Budgets below, at and above the length; a window and sinks beyond the budget (request 0 at window 64)."""
    lengths = [300, 41, 1000, 7, 64] if not emulated(device) else [300, 41, 7]
    budgets = [30, 41, 100, 3, 20][: len(lengths)]
    keep_first = 2
    pages = sum(-(-n // page_size) for n in lengths) + 2
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1))
    indptr, indices, last, at = [0], [], [], 0
    for n in lengths:
        c = -(-n // page_size)
        indices += perm[at : at + c].tolist()
        at += c
        indptr.append(len(indices))
        last.append(n - (c - 1) * page_size)
    scores = quantized_scores(pages, 3, page_size)
    scores[0, 0, 0] = float("nan")
    indptr, indices, last = i32(indptr), i32(indices), i32(last)
    kept, kept_indptr = select_keys(scores.to(device), indptr.to(device), indices.to(device), last.to(device), budgets,
                                    window, keep_first, kernel_size)
    assert kept_indptr.cpu().tolist() == [0] + torch.tensor([min(b, n) for b, n in zip(budgets, lengths)]).cumsum(0).tolist()
    for b in range(len(lengths)):
        expected = select_oracle(paged_scores(scores, indptr, indices, last, b), budgets[b], window, keep_first,
                                 kernel_size)
        assert torch.equal(kept.cpu()[kept_indptr[b] : kept_indptr[b + 1]].long(), expected.long()), f"request {b}"


def test_select_forced_positions_beyond_the_budget(device):
    """keep_first + window above the budget: the lower forced positions win."""
    scores = quantized_scores(4, 1, 16)
    indptr, indices, last = i32([0, 4]), i32([3, 1, 0, 2]), i32([16])
    kept, _ = select_keys(scores.to(device), indptr.to(device), indices.to(device), last.to(device), 5, window=6,
                          keep_first=3)
    assert kept.cpu()[:, 0].tolist() == [0, 1, 2, 58, 59]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fresh_pages", [False, True])
def test_compact_bitwise(device, layout, page_size, fresh_pages):
    lengths, budgets, heads = [150, 33, 80], [40, 33, 17], 3
    cache, indptr, indices, last = paged(random_kv(lengths, heads, 64, 5), page_size, layout, torch.bfloat16, device,
                                         extra_pages=12 if page_size == 16 else 200, seed=5)
    scores = torch.rand(cache.shape[0], heads, page_size, generator=torch.Generator().manual_seed(2)).to(device)
    kept, kept_indptr = select_keys(scores, indptr.to(device), indices.to(device), last.to(device), budgets)
    before = [dense(cache, layout, indptr, indices, last, b) for b in range(len(lengths))]
    before_scores = [paged_scores(scores, indptr, indices, last, b) for b in range(len(lengths))]
    out = {}
    if fresh_pages:
        free = sorted(set(range(cache.shape[0])) - set(indices.tolist()))
        need = [-(-k // page_size) for k in budgets]
        out = {"out_indptr": i32([0] + torch.tensor(need).cumsum(0).tolist()).to(device),
               "out_indices": i32(free[: sum(need)]).to(device)}
    table = compact(cache, indptr.to(device), indices.to(device), last.to(device), kept, kept_indptr, layout, scores,
                    **out)
    new_ptr, new_idx, new_last = table.kv_indptr.cpu(), table.kv_indices.cpu(), table.kv_last_page_len.cpu()
    for b in range(len(lengths)):
        rows = kept.cpu()[kept_indptr[b] : kept_indptr[b + 1]].long()
        k_after, v_after = dense(cache, layout, new_ptr, new_idx, new_last, b)
        heads_ix = torch.arange(heads)[None, :]
        assert torch.equal(k_after, before[b][0][rows, heads_ix]) and torch.equal(v_after, before[b][1][rows, heads_ix])
        assert torch.equal(paged_scores(scores, new_ptr, new_idx, new_last, b), before_scores[b][rows, heads_ix])
    if not fresh_pages:
        assert sorted(table.freed_pages + new_idx.tolist()) == sorted(indices.tolist())


def decode_run(device, cache, indptr, indices, last, q, layout="NHD", kv_scores=None, **plan):
    wrapper = kv_compress_decode_wrapper(device, layout)
    wrapper.plan(indptr.to(device), indices.to(device), last.to(device), q.shape[1], kv_views(cache, layout)[0].shape[2],
                 q.shape[2], kv_views(cache, layout)[0].shape[1], q_data_type=q.dtype, **plan)
    return wrapper.run(q, cache, return_lse=True, **({} if kv_scores is None else {"kv_scores": kv_scores}))


def kv_compress_decode_wrapper(device, layout):
    from flashkern import BatchDecodeWithPagedKVCacheWrapper
    return BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=device), layout)


def test_ratio_zero_is_the_uncompressed_cache(device):
    lengths, heads, group = [120, 70], 2, 4
    cache, indptr, indices, last = paged(random_kv(lengths, heads, 64, 3), 16, "NHD", torch.float16, device, seed=3)
    q = rand((sum(lengths), heads * group, 64), torch.float16, device, seed=4)
    qo_indptr = i32([0] + torch.tensor(lengths).cumsum(0).tolist())
    _, lse = prefill_lse(device, cache, indptr, indices, last, q, qo_indptr)
    q_next = rand((2, heads * group, 64), torch.float16, device, seed=6)
    o_before, _ = decode_run(device, cache, indptr, indices, last, q_next)
    table = SnapKV(ratio=0.0, window=16).compress(q, lse, qo_indptr.to(device), cache, indptr.to(device),
                                                  indices.to(device), last.to(device))
    o_after, _ = decode_run(device, cache, table.kv_indptr, table.kv_indices, table.kv_last_page_len, q_next)
    assert torch.equal(o_before, o_after)


def prefill_lse(device, cache, indptr, indices, last, q, qo_indptr, layout="NHD"):
    from flashkern import BatchPrefillWithPagedKVCacheWrapper
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=device), layout)
    k = kv_views(cache, layout)[0]
    w.plan(qo_indptr.to(device), indptr.to(device), indices.to(device), last.to(device), q.shape[1], k.shape[2],
           q.shape[2], k.shape[1], causal=True, q_data_type=q.dtype)
    return w.run(q, cache, return_lse=True)


def test_snapkv_keeps_a_needle_at_one_percent(device):
    """A key that the window's queries attend to survives a 1 % budget."""
    n, heads, group, d = 1600 if not emulated(device) else 400, 1, 2, 64
    kv = random_kv([n], heads, d, 8)
    needle = 317
    k, v = kv[0]
    k[needle] = 0
    k[needle, 0, 0] = 12.0  # q . k_needle = 12 * q[0]: the window's queries have q[0] = 3
    cache, indptr, indices, last = paged([(k, v)], 16, "NHD", torch.float16, device, seed=8)
    q = rand((n, heads * group, d), torch.float16, device, seed=9) * 0.3
    q[-32:, :, 0] = 3.0
    qo_indptr = i32([0, n])
    _, lse = prefill_lse(device, cache, indptr, indices, last, q, qo_indptr)
    policy = SnapKV(budget=max(n // 100, 1) + 32, window=32)
    scores = policy.scores(q, lse, qo_indptr.to(device), cache, indptr.to(device), indices.to(device), last.to(device))
    kept, _ = select_keys(scores, indptr.to(device), indices.to(device), last.to(device), policy.budget, 32, 0, 5)
    assert needle in kept.cpu()[:, 0].tolist()


def test_streaming_llm(device):
    lengths = [40, 10]
    cache, indptr, indices, last = paged(random_kv(lengths, 1, 64, 2), 4, "NHD", torch.float16, device, seed=2)
    before = [dense(cache, "NHD", indptr, indices, last, b) for b in range(2)]
    table = StreamingLLM(sinks=2, window=8).compress(cache, indptr.to(device), indices.to(device), last.to(device))
    k0, _ = dense(cache, "NHD", table.kv_indptr.cpu(), table.kv_indices.cpu(), table.kv_last_page_len.cpu(), 0)
    keep = [0, 1] + list(range(32, 40))
    assert torch.equal(k0, before[0][0][keep])
    k1, _ = dense(cache, "NHD", table.kv_indptr.cpu(), table.kv_indices.cpu(), table.kv_last_page_len.cpu(), 1)
    assert torch.equal(k1, before[1][0])


def test_bad_input(device):
    cache, indptr, indices, last = paged(random_kv([20], 1, 64, 2), 4, "NHD", torch.float16, device, seed=2)
    scores = torch.zeros(cache.shape[0], 1, 4, device=device)
    args = (indptr.to(device), indices.to(device), last.to(device))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        select_keys(scores, *args, 0)
    kept, kept_indptr = select_keys(scores, *args, 100)  # past the length: every key
    assert kept.cpu()[:, 0].tolist() == list(range(20))
    twice = (i32([0, 6]).to(device), torch.cat([indices, indices[:1]]).to(device), last.to(device))
    kept_twice, kept_twice_indptr = select_keys(scores, *twice, 5)  # reading a page twice is fine
    with pytest.raises(ValueError, match="appears twice"):  # writing it is not
        kv_compress.compact(cache, *twice, kept_twice, kept_twice_indptr)
    with pytest.raises(ValueError, match="appears twice"):
        key_scores(rand((1, 1, 64), torch.float16, device), torch.zeros(1, 1, device=device), cache,
                   i32([0, 1]).to(device), *twice)
    with pytest.raises(ValueError, match="scores must be a contiguous float32"):
        kv_compress.compact(cache, *args, kept, kept_indptr, scores=scores.double())
    with pytest.raises(ValueError, match="kv_indices must name pages"):
        select_keys(scores, indptr.to(device), (indices + 100).to(device), last.to(device), 5)
    q = rand((20, 1, 64), torch.float16, device)
    lse = torch.zeros(20, 1, device=device)
    with pytest.raises(ValueError, match="ratio"):
        SnapKV(ratio=1.5, window=4).compress(q, lse, i32([0, 20]).to(device), cache, *args)
    # a prompt no longer than the window is kept whole
    table = SnapKV(ratio=0.5, window=64).compress(q, lse, i32([0, 20]).to(device), cache, *args)
    assert int(table.kv_indptr[-1]) == 5 and int(table.kv_last_page_len[0]) == 4


def test_budget_and_policy_numbers_must_be_ints(device):
    """A float budget tensor was truncated (2.7 kept 2, while the float 2.5 is a TypeError); StreamingLLM took
    sinks=2.5 (compress() failed later, bare) and sinks='4' failed in a bare comparison."""
    cache, indptr, indices, last = paged(random_kv([20], 1, 64, 2), 4, "NHD", torch.float16, device, seed=2)
    scores = torch.zeros(cache.shape[0], 1, 4, device=device)
    args = (indptr.to(device), indices.to(device), last.to(device))
    for budget in (torch.tensor([2.7]), torch.tensor([True]), 2.5):
        with pytest.raises(TypeError, match="budget must be an int or one int per request"):
            select_keys(scores, *args, budget)
    kept, _ = select_keys(scores, *args, torch.tensor([3]))
    assert kept.shape[0] == 3
    for sinks in (2.5, "4", True):
        with pytest.raises(TypeError, match="StreamingLLM: sinks must be an int"):
            StreamingLLM(sinks=sinks)
    with pytest.raises(TypeError, match="StreamingLLM: window must be an int"):
        StreamingLLM(window=8.0)


def test_h2o_policy_moves_scores(device):
    lengths = [50]
    cache, indptr, indices, last = paged(random_kv(lengths, 2, 64, 1), 8, "NHD", torch.float16, device, seed=1)
    scores = quantized_scores(cache.shape[0], 2, 8, seed=3).to(device)
    before = paged_scores(scores, indptr, indices, last, 0)
    table = H2O(heavy=6, recent=4).compress(scores, cache, indptr.to(device), indices.to(device), last.to(device))
    kept = torch.stack([torch.tensor(select_oracle(before[:, h : h + 1], 10, 4, 0, 1)[:, 0].tolist()) for h in range(2)], 1)
    after = paged_scores(scores, table.kv_indptr.cpu(), table.kv_indices.cpu(), table.kv_last_page_len.cpu(), 0)
    assert torch.equal(after, before[kept, torch.arange(2)[None, :]])


@pytest.mark.parametrize("split", [None, 4])
def test_h2o_scores_over_prefill_and_decode_steps(device, split):
    """run(kv_scores=...) of a causal prefill, then decode steps that append a token each (split-KV with
    fixed_split_size=4 pages: several chunks, merged states), against H2O's sum of float64 probabilities;
    then H2O compaction, and decoding goes on from the compacted cache with the scores moved along."""
    from flashkern import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

    heads, group, d, page_size = 2, 4, 64, 16
    lengths = [300, 130] if not emulated(device) else [150, 90]
    steps = 3
    kv = random_kv([n + steps for n in lengths], heads, d, 11)
    cache, indptr, indices, last = paged(kv, page_size, "NHD", torch.float16, device, seed=11)
    # the prompt: every request's first lengths[b] tokens
    last_prompt = i32([n - (-(-n // page_size) - 1) * page_size for n in lengths])
    indptr_prompt = i32([0] + torch.tensor([-(-n // page_size) for n in lengths]).cumsum(0).tolist())
    indices_prompt = torch.cat([indices[indptr[b] : indptr[b] + (indptr_prompt[b + 1] - indptr_prompt[b])]
                                for b in range(len(lengths))])
    q = rand((sum(lengths), heads * group, d), torch.float16, device, seed=12)
    qo_indptr = i32([0] + torch.tensor(lengths).cumsum(0).tolist())
    scores = torch.full((cache.shape[0], heads, page_size), float("nan"), device=device)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    pre = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo_indptr.to(device), indptr_prompt.to(device), indices_prompt.to(device), last_prompt.to(device),
             heads * group, heads, d, page_size, causal=True, q_data_type=torch.float16)
    _, lse = pre.run(q, cache, return_lse=True, kv_scores=scores)
    expected = []
    for b, n in enumerate(lengths):
        k = kv[b][0][:n].to(torch.float16).double()
        s = logits64(q[qo_indptr[b] : qo_indptr[b + 1]], k, d**-0.5)
        expected.append(torch.exp(s - torch.logsumexp(s, -1, keepdim=True)).nan_to_num(0.0).view(n, heads, group, n)
                        .sum((0, 2)).t())
    dec = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    for step in range(steps):
        now = [n + step + 1 for n in lengths]
        pages = [-(-n // page_size) for n in now]
        d_indptr = i32([0] + torch.tensor(pages).cumsum(0).tolist())
        d_indices = torch.cat([indices[indptr[b] : indptr[b] + pages[b]] for b in range(len(now))])
        d_last = i32([n - (p - 1) * page_size for n, p in zip(now, pages)])
        dec.plan(d_indptr.to(device), d_indices.to(device), d_last.to(device), heads * group, heads, d, page_size,
                 q_data_type=torch.float16, fixed_split_size=split)
        qd = rand((len(now), heads * group, d), torch.float16, device, seed=20 + step)
        dec.run(qd, cache, kv_scores=scores)
        for b, n in enumerate(now):
            k = kv[b][0][:n].to(torch.float16).double()
            s = logits64(qd[b : b + 1], k, d**-0.5)[0]  # [qo_heads, n]
            p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True)).view(heads, group, n).sum(1).t()
            expected[b] = torch.cat([expected[b], torch.zeros(1, heads, dtype=torch.float64)]) + p
    for b in range(len(lengths)):
        assert_close(paged_scores(scores, d_indptr, d_indices, d_last, b), expected[b], torch.float32)
    # compress, and accumulate on: the kept keys keep their scores; the next step appends a token and adds
    moved = [paged_scores(scores, d_indptr, d_indices, d_last, b) for b in range(len(lengths))]
    kept, kept_indptr = select_keys(scores, d_indptr.to(device), d_indices.to(device), d_last.to(device), 40, 8)
    table = compact(cache, d_indptr.to(device), d_indices.to(device), d_last.to(device), kept, kept_indptr,
                    scores=scores)
    t_ptr, t_idx, t_last = table.kv_indptr.cpu(), table.kv_indices.cpu(), table.kv_last_page_len.cpu() + 1
    new_kv = rand((len(lengths), 2, heads, d), torch.float16, device, seed=31)
    for b in range(len(lengths)):  # position 40: page 2, slot 8 of the compacted table
        cache[t_idx[t_ptr[b] + 2], :, 8] = new_kv[b]
    dec.plan(t_ptr.to(device), t_idx.to(device), t_last.to(device), heads * group, heads, d, page_size,
             q_data_type=torch.float16)
    qd = rand((len(lengths), heads * group, d), torch.float16, device, seed=30)
    dec.run(qd, cache, kv_scores=scores)
    for b in range(len(lengths)):
        rows = kept.cpu()[kept_indptr[b] : kept_indptr[b + 1]].long()
        k, _ = dense(cache, "NHD", t_ptr, t_idx, t_last, b)  # per head its own kept keys, then the new one
        s = logits64(qd[b : b + 1], k, d**-0.5, causal=False)[0]
        p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True)).view(heads, group, -1).sum(1).t()
        before = torch.cat([moved[b][rows, torch.arange(heads)], torch.zeros(1, heads, dtype=torch.float64)])
        assert_close(paged_scores(scores, t_ptr, t_idx, t_last, b), before + p, torch.float32)


@pytest.mark.parametrize("group,q_len", [(4, 1), (8, 1), (16, 1), (4, 3)])
def test_decode_scores_from_the_attention_logits(device, group, q_len):
    """Decode with a window, a soft cap and split KV: GQA 4 (the decode kernel), 8 and 16 (16-row tiles), three
    queries a request (MTP: causal among themselves, 16-row tiles). run(kv_scores=) reads the logits the
    attention kernels wrote (their epilogue), against float64 probabilities."""
    from flashkern import BatchDecodeWithPagedKVCacheWrapper

    heads, d, page_size, window, cap = 2, 64, 16, 50, 30.0
    lengths = [200, 37, 3]
    kv = random_kv(lengths, heads, d, 5)
    cache, indptr, indices, last = paged(kv, page_size, "NHD", torch.bfloat16, device, seed=5)
    q = rand((len(lengths) * q_len, heads * group, d), torch.bfloat16, device, seed=6)
    dec = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=device))
    dec.plan(indptr.to(device), indices.to(device), last.to(device), heads * group, heads, d, page_size,
             q_data_type=torch.bfloat16, window_left=window, logits_soft_cap=cap, fixed_split_size=4,
             q_len_per_req=q_len)
    info = dec._core._plan_info
    assert info["grid"][2] == 0 and info["grid"][3] == 1  # no 64-row tile (they write no logits); a split merged
    scores = torch.zeros(cache.shape[0], heads, page_size, device=device)
    dec.run(q, cache, kv_scores=scores)
    for b, n in enumerate(lengths):
        k = kv[b][0].to(torch.bfloat16).double()
        s = logits64(q[b * q_len : (b + 1) * q_len], k, d**-0.5, causal=True, window_left=window, cap=cap)
        p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True)).view(q_len, heads, group, n).sum((0, 2)).t()
        assert_close(paged_scores(scores, indptr, indices, last, b), p, torch.float32)


def test_attention_logits_argument_is_checked(device):
    """kv_scores' logits (the wrapper allocates them): float32 [q rows, qo_heads, >= max_kv_len], contiguous."""
    from flashkern.kv_compress import _run

    cache, indptr, indices, last = paged(random_kv([5, 9], 2, 64, 0), 16, "NHD", torch.float16, device)
    q = rand((2, 4, 64), torch.float16, device)
    args = (q, torch.zeros(2, 4, device=device), cache[:, 0], i32([0, 1, 2]).to(device), indptr.to(device),
            indices.to(device), last.to(device), torch.zeros(cache.shape[0], 2, 16, device=device), 9, 0.125, 1.0,
            True, -1, 0.0, False)
    for bad in (torch.zeros(2, 4, 8, device=device), torch.zeros(2, 4, 9, dtype=torch.float16, device=device),
                torch.zeros(2, 4, 18, device=device)[:, :, ::2], torch.zeros(2, 3, 9, device=device)):
        with pytest.raises(ValueError, match="logits must be a contiguous float32 tensor"):
            _run("kv_scores", q.device, torch.float16, *args, bad)
    # a request longer than max_kv_len (8 < 9): the host reference refuses; the kernels score keys 0 .. 7 only
    short = args[:8] + (8,) + args[9:]
    if emulated(device):
        _run("kv_scores", q.device, torch.float16, *short, torch.zeros(2, 4, 8, device=device))
        pages = indices[indptr[1] : indptr[2]].long()
        assert (short[7][pages[0], :, :8] > 0).all() and (short[7][pages[0], :, 8] == 0).all()
    else:
        with pytest.raises(ValueError, match="past max_kv_len"):
            _run("kv_scores", q.device, torch.float16, *short, torch.zeros(2, 4, 8, device=device))


def test_attention_logits_need_one_level_without_a_mask(device):
    """The attention kernels write a key's logit at its position in its level: a cascade plan (two levels) or a
    custom mask with logits is refused by batch_attention itself."""
    from flashkern import MultiLevelCascadeAttentionWrapper, _backend
    from flashkern._paged_attention import _batch_attention_cpu

    cache, indptr, indices, last = paged(random_kv([20, 20], 2, 64, 0), 16, "NHD", torch.float16, device)
    wrapper = MultiLevelCascadeAttentionWrapper(2, torch.empty(16 << 20, dtype=torch.uint8, device=device))
    wrapper.plan([i32([0, 2]), i32([0, 1, 2])], [i32([0, 1]), i32([0, 1, 2])], [indices[:1], indices[2:4]],
                 [i32([16]), i32([4, 4])], 8, 2, 64, 16, q_data_type=torch.float16)
    info, core = wrapper._core._plan_info, wrapper._core
    q = rand((2, 8, 64), torch.float16, device)
    k, v = cache[:, 0], cache[:, 1]
    run = _batch_attention_cpu if _backend.use_reference(q.device) else torch.ops.flashkern.batch_attention
    with pytest.raises(ValueError, match="one level"):
        run(q, k, v, info["kv_indices"], core._workspace, torch.empty_like(q), torch.empty(2, 8, device=device),
            info["grid"], 0.125, None, 1.0, False, None, 0.0, torch.zeros(2, 8, 64, device=device))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compaction_through_the_prefix_cache(device, layout):
    """Requests sharing prefix pages compress into fresh pages of their own: no shared page is written, the
    other requests and later ones still share them, and the cache's page lists and pool stay whole."""
    from flashkern.prefix_cache import PrefixCache

    page_size, heads, pool = 4, 2, 40
    cache = PrefixCache(pool, page_size)
    shape = (pool, 2, page_size, heads, 64) if layout == "NHD" else (pool, 2, heads, page_size, 64)
    kv = rand(shape, torch.float16, device, seed=8)
    a = cache.start(list(range(1, 23)))  # 22 tokens
    cache.publish(a)
    b = cache.start(list(range(1, 13)) + [99] * 9)  # shares a's first 3 pages
    other = cache.start(list(range(1, 13)) + [77] * 3)  # shares them too, not compressed
    assert len(b.path) == 3
    plan = cache.plan_decode([a, b])
    indptr, indices, last = (x.to(device) for x in plan)
    scores = torch.rand(pool, heads, page_size, generator=torch.Generator().manual_seed(3)).to(device)
    kept, kept_indptr = select_keys(scores, indptr, indices, last, [7, 5], window=2)
    before = [dense(kv, layout, *plan, r) for r in range(2)]
    before_scores = [paged_scores(scores, *plan, r) for r in range(2)]
    shared = sorted({n.page for n in cache._nodes()})
    kv_shared = kv[shared].clone()

    new = cache.compact([a, b], kv, kept, kept_indptr, layout, scores)

    assert torch.equal(kv[shared], kv_shared)  # shared pages are never written
    assert not set(new.indices.tolist()) & set(shared)
    for r, request in enumerate((a, b)):
        rows = kept.cpu()[kept_indptr[r] : kept_indptr[r + 1]].long()
        k_after, v_after = dense(kv, layout, *new, r)
        heads_ix = torch.arange(heads)[None, :]
        assert torch.equal(k_after, before[r][0][rows, heads_ix]) and torch.equal(v_after, before[r][1][rows, heads_ix])
        assert torch.equal(paged_scores(scores, *new, r), before_scores[r][rows, heads_ix])
        assert request.path == [] and request.kv_tokens == rows.shape[0]
    assert (len(a.tokens), len(b.tokens)) == (22, 21)  # positions for the next token's RoPE stay
    assert len(other.path) == 3 and cache.match(list(range(1, 13)))[1] == [n.page for n in other.path]

    cache.append(a, 6)  # 13 tokens of KV: 4 pages
    assert len(a.pages) == 4 and cache.plan_decode([a]).last_page_len.tolist() == [1]
    with pytest.raises(ValueError, match="compressed"):
        cache.publish(a)
    for request in (a, b, other):
        cache.finish(request)
    assert cache.free_pages + sum(1 for _ in cache._nodes()) == pool  # every page back in the pool or the tree
    with pytest.raises(ValueError, match="kept_indptr"):
        cache.compact([cache.start([1, 2, 3])], kv, kept, kept_indptr, layout)


def test_score_grid_need_not_cover_the_longest_request(device):
    """max_kv_len only sizes the score kernel's grid: a block loops over the key tiles of a longer request
    (what CUDA graphs need), with the same bits as a grid of a block a tile."""
    cache, indptr, indices, last, qo_indptr, q, lse, _ = setup(device, [300, 45], [3, 2], 2, 4)
    args = (q, lse, cache[:, 0], qo_indptr.to(device), indptr.to(device), indices.to(device), last.to(device))
    scores = []
    for max_kv_len in (300, 64, 1):
        s = torch.full((cache.shape[0], 2, 16), float("nan"), device=device)
        kv_compress._run("kv_scores", q.device, cache.dtype, *args, s, max_kv_len, 64**-0.5, 1.0, True, -1, 0.0, False)
        scores.append(paged_scores(s, indptr, indices, last, 0))
    assert torch.equal(scores[0], scores[1]) and torch.equal(scores[0], scores[2])


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kv_scores_with_cuda_graph_buffers(device, kind):
    """use_cuda_graph=True: run(kv_scores=) reads the fixed page-table buffers with a grid that does not follow
    the plan (the second pass, no logits), so a replay after plan() scores the new tables; such a wrapper's
    plans keep the batch and never repeat a page."""
    from flashkern import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

    heads, group, d, page_size = 2, 4, 64, 16
    q_lens = [1, 1] if kind == "decode" else [3, 2]
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    bufs = [torch.empty(n, dtype=torch.int32, device=device) for n in (3, 64, 2, 3)]
    if kind == "decode":
        wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                                     paged_kv_indices_buffer=bufs[1],
                                                     paged_kv_last_page_len_buffer=bufs[2])
    else:
        wrapper = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs[3],
                                                      paged_kv_indptr_buf=bufs[0], paged_kv_indices_buf=bufs[1],
                                                      paged_kv_last_page_len_buf=bufs[2])
    lengths = [200, 37, 90, 260]
    cache, indptr, indices, last, qo_indptr, q, lse, probs = setup(device, lengths, q_lens * 2, heads, group)
    for first in (0, 2):  # a plan, then a replan with other lengths and pages: what a replay would score
        pair = [first, first + 1]
        p_indptr = indptr[first : first + 3] - indptr[first]
        p_indices, p_last = indices[indptr[first] : indptr[first + 2]], last[first : first + 2]
        rows = slice(int(qo_indptr[first]), int(qo_indptr[first + 2]))
        if kind == "decode":
            wrapper.plan(p_indptr, p_indices, p_last, heads * group, heads, d, page_size, q_data_type=torch.float16)
        else:
            wrapper.plan(qo_indptr[first : first + 3] - qo_indptr[first], p_indptr, p_indices, p_last, heads * group,
                         heads, d, page_size, causal=True, q_data_type=torch.float16)
        scores = torch.zeros(cache.shape[0], heads, page_size, device=device)
        _, got_lse = wrapper.run(q[rows], cache, return_lse=True, kv_scores=scores)
        assert_close(got_lse, lse[rows], torch.float16)
        for i, b in enumerate(pair):
            expected = probs[b].view(q_lens[i], heads, group, lengths[b]).sum((0, 2)).t()
            assert_close(paged_scores(scores, p_indptr, p_indices, p_last, i), expected, torch.float32)
    twice = (i32([0, 1, 2]), i32([5, 5]), i32([16, 16]))
    with pytest.raises(ValueError, match="repeat a page"):
        if kind == "decode":
            wrapper.plan(*twice, heads * group, heads, d, page_size, q_data_type=torch.float16)
        else:
            wrapper.plan(i32([0, 1, 2]), *twice, heads * group, heads, d, page_size, causal=True,
                         q_data_type=torch.float16)
