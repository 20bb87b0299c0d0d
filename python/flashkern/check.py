"""`flashkern check`: every op on every available device against the float64 reference."""

import torch

from . import _backend, activation, attention, norm, ref, rope
from .rope_scaling import cos_sin_cache, theta_inv_freq
from .tolerances import tolerance

SHAPES = {"norm": [(1, 1), (37, 769), (4, 4096), (3, 5, 128)], "act": [(1, 2), (37, 2 * 769), (4, 2 * 4096)]}


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _cases(device, dtype, gen):
    """Yields (op, shape, actual, expected) for one device and dtype."""
    for shape in SHAPES["norm"]:
        x, res = _rand(shape, dtype, device, gen), _rand(shape, dtype, device, gen)
        w = _rand(shape[-1:], dtype, device, gen)
        for op, fn, offset in (("rmsnorm", norm.rmsnorm, 0.0), ("gemma_rmsnorm", norm.gemma_rmsnorm, 1.0)):
            yield op, shape, fn(x, w), ref.rmsnorm(x.double(), w.double(), 1e-6, offset)
        for op, fn, offset in (
            ("fused_add_rmsnorm", norm.fused_add_rmsnorm, 0.0),
            ("gemma_fused_add_rmsnorm", norm.gemma_fused_add_rmsnorm, 1.0),
        ):
            xi, ri = x.clone(), res.clone()
            fn(xi, ri, w)
            expected_y, expected_r = ref.fused_add_rmsnorm(x.double(), res.double(), w.double(), 1e-6, offset)
            yield op, shape, torch.cat([xi.flatten(), ri.flatten()]), torch.cat(
                [expected_y.flatten(), expected_r.flatten()]
            )
    for shape in SHAPES["act"]:
        x = _rand(shape, dtype, device, gen)
        for name in ("silu", "gelu", "gelu_tanh"):
            fn = getattr(activation, f"{name}_and_mul")
            yield f"{name}_and_mul", shape, fn(x), ref.act_and_mul(x.double(), name)


def _rope_cases(device, dtype, gen):
    tokens = 37
    q, k = _rand((tokens, 8, 128), dtype, device, gen), _rand((tokens, 2, 128), dtype, device, gen)
    pos = torch.randint(0, 32768, (tokens,), generator=gen).to(device)
    for interleave in (False, True):
        name = "apply_rope_pos_ids" + (" (interleave)" if interleave else "")
        inv_freq = theta_inv_freq(96, 5e5).to(device)
        actual = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=96, interleave=interleave, rope_theta=5e5)
        expected = ref.rope(q.double(), k.double(), pos, inv_freq, interleave)
        yield name, tuple(q.shape), torch.cat([a.flatten() for a in actual]), torch.cat([e.flatten() for e in expected])
    cache = cos_sin_cache(theta_inv_freq(128, 1e4), 32768).to(device)
    actual = rope.apply_rope_with_cos_sin_cache(pos, q.flatten(1), k.flatten(1), 128, cache)
    expected = ref.rope(q.double(), k.double(), pos, cache)
    yield "apply_rope_with_cos_sin_cache", tuple(q.shape), torch.cat([a.flatten() for a in actual]), torch.cat(
        [e.flatten() for e in expected]
    )


def _merge_cases(device, dtype, gen):
    v = _rand((37, 5, 8, 128), dtype, device, gen)
    s = (_rand((37, 5, 8), torch.float32, device, gen) * 4).float()
    s[3] = float("-inf")  # a token whose states are all empty
    actual = attention.merge_states(v, s)
    expected = ref.merge_states(v.double(), s.double())
    yield "merge_states", tuple(v.shape), torch.cat([a.double().flatten() for a in actual]), torch.cat(
        [e.flatten() for e in expected]
    )
    a = attention.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    e = ref.merge_state(v[:, 0].double(), s[:, 0].double(), v[:, 1].double(), s[:, 1].double())
    yield "merge_state", tuple(v[:, 0].shape), torch.cat([x.double().flatten() for x in a]), torch.cat(
        [x.flatten() for x in e]
    )


def check(devices=None, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list:
    """Rows of (op, device, backend, dtype, shape, max abs error, passed), one per case."""
    if devices is None:
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for device in devices:
        backend = _backend.backend_for(torch.device(device))
        for dtype in dtypes:
            for op, shape, actual, expected in [*_cases(device, dtype, gen), *_rope_cases(device, dtype, gen), *_merge_cases(device, dtype, gen)]:
                actual = actual.double().cpu()
                expected = expected.cpu()
                tol = tolerance(dtype)
                err = torch.where(actual == expected, 0.0, (actual - expected).abs())  # equal infinities match
                passed = bool((err <= tol["atol"] + tol["rtol"] * expected.abs()).all())
                rows.append(
                    {
                        "op": op,
                        "device": device,
                        "backend": backend,
                        "dtype": str(dtype).replace("torch.", ""),
                        "shape": tuple(shape),
                        "max_abs_err": float(err.max()),
                        "passed": passed,
                    }
                )
    return rows
