"""Attention: merge_states (the split-KV / cascade merge) beside torch, torch.compile and FlashInfer;
paged-KV batch decode beside torch's SDPA (on the same KV, contiguous) and FlashInfer, at head_dim 512 too,
and over an fp8 cache beside the 16-bit one; cascade
decode beside the same batch without the cascade (every request reads the shared prefix)."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op


@pytest.mark.benchmark(group="merge_states")
@pytest.mark.parametrize("provider,label,tokens,shape,dtype", params(cases.MERGE_STATES, cases.merge_shapes()))
def test_merge_states(benchmark, provider, label, tokens, shape, dtype):
    bench_op(benchmark, op="merge_states", provider=provider, shape=(tokens, *shape), dtype=dtype,
             bytes_moved=cases.merge_bytes(tokens, shape, dtype), make_inputs=cases.merge_inputs(tokens, shape, dtype))


@pytest.mark.benchmark(group="batch_decode")
@pytest.mark.parametrize("provider,label,batch,shape,dtype", params(cases.DECODE, cases.decode_shapes()))
def test_batch_decode(benchmark, provider, label, batch, shape, dtype):
    length, group = shape
    bench_op(benchmark, op="batch_decode", provider=provider, shape=(batch, length, group), dtype=dtype,
             bytes_moved=cases.decode_bytes(batch, shape, dtype), make_inputs=cases.decode_inputs(batch, shape, dtype))


@pytest.mark.benchmark(group="batch_decode_d512")
@pytest.mark.parametrize("provider,label,batch,shape,dtype", params(cases.DECODE, cases.decode_wide_shapes()))
def test_batch_decode_d512(benchmark, provider, label, batch, shape, dtype):
    """head_dim 512 (GQA 16:1): the 16-row tiles with the output dims split over warps."""
    length, group = shape
    d = cases.WIDE_HEAD_DIM
    bench_op(benchmark, op="batch_decode_d512", provider=provider, shape=(batch, length, group), dtype=dtype,
             bytes_moved=cases.decode_bytes(batch, shape, dtype, d), make_inputs=cases.decode_inputs(batch, shape, dtype, d))


@pytest.mark.benchmark(group="batch_decode_fp8")
@pytest.mark.parametrize("provider,label,batch,shape,dtype", params(cases.DECODE_FP8, cases.decode_shapes()))
def test_batch_decode_fp8(benchmark, provider, label, batch, shape, dtype):
    """An fp8 e4m3 cache beside the 16-bit one (goal on an H200: <= 0.6x its time at batch >= 16, >= 4K tokens)."""
    length, group = shape
    bench_op(benchmark, op="batch_decode_fp8", provider=provider, shape=(batch, length, group), dtype=dtype,
             bytes_moved=cases.decode_fp8_bytes(batch, shape, dtype, provider),
             make_inputs=cases.decode_fp8_inputs(batch, shape, dtype))


@pytest.mark.benchmark(group="cascade")
@pytest.mark.parametrize("provider,label,batch,shape,dtype", params(cases.CASCADE, cases.cascade_shapes()))
def test_cascade(benchmark, provider, label, batch, shape, dtype):
    prefix, suffix = shape
    extra = bench_op(benchmark, op="cascade", provider=provider, shape=(batch, prefix, suffix), dtype=dtype,
                     bytes_moved=cases.cascade_bytes(batch, shape, dtype),
                     make_inputs=cases.cascade_inputs(batch, shape, dtype))
    benchmark.extra_info["prefix_len"] = extra["prefix_len"] = prefix


@pytest.mark.benchmark(group="prefill")
@pytest.mark.parametrize("provider,label,batch,shape,dtype", params(cases.PREFILL, cases.prefill_shapes()))
def test_prefill(benchmark, provider, label, batch, shape, dtype):
    """TFLOP/s of the visible (query, key) pairs only, and GB/s of q, k, v and the output."""
    bench_op(benchmark, op="prefill", provider=provider, shape=(batch, max(shape[0]), max(shape[1]), shape[2]),
             dtype=dtype, bytes_moved=cases.prefill_bytes(shape, dtype), make_inputs=cases.prefill_inputs(shape, dtype),
             flops=cases.prefill_flops(shape))
