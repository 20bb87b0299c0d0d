"""The training step: one AdamW step with global-norm clipping over about 200 tensors (8M and 128M
parameters; 1B in the full set), float32 and bfloat16 parameters: flashkern's fused step (norm and
update kernels, float32 state) beside torch's AdamW(fused=True) after clip_grad_norm_(foreach=True)
and apex's FusedAdam when importable. Bytes: cases.optim_bytes, the least a fused step moves."""

import pytest

from . import cases
from .harness import bench_op


@pytest.mark.benchmark(group="adamw_step")
@pytest.mark.parametrize("provider,label,total,tensors,dtype",
                         cases.params(cases.OPTIM_STEP, cases.optim_shapes(), dtypes=cases.OPTIM_DTYPES))
def test_adamw_step(benchmark, provider, label, total, tensors, dtype):
    bench_op(benchmark, op="adamw_step", provider=provider, shape=(total, tensors), dtype=dtype,
             bytes_moved=cases.optim_bytes(total, dtype), make_inputs=cases.optim_inputs(total, tensors, dtype))
