"""Decode attention: BatchDecodeWithPagedKVCacheWrapper and single_decode_with_kv_cache against
attention computed from scratch in float64, on every device (the CPU runs the plan through the
reference, a GPU through the kernels). Page sizes, layouts, GQA groups (any size), head dims,
lengths from 1 to 128K, empty requests, split and unsplit KV; NaN in every unused cache slot and
in the outputs before the run; argument checks in plan() and run(); opcheck, torch.compile and
(GPU) CUDA graph capture and replay after a new plan."""

import pytest
import torch
from conftest import assert_close, poisoned, rand, requires_gpu
from paged_kv import attention, causal_expected, i32, paged, random_kv, rounded
from torch.library import opcheck

import flashkern
from flashkern import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from flashkern.tolerances import tolerance

DTYPES = [torch.float16, torch.bfloat16]
LENGTHS = [1, 17, 37, 0, 4097]  # odd lengths, an empty request, a long one that is split


def workspace(device, mib=32):
    return torch.empty(mib << 20, dtype=torch.uint8, device=device)


def check(out, lse, expected, dtype):
    assert_close(out, torch.stack([o for o, _ in expected]), dtype)
    torch.testing.assert_close(lse.double().cpu(), torch.stack([s for _, s in expected]), **tolerance(torch.float32))


def decode(device, lengths, page_size, kv_heads, group, head_dim, dtype, kv_layout="NHD", seed=0, tuple_cache=False,
           min_chunk=None):
    """Plans and runs one batch, checks it against float64 attention; returns the wrapper."""
    kvs = random_kv(lengths, kv_heads, head_dim, seed)
    cache, indptr, indices, last = paged(kvs, page_size, kv_layout, dtype, device, seed=seed)
    q = rand((len(lengths), kv_heads * group, head_dim), dtype, device, seed=seed + 100)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device), kv_layout)
    if min_chunk is not None:
        wrapper._core._min_chunk = min_chunk
    wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=dtype)
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    kv = (cache[:, 0], cache[:, 1]) if tuple_cache else cache
    result = wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check(out, lse, [attention(q[b], k, v) for b, (k, v) in enumerate(rounded(kvs, dtype))], dtype)
    return wrapper


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_decode(device, page_size, group, dtype):
    wrapper = decode(device, LENGTHS, page_size, 2, group, 128, dtype)
    assert wrapper._core._plan_info["chunk"] < 4097  # the long request was split and merged


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])  # 512: 16-row tiles only, for every group
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("group", [4, 8])  # the decode kernel, the 16-row multi-query kernel
@pytest.mark.parametrize("tuple_cache", [False, True])
def test_head_dims_and_layouts(device, head_dim, kv_layout, group, tuple_cache):
    decode(device, [33, 300, 1], 16, 2, group, head_dim, torch.bfloat16, kv_layout, seed=3, tuple_cache=tuple_cache,
           min_chunk=64)


@pytest.mark.parametrize("kv_heads,group", [(1, 32), (2, 24), (1, 7)])  # MQA, 64-row tiles, odd groups
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_groups_and_mqa(device, kv_heads, group, dtype):
    decode(device, [5, 130, 64], 16, kv_heads, group, 64, dtype, seed=4, min_chunk=64)


def test_unsplit_batch(device):
    wrapper = decode(device, [40, 3, 77], 16, 2, 4, 128, torch.float16, seed=5, min_chunk=1 << 20)
    info = wrapper._core._plan_info
    assert info["counts"] == (3, 0, 0) and info["grid"][3] == 0  # one item per request, nothing to merge


def test_very_different_lengths_and_long_sequence(device):
    """A 128K-token request beside 1-token ones."""
    decode(device, [131073, 1, 2, 1000], 128, 1, 4, 64, torch.bfloat16, seed=6)


def test_all_requests_empty(device):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([0, 0, 0]), i32([]), i32([0, 0]), 8, 2, 64, 16, q_data_type=torch.float16)
    cache = torch.full((4, 2, 16, 2, 64), float("nan"), dtype=torch.float16, device=device)
    out, lse = wrapper.run(rand((2, 8, 64), torch.float16, device), cache, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_replan_changes_the_answer(device):
    """One wrapper, two batches: the second plan fully replaces the first."""
    kv_heads, group, head_dim = 2, 4, 64
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    for seed, lengths in ((10, [100, 7]), (11, [3, 600, 20])):
        kvs = random_kv(lengths, kv_heads, head_dim, seed)
        cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=seed)
        q = rand((len(lengths), kv_heads * group, head_dim), torch.float16, device, seed=seed)
        wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, 16, q_data_type="float16")
        out, lse = wrapper.run(q, cache, return_lse=True)
        check(out, lse, [attention(q[b], k, v) for b, (k, v) in enumerate(rounded(kvs, torch.float16))], torch.float16)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("length", [1, 37, 4097])
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_decode(device, kv_layout, length, dtype):
    (k, v), = rounded(random_kv([length], 2, 128, seed=7), dtype)
    q = rand((8, 128), dtype, device, seed=8)
    kk, vv = (k, v) if kv_layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = single_decode_with_kv_cache(q, kk.to(device, dtype), vv.to(device, dtype), kv_layout, return_lse=True,
                                           sm_scale=0.1)
    eo, e_lse = attention(q, k, v, sm_scale=0.1)
    assert_close(out, eo, dtype)
    torch.testing.assert_close(lse.double().cpu(), e_lse, **tolerance(torch.float32))
    assert_close(single_decode_with_kv_cache(q, kk.to(device, dtype), vv.to(device, dtype), kv_layout, sm_scale=0.1),
                 eo, dtype)


def test_single_decode_head_dim_512(device):
    """Gemma-4's shape: head_dim 512, 16 q heads on one KV head (16-row tiles), split into chunks."""
    (k, v), = rounded(random_kv([700], 1, 512, seed=30), torch.bfloat16)
    q = rand((16, 512), torch.bfloat16, device, seed=31)
    out, lse = single_decode_with_kv_cache(q, k.to(device, torch.bfloat16), v.to(device, torch.bfloat16),
                                           return_lse=True)
    eo, e_lse = attention(q, k, v)
    assert_close(out, eo, torch.bfloat16)
    torch.testing.assert_close(lse.double().cpu(), e_lse, **tolerance(torch.float32))


def test_lse_is_natural_log(device):
    (k, v), = random_kv([50], 1, 64, seed=9)
    q = rand((1, 64), torch.float16, device, seed=9)
    _, lse = single_decode_with_kv_cache(q, k.to(device, torch.float16), v.to(device, torch.float16), return_lse=True)
    logits = (q.double().cpu() @ k[:, 0].to(torch.float16).double().T) / 8.0
    torch.testing.assert_close(lse.double().cpu(), torch.log(torch.exp(logits).sum(-1)), **tolerance(torch.float32))


# ---------------------------------------------------------------- argument checks


def planned(device, dtype=torch.float16):
    kvs = random_kv([20, 5], 2, 64, seed=12)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device, seed=12)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device, 4))
    wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=dtype)
    return wrapper, cache, (indptr, indices, last), rand((2, 8, 64), dtype, device, seed=13)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {**a, "indices": a["indices"].long()}, TypeError, "indices must be int32"),
    (lambda a: {**a, "indptr": a["indptr"].long()}, TypeError, "indptr must be int32"),
    (lambda a: {**a, "indptr": a["indptr"][None]}, ValueError, "indptr must be 1-D"),
    (lambda a: {**a, "last_page_len": a["last_page_len"][:1]}, ValueError, "last_page_len must have 2 entries"),
    (lambda a: {**a, "indptr": i32([0, 2, 1])}, ValueError, "indptr must be non-decreasing"),
    (lambda a: {**a, "indptr": i32([0, 2, 9])}, ValueError, "points past the 3 entries of indices"),
    (lambda a: {**a, "last_page_len": i32([0, 5])}, ValueError, r"last_page_len\[0\] must be in \[1, page_size=16\]"),
    (lambda a: {**a, "last_page_len": i32([17, 5])}, ValueError, r"last_page_len\[0\] must be in \[1, page_size=16\]"),
    (lambda a: {**a, "indices": i32([0, -1, 2])}, ValueError, "negative page index"),
    (lambda a: {**a, "head_dim": 96}, ValueError, "head_dim must be 64, 128, 256 or 512"),
    (lambda a: {**a, "num_qo_heads": 7}, ValueError, "must be a multiple of num_kv_heads"),
    (lambda a: {**a, "q_data_type": torch.float32}, TypeError, "q_data_type must be torch.float16 or torch.bfloat16"),
    (lambda a: {**a, "kv_data_type": torch.bfloat16}, TypeError, "kv_data_type must equal q_data_type"),
    (lambda a: {**a, "page_size": 0}, ValueError, "page_size must be a positive int"),
    (lambda a: {**a, "pos_encoding_mode": "ROPE_LLAMA"}, ValueError, "pos_encoding_mode='ROPE_LLAMA' is not supported"),
    (lambda a: {**a, "logits_soft_cap": -1.0}, ValueError, "logits_soft_cap must be None, 0 or a finite number >= 1e-6"),
])
def test_plan_rejects_bad_page_tables(device, change, error, match):
    args = {"indptr": i32([0, 2, 3]), "indices": i32([0, 1, 2]), "last_page_len": i32([4, 5]), "num_qo_heads": 8,
            "num_kv_heads": 2, "head_dim": 64, "page_size": 16, "q_data_type": torch.float16}
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device, 4))
    with pytest.raises(error, match=match):
        wrapper.plan(**change(args))


def test_last_page_len_of_a_request_without_pages(device):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device, 4))
    with pytest.raises(ValueError, match=r"last_page_len\[1\] must be 0 for a request without pages, got 3"):
        wrapper.plan(i32([0, 1, 1]), i32([0]), i32([4, 3]), 8, 2, 64, 16)


def test_run_checks_shapes_against_the_plan(device):
    wrapper, cache, _, q = planned(device)
    with pytest.raises(ValueError, match="q must have the planned shape"):
        wrapper.run(q[:, :4], cache)
    with pytest.raises(TypeError, match="planned q_data_type"):
        wrapper.run(q.bfloat16(), cache.bfloat16())
    with pytest.raises(ValueError, match=r"\(page_size, num_kv_heads, head_dim\) = \(16, 2, 32\)"):
        wrapper.run(q, cache[..., :32])
    with pytest.raises(ValueError, match="paged_kv_cache must be 5-D"):
        wrapper.run(q, cache[:, 0])
    with pytest.raises(ValueError, match="paged_kv_cache has 2 pages"):  # the plan uses page 2
        wrapper.run(q, cache[:2])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        wrapper.run(q, cache, out=torch.empty_like(q).transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="call plan"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device, 1)).run(q, cache)


def test_workspace_checks(device):
    with pytest.raises(ValueError, match="workspace_buffer must be a contiguous 1-D tensor of 1-byte elements"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(100, dtype=torch.float32, device=device))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(512, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="workspace is too small"):  # not even the per-query part
        wrapper.plan(i32([0, 1, 2]), i32([0, 1]), i32([3, 3]), 32, 8, 128, 16)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs paged_kv_indptr_buffer"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device, 1), use_cuda_graph=True)
    with pytest.raises(ValueError, match="workspace_buffer must start on a 16-byte boundary"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device, 1)[1:])


def test_misaligned_or_strided_q(device):
    """q need not be aligned or contiguous (the GPU path copies it): the answer is q's."""
    wrapper, cache, _, q = planned(device)
    expected = wrapper.run(q, cache)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape)
    shifted.copy_(q)
    wide = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=device)[..., : q.shape[2]]
    wide.copy_(q)
    for view in (shifted, wide):
        torch.testing.assert_close(wrapper.run(view, cache), expected)


def test_misaligned_out_is_rejected(device):
    wrapper, cache, _, q = planned(device)
    out = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape)  # contiguous, 2 bytes off
    with pytest.raises(ValueError, match="out must start on a 16-byte boundary"):
        wrapper.run(q, cache, out=out)


def test_single_decode_checks(device):
    q, k = rand((8, 64), torch.float16, device), rand((9, 2, 64), torch.float16, device)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        single_decode_with_kv_cache(q.float(), k.float(), k.float())
    with pytest.raises(TypeError, match="k and v must have q's dtype"):
        single_decode_with_kv_cache(q, k.bfloat16(), k.bfloat16())
    with pytest.raises(ValueError, match="q must be 2-D"):
        single_decode_with_kv_cache(q[None], k, k)
    with pytest.raises(ValueError, match="single_decode_with_kv_cache: head_dim must be 64, 128, 256 or 512"):
        single_decode_with_kv_cache(q[:, :48], k[..., :48], k[..., :48])
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND'"):
        single_decode_with_kv_cache(q, k, k, kv_layout="NDH")


# ---------------------------------------------------------------- FlashInfer's calling conventions


def test_int8_workspace_and_run_return_lse(device):
    """FlashInfer's examples allocate the workspace as int8; run_return_lse / forward_return_lse."""
    wrapper, cache, tables, q = planned(device)
    expected_out, expected_lse = wrapper.run(q, cache, return_lse=True)
    other = BatchDecodeWithPagedKVCacheWrapper(torch.empty(4 << 20, dtype=torch.int8, device=device))
    other.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16)
    for run in (other.run_return_lse, other.forward_return_lse):
        out, lse = run(q, cache)
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_reset_workspace_buffer_needs_a_new_plan(device):
    wrapper, cache, tables, q = planned(device)
    expected = wrapper.run(q, cache)
    wrapper.reset_workspace_buffer(torch.empty(4 << 20, dtype=torch.int8, device=device),
                                   torch.empty(1 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(RuntimeError, match="call plan"):
        wrapper.run(q, cache)
    wrapper.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16)
    assert torch.equal(wrapper.run(q, cache), expected)
    wrapper.end_forward()  # a no-op, as in FlashInfer
    assert wrapper.use_tensor_cores is False
    assert BatchDecodeWithPagedKVCacheWrapper(workspace(device, 1), use_tensor_cores=True).use_tensor_cores


def test_data_type_fills_only_the_dtypes_left_unset(device):
    wrapper, cache, tables, q = planned(device, torch.bfloat16)
    expected = wrapper.run(q, cache)
    wrapper.plan(*tables, 8, 2, 64, 16, q_data_type=None, data_type=torch.bfloat16)  # fills q and kv
    assert torch.equal(wrapper.run(q, cache), expected)
    # an explicit q_data_type stays: kv_data_type alone becomes bfloat16, which q (float16) must equal
    with pytest.raises(TypeError, match="kv_data_type must equal q_data_type"):
        wrapper.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16, data_type=torch.bfloat16)


# ---------------------------------------------------------------- PyTorch integration


def test_opcheck(device):
    wrapper, cache, _, q = planned(device)
    info = wrapper._core._plan_info
    k, v = cache[:, 0], cache[:, 1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=device)
    opcheck(torch.ops.flashkern.batch_attention.default,
            (q, k, v, info["kv_indices"], wrapper._core._workspace, out, lse, info["grid"], info["sm_scale"]))


def test_workspace_without_a_plan_is_refused(device):
    """The low-level op given a workspace that holds no plan (zeros, random bytes, a plan for another batch):
    ValueError where the workspace is host memory (the reference and the emulate backends); on a GPU,
    reading it would cost a synchronization, and the caller's plan() is the contract."""
    if str(device) != "cpu":
        pytest.skip("a GPU's workspace is not read on the host")
    wrapper, cache, _, q = planned(device)
    info = wrapper._core._plan_info
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=device)
    args = (q, cache[:, 0], cache[:, 1], info["kv_indices"])
    torch.ops.flashkern.batch_attention(*args, wrapper._core._workspace, out, lse, info["grid"], info["sm_scale"])
    foreign = [torch.zeros(1 << 20, dtype=torch.uint8),
               torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))]
    for workspace in foreign:
        with pytest.raises(ValueError, match="the workspace holds no flashkern plan"):
            torch.ops.flashkern.batch_attention(*args, workspace, out, lse, info["grid"], info["sm_scale"])
    with pytest.raises(ValueError, match="the workspace holds no flashkern plan for 1 queries"):
        torch.ops.flashkern.batch_attention(q[:1], *args[1:], wrapper._core._workspace, out[:1], lse[:1], info["grid"],
                                            info["sm_scale"])


def test_head_dim_512_plans_and_grids_have_16_row_tiles_only(device):
    """head_dim 512's plans hold 16-row tiles only (a decode of 1 or 2 heads a group included), a CUDA-graph
    wrapper's fixed grid launches only them, and the op refuses a grid that asks for the other kernels."""
    kvs = random_kv([20, 5], 1, 512, seed=32)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=32)
    for group, graph in ((1, False), (2, True)):
        wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device, 4), use_cuda_graph=graph,
                                                     paged_kv_indptr_buffer=indptr.clone() if graph else None,
                                                     paged_kv_indices_buffer=indices.clone() if graph else None,
                                                     paged_kv_last_page_len_buffer=last.clone() if graph else None)
        wrapper.plan(indptr, indices, last, group, 1, 512, 16, q_data_type=torch.float16)
        info = wrapper._core._plan_info
        assert info["counts"][0] == info["counts"][2] == 0 and info["counts"][1] > 0
        assert info["grid"][0] == info["grid"][2] == 0 and info["grid"][1] > 0
    q = rand((2, 2, 512), torch.float16, device, seed=33)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=device)
    with pytest.raises(ValueError, match="head_dim 512 runs 16-row tiles only"):
        torch.ops.flashkern.batch_attention(q, cache[:, 0], cache[:, 1], info["kv_indices"], wrapper._core._workspace,
                                            out, lse, [1, 1, 0, 1], info["sm_scale"])


def test_head_dim_512_kv_scores_is_refused_before_any_work(device):
    """H2O's scoring kernels take head dims up to 256: at 512 run() refuses kv_scores before attention runs."""
    kvs = random_kv([20], 1, 512, seed=34)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=34)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device, 4))
    wrapper.plan(indptr, indices, last, 2, 1, 512, 16, q_data_type=torch.float16)
    q, out = rand((1, 2, 512), torch.float16, device, seed=35), poisoned((1, 2, 512), torch.float16, device)
    with pytest.raises(ValueError, match=r"kv_scores \(H2O\): head_dim must be 64, 128 or 256, got 512"):
        wrapper.run(q, cache, out=out, kv_scores=torch.zeros(cache.shape[0], 1, 16, device=device))
    assert out.isnan().all()


@pytest.mark.parametrize("group", [40, 64])
def test_head_dim_512_workspace_holds_its_items(group):
    """At head_dim 512 a query's heads run in 16-row tiles, so a group of 40 or 64 heads touches up to 4 or 5
    of them: the workspace that workspace_size() asks for holds the plan's items (host planning only)."""
    batch, pages = 512, 7  # 100 tokens a request, pages of 16
    args = (i32([b * pages for b in range(batch + 1)]), i32(list(range(batch * pages))), i32([4] * batch),
            group, 1, 512, 16)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 0))
    needed, _ = wrapper.workspace_size(*args)
    wrapper.reset_workspace_buffer(torch.empty(needed, dtype=torch.uint8))
    wrapper.plan(*args)
    assert sum(wrapper._core._plan_info["counts"]) >= batch * ((group + 15) // 16)


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    wrapper, cache, _, q = planned(device)
    expected = wrapper.run(q, cache)
    compiled = torch.compile(lambda q, cache: wrapper.run(q, cache, return_lse=True), fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, cache)
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(lse).all()


@requires_gpu
@pytest.mark.parametrize("group", [4, 8])
def test_cuda_graph_replay_after_replan(group):
    """Capture run() once; every later plan() with other lengths is what a replay computes."""
    kv_heads, head_dim, page_size, batch = 2, 128, 16, 3
    kv_indptr_buf = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    kv_indices_buf = torch.empty(4096, dtype=torch.int32, device="cuda")
    last_buf = torch.empty(batch, dtype=torch.int32, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), use_cuda_graph=True,
                                                 paged_kv_indptr_buffer=kv_indptr_buf,
                                                 paged_kv_indices_buffer=kv_indices_buf,
                                                 paged_kv_last_page_len_buffer=last_buf)
    cache = torch.randn(600, 2, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q = rand((batch, kv_heads * group, head_dim), torch.bfloat16, "cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")

    def plan(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        pages = [-(-n // page_size) for n in lengths]
        indices = torch.randperm(600, generator=g)[: sum(pages)].int()
        indptr = i32([0] + torch.tensor(pages).cumsum(0).tolist())
        last = i32([n - (p - 1) * page_size for n, p in zip(lengths, pages)])
        wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size,
                     q_data_type=torch.bfloat16)
        return indptr, indices, last

    def expected(indptr, indices, last):
        return flashkern.ref.batch_decode(q.double(), cache.double(), indptr, indices, last)

    plan([100, 3000, 17], 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run(q, cache, out=out, lse=lse)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache, out=out, lse=lse)
    for lengths, seed in (([100, 3000, 17], 0), ([5000, 1, 640], 1), ([33, 34, 35], 2)):
        tables = plan(lengths, seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eo, e_lse = expected(*tables)
        assert_close(out, eo, torch.bfloat16)
        torch.testing.assert_close(lse.double().cpu(), e_lse.cpu(), **tolerance(torch.float32))


@requires_gpu
def test_misaligned_cache_is_rejected():
    wrapper, cache, _, q = planned("cuda")
    flat = torch.empty(cache.numel() + 1, dtype=cache.dtype, device="cuda")[1:].view(cache.shape)
    flat.copy_(cache)
    with pytest.raises(ValueError, match="16-byte boundary"):
        wrapper.run(q, flat)


def test_flashinfer_plan_and_run_parameters(device):
    """FlashInfer's plan() parameters by position, in its order (o_data_type before data_type) and by
    name; run()'s keywords. What flashkern does not implement raises ValueError naming it."""
    wrapper, cache, tables, q = planned(device)
    expected = wrapper.run(q, cache)
    #           pos_enc  window  soft_cap  q_dtype        kv_dtype       o_dtype        data_type
    wrapper.plan(*tables, 8, 2, 64, 16, "NONE", -1, None, torch.float16, torch.float16, torch.float16, None,
                 None, None, None, True, None, None, None, False, 1, window_right=0)
    out, lse = wrapper.run(q, cache, enable_pdl=True, window_left=-1, sinks=None, q_len_per_req=1,
                           skip_softmax_threshold_scale_factor=None, kv_cache_sf=None, return_lse=True)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="plan: window_right=-1 is not supported by flashkern"):
        wrapper.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16, window_right=-1)
    for name, value in (("skip_softmax_threshold_scale_factor", 0.5), ("kv_cache_sf", (cache, cache))):
        with pytest.raises(ValueError, match=f"run: {name}.* not supported by flashkern"):
            wrapper.run(q, cache, **{name: value})
    with pytest.raises(ValueError, match="run: window_left=128 differs from the plan's -1"):  # the window is planned
        wrapper.run(q, cache, window_left=128)
    with pytest.raises(ValueError, match="run: q_len_per_req=2 differs from the plan's 1"):
        wrapper.run(q, cache, q_len_per_req=2)
    with pytest.raises(ValueError, match="run: k_scale as a tensor needs an fp8 kv_data_type"):
        wrapper.run(q, cache, k_scale=torch.ones(()))
    with pytest.raises(ValueError, match=r"run: sinks must be a floating tensor of shape \(8,\)"):
        wrapper.run(q, cache, sinks=torch.zeros(2, device=device))
    with pytest.raises(TypeError, match="run: out must have the planned o_data_type torch.float16"):
        wrapper.run(q, cache, out=torch.empty(q.shape, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="extra positional arguments"):
        wrapper.run(q, cache, 1.0)
    with pytest.raises(TypeError, match="enable_pdl must be None or a bool"):
        wrapper.run(q, cache, enable_pdl="on")
    with pytest.raises(ValueError, match="jit_args .* not supported"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device, 1), jit_args=["custom"])


@pytest.mark.parametrize("split", ["disable_split_kv", "fixed_split_size"])
def test_split_options(device, split):
    """disable_split_kv: one block of work per request, no merge; fixed_split_size: chunks of that many
    pages whatever the device (the plan does not depend on the batch); both still exact."""
    kwargs = {"disable_split_kv": True} if split == "disable_split_kv" else {"fixed_split_size": 8}  # 8 x 16 tokens
    lengths = [4097, 300, 1]
    kvs = random_kv(lengths, 2, 64, seed=3)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.bfloat16, device, seed=3)
    q = rand((3, 8, 64), torch.bfloat16, device, seed=4)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kwargs)
    info = wrapper._core._plan_info
    assert info["chunk"] == (4160 if split == "disable_split_kv" else 128)  # 4097 rounded up to 64; 8 pages
    assert (info["grid"][3] == 0) == (split == "disable_split_kv")  # a merge only when split
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, lse, [attention(q[b], k, v) for b, (k, v) in enumerate(rounded(kvs, torch.bfloat16))], torch.bfloat16)


@pytest.mark.parametrize("group", [1, 4, 8])  # 16-row tiles (q_len * group <= 16), 64-row tiles
@pytest.mark.parametrize("q_len", [2, 4])
def test_q_len_per_req(device, group, q_len):
    """Several query tokens per request, the request's last ones, causal among themselves: a request of
    exactly q_len tokens (its first query sees one key), a split one."""
    dtype = torch.bfloat16
    lengths = [q_len, 37, 5, 700]
    kvs = random_kv(lengths, 2, 64, seed=30)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device, seed=30)
    q = rand((len(lengths) * q_len, 2 * group, 64), dtype, device, seed=31)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, 2 * group, 2, 64, 16, q_data_type=dtype, q_len_per_req=q_len)
    assert wrapper._core._plan_info["chunk"] < 700
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse, q_len_per_req=q_len)
    check(out, lse, causal_expected(q, rounded(kvs, dtype), q_len), dtype)
    with pytest.raises(ValueError, match="q_len_per_req"):  # FlashInfer's test matches this word
        wrapper.run(q[:-1], cache)


def test_wrappers_sharing_a_workspace(device):
    """Two wrappers given one workspace_buffer (the plan lives in it): A.plan, B.plan, A.run raises instead of
    running B's plan; after A plans again its run is right, and B's is refused."""
    dtype, shared = torch.float16, workspace(device)
    kvs = random_kv([30, 200], 2, 64, seed=40)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device, seed=40)
    q = rand((2, 8, 64), dtype, device, seed=41)
    a, b = BatchDecodeWithPagedKVCacheWrapper(shared), BatchDecodeWithPagedKVCacheWrapper(shared)
    a.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=dtype)
    b.plan(indptr[:2], indices[: indptr[1]], last[:1], 8, 2, 64, 16, q_data_type=dtype)
    with pytest.raises(ValueError, match="another wrapper planned into this workspace_buffer"):
        a.run(q, cache)
    a.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=dtype)
    out, lse = a.run(q, cache, return_lse=True)
    check(out, lse, [attention(q[i], k, v) for i, (k, v) in enumerate(rounded(kvs, dtype))], dtype)
    with pytest.raises(ValueError, match="another wrapper planned"):
        b.run(q[:1], cache)


def test_page_tables_on_the_meta_device(device):
    kvs = random_kv([30], 2, 64, seed=42)
    _, indptr, indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=42)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    with pytest.raises(ValueError, match="meta device"):
        wrapper.plan(indptr.to("meta"), indices, last, 8, 2, 64, 16, q_data_type=torch.float16)


def test_q_len_per_req_rejects_what_flashinfer_rejects(device):
    """KV shorter than q_len_per_req (the verified tokens must be in the cache already), and a CUDA-graph
    wrapper re-planned with another q_len_per_req: ValueError in FlashInfer's words."""
    kvs = random_kv([3, 37], 2, 64, seed=32)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.bfloat16, device, seed=32)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    with pytest.raises(ValueError, match="empty KV range"):
        wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=4)
    wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=3)
    buffers = {"paged_kv_indptr_buffer": torch.empty(3, dtype=torch.int32, device=device),
               "paged_kv_indices_buffer": torch.empty(16, dtype=torch.int32, device=device),
               "paged_kv_last_page_len_buffer": torch.empty(2, dtype=torch.int32, device=device)}
    graph_wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device), use_cuda_graph=True, **buffers)
    graph_wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=2)
    graph_wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=2)
    with pytest.raises(ValueError, match="frozen"):
        graph_wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=3)


@pytest.mark.parametrize("q_len", [1, 3])
def test_sinks(device, q_len):
    """A sink logit per head: one more term, of value zero, in each softmax, also for a request
    without keys (out 0, lse = the sink; one query a request only), across split chunks, and in the lse."""
    dtype = torch.float16
    lengths = [1, 0, 40, 900] if q_len == 1 else [3, 5, 40, 900]
    kvs = random_kv(lengths, 2, 128, seed=32)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device, seed=32)
    q = rand((len(lengths) * q_len, 8, 128), dtype, device, seed=33)
    sinks = rand((8,), torch.float32, device, seed=34) * 3
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, 8, 2, 128, 16, q_data_type=dtype, q_len_per_req=q_len)
    out, lse = wrapper.run(q, cache, sinks=sinks, return_lse=True)
    check(out, lse, causal_expected(q, rounded(kvs, dtype), q_len, sinks), dtype)
    out_bf16, _ = wrapper.run(q, cache, sinks=sinks.bfloat16(), return_lse=True)  # any float dtype
    assert_close(out_bf16, torch.stack([o for o, _ in causal_expected(q, rounded(kvs, dtype), q_len,
                                                                        sinks.bfloat16())]), dtype)
    o1, s1 = single_decode_with_kv_cache(q[2 * q_len], *(x.to(device, dtype) for x in kvs[2]), sinks=sinks,
                                         return_lse=True)
    check(o1[None], s1[None], [attention(q[2 * q_len], *rounded(kvs, dtype)[2], sinks=sinks)], dtype)


@pytest.mark.parametrize("q_dtype,o_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_o_data_type_and_scales(device, q_dtype, o_dtype):
    """o_data_type: the output in the other 16-bit type, rounded once from fp32; q_scale and k_scale
    scale the logits, v_scale the output, as FlashInfer folds them."""
    lengths = [5, 300]
    kvs = random_kv(lengths, 1, 64, seed=35)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", q_dtype, device, seed=35)
    q = rand((2, 4, 64), q_dtype, device, seed=36)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, 4, 1, 64, 16, q_data_type=q_dtype, o_data_type=o_dtype)
    out, lse = poisoned(q.shape, o_dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse, q_scale=0.5, k_scale=3.0, v_scale=0.25)
    assert out.dtype == o_dtype
    expected = [attention(q[b], k, v, sm_scale=1.5 * 64**-0.5) for b, (k, v) in enumerate(rounded(kvs, q_dtype))]
    check(out, lse, [(0.25 * o, s) for o, s in expected], o_dtype)


def test_block_tables_and_seq_lens(device):
    """FlashInfer's fixed-width page table: seq_lens and block_tables alone, or with a CSR table that
    says the same; tables that disagree are a ValueError."""
    wrapper, cache, (indptr, indices, last), q = planned(device)
    expected = wrapper.run(q, cache)
    seq_lens = i32([20, 5])
    block_tables = i32([[indices[0], indices[1], -1], [indices[2], -1, -1]])  # -1: unused entries
    for kwargs in ({"block_tables": block_tables, "seq_lens": seq_lens},
                   {"block_tables": block_tables}, {"seq_lens": seq_lens}):
        tables = (None, None, None) if "seq_lens" in kwargs and "block_tables" in kwargs else (indptr, indices, last)
        wrapper.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16, **kwargs)
        assert torch.equal(wrapper.run(q, cache), expected)
    op = "BatchDecodeWithPagedKVCacheWrapper.plan"
    for kwargs, match in (({"seq_lens": i32([20, 6])}, "seq_lens .* differ from the lengths"),
                          ({"block_tables": block_tables[:, :1]}, "block_tables must be a 2-D integer tensor"),
                          ({"block_tables": i32([[indices[1], indices[0]], [indices[2], 0]])},
                           "block_tables names other pages than indices")):
        with pytest.raises(ValueError, match=f"{op}: {match}"):
            wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.float16, **kwargs)
    with pytest.raises(ValueError, match="block_tables needs seq_lens"):
        wrapper.plan(None, None, None, 8, 2, 64, 16, block_tables=block_tables)


def test_workspace_size(device):
    """FlashInfer's workspace_size(): the bytes with which plan() splits as the device asks (the same
    chunks as with a large workspace), 0 for the int workspace; it plans nothing (the current plan stays)."""
    wrapper, cache, (indptr, indices, last), q = planned(device)
    before = wrapper.run(q, cache)
    lengths = [4097, 300, 1]
    kvs = random_kv(lengths, 2, 64, seed=60)
    big_cache, *tables = paged(kvs, 16, "NHD", torch.float16, device, seed=60)
    float_bytes, int_bytes = wrapper.workspace_size(*tables, 8, 2, 64, 16, q_data_type=torch.float16)
    assert int_bytes == 0 and float_bytes > 0
    assert torch.equal(wrapper.run(q, cache), before)
    large = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    large.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16)
    exact = BatchDecodeWithPagedKVCacheWrapper(torch.empty(float_bytes, dtype=torch.uint8, device=device))
    exact.plan(*tables, 8, 2, 64, 16, q_data_type=torch.float16)
    assert exact._core._plan_info["chunk"] == large._core._plan_info["chunk"] < 4097
    q2 = rand((3, 8, 64), torch.float16, device, seed=61)
    out, lse = exact.run(q2, big_cache, return_lse=True)
    check(out, lse, [attention(q2[b], k, v) for b, (k, v) in enumerate(rounded(kvs, torch.float16))], torch.float16)
