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
from conftest import assert_close, subprocess_limit

from flashkern import comm

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
        with pytest.raises(ValueError, match="not wired yet"):
            comm.create_allreduce_fusion_workspace("symm_mem", max_token_num=8, hidden_dim=1024, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="residual must have shape"):
            comm.fused_allreduce_add_rmsnorm(x, residual[:2], weight)
        with pytest.raises(ValueError, match="norm weight"):
            comm.fused_allreduce_add_rmsnorm(x, residual, weight[:10])
    finally:
        dist.destroy_process_group()


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
    with pytest.raises(ValueError, match="peers\\[rank\\] must be this rank's workspace"):
        op(x, None, None, out, None, None, workspace, [workspace.data_ptr() + 16], 0, two_shot, 1e-6, 0.0)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        op(x.float(), None, None, out.float(), None, None, workspace, [workspace.data_ptr()], 0, two_shot, 1e-6, 0.0)
