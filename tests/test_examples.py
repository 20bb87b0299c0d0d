"""examples/prefix_cache_generate.py: greedy generation through the prefix cache, prefill attention and
the planned cascade equals transformers' generate() on a tiny random Llama (16 requests, two system
prompts), up to float16 near-ties (the example's TIE), on every device."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import prefix_cache_generate as example  # noqa: E402


def test_prefix_cache_generate_matches_transformers(device):
    if getattr(device, "backend", None) == "emulate-wave64":
        pytest.skip("emulate-wave64: the CUDA build's emulation runs it (CI time)")
    verdicts, paged = example.main(str(device))
    assert all(v == "equal" or v.startswith("tie") for v in verdicts), verdicts
    assert verdicts.count("equal") >= 14
    assert paged.shared_tokens >= 14 * 32  # the system prompts' full pages were shared, not prefilled
    assert paged.cache.running == [] and paged.cache.free_pages + len(list(paged.cache._nodes())) == paged.cache.num_pages


def test_tensor_parallel_generation_matches_one_process():
    """examples/tensor_parallel.py under torchrun, 2 ranks on gloo over 127.0.0.1: every layer's all-reduce +
    add + RMSNorm through flashkern.comm, greedy tokens and logits equal to the whole model's."""
    import os
    import subprocess

    from conftest import subprocess_limit
    from test_comm import free_port, rank_env

    root = Path(__file__).resolve().parent.parent
    env = rank_env()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), str(root / "examples" / "tensor_parallel.py")],
                         env=env, capture_output=True, text=True, timeout=subprocess_limit(10))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "tensor parallel over 2 ranks" in run.stdout and "matches generate()" in run.stdout, run.stdout
