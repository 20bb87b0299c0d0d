"""flashkern.cupy: the public ops on CuPy arrays (zero-copy through DLPack, CuPy's stream)."""

import pytest
import torch
from conftest import assert_close, requires_gpu

import flashkern
import flashkern.cupy as fkcp
from flashkern import ref


def test_imports_without_cupy_and_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(fkcp, "_cp", None)
    with pytest.raises(ImportError, match=r"flashkern.cupy needs CuPy, which is not installed"):
        fkcp.rmsnorm(None, None)
    assert set(fkcp.__all__) >= {"rmsnorm", "silu_and_mul", "apply_rope_pos_ids", "fused_add_rmsnorm"}
    assert all(hasattr(flashkern, name) for name in fkcp.__all__)


@requires_gpu
@pytest.mark.skipif(fkcp._cp is None, reason="needs CuPy")
def test_ops_on_cupy_arrays():
    cp = fkcp._cp
    x = cp.random.standard_normal((37, 769), dtype=cp.float32)
    w = cp.random.standard_normal((769,), dtype=cp.float32)
    y = fkcp.rmsnorm(x, w, 1e-6)
    assert isinstance(y, cp.ndarray) and y.shape == x.shape
    assert_close(torch.from_dlpack(y), ref.rmsnorm(torch.from_dlpack(x).double(), torch.from_dlpack(w).double()))
    residual = cp.random.standard_normal((37, 769), dtype=cp.float32)
    expected = ref.fused_add_rmsnorm(torch.from_dlpack(x).double(), torch.from_dlpack(residual).double(),
                                     torch.from_dlpack(w).double())
    fkcp.fused_add_rmsnorm(x, residual, w)  # in place on the CuPy buffers: zero-copy
    assert_close(torch.from_dlpack(x), expected[0])
    g = cp.random.standard_normal((5, 2 * 64), dtype=cp.float32)
    assert_close(torch.from_dlpack(fkcp.silu_and_mul(g)), ref.act_and_mul(torch.from_dlpack(g).double(), "silu"))
    with cp.cuda.Stream(non_blocking=True) as s:  # runs on CuPy's current stream
        y2 = fkcp.rmsnorm(x, w)
        s.synchronize()
    assert isinstance(y2, cp.ndarray)
