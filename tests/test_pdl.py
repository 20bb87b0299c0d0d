"""enable_pdl=True (programmatic dependent launch, csrc/include/flashkern/platform.h): the ops that take
it give the same bits as with it off, on every device (a GPU without PDL, the CPU and the emulators
launch plainly; sm_90+ overlaps each launch with the end of the kernel before), also in a chain of
dependent launches captured in a CUDA graph, where each kernel reads what the previous one wrote.
test_kernel_build.py checks the instructions: griddepcontrol.wait before any global access."""

import pytest
import torch
from conftest import rand, requires_gpu
from paged_kv import paged, random_kv

import flashkern


def decode_case(device, dtype=torch.bfloat16):
    kvs = random_kv([300, 17, 1], 2, 128, seed=50)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, device, seed=50)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device))
    wrapper._core._min_chunk = 64  # split and merged: four launches in one run
    wrapper.plan(indptr, indices, last, 16, 2, 128, 16, q_data_type=dtype)
    return wrapper, cache


def layer(x, residual, w_norm, wrapper, cache, enable_pdl):
    """A decoder layer's dependent chain: each op reads what the one before wrote."""
    flashkern.fused_add_rmsnorm(x, residual, w_norm, enable_pdl=enable_pdl)
    h = flashkern.silu_and_mul(x, enable_pdl=enable_pdl)  # [3, 2048] -> [3, 1024]
    q = flashkern.rmsnorm(h.view(3, 16, 64).repeat(1, 1, 2), w_norm[:128], enable_pdl=enable_pdl)
    return wrapper.run(q, cache, enable_pdl=enable_pdl)


def test_pdl_gives_the_same_bits(device):
    wrapper, cache = decode_case(device)
    results = []
    for enable_pdl in (False, True, None):
        x, residual = rand((3, 2048), torch.bfloat16, device, seed=51), rand((3, 2048), torch.bfloat16, device, seed=52)
        w = rand((2048,), torch.bfloat16, device, seed=53)
        results.append((layer(x, residual, w, wrapper, cache, enable_pdl), x, residual))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@requires_gpu
def test_pdl_in_a_cuda_graph():
    """The chain captured with enable_pdl=True (programmatic edges in the graph; the first kernel right
    after a device-to-device copy, which is no kernel and so a full dependency), replayed on new inputs,
    equals the chain run eagerly without PDL."""
    wrapper, cache = decode_case("cuda")
    source = rand((3, 2048), torch.bfloat16, "cuda", seed=54)
    x, residual = torch.empty_like(source), rand((3, 2048), torch.bfloat16, "cuda", seed=55)
    w = rand((2048,), torch.bfloat16, "cuda", seed=53)
    x.copy_(source)
    layer(x, residual, w, wrapper, cache, True)  # warm up (opt-ins, caches) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(source)  # a copy node, then the PDL kernels
        out = layer(x, residual, w, wrapper, cache, True)
    for seed in (56, 58):
        x0, r0 = rand((3, 2048), torch.bfloat16, "cuda", seed=seed), rand((3, 2048), torch.bfloat16, "cuda", seed=seed + 1)
        source.copy_(x0)
        residual.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        expected = layer(x0, r0, w, wrapper, cache, False)
        assert torch.equal(out, expected) and torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("value", ["on", 1])
def test_enable_pdl_is_none_or_a_bool(value):
    x = torch.ones(2, 8)
    with pytest.raises(TypeError, match="rmsnorm: enable_pdl must be None or a bool"):
        flashkern.rmsnorm(x, torch.ones(8), enable_pdl=value)
