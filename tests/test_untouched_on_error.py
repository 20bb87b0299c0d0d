"""A call that raises leaves every tensor it would write as it was: an in-place or out= op checks all its
arguments before its first write, on every backend (the reference, the emulated kernels; a GPU). One table,
an op family a few rows: each row builds a call that must raise and the tensors it writes (outputs, caches,
accumulators, in-place operands); the test snapshots their bits, makes the call and compares (issue 41:
run(kv_scores=...) wrote out and lse before the score step raised; allreduce_fusion wrote the sum before the
norm refused rms_eps)."""

import pytest
import torch
from conftest import rand
from paged_kv import i32, paged, random_kv

import flashkern
from flashkern import kv_compress

PAGE = 16


def workspace(device):
    return torch.empty(32 << 20, dtype=torch.uint8, device=device)


def attention_case(device, kind, dtype=torch.float16):
    """A planned wrapper over a 16-bit paged cache (2 requests, 2 KV heads, group 2, head_dim 64), q, the cache,
    and out / lse / kv_scores buffers (NaN-free values, so that any write shows)."""
    cache, kv_indptr, kv_indices, last = paged(random_kv([20, 33], 2, 64), PAGE, "NHD", dtype, device, seed=1)
    if kind == "decode":
        wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(workspace(device))
        wrapper.plan(kv_indptr, kv_indices, last, 4, 2, 64, PAGE, q_data_type=dtype)
        tokens = 2
    elif kind == "prefill":
        wrapper = flashkern.BatchPrefillWithPagedKVCacheWrapper(workspace(device))
        wrapper.plan(i32([0, 3, 8]), kv_indptr, kv_indices, last, 4, 2, 64, PAGE, causal=True, q_data_type=dtype)
        tokens = 8
    else:
        wrapper = flashkern.MultiLevelCascadeAttentionWrapper(1, workspace(device))
        wrapper.plan([i32([0, 1, 2])], [kv_indptr], [kv_indices], [last], 4, 2, 64, PAGE, q_data_type=dtype)
        tokens = 2
    q = rand((tokens, 4, 64), dtype, device, seed=2)
    out = rand((tokens, 4, 64), dtype, device, seed=3)
    lse = rand((tokens, 4), torch.float32, device, seed=4)
    scores = rand((cache.shape[0], 2, PAGE), torch.float32, device, seed=5)
    return wrapper, q, cache, out, lse, scores


def bad_scores(scores, how):
    if how == "dtype":
        return scores.half()
    if how == "shape":
        return torch.zeros(scores.shape[0], scores.shape[1], scores.shape[2] + 1, device=scores.device)
    return torch.zeros(scores.shape[0], scores.shape[2], scores.shape[1], device=scores.device).transpose(1, 2)


def kv_scores_row(kind, how):
    """Item 1: run(kv_scores=s, out=out, lse=lse) with s of the wrong dtype, shape or layout."""
    def build(device):
        wrapper, q, cache, out, lse, scores = attention_case(device, kind)
        s = bad_scores(scores, how)
        return (lambda: wrapper.run(q, cache, out=out, lse=lse, kv_scores=s)), [out, lse, cache, s], \
            r"kv_scores \(H2O's running scores\): scores must be a contiguous float32 tensor"
    return build


def attention_scale_row(kind):
    def build(device):
        wrapper, q, cache, out, lse, _ = attention_case(device, kind)
        return (lambda: wrapper.run(q, cache, out=out, lse=lse, v_scale=0.0)), [out, lse, cache], \
            "v_scale must be None or a finite number > 0"
    return build


def rmsnorm_row(device):
    x, w = rand((3, 64), torch.float16, device), rand((64,), torch.float16, device)
    out = rand((3, 64), torch.float16, device, seed=1)
    return (lambda: flashkern.rmsnorm(x, w, eps=-1.0, out=out)), [out, x], "eps must be a finite number >= 0"


def fused_add_rmsnorm_row(device):
    x, res, w = (rand(s, torch.float16, device, seed=i) for i, s in enumerate([(3, 64), (3, 64), (64,)]))
    return (lambda: flashkern.fused_add_rmsnorm(x, res, w, eps=float("nan"))), [x, res], \
        "eps must be a finite number >= 0"


def silu_and_mul_row(device):
    x, out = rand((3, 64), torch.float16, device), rand((3, 31), torch.float16, device, seed=1)
    return (lambda: flashkern.silu_and_mul(x, out=out)), [out, x], "out"


def rope_row(device):
    q, k = rand((5, 4, 64), torch.float16, device), rand((5, 2, 64), torch.float16, device, seed=1)
    return (lambda: flashkern.apply_rope_inplace(q, k, i32([0, 5]).to(device), i32([0]).to(device),
                                                 rotary_dim=65)), [q, k], "rotary_dim"


def append_row(device):
    cache = rand((4, 2, PAGE, 2, 16), torch.float32, device).to(torch.float8_e4m3fn)
    kv = rand((3, 2, 16), torch.float16, device)
    return (lambda: flashkern.append_paged_kv_cache(kv, -kv, i32([0, 0, 0]).to(device), i32([0, 1, 2]).to(device),
                                                    cache, i32([3]).to(device), i32([0, 1]).to(device),
                                                    i32([3]).to(device), v_scale=torch.tensor([1.0, -1.0]))), \
        [cache], "v_scale must hold numbers > 0"


def key_scores_row(device):
    """Accumulating scores with an lse of the wrong dtype: the accumulator keeps its values."""
    _, q, cache, _, lse, scores = attention_case(device, "prefill")
    _, kv_indptr, kv_indices, last = paged(random_kv([20, 33], 2, 64), PAGE, "NHD", torch.float16, device, seed=1)
    return (lambda: kv_compress.key_scores(q, lse.double(), cache, i32([0, 3, 8]).to(device), kv_indptr.to(device),
                                           kv_indices.to(device), last.to(device), scores=scores,
                                           accumulate=True)), [scores, cache], "lse"


def compact_row(device):
    """Compaction in place with kept positions that do not ascend: nothing moves."""
    cache, kv_indptr, kv_indices, last = paged(random_kv([20, 33], 2, 64), PAGE, "NHD", torch.float16, device, seed=1)
    scores = rand((cache.shape[0], 2, PAGE), torch.float32, device, seed=5)
    kept = i32([[3, 3], [1, 2], [0, 1], [5, 7]]).to(device)
    return (lambda: kv_compress.compact(cache, kv_indptr.to(device), kv_indices.to(device), last.to(device), kept,
                                        i32([0, 2, 4]).to(device), scores=scores)), [cache, scores], "kept positions"


def speculative_row(device):
    """A seed past 64 bits (it wrapped): the caller's accepted / emitted counters untouched."""
    probs = torch.softmax(rand((2, 3, 16), torch.float32, device), -1)
    target = torch.softmax(rand((2, 4, 16), torch.float32, device, seed=1), -1)
    ids = i32([[1, 2, 3], [4, 5, 6]]).to(device)
    accepted, emitted = i32([7, 7]).to(device), i32([7, 7]).to(device)
    return (lambda: flashkern.chain_speculative_sampling(probs, ids, target, accepted, emitted, seed=2**64,
                                                         offset=0)), [accepted, emitted], "seed must fit 64 bits"


def clip_row(device):
    grads = [rand((5,), torch.float32, device), rand((3, 4), torch.float32, device, seed=1)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return (lambda: flashkern.optim.clip_grad_norm_(params, 1.0, norm_type=-1.0)), grads, "norm_type must be positive"


ROWS = {
    **{f"decode kv_scores {how}": kv_scores_row("decode", how) for how in ("dtype", "shape", "layout")},
    **{f"prefill kv_scores {how}": kv_scores_row("prefill", how) for how in ("dtype", "shape", "layout")},
    **{f"{kind} v_scale 0": attention_scale_row(kind) for kind in ("decode", "prefill", "cascade")},
    "rmsnorm out=": rmsnorm_row,
    "fused_add_rmsnorm": fused_add_rmsnorm_row,
    "silu_and_mul out=": silu_and_mul_row,
    "apply_rope_inplace": rope_row,
    "append_paged_kv_cache": append_row,
    "key_scores accumulate": key_scores_row,
    "compact": compact_row,
    "chain_speculative_sampling": speculative_row,
    "clip_grad_norm_": clip_row,
}


def bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8).clone()


def assert_raises_untouched(call, written, match):
    before = [bits(t) for t in written]
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    for i, (t, b) in enumerate(zip(written, before)):
        assert torch.equal(bits(t), b), f"tensor {i} of the call was written before it raised"


@pytest.mark.parametrize("row", list(ROWS))
def test_a_call_that_raises_writes_nothing(device, row):
    call, written, match = ROWS[row](device)
    assert_raises_untouched(call, written, match)


# ---- the fused all-reduce (a gloo group of one in this process) ----


@pytest.fixture
def group_of_one():
    import torch.distributed as dist

    from test_comm import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def comm_tensors(dtype=torch.bfloat16):
    x, res, res_out, norm_out, out = (rand((4, 256), dtype, "cpu", seed=i) for i in range(5))
    return x, res, res_out, norm_out, out, rand((256,), torch.float32, "cpu", seed=9).abs() + 0.5


@pytest.mark.parametrize("case", ["rms_eps", "use_oneshot"])
def test_allreduce_fusion_checks_before_writing(group_of_one, case):
    """kARResidualRMSNorm with output=: rms_eps=-1 raised after the sum was written into output; use_oneshot
    'yes' was taken on the auto engine (a group of one falls back to dist.all_reduce)."""
    from flashkern import comm

    x, res, res_out, norm_out, out, w = comm_tensors()
    ws = comm.create_allreduce_fusion_workspace(max_token_num=8, hidden_dim=256, dtype=torch.bfloat16)
    options = {"rms_eps": -1.0} if case == "rms_eps" else {"use_oneshot": "yes"}
    error = ValueError if case == "rms_eps" else TypeError
    before = [bits(t) for t in (out, res_out, norm_out, x, res)]
    with pytest.raises(error, match="rms_eps must be a finite number >= 0" if case == "rms_eps" else
                       "use_oneshot must be None or a bool, got 'yes'"):
        comm.allreduce_fusion(x, ws, comm.AllReduceFusionPattern.kARResidualRMSNorm, output=out, residual_in=res,
                              residual_out=res_out, norm_out=norm_out, rms_gamma=w, **options)
    assert all(torch.equal(bits(t), b) for t, b in zip((out, res_out, norm_out, x, res), before))


@pytest.mark.parametrize("case", ["eps", "group"])
def test_fused_allreduce_add_rmsnorm_checks_before_writing(group_of_one, case):
    """In place: a bad eps or a group that is not a ProcessGroup (group="world" failed inside torch.distributed
    with an AttributeError) raises with input and residual as they were."""
    from flashkern import comm

    x, res, _, _, _, w = comm_tensors()
    before = [bits(x), bits(res)]
    options = {"eps": -1.0} if case == "eps" else {"group": "world"}
    with pytest.raises(ValueError if case == "eps" else TypeError,
                       match="eps must be a finite number >= 0" if case == "eps" else
                       "group must be None \\(the world\\) or a torch.distributed.ProcessGroup, got str"):
        comm.fused_allreduce_add_rmsnorm(x, res, w, **options)
    assert torch.equal(bits(x), before[0]) and torch.equal(bits(res), before[1])
