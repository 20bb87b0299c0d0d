"""KV-cache compression: batch decode that also accumulates H2O's per-key scores beside the plain decode
(the overhead of the scores: the kernels' logits written, then read with the lse), the selection of 10 % of the keys beside
torch.topk over dense scores, the compaction in place beside torch.gather of dense K and V, and decode over the
compacted cache beside decode over the whole one (its time should follow the kept fraction). Bytes:
cases.decode_scores_bytes, kv_select_bytes, kv_compact_bytes, decode_compressed_bytes."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op

ARGS = "provider,label,batch,shape,dtype"


@pytest.mark.benchmark(group="decode_kv_scores")
@pytest.mark.parametrize(ARGS, params(cases.DECODE_SCORES, cases.kv_compress_shapes()))
def test_decode_with_scores(benchmark, provider, label, batch, shape, dtype):
    bench_op(benchmark, op="decode_kv_scores", provider=provider, shape=(batch, *shape), dtype=dtype,
             bytes_moved=cases.decode_scores_bytes(batch, shape, dtype),
             make_inputs=cases.kv_compress_inputs(batch, shape, dtype))


@pytest.mark.benchmark(group="kv_select")
@pytest.mark.parametrize(ARGS, params(cases.KV_SELECT, cases.kv_compress_shapes()))
def test_select(benchmark, provider, label, batch, shape, dtype):
    bench_op(benchmark, op="kv_select", provider=provider, shape=(batch, *shape), dtype=dtype,
             bytes_moved=cases.kv_select_bytes(batch, shape, dtype),
             make_inputs=cases.kv_compress_inputs(batch, shape, dtype))


@pytest.mark.benchmark(group="kv_compact")
@pytest.mark.parametrize(ARGS, params(cases.KV_COMPACT, cases.kv_compress_shapes()))
def test_compact(benchmark, provider, label, batch, shape, dtype):
    bench_op(benchmark, op="kv_compact", provider=provider, shape=(batch, *shape), dtype=dtype,
             bytes_moved=cases.kv_compact_bytes(batch, shape, dtype),
             make_inputs=cases.kv_compress_inputs(batch, shape, dtype))


@pytest.mark.benchmark(group="decode_compressed")
@pytest.mark.parametrize(ARGS, params(cases.DECODE_COMPRESSED, cases.kv_compress_shapes()))
def test_decode_after_compression(benchmark, provider, label, batch, shape, dtype):
    bench_op(benchmark, op="decode_compressed", provider=provider, shape=(batch, *shape), dtype=dtype,
             bytes_moved=cases.decode_compressed_bytes(batch, shape, dtype, provider),
             make_inputs=cases.kv_compress_inputs(batch, shape, dtype))
