"""`flashkern check`: every op on every available device against the float64 reference."""

import torch

from . import _backend, activation, attention, cascade, decode, norm, ref, rope, sampling
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


def _renorm_cases(device, dtype, gen):
    """The deterministic sampling ops: top-k / top-p renormalization and top-k logit masking (equal
    infinities match) on peaked rows with a tail."""
    logits = (_rand((5, 1027), torch.float32, device, gen) * 3).to(dtype)
    probs = torch.softmax(logits.float(), dim=-1).to(dtype)
    rows = torch.full((5,), 1)
    for op, fn, x, kind, kw in (("top_k_renorm_probs", sampling.top_k_renorm_probs, probs, "top_k_probs", {"top_k": 40}),
                                ("top_p_renorm_probs", sampling.top_p_renorm_probs, probs, "top_p_probs", {"top_p": 0.7}),
                                ("top_k_mask_logits", sampling.top_k_mask_logits, logits, "top_k_logits", {"top_k": 40})):
        per_row = {name: rows * value for name, value in kw.items()}
        yield op, tuple(x.shape), fn(x, *kw.values()), ref.sampling.renorm(x.double().cpu(), kind, **per_row)


def _paged_attention_cases(device, dtype, gen):
    """Batch decode (GQA groups 4 and 8: both kernels), a two-level cascade and a single request, on a
    shuffled paged cache, against the float64 references."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    kv_heads, head_dim, page_size, lengths = 2, 128, 16, [1, 37, 0, 600]
    pages = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages) + 2
    cache = _rand((num_pages, 2, page_size, kv_heads, head_dim), dtype, device, gen)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    indices = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = i32([0] + torch.tensor(pages).cumsum(0).tolist())
    last = i32([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)])
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    for group in (4, 8):
        q = _rand((len(lengths), kv_heads * group, head_dim), dtype, device, gen)
        wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=dtype)
        out, lse = wrapper.run(q, cache, return_lse=True)
        e_out, e_lse = ref.batch_decode(q.double(), cache.double(), indptr, indices, last)
        yield f"batch_decode (group {group})", tuple(q.shape), torch.cat([out.double().flatten(), lse.double().flatten()]), \
            torch.cat([e_out.flatten(), e_lse.flatten()])
    # level 0: request 3's pages shared by all four requests; level 1: each request's own pages
    shared = (i32([0, 4]), i32([0, pages[3]]), indices[indptr[3] :], last[3:])
    own = (i32([0, 1, 2, 3, 4]), indptr, indices, last)
    levels = [list(t) for t in zip(shared, own)]
    wrapper = cascade.MultiLevelCascadeAttentionWrapper(2, workspace)
    wrapper.plan(*levels, kv_heads * 4, kv_heads, head_dim, page_size, q_data_type=dtype)
    q = _rand((4, kv_heads * 4, head_dim), dtype, device, gen)
    out = wrapper.run(q, cache)
    yield "cascade (2 levels)", tuple(q.shape), out.double().flatten(), ref.cascade_decode(q.double(), cache.double(), *levels)[0].flatten()
    k, v = cache[indices[indptr[3] :].long()].transpose(0, 1).flatten(1, 2)[:, :600]
    q1 = q[0]
    out = decode.single_decode_with_kv_cache(q1, k, v)
    e = ref.decode_attention(q1.double(), k.double(), v.double())[0]
    yield "single_decode_with_kv_cache", tuple(q1.shape), out.double().flatten(), e.flatten()


def check(devices=None, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list:
    """Rows of (op, device, backend, dtype, shape, max abs error, passed), one per case."""
    if devices is None:
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for device in devices:
        backend = _backend.backend_for(torch.device(device))
        for dtype in dtypes:
            cases = [*_cases(device, dtype, gen), *_rope_cases(device, dtype, gen), *_merge_cases(device, dtype, gen),
                     *_paged_attention_cases(device, dtype, gen), *_renorm_cases(device, dtype, gen)]
            for op, shape, actual, expected in cases:
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
