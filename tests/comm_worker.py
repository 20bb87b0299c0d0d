"""One rank of tests/test_comm.py: ``python comm_worker.py RANK WORLD PORT SCENARIO OUT``. Joins a gloo group on
127.0.0.1, runs the scenario's calls, checks each against float64 computed here from every rank's inputs (each
rank's are seeded by its rank, so any rank can make all of them) and writes what it found to OUT as JSON:
{"failures": [...], "checksums": [...]} (checksums: the outputs' bits, equal on every rank)."""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from flashkern import comm
from flashkern.tolerances import tolerance

TOKENS, HIDDEN = (1, 7, 128, 2048), (1024, 4096, 7168)


def rand(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def inputs(case, world, tokens, hidden, dtype):
    """Every rank's input, the (replicated) residual and norm weight of a case."""
    xs = [rand((tokens, hidden), dtype, 1000 * case + r) for r in range(world)]
    return xs, rand((tokens, hidden), dtype, 1000 * case + 999), rand((hidden,), torch.float32, 1000 * case + 998)


def expected(xs, residual, weight, eps, weight_offset=0.0):
    """float64: the sum over the ranks, residual + sum, and the RMSNorm of that."""
    total = sum(x.double() for x in xs)
    summed = residual.double() + total
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)
    return total, summed, normed


def close(failures, name, got, want, dtype, roundings=1):
    """roundings: how many times the result may have been rounded to dtype on its way (the tolerance's one,
    or the engine's sum rounded at each of its world - 1 additions)."""
    bound = {k: v * roundings for k, v in tolerance(dtype).items()}
    try:
        torch.testing.assert_close(got.double(), want, **bound)
    except AssertionError as e:
        failures.append(f"{name}: {str(e).splitlines()[0:4]}")


def checksum(t):
    return int(t.contiguous().view(torch.uint8).long().sum())


def fused(rank, world, failures, sums):
    """fused_allreduce_add_rmsnorm over the issue's sizes, bfloat16 (and float16 for the smaller ones)."""
    case = 0
    for tokens in TOKENS:
        for hidden in HIDDEN:
            for dtype in (torch.bfloat16,) + ((torch.float16,) if tokens * hidden <= 128 * 4096 else ()):
                case += 1
                xs, residual, weight = inputs(case, world, tokens, hidden, dtype)
                x, res = xs[rank].clone(), residual.clone()
                comm.fused_allreduce_add_rmsnorm(x, res, weight, 1e-6)
                _, summed, normed = expected(xs, residual, weight, 1e-6)
                close(failures, f"residual {tokens}x{hidden} {dtype}", res, summed, dtype)
                close(failures, f"norm {tokens}x{hidden} {dtype}", x, normed, dtype)
                sums += [checksum(res), checksum(x)]


def flashinfer_api(rank, world, failures, sums):
    """allreduce_fusion, both patterns, fp32_acc on and off, Gemma's weight_bias; a workspace reused with fewer
    tokens; a debug workspace."""
    P = comm.AllReduceFusionPattern
    ws = comm.create_allreduce_fusion_workspace("auto", world, rank, max_token_num=64, hidden_dim=1024,
                                                dtype=torch.bfloat16, debug=True)
    for case, (tokens, fp32_acc, bias) in enumerate([(64, True, 0.0), (5, False, 0.0), (17, True, 1.0)], start=100):
        xs, residual, weight = inputs(case, world, tokens, 1024, torch.bfloat16)
        total, summed, normed = expected(xs, residual, weight, 1e-5, bias)
        out = comm.allreduce_fusion(xs[rank], ws, P.kAllReduce, fp32_acc=fp32_acc)
        close(failures, f"kAllReduce {tokens} fp32_acc={fp32_acc}", out, total, torch.bfloat16,
              world - 1 if not fp32_acc else 1)
        res_out, norm_out, ar_out = (torch.full_like(residual, float("nan")) for _ in range(3))
        got = comm.allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, output=ar_out, residual_in=residual,
                                    residual_out=res_out, norm_out=norm_out, rms_gamma=weight, rms_eps=1e-5,
                                    fp32_acc=fp32_acc, weight_bias=bias)
        if got is not norm_out:
            failures.append("kARResidualRMSNorm must return norm_out")
        close(failures, f"output {tokens}", ar_out, total, torch.bfloat16, world - 1 if not fp32_acc else 1)
        if not fp32_acc:  # the engine summed in bfloat16 (a rounding a step): add and norm the sum it made
            _, summed, normed = expected([ar_out], residual, weight, 1e-5, bias)
        close(failures, f"residual_out {tokens}", res_out, summed, torch.bfloat16)
        close(failures, f"norm_out {tokens} bias {bias}", norm_out, normed, torch.bfloat16)
        sums += [checksum(res_out), checksum(norm_out)]
    # a rank with another shape: every rank raises (the debug all-gather), none hangs
    tokens = 3 if rank == 0 else 4
    try:
        comm.allreduce_fusion(torch.zeros(tokens, 1024, dtype=torch.bfloat16), ws, P.kAllReduce)
        failures.append("ranks with different shapes did not raise")
    except ValueError as e:
        if "different shapes" not in str(e):
            failures.append(f"wrong error for different shapes: {e}")


def disagreeing_workspace(rank, world, failures, sums):
    try:
        comm.create_allreduce_fusion_workspace(max_token_num=16 + rank, hidden_dim=1024, dtype=torch.bfloat16)
        failures.append("a workspace the ranks disagree on did not raise")
    except ValueError as e:
        if "disagree" not in str(e):
            failures.append(f"wrong error for a disagreeing workspace: {e}")


def compiled(rank, world, failures, sums, workspace=None, case=300):
    """torch.compile(fullgraph=True) of a layer's end (the op between two matmuls): the same bits as eager."""
    xs, residual, weight = inputs(case, world, 7, 1024, torch.bfloat16)
    proj = rand((1024, 1024), torch.bfloat16, case + 1) / 32

    def layer_end(x, res):
        h = x @ proj
        comm.fused_allreduce_add_rmsnorm(h, res, weight, workspace=workspace)
        return h, res

    eager = layer_end(xs[rank].clone(), residual.clone())
    got = torch.compile(layer_end, fullgraph=True)(xs[rank].clone(), residual.clone())
    for name, a, b in zip(("norm", "residual"), got, eager):
        if not torch.equal(a, b):
            failures.append(f"compiled {name} differs from eager by {(a.float() - b.float()).abs().max()}")
    sums += [checksum(t) for t in got]


def kernels(rank, world, failures, sums):
    """The symmetric-memory engine on the emulated kernels (FLASHKERN_BACKEND=emulate: the workspace is a file
    in shared memory a rank, mapped into every rank): one-shot and two-shot, both patterns and the plain op,
    against float64, every rank the same bits; auto leaves a float32 call and one past its cap to gloo."""
    import flashkern

    flashkern.set_backend("emulate")
    P = comm.AllReduceFusionPattern
    spaces = {dtype: comm.create_allreduce_fusion_workspace("symm_mem", world, rank, max_token_num=33,
                                                            hidden_dim=1024, dtype=dtype)
              for dtype in (torch.bfloat16, torch.float16)}
    for ws in spaces.values():
        if ws.engine != "symm_mem" or len(ws.peers) != world or ws.peers[rank] != ws.buffer.data_ptr():
            failures.append(f"symm_mem workspace: engine {ws.engine}, {len(ws.peers)} peers")
            return
    for case, (tokens, one_shot, bias, dtype) in enumerate([(33, True, 0.0, torch.bfloat16),
                                                            (33, False, 1.0, torch.bfloat16),
                                                            (1, False, 0.0, torch.float16),
                                                            (5, True, 0.0, torch.float16)], start=400):
        xs, residual, weight = inputs(case, world, tokens, 1024, dtype)
        total, summed, normed = expected(xs, residual, weight, 1e-5, bias)
        poison = lambda: torch.full_like(residual, float("nan"))  # noqa: E731
        ws = spaces[dtype]
        out = comm.allreduce_fusion(xs[rank], ws, P.kAllReduce, use_oneshot=one_shot, output=poison())
        close(failures, f"kAllReduce {tokens} one_shot={one_shot}", out, total, dtype)
        res_out, norm_out, ar_out = poison(), poison(), poison()
        comm.allreduce_fusion(xs[rank], ws, P.kARResidualRMSNorm, output=ar_out, residual_in=residual,
                              residual_out=res_out, norm_out=norm_out, rms_gamma=weight, rms_eps=1e-5,
                              use_oneshot=one_shot, weight_bias=bias)
        close(failures, f"output {tokens} one_shot={one_shot}", ar_out, total, dtype)
        close(failures, f"residual_out {tokens} one_shot={one_shot}", res_out, summed, dtype)
        close(failures, f"norm_out {tokens} one_shot={one_shot} bias {bias}", norm_out, normed, dtype)
        sums += [checksum(t) for t in (out, ar_out, res_out, norm_out)]
    xs, residual, weight = inputs(410, world, 9, 1024, torch.bfloat16)  # the plain op, in place, a strided residual
    _, summed, normed = expected(xs, residual, weight, 1e-6)
    x, res = xs[rank].clone(), torch.empty(1024, 9, dtype=torch.bfloat16).t().copy_(residual)
    comm.fused_allreduce_add_rmsnorm(x, res, weight, workspace=spaces[torch.bfloat16])
    close(failures, "fused residual", res, summed, torch.bfloat16)
    close(failures, "fused norm", x, normed, torch.bfloat16)
    sums += [checksum(res), checksum(x)]
    comm.AUTO_MAX_MESSAGE_BYTES = 4 * 1024 * 2  # auto: 4 tokens of 1024 take the kernels, more take gloo
    auto = comm.create_allreduce_fusion_workspace("auto", max_token_num=16, hidden_dim=1024, dtype=torch.bfloat16)
    wide = comm.create_allreduce_fusion_workspace("auto", max_token_num=16, hidden_dim=1024, dtype=torch.float32)
    if (auto.engine, auto.message_bytes, wide.engine) != ("symm_mem", 4 * 1024 * 2, "nccl"):
        failures.append(f"auto chose {auto.engine} ({auto.message_bytes} bytes), float32 {wide.engine}")
    for tokens in (4, 16):
        xs, residual, weight = inputs(420 + tokens, world, tokens, 1024, torch.bfloat16)
        total, _, _ = expected(xs, residual, weight, 1e-6)
        out = comm.allreduce_fusion(xs[rank], auto, P.kAllReduce, fp32_acc=True)
        close(failures, f"auto kAllReduce {tokens}", out, total, torch.bfloat16)
    try:
        comm.allreduce_fusion(torch.zeros(2, 1024), auto, P.kAllReduce)
        failures.append("a float32 call on a bfloat16 workspace did not raise")
    except TypeError:
        pass
    ws = spaces[torch.bfloat16]
    ws.destroy()
    try:
        comm.allreduce_fusion(xs[rank], ws, P.kAllReduce)
        failures.append("a destroyed workspace took a call")
    except ValueError:
        pass


def kernels_unavailable(rank, world, failures, sums):
    """Without the emulation CPU tensors have no kernels: auto falls back to gloo and says why; a forced
    symm_mem raises on every rank."""
    auto = comm.create_allreduce_fusion_workspace(max_token_num=4, hidden_dim=1024, dtype=torch.bfloat16)
    if auto.engine != "nccl" or "FLASHKERN_BACKEND=emulate" not in (auto.fallback_reason or ""):
        failures.append(f"auto on CPU: {auto.engine} ({auto.fallback_reason})")
    try:
        comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=4, hidden_dim=1024, dtype=torch.bfloat16)
        failures.append("a forced symm_mem without kernels did not raise")
    except ValueError as e:
        if "cannot run here" not in str(e):
            failures.append(f"wrong error for symm_mem without kernels: {e}")


def compiled_kernels(rank, world, failures, sums):
    """The same on the emulated kernels."""
    import flashkern

    flashkern.set_backend("emulate")
    ws = comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=7, hidden_dim=1024, dtype=torch.bfloat16)
    compiled(rank, world, failures, sums, workspace=ws, case=500)


SCENARIOS = {"kernels": kernels, "kernels_unavailable": kernels_unavailable, "compiled_kernels": compiled_kernels,
             "compiled": compiled, "fused": fused, "flashinfer_api": flashinfer_api,
             "disagreeing_workspace": disagreeing_workspace}


def main():
    rank, world, port, scenario, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    failures, sums = [], []
    try:
        SCENARIOS[scenario](rank, world, failures, sums)
    finally:
        with open(out, "w") as f:
            json.dump({"failures": failures, "checksums": sums}, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
