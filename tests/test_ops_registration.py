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
    g, u = rand((5, 24), torch.float32, device, seed=7).requires_grad_(), rand((5, 24), torch.float32, device, seed=8)
    yield ops.act_mul.default, (g, u.requires_grad_(), "gelu_tanh")
    yield ops.act_mul_backward.default, (u.detach(), g.detach(), u.detach(), "silu")
    v, s = rand((7, 3, 2, 64), torch.bfloat16, device, seed=9), rand((7, 3, 2), torch.float32, device, seed=10)
    yield ops.merge_states.default, (v, s)
    yield ops.merge_state.default, (v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    yield ops.merge_state_in_place.default, (v[:, 0].clone(), s[:, 0].clone(), v[:, 1], s[:, 1], None)
    yield ops.merge_state_in_place.default, (v[:, 0].clone(), s[:, 0].clone(), v[:, 1], s[:, 1], s[:, 2, 0] > 0)
    q = rand((6, 4, 32), torch.float32, device, seed=5).requires_grad_()
    k = rand((6, 2, 32), torch.float32, device, seed=6).requires_grad_()
    pos = torch.arange(6, device=device) * 3
    inv_freq = flashkern.rope_scaling.theta_inv_freq(24, 1e4).to(device)
    cache = flashkern.cos_sin_cache(inv_freq, 32)
    for freqs, interleave in ((inv_freq, False), (cache, True)):
        yield ops.rope.default, (q, k, pos, freqs, interleave, False)
        yield ops.rope_.default, (q.detach().clone(), k.detach().clone(), pos.int(), freqs, interleave)
    xb, rb = rand((5, 64), torch.bfloat16, device, seed=11), rand((5, 64), torch.bfloat16, device, seed=12)
    ws = torch.zeros(flashkern.comm.workspace_bytes(5 * 64 * 2), dtype=torch.uint8, device=device)  # a group of one
    yield ops.allreduce_fusion.default, (xb, rb, rand((64,), torch.float32, device, seed=13), None, torch.empty_like(xb),
                                         torch.empty_like(xb), ws, [ws.data_ptr()], 0, False, 1e-6, 0.0)
    yield ops.allreduce_fusion.default, (xb, None, None, torch.empty_like(xb), None, None, ws, [ws.data_ptr()], 0, True,
                                         1e-6, 0.0)
    kv = rand((5, 3, 16), torch.bfloat16, device, seed=14)
    table = (torch.tensor([2, 0, 3], dtype=torch.int32, device=device), torch.tensor([0, 2, 3], dtype=torch.int32,
             device=device), torch.tensor([4, 1], dtype=torch.int32, device=device))
    where = (torch.tensor([0, 1, 0, 0, 0], dtype=torch.int32, device=device),
             torch.tensor([4, 0, 1, 2, 3], dtype=torch.int32, device=device))
    paged = rand((4, 2, 4, 3, 16), torch.bfloat16, device, seed=15)
    yield ops.append_paged_kv_cache.default, (kv, -kv, *where, paged[:, 0].clone(), paged[:, 1].clone(), *table)


def test_opcheck(device):
    for op, args in op_cases(device):
        opcheck(op, args)  # raises on a schema, fake, autograd registration or dynamic-shape mismatch


def _model(x, residual, w_norm, w_up):
    flashkern.fused_add_rmsnorm(x, residual, w_norm)
    h = flashkern.rmsnorm(x, w_norm) @ w_up
    q = h.view(h.shape[0], 3, 32)
    pos = torch.arange(h.shape[0], device=h.device)
    q_rot, _ = flashkern.apply_rope_pos_ids(q, q, pos, rotary_dim=16)
    flashkern.apply_llama31_rope_pos_ids_inplace(q, q.clone(), pos)
    indptr = torch.tensor([0, 3, h.shape[0]], device=h.device)
    q_ragged, _ = flashkern.apply_rope(q, q, indptr, torch.tensor([5, 0], device=h.device), interleave=True)
    cache = flashkern.cos_sin_cache(flashkern.rope_scaling.theta_inv_freq(32, 1e4, device=h.device), 64)
    q_cached, _ = flashkern.apply_rope_with_cos_sin_cache(pos, q.view(h.shape), q.view(h.shape), 32, cache)
    gated = flashkern.act_mul(h[:, :48], h[:, 48:], "gelu")
    return (flashkern.silu_and_mul(h) + flashkern.gelu_tanh_and_mul(h) + q_rot.view(h.shape)[:, :48]
            + q.view(h.shape)[:, 48:] + q_ragged.view(h.shape)[:, :48] + q_cached[:, 48:] + gated)


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
    q, k = rand((37, 8, 128), torch.bfloat16, "cuda", seed=4), rand((37, 2, 128), torch.bfloat16, "cuda", seed=5)
    q_run, k_run, pos = q.clone(), k.clone(), torch.arange(37, device="cuda")

    def step():
        flashkern.fused_add_rmsnorm(x_run, res_run, w)
        flashkern.rmsnorm(x_run, w, out=out)
        flashkern.silu_and_mul(gate_up, out=act)
        flashkern.apply_rope_pos_ids_inplace(q_run, k_run, pos)

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
        q_run.copy_(q)
        k_run.copy_(k)
        pos.add_(1000)
        gate_up.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        y, new_res = flashkern.ref.fused_add_rmsnorm(x.double(), res.double(), w.double())
        assert_close(res_run, new_res)
        assert_close(x_run, y)
        assert_close(out, flashkern.ref.rmsnorm(x_run.double(), w.double()))
        assert_close(act, flashkern.ref.act_and_mul(gate_up.double(), "silu"))
        inv_freq = flashkern.rope_scaling.theta_inv_freq(128, 1e4).cuda()
        assert_close(q_run, flashkern.ref.rope(q.double(), k.double(), pos, inv_freq)[0], torch.bfloat16)
