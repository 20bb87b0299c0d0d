"""An fp8 KV cache (kv_data_type float8_e4m3fn / float8_e5m2, AMD's fnuz formats where the device has
them) under a float16 / bfloat16 q, on every device: the decode, paged and ragged prefill and cascade
wrappers and the single-request functions against float64 attention over the dequantized values
(the fp8 values times k_scale / v_scale, a number or one per KV head). NaN in every unused cache slot
and in the outputs before the run; the argument checks."""

import pytest
import torch
from conftest import poisoned, rand
from paged_kv import i32, paged, random_kv
from test_prefill import check, expected_batch, indptr, workspace

import flashkern
from flashkern import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)

OCP = [torch.float8_e4m3fn, torch.float8_e5m2]
FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def nvidia(device):
    """Whether the device runs NVIDIA's kernels (a CUDA GPU, or their emulation): no fnuz formats."""
    backend = getattr(device, "backend", None)
    return backend == "emulate" or (backend is None and str(device).startswith("cuda") and torch.version.hip is None)


def quantized(kvs, fp8, k_scale, v_scale):
    """Each request's (k, v) float64 [n, kv_heads, D] divided by the scales (per head) and cast to fp8: the
    fp8 values (float64, exact) for the cache, and what they stand for (times the scales) for the oracle."""
    stored = [((k / k_scale[:, None]).to(fp8).double(), (v / v_scale[:, None]).to(fp8).double()) for k, v in kvs]
    return stored, [(k * k_scale[:, None], v * v_scale[:, None]) for k, v in stored]


def scales(kv_heads, per_head, seed):
    """(k_scale, v_scale) as float64 [kv_heads] for the oracle, and as run() takes them: float32 tensors, or
    the numbers (one for every head)."""
    g = torch.Generator().manual_seed(seed)
    if per_head:
        k, v = 0.5 + torch.rand(kv_heads, generator=g, dtype=torch.float64), 0.25 + torch.rand(kv_heads, generator=g,
                                                                                              dtype=torch.float64)
    else:
        k, v = torch.full((kv_heads,), 0.75, dtype=torch.float64), torch.full((kv_heads,), 1.5, dtype=torch.float64)
    return (k, v), (k.float(), v.float()) if per_head else (0.75, 1.5)


def on(device, values):
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in values)


# (group, head_dim, page_size, kv_layout, per-head scales): the decode kernel, the 16-row tiles (groups > 4)
DECODE_CASES = [(1, 128, 16, "NHD", True), (4, 64, 1, "HND", False), (8, 256, 16, "NHD", True),
                (16, 128, 16, "HND", True), (2, 512, 16, "HND", True)]


# every shape in OCP's formats; the fnuz ones (the conversion differs per format, not per shape) in two
@pytest.mark.parametrize("fp8,group,head_dim,page_size,kv_layout,per_head",
                         [(f, *c) for f in OCP for c in DECODE_CASES] + [(f, *DECODE_CASES[i]) for f in FNUZ
                                                                         for i in (0, 3)])
def test_batch_decode(device, fp8, group, head_dim, page_size, kv_layout, per_head):
    kv_heads, dtype = 2, torch.bfloat16 if group == 8 else torch.float16
    (k_s, v_s), run_scales = scales(kv_heads, per_head, seed=group)
    stored, exact = quantized(random_kv([1, 17, 0, 300], kv_heads, head_dim, seed=group), fp8, k_s, v_s)
    cache, kv_indptr, kv_indices, last = paged(stored, page_size, kv_layout, fp8, device, seed=group)
    q = rand((4, kv_heads * group, head_dim), dtype, device, seed=group + 1)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device), kv_layout)
    wrapper.plan(kv_indptr, kv_indices, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=dtype,
                 kv_data_type=fp8)
    k_scale, v_scale = on(device, run_scales)
    if fp8 in FNUZ and nvidia(device):
        with pytest.raises(TypeError, match="not supported on this device"):
            wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)
        return
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    check(out, lse, expected_batch(q, exact, [1] * 4), dtype)


# (causal, window_left, logits_soft_cap, sinks, head_dim): prefill's options over the 16- and 64-row tiles
PREFILL_CASES = [(True, 17, None, True, 256), (False, -1, 30.0, False, 128), (True, 17, 30.0, True, 512)]


@pytest.mark.parametrize("fp8", OCP)
@pytest.mark.parametrize("causal,window_left,cap,sinks,head_dim", PREFILL_CASES)
def test_paged_prefill(device, fp8, causal, window_left, cap, sinks, head_dim):
    qo_lens, kv_lens, kv_heads, group = [17, 1, 40, 0], [40, 1, 200, 9], 2, 4
    (k_s, v_s), run_scales = scales(kv_heads, True, seed=3)
    stored, exact = quantized(random_kv(kv_lens, kv_heads, head_dim, seed=3), fp8, k_s, v_s)
    cache, kv_indptr, kv_indices, last = paged(stored, 16, "NHD", fp8, device, seed=3)
    q = rand((sum(qo_lens), kv_heads * group, head_dim), torch.bfloat16, device, seed=4)
    sink = torch.tensor([0.5, -1.0, 2.0, float("-inf")] * 2, device=device) if sinks else None
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr(qo_lens), kv_indptr, kv_indices, last, kv_heads * group, kv_heads, head_dim, 16,
                 causal=causal, window_left=window_left, logits_soft_cap=cap, q_data_type=torch.bfloat16,
                 kv_data_type=fp8)
    k_scale, v_scale = on(device, run_scales)
    out, lse = poisoned(q.shape, torch.bfloat16, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, sinks=sink)
    check(out, lse, expected_batch(q, exact, qo_lens, causal, window_left, cap=cap, sinks=sink), torch.bfloat16)


def planned_ragged(device, kv_heads, group, per_head, seed, kv_data_type=torch.float8_e4m3fn):
    """A causal ragged prefill over fp8 K and V (requests of 7 and 70 queries, 7 and 90 keys): (wrapper, q, k, v,
    the exact values, qo_lens, the run's scales)."""
    qo_lens, kv_lens, head_dim = [7, 70], [7, 90], 64
    (k_s, v_s), run_scales = scales(kv_heads, per_head, seed=seed)
    stored, exact = quantized(random_kv(kv_lens, kv_heads, head_dim, seed=seed), torch.float8_e4m3fn, k_s, v_s)
    k = torch.cat([k for k, _ in stored]).to(device=device, dtype=torch.float8_e4m3fn)
    v = torch.cat([v for _, v in stored]).to(device=device, dtype=torch.float8_e4m3fn)
    q = rand((sum(qo_lens), kv_heads * group, head_dim), torch.float16, device, seed=seed + 1)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr(qo_lens), indptr(kv_lens), kv_heads * group, kv_heads, head_dim, causal=True,
                 q_data_type=torch.float16, kv_data_type=kv_data_type)
    return wrapper, q, k, v, exact, qo_lens, run_scales


def test_ragged_prefill(device):
    wrapper, q, k, v, exact, qo_lens, _ = planned_ragged(device, 1, 8, False, seed=5, kv_data_type="float8_e4m3fn")
    out, lse = wrapper.run(q, k, v, k_scale=0.75, v_scale=1.5, return_lse=True)
    check(out, lse, expected_batch(q, exact, qo_lens, True), torch.float16)


def test_cascade(device):
    """A shared prefix (level 0) and each request's own tokens (level 1), both read from one fp8 cache."""
    batch, kv_heads, group, head_dim = 5, 2, 4, 128
    (k_s, v_s), run_scales = scales(kv_heads, True, seed=7)
    stored, exact = quantized(random_kv([100, 3, 0, 40, 17, 1], kv_heads, head_dim, seed=7), torch.float8_e5m2, k_s,
                              v_s)
    cache, kv_indptr, kv_indices, last = paged(stored, 16, "NHD", torch.float8_e5m2, device, seed=7)
    levels = ([i32([0, batch]), i32(list(range(batch + 1)))], [kv_indptr[:2], kv_indptr[1:] - kv_indptr[1]],
              [kv_indices[: kv_indptr[1]], kv_indices[kv_indptr[1] :]], [last[:1], last[1:]])
    q = rand((batch, kv_heads * group, head_dim), torch.float16, device, seed=8)
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device))
    wrapper.plan(*levels, kv_heads * group, kv_heads, head_dim, 16, q_data_type=torch.float16,
                 kv_data_type=torch.float8_e5m2)
    k_scale, v_scale = on(device, run_scales)
    out, lse = wrapper.run(q, cache, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    prefix_k, prefix_v = exact[0]
    whole = [(torch.cat([prefix_k, k]), torch.cat([prefix_v, v])) for k, v in exact[1:]]
    check(out, lse, expected_batch(q, whole, [1] * batch), torch.float16)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_request_functions(device, kv_layout):
    kv_heads, head_dim = 2, 64
    (k_s, v_s), _ = scales(kv_heads, False, seed=9)
    [(k, v)], [exact] = quantized(random_kv([50], kv_heads, head_dim, seed=9), torch.float8_e4m3fn, k_s, v_s)
    k, v = (x.to(device=device, dtype=torch.float8_e4m3fn) for x in (k, v))
    if kv_layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    q = rand((kv_heads * 4, head_dim), torch.float16, device, seed=10)
    out, lse = flashkern.single_decode_with_kv_cache(q, k, v, kv_layout, k_scale=0.75, v_scale=1.5, return_lse=True)
    check(out[None], lse[None], expected_batch(q[None], [exact], [1]), torch.float16)
    q = rand((20, kv_heads * 4, head_dim), torch.bfloat16, device, seed=11)
    out, lse = flashkern.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout=kv_layout, k_scale=0.75,
                                                      v_scale=1.5, return_lse=True)
    check(out, lse, expected_batch(q, [exact], [20], True), torch.bfloat16)


def test_flashinfer_head_dim_512_decode_case(device):
    """FlashInfer's fp8 decode test at head_dim 512 as its callers write it (test_batch_decode_kernels.py):
    N(0, 1) float32 values cast to e4m3 in a strided (non-contiguous) NHD cache, `data_type=` in plan(),
    no scales, 32 q heads on 4 KV heads, pages of 8; each request against single_decode_with_kv_cache over
    its own fp8 K and V (FlashInfer's oracle, at its 1e-3) and against float64 attention."""
    batch, kv_len, page_size, kv_heads, qo_heads, d = 3, 97, 8, 4, 32, 512
    pages = -(-kv_len // page_size)
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(batch * pages, 2, 2, page_size, 2, kv_heads, 2, d, generator=g)
    cache = wide.to(torch.float8_e4m3fn)[:, :, 1, :, 1, :, 1].to(device)  # [pages, 2, page_size, kv_heads, D]
    assert not cache.is_contiguous()
    q = torch.randn(batch, qo_heads, d, generator=g).half().to(device)
    kv_indptr = i32([b * pages for b in range(batch + 1)])
    kv_indices, last = i32(list(range(batch * pages))), i32([(kv_len - 1) % page_size + 1] * batch)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(kv_indptr, kv_indices, last, qo_heads, kv_heads, d, page_size, data_type=torch.float8_e4m3fn,
                 q_data_type=torch.float16)
    out, lse = wrapper.run(q, cache, return_lse=True)
    exact = []
    for b in range(batch):
        k, v = (cache[b * pages : (b + 1) * pages, i].flatten(0, 1)[:kv_len] for i in (0, 1))
        o_single = flashkern.single_decode_with_kv_cache(q[b], k, v)
        torch.testing.assert_close(out[b], o_single, rtol=1e-3, atol=1e-3)
        exact.append((k.double().cpu(), v.double().cpu()))
    check(out, lse, expected_batch(q, exact, [1] * batch), torch.float16)


def planned_decode(device, kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16):
    cache, kv_indptr, kv_indices, last = paged(random_kv([20], 2, 64), 16, "NHD", kv_dtype, device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(kv_indptr, kv_indices, last, 4, 2, 64, 16, q_data_type=q_dtype, kv_data_type=kv_dtype)
    return wrapper, rand((1, 4, 64), q_dtype, device), cache


@pytest.mark.parametrize("change,error,match", [
    ({"k_scale": "length"}, ValueError, r"k_scale must be a number or a floating tensor of 1 or num_kv_heads \(2\)"),
    ({"v_scale": "cpu-on-gpu"}, ValueError, r"v_scale must be .* on"),
    ({"k_scale": "nan"}, ValueError, "k_scale must be None or a finite number"),
    ({"cache": torch.float8_e5m2}, TypeError, "must have the planned kv_data_type torch.float8_e4m3fn"),
])
def test_run_checks(device, change, error, match):
    wrapper, q, cache = planned_decode(device)
    kwargs = {}
    if change.get("k_scale") == "length":
        kwargs["k_scale"] = torch.ones(3, device=device)
    if change.get("k_scale") == "nan":
        kwargs["k_scale"] = float("nan")
    if change.get("v_scale") == "cpu-on-gpu":
        kwargs["v_scale"] = torch.ones(2, device="meta")
    if "cache" in change:
        cache = cache.to(change["cache"])
    with pytest.raises(error, match=match):
        wrapper.run(q, cache, **kwargs)


def test_misaligned_cache(device):
    """An fp8 cache 8 bytes past a 16-byte boundary: the kernels (16-byte copies) refuse it; the CPU
    implementation takes it and gives the aligned cache's result."""
    wrapper, q, cache = planned_decode(device)
    buffer = torch.empty(cache.numel() + 8, dtype=torch.uint8, device=cache.device)
    shifted = buffer[8:].view(cache.dtype).view(cache.shape)
    shifted.copy_(cache)
    if device == "cpu" and not hasattr(device, "backend"):  # the CPU implementation, not an emulated kernel
        assert torch.equal(wrapper.run(q, shifted), wrapper.run(q, cache))
    else:
        with pytest.raises(ValueError, match="paged_kv_cache must start on a 16-byte boundary"):
            wrapper.run(q, shifted)


def test_plan_checks(device):
    with pytest.raises(TypeError, match="q_data_type must be torch.float16 or torch.bfloat16, got torch.float8"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device)).plan(
            i32([0, 1]), i32([0]), i32([5]), 4, 2, 64, 16, q_data_type=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="kv_data_type must be torch.float16 or torch.bfloat16, or an fp8 dtype"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device)).plan(
            i32([0, 1]), i32([0]), i32([5]), 4, 2, 64, 16, q_data_type=torch.float16, kv_data_type=torch.int8)
    with pytest.raises(TypeError, match="q_data_type must be torch.float16 or torch.bfloat16"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(device)).plan(
            i32([0, 1]), i32([0]), i32([5]), 4, 2, 64, 16, q_data_type=torch.float32,
            kv_data_type=torch.float8_e4m3fn)
    # a tensor of scales with a 16-bit cache: it would be read per head by kernels that read no scale
    wrapper, q, cache = planned_decode(device, torch.float16)
    with pytest.raises(ValueError, match="k_scale as a tensor needs an fp8 kv_data_type"):
        wrapper.run(q, cache, k_scale=torch.ones(2, device=device))
    # an fp8 k with a float32 q (single_prefill's reference path) or a v of another dtype
    k = torch.zeros(5, 2, 64, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="k and v must have q's dtype torch.float32"):
        flashkern.single_prefill_with_kv_cache(torch.zeros(3, 4, 64, device=device), k, k)
    with pytest.raises(TypeError, match="k and v must have q's dtype"):
        flashkern.single_decode_with_kv_cache(torch.zeros(4, 64, device=device, dtype=torch.float16), k,
                                              k.to(torch.float8_e5m2))


def test_kv_scores_refuses_an_fp8_cache(device):
    wrapper, q, cache = planned_decode(device)
    with pytest.raises(ValueError, match="kv_scores .* reads a 16-bit cache"):
        wrapper.run(q, cache, kv_scores=torch.zeros(cache.shape[0], 2, 16, device=device))


# ---- issue 41: the scales' values, and a per-head v_scale under the ragged wrapper ----

BAD_SCALES = [0.0, -0.5, float("inf"), float("nan")]


def planned_paged_prefill(device, qo_lens=(3, 70), kv_lens=(20, 90), kv_dtype=torch.float8_e4m3fn, seed=9):
    """A paged prefill plan over an fp8 cache (2 KV heads, group 2, head_dim 64): 16- and 64-row tiles."""
    stored = [(k.to(kv_dtype).double(), v.to(kv_dtype).double())
              for k, v in random_kv(list(kv_lens), 2, 64, seed=seed)]
    cache, kv_indptr, kv_indices, last = paged(stored, 16, "NHD", kv_dtype, device, seed=seed)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr(list(qo_lens)), kv_indptr, kv_indices, last, 4, 2, 64, 16, causal=True,
                 q_data_type=torch.float16, kv_data_type=kv_dtype)
    return wrapper, rand((sum(qo_lens), 4, 64), torch.float16, device, seed=seed + 1), cache


def planned_cascade(device):
    cache, kv_indptr, kv_indices, last = paged(random_kv([20, 5], 2, 64), 16, "NHD", torch.float8_e4m3fn, device)
    wrapper = MultiLevelCascadeAttentionWrapper(1, workspace(device))
    wrapper.plan([i32([0, 1, 2])], [kv_indptr], [kv_indices], [last], 4, 2, 64, 16, q_data_type=torch.float16,
                 kv_data_type=torch.float8_e4m3fn)
    return wrapper, rand((2, 4, 64), torch.float16, device), cache


def planned_split_decode(device):
    """Decode split into 16-token chunks: the merge of partial states."""
    cache, kv_indptr, kv_indices, last = paged(random_kv([20, 37], 2, 64), 16, "NHD", torch.float8_e4m3fn, device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(kv_indptr, kv_indices, last, 4, 2, 64, 16, q_data_type=torch.float16,
                 kv_data_type=torch.float8_e4m3fn, fixed_split_size=16)
    return wrapper, rand((2, 4, 64), torch.float16, device), cache


WRAPPERS = {"decode": planned_decode, "split decode": planned_split_decode, "paged prefill": planned_paged_prefill,
            "cascade": planned_cascade}


@pytest.mark.parametrize("name", list(WRAPPERS))
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_bad_scales_raise_before_any_write(device, name, bad):
    """k_scale / v_scale of 0, a negative number, inf or NaN (as a number, or in a CPU tensor of scales, which
    the host reads): ValueError, out and lse untouched; the same numbers as append_paged_kv_cache refuses."""
    wrapper, q, cache = WRAPPERS[name](device)
    out, lse = poisoned(q.shape, torch.float16, device), poisoned(q.shape[:2], torch.float32, device)
    host_read = torch.device(device).type == "cpu"  # a GPU's scale tensor is not read on the host (NaN rows instead)
    for scale in (bad, torch.tensor([1.0, bad])) if host_read else (bad,):
        for which in ("k_scale", "v_scale"):
            with pytest.raises(ValueError, match=rf"{which} must (be None or a finite number > 0|hold numbers > 0)"):
                wrapper.run(q, cache, out=out, lse=lse, **{which: scale})
            assert out.isnan().all() and lse.isnan().all()


def test_bad_scale_numbers_single_request(device):
    k = rand((5, 2, 64), torch.float16, device).to(torch.float8_e4m3fn)
    q = rand((3, 4, 64), torch.float16, device)
    for f in (lambda **s: flashkern.single_prefill_with_kv_cache(q, k, k, **s),
              lambda **s: flashkern.single_decode_with_kv_cache(q[0], k, k, **s)):
        with pytest.raises(ValueError, match="k_scale must be None or a finite number > 0"):
            f(k_scale=0.0)
        with pytest.raises(ValueError, match="v_scale must be None or a finite number > 0"):
            f(v_scale=-1.0)


@pytest.fixture
def device_scales(monkeypatch):
    """Scale tensors as on a GPU: not read on the host (the check of a CPU tensor's values is taken away), so
    the op, the kernels or the reference, gets the bad scales."""
    from flashkern import _paged_attention, page

    monkeypatch.setattr(_paged_attention, "check_kv_scale_values", lambda *args: None)
    monkeypatch.setattr(page, "check_kv_scale_values", lambda *args: None)


@pytest.mark.parametrize("name", list(WRAPPERS))
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_bad_scale_tensor_gives_nan_rows(device, device_scales, name, bad):
    """What a GPU does with a scale tensor it cannot check without a host sync: the rows of the head whose
    k_scale or v_scale is bad come out NaN (never plausible numbers); the other head's rows are as with good
    scales. KV head 1 here: q heads 2 and 3."""
    wrapper, q, cache = WRAPPERS[name](device)
    good = torch.tensor([0.75, 1.25], device=device)
    want = wrapper.run(q, cache, k_scale=good, v_scale=good)
    assert not want.isnan().any()
    for which in ("k_scale", "v_scale"):
        scales = {"k_scale": good, "v_scale": good, which: torch.tensor([0.75, bad], device=device)}
        got = wrapper.run(q, cache, **scales)
        assert got[:, 2:].isnan().all(), f"{which}={bad}: head 1's rows are not NaN"
        assert torch.equal(got[:, :2], want[:, :2])


def test_ragged_prefill_takes_a_per_head_v_scale(device):
    """A per-head v_scale tensor over an fp8 ragged KV (it was refused: "a tensor of scales needs an fp8 KV
    cache"), with o_scale on top; the oracle scales each head's values."""
    wrapper, q, k, v, exact, qo_lens, (k_run, v_run) = planned_ragged(device, 2, 2, True, seed=11)
    out, lse = wrapper.run(q, k, v, k_scale=k_run.to(device), v_scale=v_run.to(device), o_scale=0.5,
                           return_lse=True)
    o, s = expected_batch(q, exact, qo_lens, True)
    check(out, lse, (o * 0.5, s), torch.float16)
