"""The ops as PyTorch sees them: schemas, fake functions and autograd (opcheck), torch.compile
with fullgraph=True, and CUDA graph capture."""

import pytest
import torch
from conftest import assert_close, rand, requires_gpu
from torch.library import opcheck

import flashkern

ops = torch.ops.flashkern


def op_cases(device):
    """(op overload, args) for every op, with tensors that require grad where autograd applies."""
    x = rand((5, 2, 24), torch.float32, device).requires_grad_()
    x2 = rand((37, 24), torch.float32, device, seed=1)
    w = rand((24,), torch.float32, device, seed=2).requires_grad_()
    a = rand((3, 5, 2 * 24), torch.float32, device, seed=3).requires_grad_()
    yield ops.rmsnorm.default, (x, w, 1e-6, 0.0)
    yield ops.rmsnorm.default, (x2.half(), w.detach(), 1e-5, 1.0)
    yield ops.rmsnorm_out.default, (torch.empty_like(x2), x2, w.detach(), 1e-6, 0.0)
    yield ops.fused_add_rmsnorm.default, (x2.clone(), x2.clone() * 2, w.detach(), 1e-6, 1.0)
    yield ops.rmsnorm_backward.default, (x2.clone(), x2, w.detach(), 1e-6, 0.0)
    for act in ("silu", "gelu", "gelu_tanh"):
        yield ops.act_and_mul.default, (a, act)
        yield ops.act_and_mul_out.default, (a.new_empty(3, 5, 24).detach(), a.detach(), act)
        yield ops.act_and_mul_backward.default, (rand((3, 5, 24), torch.float32, device, seed=4), a.detach(), act)


def test_opcheck(device):
    for op, args in op_cases(device):
        opcheck(op, args)  # raises on a schema, fake, autograd registration or dynamic-shape mismatch


def _model(x, residual, w_norm, w_up):
    flashkern.fused_add_rmsnorm(x, residual, w_norm)
    h = flashkern.rmsnorm(x, w_norm) @ w_up
    return flashkern.silu_and_mul(h) + flashkern.gelu_tanh_and_mul(h)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()
    x, res = rand((7, 64), torch.float32, device), rand((7, 64), torch.float32, device, seed=1)
    w, w_up = rand((64,), torch.float32, device, seed=2), rand((64, 96), torch.float32, device, seed=3)
    expected = _model(x.clone(), res.clone(), w, w_up)
    compiled = torch.compile(_model, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x.clone(), res.clone(), w, w_up), expected)


def test_torch_compile_training_step(device):
    torch._dynamo.reset()
    x = rand((9, 32), torch.float32, device).requires_grad_()
    w = rand((32,), torch.float32, device, seed=1).requires_grad_()

    def loss(x, w):
        return flashkern.silu_and_mul(flashkern.rmsnorm(x, w)).pow(2).sum()

    loss(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(x, w).backward()
    torch.testing.assert_close((x.grad, w.grad), expected)


@requires_gpu
def test_cuda_graph_capture_and_replay():
    x = rand((37, 4096), torch.bfloat16, "cuda")
    res = rand((37, 4096), torch.bfloat16, "cuda", seed=1)
    w = rand((4096,), torch.float32, "cuda", seed=2)
    gate_up = rand((37, 2 * 4096), torch.bfloat16, "cuda", seed=3)
    out, act = torch.empty_like(x), torch.empty(37, 4096, dtype=torch.bfloat16, device="cuda")
    x_run, res_run = x.clone(), res.clone()

    def step():
        flashkern.fused_add_rmsnorm(x_run, res_run, w)
        flashkern.rmsnorm(x_run, w, out=out)
        flashkern.silu_and_mul(gate_up, out=act)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):  # replays see new data in the same buffers
        x_run.copy_(x)
        res_run.copy_(res)
        gate_up.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        y, new_res = flashkern.ref.fused_add_rmsnorm(x.double(), res.double(), w.double())
        assert_close(res_run, new_res)
        assert_close(x_run, y)
        assert_close(out, flashkern.ref.rmsnorm(x_run.double(), w.double()))
        assert_close(act, flashkern.ref.act_and_mul(gate_up.double(), "silu"))
