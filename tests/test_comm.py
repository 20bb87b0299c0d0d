"""flashkern.comm across processes: world sizes 2 and 4 on gloo over 127.0.0.1 (tests/comm_worker.py is one
rank), against float64 computed from every rank's inputs; a hang is stopped by the time limit and fails."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close, poisoned, rand, requires_gpu, subprocess_limit

from flashkern import comm, ref

WORKER = Path(__file__).resolve().parent / "comm_worker.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env():
    """A rank's environment: the flashkern this test imported (installed, or the source tree with its build)."""
    import flashkern

    where = str(Path(flashkern.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([where, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def run_ranks(world, scenario, tmp_path, alone_seconds):
    """Every rank's report; all ranks are killed if any outlives the limit."""
    port = free_port()
    env = rank_env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), scenario,
                               str(tmp_path / f"rank{r}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=subprocess_limit(alone_seconds))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario} on {world} ranks did not finish in time (a hang)")
    reports = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-3000:]}"
        reports.append(json.loads((tmp_path / f"rank{r}.json").read_text()))
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_fused_allreduce_add_rmsnorm(world, tmp_path):
    """The issue's sizes (tokens 1, 7, 128, 2048 x hidden 1024, 4096, 7168), bfloat16 and float16: residual and
    norm against float64 on every rank, and the same bits on every rank."""
    reports = run_ranks(world, "fused", tmp_path, alone_seconds=30)
    for r, report in enumerate(reports):
        assert report["failures"] == [], f"rank {r}: {report['failures']}"
    assert all(report["checksums"] == reports[0]["checksums"] for report in reports)
    assert len(reports[0]["checksums"]) == 2 * (12 + 8)  # bfloat16 everywhere, float16 up to 128 x 4096


@pytest.mark.parametrize("world", [2, 4])
def test_flashinfer_allreduce_fusion(world, tmp_path):
    reports = run_ranks(world, "flashinfer_api", tmp_path, alone_seconds=10)
    for r, report in enumerate(reports):
        assert report["failures"] == [], f"rank {r}: {report['failures']}"
    assert all(report["checksums"] == reports[0]["checksums"] for report in reports)


def test_fused_op_under_torch_compile(tmp_path):
    """torch.compile(fullgraph=True) traces the op (dynamo turns dist.all_reduce into a functional collective):
    the same bits as eager on both ranks."""
    reports = run_ranks(2, "compiled", tmp_path, alone_seconds=60)
    assert [report["failures"] for report in reports] == [[], []]
    assert reports[0]["checksums"] == reports[1]["checksums"]


def test_a_workspace_the_ranks_disagree_on_raises_everywhere(tmp_path):
    reports = run_ranks(2, "disagreeing_workspace", tmp_path, alone_seconds=5)
    assert [report["failures"] for report in reports] == [[], []]


def test_single_process_group(tmp_path):
    """A group of one: the sum over the ranks is the input, so the op is fused_add_rmsnorm (float32 add)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        residual = torch.randn(5, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        weight = torch.rand(1024) + 0.5
        summed = residual.double() + x.double()
        want = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        comm.fused_allreduce_add_rmsnorm(x, residual, weight)
        torch.testing.assert_close(residual.double(), summed, atol=1.6e-2, rtol=1.6e-2)
        torch.testing.assert_close(x.double(), want, atol=1.6e-2, rtol=1.6e-2)
        ws = comm.create_allreduce_fusion_workspace(max_token_num=8, hidden_dim=1024, dtype=torch.bfloat16)
        assert ws.world_size == 1 and ws.is_buffer_size_sufficient(1, 8, 1024, torch.bfloat16)
        assert not ws.is_buffer_size_sufficient(1, 9, 1024, torch.bfloat16)
        with pytest.raises(ValueError, match="does not fit"):
            comm.allreduce_fusion(torch.zeros(9, 1024, dtype=torch.bfloat16), ws, 0)
        with pytest.raises(TypeError, match="made for"):
            comm.allreduce_fusion(torch.zeros(2, 1024, dtype=torch.float16), ws, 0)
        with pytest.raises(ValueError, match="not supported"):
            comm.allreduce_fusion(torch.zeros(2, 1024, dtype=torch.bfloat16), ws, 2)
        with pytest.raises(ValueError, match="needs residual_in"):
            comm.allreduce_fusion(torch.zeros(2, 1024, dtype=torch.bfloat16), ws, 1)
        assert (ws.engine, ws.fallback_reason) == ("nccl", "a group of one")
        with pytest.raises(ValueError, match="cannot run here: rank 0: CPU tensors"):
            comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=8, hidden_dim=1024, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="residual must have shape"):
            comm.fused_allreduce_add_rmsnorm(x, residual[:2], weight)
        with pytest.raises(ValueError, match="norm weight"):
            comm.fused_allreduce_add_rmsnorm(x, residual, weight[:10])
    finally:
        dist.destroy_process_group()


def test_symmetric_memory_group_of_one(tmp_path):
    """backend="symm_mem" on one rank: the workspace mapped from shared memory and the emulated kernels, one-shot
    and two-shot, the in-place op on non-contiguous tensors, and a call the forced kernels cannot take."""
    pytest.importorskip("flashkern._emulate")
    import torch.distributed as dist

    import flashkern

    previous = flashkern.set_backend("emulate")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ws = comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=6, hidden_dim=1024, dtype=torch.bfloat16)
        assert ws.engine == "symm_mem" and ws.peers == [ws.buffer.data_ptr()]
        assert ws.buffer.numel() == comm.workspace_bytes(6 * 1024 * 2) and int(ws.buffer.sum()) == 0
        x = torch.randn(1024, 5, generator=torch.Generator().manual_seed(3)).bfloat16().t()
        residual = torch.randn(5, 1024, generator=torch.Generator().manual_seed(4)).bfloat16()
        weight = torch.rand(1024) + 0.5
        summed = residual.double() + x.double()
        want = ref.rmsnorm(summed, weight.double(), 1e-6)
        for one_shot in (True, False):
            out = comm.allreduce_fusion(x.contiguous(), ws, 0, use_oneshot=one_shot)
            assert torch.equal(out, x)
        comm.fused_allreduce_add_rmsnorm(x, residual, weight, workspace=ws)
        assert_close(residual, summed, torch.bfloat16)
        assert_close(x, want, torch.bfloat16)
        with pytest.raises(ValueError, match="does not fit"):
            comm.allreduce_fusion(torch.zeros(7, 1024, dtype=torch.bfloat16), ws, 0)
        with pytest.raises(TypeError, match="use_oneshot"):
            comm.allreduce_fusion(torch.zeros(2, 1024, dtype=torch.bfloat16), ws, 0, use_oneshot=1)
        with pytest.raises(ValueError, match="cannot run here: rank 0: the kernels take float16 and bfloat16"):
            comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=6, hidden_dim=1024, dtype=torch.float32)
        with pytest.raises(ValueError, match="multiple of 8 up to 16384"):
            comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=6, hidden_dim=1028, dtype=torch.float16)
    finally:
        dist.destroy_process_group()
        flashkern.set_backend(previous)


@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_engine_on_the_emulated_kernels(world, tmp_path):
    """Processes on gloo, each rank's workspace a shared-memory file mapped into every rank, the emulated kernels
    (tests/comm_worker.py's kernels scenario)."""
    pytest.importorskip("flashkern._emulate")
    reports = run_ranks(world, "kernels", tmp_path, alone_seconds=60)
    for r, report in enumerate(reports):
        assert report["failures"] == [], f"rank {r}: {report['failures']}"
    assert all(report["checksums"] == reports[0]["checksums"] for report in reports)
    assert len(reports[0]["checksums"]) == 4 * 4 + 2


def test_symmetric_memory_unavailable_falls_back_or_raises(tmp_path):
    reports = run_ranks(2, "kernels_unavailable", tmp_path, alone_seconds=5)
    assert [report["failures"] for report in reports] == [[], []]


def test_kernels_engine_under_torch_compile(tmp_path):
    pytest.importorskip("flashkern._emulate")
    reports = run_ranks(2, "compiled_kernels", tmp_path, alone_seconds=60)
    assert [report["failures"] for report in reports] == [[], []]
    assert reports[0]["checksums"] == reports[1]["checksums"]


def test_without_torch_distributed():
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="not initialized"):
        comm.fused_allreduce_add_rmsnorm(x, x.clone(), torch.ones(8))


@pytest.mark.parametrize("two_shot", [False, True])
def test_allreduce_kernel_op_on_one_rank(two_shot):
    """torch.ops' allreduce_fusion (csrc/torch/glue/comm.h) over the emulated kernels, a group of one:
    the glue's checks, params and launch; the multi-rank protocol is tests/test_emulated_kernels.py's."""
    pytest.importorskip("flashkern._emulate")
    from flashkern import ref

    op = torch.ops.flashkern_emulate.allreduce_fusion
    x, residual = torch.randn(5, 1024).bfloat16(), torch.randn(5, 1024).bfloat16()
    weight = torch.randn(1024)
    workspace = torch.zeros(4096 + 6 * 5 * 1024 * 2, dtype=torch.uint8)
    residual_out, norm_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    op(x, residual, weight, None, residual_out, norm_out, workspace, [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)
    s = x.double() + residual.double()
    assert_close(residual_out, s, torch.bfloat16)
    assert_close(norm_out, ref.rmsnorm(s, weight.double(), 1e-6), torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    op(x, None, None, out, None, None, workspace, [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="does not fit the workspace"):
        op(torch.zeros(6, 1024).bfloat16(), None, None, torch.zeros(6, 1024).bfloat16(), None, None, workspace,
           [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)
    # tensors that do not start on 16 bytes: the glue reads and writes through aligned copies (the in-place form)
    shifted = lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)  # noqa: E731
    x_in, res_in, w_in = shifted(x), shifted(residual), shifted(weight)
    assert x_in.data_ptr() % 16 and res_in.data_ptr() % 16 and w_in.data_ptr() % 16
    op(x_in, res_in, w_in, None, res_in, x_in, workspace, [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)
    assert_close(res_in, s, torch.bfloat16)
    assert_close(x_in, ref.rmsnorm(s, weight.double(), 1e-6), torch.bfloat16)
    out.fill_(float("nan"))  # peers[rank] is not read: this rank's workspace is the tensor given
    op(x, None, None, out, None, None, workspace, [workspace.data_ptr() + 16], 0, two_shot, 1e-6, 0.0)
    assert torch.equal(out, x)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        op(x.float(), None, None, out.float(), None, None, workspace, [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)


@requires_gpu
def test_symmetric_memory_on_one_gpu_in_a_cuda_graph():
    """The issue's single-GPU check: torch's symmetric memory for a group of one (an error from torch here means
    it does not allow one), the kernels eager, then captured (one-shot and two-shot) and replayed on new data."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    try:
        ws = comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=64, hidden_dim=4096, dtype=torch.bfloat16)
        assert ws.engine == "symm_mem" and ws.peers == [ws.buffer.data_ptr()]
        x, residual = rand((37, 4096), torch.bfloat16, device), rand((37, 4096), torch.bfloat16, device, seed=1)
        weight = rand((4096,), torch.float32, device, seed=2)
        outs = {one_shot: (poisoned(x.shape, x.dtype, device), poisoned(x.shape, x.dtype, device))
                for one_shot in (True, False)}

        def step():
            for one_shot, (res_out, norm_out) in outs.items():
                comm.allreduce_fusion(x, ws, comm.AllReduceFusionPattern.kARResidualRMSNorm, residual_in=residual,
                                      residual_out=res_out, norm_out=norm_out, rms_gamma=weight, use_oneshot=one_shot)

        def check():
            torch.cuda.synchronize()
            s = x.double() + residual.double()
            for res_out, norm_out in outs.values():
                assert_close(res_out, s, torch.bfloat16)
                assert_close(norm_out, ref.rmsnorm(s, weight.double(), 1e-6), torch.bfloat16)

        step()
        check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in (3, 4, 5):  # replays see new data in the same buffers; the flags keep counting
            x.copy_(rand(x.shape, x.dtype, device, seed=seed))
            for res_out, norm_out in outs.values():
                res_out.fill_(float("nan")), norm_out.fill_(float("nan"))
            graph.replay()
            check()
    finally:
        dist.destroy_process_group()


def test_comm_benchmark_smoke(tmp_path):
    """bench/comm.py under torchrun on 2 gloo ranks (the emulated kernels where built): every provider timed."""
    try:
        import flashkern._emulate  # noqa: F401
        backend = "emulate"
    except ImportError:
        backend = "auto"
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "comm.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "bench.comm", "--set", "smoke",
                          "--out", str(out)], cwd=root, env={**rank_env(), "FLASHKERN_BACKEND": backend},
                         capture_output=True, text=True, timeout=subprocess_limit(60))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "flashinfer" in data["machine_info"]["missing_providers"]
    providers = {"flashkern-auto", "nccl+norm"} | ({"flashkern-oneshot", "flashkern-twoshot"} if backend == "emulate"
                                                   else set())
    for tokens in (1, 7):
        rows = [r for r in data["rows"] if r["tokens"] == tokens]
        assert {r["provider"] for r in rows} == providers
        assert all(r["median_us"] > 0 and r["message_bytes"] == tokens * 1024 * 2 for r in rows)
