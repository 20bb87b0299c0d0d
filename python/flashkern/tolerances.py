"""The one tolerance table: how far an op's result may be from the float64 reference, per dtype.

A result r passes against the reference e when |r - e| <= atol + rtol * |e| elementwise
(torch.testing.assert_close). The bounds cover the rounding of the output to its dtype (half an
ulp: 2^-9 for bfloat16, 2^-12 for float16) plus one earlier rounding where an op stores an
intermediate (fused_add_rmsnorm's residual), plus float32 accumulation.
"""

import torch

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
}


# A whole model (tests/test_integrations.py: tiny float32 models, logits and gradients) compounds
# the per-op float32 error over its layers and the final projection.
MODEL_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def tolerance(dtype: torch.dtype) -> dict:
    return TOLERANCES[dtype]
