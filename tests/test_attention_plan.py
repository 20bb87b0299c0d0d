"""The host planner of batch attention (csrc/include/flashkern/attention_plan.h), through the
wrappers' plan(): every (query, q head, KV token) is covered exactly once per level, chunks are
64-token aligned and balanced over the device, the merge lists name exactly each query's states,
and the workspace bounds hold."""

import random

import pytest
import torch
from paged_kv import i32

import flashkern
from flashkern import _C, ref

KIND_ROWS = ref.attention.KIND_ROWS


def plan_of(wrapper):
    core = wrapper._core
    info = core._plan_info
    words = core._workspace[: 4 * _C.workspace_layout(core._workspace.numel(), info["batch"], info["num_qo_heads"],
                                                      info["head_dim"])[0]].view(torch.int32)
    return info, ref.attention.read_plan(words)


def check_plan(wrapper, levels, group, causal=False):
    """levels: [(qo_indptr, kv_indptr, last_page_len)] as lists; page_size from the plan; causal: the
    last level's groups are causal (query i of a group of n sees the tokens up to i + length - n)."""
    info, (items, indptr, merge_indices, identity) = plan_of(wrapper)
    batch, page_size, chunk = info["batch"], info["page_size"], info["chunk"]
    assert chunk % 64 == 0 and identity == 0
    covered, slots_of = {}, {t: set() for t in range(batch)}
    for kind, kind_items in enumerate(items):
        lengths = [i[6] - i[5] for i in kind_items]
        assert lengths == sorted(lengths, reverse=True), "longest chunks first"
        for level, q_begin, n_q, row_begin, page_begin, kv_begin, kv_end, slot_base, first, last, mask, length in \
                kind_items:
            qo, kv, last_len = levels[level]
            g = next(j for j in range(len(qo) - 1) if qo[j] == q_begin and qo[j + 1] - qo[j] == n_q)
            assert page_begin == kv[g]
            pages = kv[g + 1] - kv[g]
            assert length == (pages - 1) * page_size + last_len[g]
            assert kv_begin % chunk == 0 and kv_end == min(length, kv_begin + chunk) and kv_begin < kv_end
            assert last == (length - n_q if causal and level == len(levels) - 1 else 1 << 30)
            assert first == -(1 << 30) and mask == -1
            expected_kind = 0 if n_q == 1 and group <= 4 else 1 if n_q * group <= 16 else 2
            assert kind == expected_kind
            rows = range(row_begin, min(row_begin + KIND_ROWS[kind], n_q * group))
            assert row_begin % KIND_ROWS[kind] == 0 and len(rows) > 0
            seeing = [r for r in rows if max(kv_begin, r // group + first) < min(kv_end, r // group + last + 1)]
            assert seeing, "an item some row of which sees its chunk"
            for r in seeing:
                t = q_begin + r // group
                covered.setdefault((level, t, r % group), []).append((kv_begin, kv_end))
                slots_of[t].add(slot_base + t)
    # every row of every group with KV at every level: chunks that cover what it sees exactly once
    states = {t: 0 for t in range(batch)}
    for level, (qo, kv, last_len) in enumerate(levels):
        for g in range(len(qo) - 1):
            pages = kv[g + 1] - kv[g]
            length = (pages - 1) * page_size + last_len[g] if pages else 0
            n_q = qo[g + 1] - qo[g]
            for t in range(qo[g], qo[g + 1]):
                end = min(length, t - qo[g] + length - n_q + 1) if causal and level == len(levels) - 1 else length
                for h in range(group):
                    spans = sorted(covered.pop((level, t, h), []))
                    if end <= 0:
                        assert spans == []
                        continue
                    assert spans[0][0] == 0 and spans[-1][0] < end <= spans[-1][1], (spans, end)
                    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
                states[t] += -(-max(end, 0) // chunk)
    assert not covered, f"rows outside every group: {list(covered)[:5]}"
    for t in range(batch):
        listed = merge_indices[indptr[t] : indptr[t + 1]]
        assert len(listed) == states[t]
        if states[t] == 1:
            assert listed == [-1]  # written by the attention kernel: no slot
        else:
            assert sorted(listed) == sorted(slots_of[t]) and len(slots_of[t]) == states[t]
    all_slots = [s for t in range(batch) if states[t] > 1 for s in slots_of[t]]
    assert len(all_slots) == len(set(all_slots)) and all(0 <= s < info["slots"] for s in all_slots)
    return info


def random_level(rng, batch, page_size, max_len, groups=None):
    sizes = [1] * batch if groups is None else groups
    qo = [0]
    for s in sizes:
        qo.append(qo[-1] + s)
    kv, last = [0], []
    for _ in sizes:
        n = rng.choice([0, 1, rng.randint(1, max_len), rng.randint(1, max_len)])
        pages = -(-n // page_size)
        kv.append(kv[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return qo, kv, last


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group", [1, 4, 5, 32])
def test_random_cascades_are_covered_exactly(seed, group):
    rng = random.Random(seed)
    batch, page_size = rng.randint(1, 40), rng.choice([1, 7, 16, 128])
    shared = [rng.randint(1, batch)]
    while sum(shared) < batch:
        shared.append(rng.randint(1, batch - sum(shared)))
    levels = [random_level(rng, batch, page_size, 3000, [batch]), random_level(rng, batch, page_size, 900, shared),
              random_level(rng, batch, page_size, 300)]
    wrapper = flashkern.MultiLevelCascadeAttentionWrapper(3, torch.empty(64 << 20, dtype=torch.uint8))
    wrapper._core._cta_budget = rng.choice([1, 16, 264, 1000])
    wrapper._core._min_chunk = rng.choice([64, 256])
    tables = [[i32(l[0]) for l in levels], [i32(l[1]) for l in levels],
              [torch.zeros(l[1][-1], dtype=torch.int32) for l in levels], [i32(l[2]) for l in levels]]
    wrapper.plan(*tables, 8 * group, 8, 64, page_size)
    check_plan(wrapper, levels, group)


def decode_plan(lengths, budget, page_size=16, kv_heads=8, group=4, workspace=64 << 20, min_chunk=256):
    level = random_level(random.Random(0), len(lengths), page_size, 1)
    kv, last = [0], []
    for n in lengths:
        pages = -(-n // page_size)
        kv.append(kv[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    level = (level[0], kv, last)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.empty(workspace, dtype=torch.uint8))
    wrapper._core._cta_budget, wrapper._core._min_chunk = budget, min_chunk
    wrapper.plan(i32(kv), torch.zeros(kv[-1], dtype=torch.int32), i32(last), kv_heads * group, kv_heads, 128, page_size)
    return check_plan(wrapper, [level], group)


@pytest.mark.parametrize("q_len", [2, 7])
def test_queries_per_request_are_causal(q_len):
    """q_len_per_req: q_len queries a group at the last level, causal, covered like any group."""
    lengths = [q_len, 700, q_len + 1, 5000, 33]  # kv_len >= q_len_per_req, as plan() requires
    kv, last = [0], []
    for n in lengths:
        pages = -(-n // 16)
        kv.append(kv[-1] + pages)
        last.append(n - (pages - 1) * 16 if pages else 0)
    qo = [q_len * b for b in range(len(lengths) + 1)]
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8))
    wrapper._core._cta_budget, wrapper._core._min_chunk = 64, 256
    wrapper.plan(i32(kv), torch.zeros(kv[-1], dtype=torch.int32), i32(last), 8 * 4, 8, 128, 16, q_len_per_req=q_len)
    assert check_plan(wrapper, [(qo, kv, last)], 4, causal=True)["chunk"] < 5000


def test_one_long_request_is_split_over_the_device():
    info = decode_plan([32768], budget=264)  # H200: 132 SMs x 2; 8 KV heads
    assert info["chunk"] == 1024 and info["counts"][0] == 32  # 32 chunks x 8 KV heads = 256 blocks


def test_a_batch_that_fills_the_device_is_not_split():
    info = decode_plan([4096] * 256, budget=264)
    assert info["counts"][0] == 256 and info["grid"][3] == 0  # one item per request, no merge


def test_balance_cuts_the_long_request_not_the_short_ones():
    info = decode_plan([20000] + [256] * 100, budget=264)
    assert 256 < info["chunk"] < 20000
    assert info["counts"][0] == 100 + -(-20000 // info["chunk"])


def test_min_chunk():
    assert decode_plan([1000], budget=10**6)["chunk"] == 256
    assert decode_plan([1000], budget=10**6, min_chunk=64)["chunk"] == 64


def test_a_small_workspace_grows_the_chunks():
    big = decode_plan([30000] * 2, budget=10**6)
    small = decode_plan([30000] * 2, budget=10**6, workspace=1 << 20)
    capacity = _C.workspace_layout(1 << 20, 2, 32, 128)[2]  # about 60 states of 32 x 128 floats
    assert small["chunk"] > big["chunk"] and small["slots"] <= capacity < big["slots"]


def test_long_causal_prefill_plan():
    """A 32K-token append to a 128K-token sequence (GQA group 8, on an H200-sized device) and a 32K
    prompt: causal row tiles get only the chunks up to their diagonal, the split fills the device,
    and the workspace the plan needs stays small (only queries that merge have partial states)."""
    qo, kv = 32768, 131072
    wrapper = flashkern.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper._core._cta_budget = 264
    args = (i32([0, qo, 2 * qo]), i32([0, kv, kv + qo]), 64, 8, 128)
    needed = wrapper._plan_ragged(**flashkern.prefill._ragged_arguments(*args, {"causal": True}), dry_run=True)
    assert needed < 256 << 20
    wrapper.reset_workspace_buffer(torch.empty(needed, dtype=torch.uint8))
    wrapper.plan(*args, causal=True)
    info, (items, indptr, merge_indices, identity) = plan_of(wrapper)
    assert identity == 1 and info["chunk"] % 64 == 0
    tiles = 2 * qo * 8 // 64
    assert sum(info["counts"]) >= tiles  # every row tile has work
    for level, q_begin, n_q, row_begin, page_begin, kv_begin, kv_end, slot_base, first, last, mask, length in items[2]:
        assert kv_begin <= (min(row_begin + 64, n_q * 8) - 1) // 8 + last  # no item lies past its last row's diagonal
