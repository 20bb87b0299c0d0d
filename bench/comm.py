"""The tensor-parallel all-reduce fused with the residual add and RMSNorm, across ranks, by message size
(issue 25): flashkern's kernels (one-shot, two-shot, and "auto"'s choice in fused_allreduce_add_rmsnorm)
beside dist.all_reduce + flashkern.fused_add_rmsnorm, and FlashInfer's allreduce_fusion where importable.

    torchrun --nproc-per-node 8 -m bench.comm --out comm.json [--set smoke|quick|full]

GPUs (one a rank, NCCL / RCCL): each row is a CUDA graph of CALLS calls replayed after a barrier and timed
with events on every rank; the row gets the slowest rank's median over REPEATS replays, per call. CPU
(gloo): eager calls and a wall clock, a smoke check of this code (FLASHKERN_BACKEND=emulate runs the
kernels on the emulator). Not part of bench/'s pytest suite: it needs a process a rank. No multi-GPU
number exists yet (docs/benchmarks.md).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import flashkern
from flashkern import comm

SETS = {  # (tokens, hidden)
    "smoke": [(t, 1024) for t in (1, 7)],
    "quick": [(t, h) for h in (4096, 8192) for t in (1, 16, 128, 1024)],
    "full": [(t, h) for h in (4096, 7168, 8192) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)],
}
CALLS, REPEATS = 20, 10
DTYPE = torch.bfloat16


def _providers(tokens, hidden, device, spaces):
    """name -> a call on fixed buffers (the same on every rank, so every rank runs the same collectives)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, generator=gen).to(device, DTYPE)
    residual = torch.randn(tokens, hidden, generator=gen).to(device, DTYPE)
    weight = torch.rand(hidden, generator=gen).to(device) + 0.5
    res_out, norm_out = torch.empty_like(x), torch.empty_like(x)
    P = comm.AllReduceFusionPattern
    calls = {}

    def fused_pattern(ws, one_shot):
        return lambda: comm.allreduce_fusion(x, ws, P.kARResidualRMSNorm, residual_in=residual, residual_out=res_out,
                                             norm_out=norm_out, rms_gamma=weight, use_oneshot=one_shot)

    kernels = spaces["symm_mem"]
    if kernels is not None and kernels.engine == "symm_mem":
        calls["flashkern-oneshot"] = fused_pattern(kernels, True)
        calls["flashkern-twoshot"] = fused_pattern(kernels, False)
    calls["flashkern-auto"] = lambda: comm.fused_allreduce_add_rmsnorm(x, residual, weight, workspace=spaces["auto"])

    def nccl_then_norm():  # the same in-place pair unfused (the norm keeps x's size from growing)
        dist.all_reduce(x)
        flashkern.fused_add_rmsnorm(x, residual, weight)

    calls["nccl+norm"] = nccl_then_norm
    if spaces.get("flashinfer") is not None:
        fi_comm, fi_ws = spaces["flashinfer"]
        calls["flashinfer"] = lambda: fi_comm.allreduce_fusion(
            input=x, workspace=fi_ws, pattern=fi_comm.AllReduceFusionPattern.kARResidualRMSNorm, launch_with_pdl=False,
            residual_in=residual, residual_out=res_out, norm_out=norm_out, rms_gamma=weight, rms_eps=1e-6)
    return calls


def _time(call, device):
    """Seconds a call: (GPU) a graph of CALLS calls after a barrier, events; (CPU) eager, a wall clock."""
    for _ in range(3):
        call()
    samples = []
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                call()
        graph.replay()
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3 / CALLS)
    else:
        for _ in range(REPEATS):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _flashinfer_workspace(world, rank, max_tokens, hidden, missing):
    try:
        import flashinfer.comm as fi_comm

        return fi_comm, fi_comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=world, rank=rank,
                                                                  max_token_num=max_tokens, hidden_dim=hidden,
                                                                  dtype=DTYPE)
    except Exception as e:  # not installed, or no engine for this machine: named in the output, not dropped
        missing["flashinfer"] = f"{type(e).__name__}: {e}"[:200]
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=SETS, default="quick")
    parser.add_argument("--out", default="comm.json")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", **({"device_id": device} if gpu else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    missing = {"vllm": "not run: vLLM's custom all-reduce needs vLLM's own parallel state"}
    rows = []
    try:
        for hidden in sorted({h for _, h in SETS[args.set]}):
            max_tokens = max(t for t, h in SETS[args.set] if h == hidden)
            spaces = {"auto": comm.create_allreduce_fusion_workspace("auto", max_token_num=max_tokens,
                                                                     hidden_dim=hidden, dtype=DTYPE),
                      "symm_mem": None}
            if world > 1 or not gpu:
                try:
                    spaces["symm_mem"] = comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=max_tokens,
                                                                                hidden_dim=hidden, dtype=DTYPE)
                except ValueError as e:  # every rank raises alike
                    missing["flashkern-oneshot/twoshot"] = str(e)[:200]
            if gpu and world > 1:
                spaces["flashinfer"] = _flashinfer_workspace(world, rank, max_tokens, hidden, missing)
            else:
                missing["flashinfer"] = "not run: its fused all-reduce needs 2 or more GPUs"
            for tokens in sorted(t for t, h in SETS[args.set] if h == hidden):
                for name, call in _providers(tokens, hidden, device, spaces).items():
                    slowest = [None] * world
                    dist.all_gather_object(slowest, _time(call, device))
                    seconds = max(slowest)
                    message = tokens * hidden * DTYPE.itemsize
                    rows.append(dict(op="allreduce_add_rmsnorm", provider=name, world=world, tokens=tokens,
                                     hidden=hidden, dtype=str(DTYPE), message_bytes=message, median_us=seconds * 1e6,
                                     algbw_gbps=message / seconds / 1e9, engine=spaces["auto"].engine))
        if rank == 0:
            info = {"torch": torch.__version__, "backend": flashkern.get_backend(), "world": world,
                    "device": torch.cuda.get_device_name() if gpu else "cpu", "missing_providers": missing,
                    "commit": os.environ.get("FLASHKERN_COMMIT")}
            with open(args.out, "w") as f:
                json.dump({"machine_info": info, "rows": rows}, f, indent=1)
            print(f"{'provider':<20}{'tokens':>7}{'hidden':>7}{'us':>10}{'GB/s':>9}")
            for r in rows:
                print(f"{r['provider']:<20}{r['tokens']:>7}{r['hidden']:>7}{r['median_us']:>10.1f}{r['algbw_gbps']:>9.2f}")
            print("providers not run: " + "; ".join(f"{k} ({v})" for k, v in missing.items()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
