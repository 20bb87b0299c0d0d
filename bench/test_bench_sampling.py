"""Sampling: top-k, top-p and top-k + top-p sampling from probabilities beside torch's sort-based
sampling and FlashInfer; plain and min-p sampling, top-k / top-p renormalization and top-k logit
masking; chain speculative sampling at n = 4 and 8. Bytes: every probability read once (see
cases.sampling_bytes, cases.speculative_bytes); µs per call under graph replay (each flashkern call
draws its seed on the device, so a replay samples anew)."""

import pytest
import torch

from . import cases
from .cases import params
from .harness import bench_op

ARGS = "provider,label,batch,vocab,dtype"


def _sampling(benchmark, op, provider, batch, vocab, dtype):
    bench_op(benchmark, op=op, provider=provider, shape=(batch, vocab), dtype=dtype,
             bytes_moved=cases.sampling_bytes(batch, vocab), make_inputs=cases.sampling_inputs(batch, vocab))


def _grid(providers):
    return params(providers, cases.sampling_shapes(), dtypes=cases.SAMPLING_DTYPES)


def _variants(providers):
    return params(providers, cases.sampling_variant_shapes(), dtypes=cases.SAMPLING_DTYPES)


@pytest.mark.benchmark(group="top_k_sampling_from_probs")
@pytest.mark.parametrize(ARGS, _grid(cases.TOP_K_SAMPLING))
def test_top_k_sampling(benchmark, provider, label, batch, vocab, dtype):
    _sampling(benchmark, "top_k_sampling_from_probs", provider, batch, vocab, dtype)


@pytest.mark.benchmark(group="top_p_sampling_from_probs")
@pytest.mark.parametrize(ARGS, _grid(cases.TOP_P_SAMPLING))
def test_top_p_sampling(benchmark, provider, label, batch, vocab, dtype):
    _sampling(benchmark, "top_p_sampling_from_probs", provider, batch, vocab, dtype)


@pytest.mark.benchmark(group="top_k_top_p_sampling_from_probs")
@pytest.mark.parametrize(ARGS, _grid(cases.TOP_K_TOP_P_SAMPLING))
def test_top_k_top_p_sampling(benchmark, provider, label, batch, vocab, dtype):
    _sampling(benchmark, "top_k_top_p_sampling_from_probs", provider, batch, vocab, dtype)


@pytest.mark.benchmark(group="sampling_from_probs")
@pytest.mark.parametrize(ARGS, _variants(cases.PLAIN_SAMPLING))
def test_sampling(benchmark, provider, label, batch, vocab, dtype):
    _sampling(benchmark, "sampling_from_probs", provider, batch, vocab, dtype)


@pytest.mark.benchmark(group="min_p_sampling_from_probs")
@pytest.mark.parametrize(ARGS, _variants(cases.MIN_P_SAMPLING))
def test_min_p_sampling(benchmark, provider, label, batch, vocab, dtype):
    _sampling(benchmark, "min_p_sampling_from_probs", provider, batch, vocab, dtype)


@pytest.mark.benchmark(group="renorm")
@pytest.mark.parametrize(
    "op," + ARGS,
    [p for op, providers in (("top_k_renorm_probs", cases.TOP_K_RENORM), ("top_p_renorm_probs", cases.TOP_P_RENORM),
                             ("top_k_mask_logits", cases.TOP_K_MASK_LOGITS))
     for p in params(providers, cases.sampling_variant_shapes(), op, dtypes=cases.SAMPLING_DTYPES)],
)
def test_renorm(benchmark, op, provider, label, batch, vocab, dtype):
    make_inputs = (cases.logits_inputs if op == "top_k_mask_logits" else cases.sampling_inputs)(batch, vocab)
    bench_op(benchmark, op=op, provider=provider, shape=(batch, vocab), dtype=dtype,
             bytes_moved=cases.renorm_bytes(batch, vocab, dtype), make_inputs=make_inputs)


@pytest.mark.benchmark(group="softmax")
@pytest.mark.parametrize(ARGS, params(cases.SOFTMAX, cases.sampling_shapes(),
                                      dtypes=cases.SAMPLING_DTYPES + ([] if cases.BENCH_SET == "smoke" else
                                                                      [torch.bfloat16])))
def test_softmax(benchmark, provider, label, batch, vocab, dtype):
    """FlashInfer's softmax at a temperature: float32 or bfloat16 logits in, float32 probabilities out."""
    bench_op(benchmark, op="softmax", provider=provider, shape=(batch, vocab), dtype=dtype,
             bytes_moved=cases.softmax_bytes(batch, vocab, dtype),
             make_inputs=lambda seed: (cases.logits_inputs(batch, vocab)(seed)[0].to(dtype),))


@pytest.mark.benchmark(group="chain_speculative_sampling")
@pytest.mark.parametrize("provider,label,batch,shape,dtype",
                         params(cases.CHAIN_SPECULATIVE, cases.speculative_shapes(), dtypes=cases.SAMPLING_DTYPES))
def test_chain_speculative_sampling(benchmark, provider, label, batch, shape, dtype):
    n, vocab = shape
    bench_op(benchmark, op="chain_speculative_sampling", provider=provider, shape=(batch, n, vocab), dtype=dtype,
             bytes_moved=cases.speculative_bytes(batch, shape), make_inputs=cases.speculative_inputs(batch, shape))
