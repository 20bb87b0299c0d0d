"""What is benchmarked: shapes from real models, the providers of each op, and the bytes each op
must move at least (every input read once, every output written once)."""

import functools
import os
import random

import torch
import torch.nn.functional as F

from .harness import GPU, Provider

# Hidden sizes and MLP intermediate sizes (d of SwiGLU's [tokens, 2d] input) of real models.
HIDDEN = {"llama3-8b": 4096, "qwen2.5-7b": 3584, "gemma2-27b": 4608, "llama3-70b": 8192, "llama3-405b": 16384}
INTERMEDIATE = {"llama3-8b": 14336, "qwen2.5-7b": 18944, "llama3-70b": 28672, "gemma2-27b": 36864}
DECODE_TOKENS = [1, 16, 64, 256]
PREFILL_TOKENS = [4096, 16384, 32768]

# smoke: the CPU check in CI; quick: the one-call device check (bench/device_check.sh); full: everything.
BENCH_SET = os.environ.get("FLASHKERN_BENCH_SET") or ("quick" if GPU else "smoke")


def model_shapes(sizes: dict):
    """[(label, tokens, size)] for the chosen set."""
    if BENCH_SET == "smoke":
        return [("tiny", 4, 256)]
    models = list(sizes.items()) if BENCH_SET == "full" else list(sizes.items())[:1] + list(sizes.items())[3:4]
    tokens = DECODE_TOKENS + PREFILL_TOKENS if BENCH_SET == "full" else [1, 64, 4096, 32768]
    return [(f"{name} t={t}", t, size) for name, size in models for t in tokens]


def variant_shapes(sizes: dict):
    """One decode and one prefill shape: for ops that share a kernel with a fully benchmarked one."""
    if BENCH_SET == "smoke":
        return [("tiny", 4, 256)]
    size = next(iter(sizes.values()))
    return [(f"t={t}", t, size) for t in (64, 4096)]


def sweep_shapes(size: int):
    """Token counts 1 .. 64K at one size: where each kernel leaves the bandwidth roof."""
    if BENCH_SET == "smoke":
        return [("sweep", 1, 64), ("sweep", 8, 64)]
    top = 16 if BENCH_SET == "full" else 14
    return [("sweep", 2**i, size) for i in range(0, top + 1, 1 if BENCH_SET == "full" else 2)]


# flashkern with enable_pdl=True: graphs of back-to-back launches show what PDL saves (GPU only: elsewhere
# it is a plain launch)
PDL = "flashkern (pdl)"
DTYPES = [torch.bfloat16] if BENCH_SET != "full" else [torch.bfloat16, torch.float16]


def params(providers, shapes, *lead, dtypes=None):
    """pytest params (*lead, provider, label, tokens, size, dtype) for every provider, shape and dtype
    (DTYPES unless `dtypes` names others: sampling takes float32 probabilities only)."""
    import pytest

    return [
        pytest.param(*lead, p, label, t, size, dtype,
                     id="-".join([*map(str, lead), p.name, label.replace(" ", "-"), str(size), str(dtype)[6:]]))
        for label, t, size in shapes
        for dtype in (dtypes or DTYPES)
        for p in providers
    ]


def rand(shape, dtype, seed):
    g = torch.Generator(device="cuda" if GPU else "cpu").manual_seed(seed)
    return torch.randn(shape, dtype=dtype, device="cuda" if GPU else "cpu", generator=g)


def _compiled(fn):
    """torch.compile of the plain-torch formula, once for all shapes (dynamic)."""
    return torch.compile(fn, dynamic=True)


# ---------------------------------------------------------------- rmsnorm


def rmsnorm_bytes(tokens, hidden, dtype):
    s = torch.finfo(dtype).bits // 8
    return 2 * tokens * hidden * s + hidden * s


def rmsnorm_inputs(tokens, hidden, dtype):
    return lambda seed: (rand((tokens, hidden), dtype, seed), rand((hidden,), dtype, 10**6 + seed))


def _hf_rmsnorm(x, w, eps=1e-6):  # as Hugging Face models write it
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


_compiled_rmsnorm = None


def _compile_rmsnorm(x, w):
    global _compiled_rmsnorm
    _compiled_rmsnorm = _compiled_rmsnorm or _compiled(_hf_rmsnorm)
    return lambda: _compiled_rmsnorm(x, w)


def _vllm_rmsnorm(x, w):
    from vllm import _custom_ops

    out = torch.empty_like(x)
    return lambda: _custom_ops.rms_norm(out, x, w, 1e-6)


def _liger_rmsnorm(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda: LigerRMSNormFunction.apply(x, w, 1e-6)


RMSNORM = [
    Provider("flashkern", lambda x, w: (lambda: _flashkern().rmsnorm(x, w, 1e-6)), requires="flashkern"),
    Provider(PDL, lambda x, w: (lambda: _flashkern().rmsnorm(x, w, 1e-6, enable_pdl=True)), "flashkern", True),
    Provider("torch", lambda x, w: (lambda: F.rms_norm(x, (x.shape[-1],), w, 1e-6))),
    Provider("torch.compile", _compile_rmsnorm),
    Provider("flashinfer", lambda x, w: (lambda: __import__("flashinfer").norm.rmsnorm(x, w, 1e-6)), "flashinfer", True),
    Provider("vllm", _vllm_rmsnorm, "vllm._custom_ops", True),
    Provider("liger", _liger_rmsnorm, "liger_kernel", True),
    Provider("sglang", lambda x, w: (lambda: __import__("sgl_kernel").rmsnorm(x, w, 1e-6)), "sgl_kernel", True),
    Provider("aiter", lambda x, w: (lambda: __import__("aiter").rmsnorm2d_fwd(x, w, 1e-6)), "aiter", True),
]


def _hf_gemma_rmsnorm(x, w, eps=1e-6):  # Gemma: (1 + w) in float32, then cast
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype)


_compiled_gemma = None


def _compile_gemma(x, w):
    global _compiled_gemma
    _compiled_gemma = _compiled_gemma or _compiled(_hf_gemma_rmsnorm)
    return lambda: _compiled_gemma(x, w)


GEMMA_RMSNORM = [
    Provider("flashkern", lambda x, w: (lambda: _flashkern().gemma_rmsnorm(x, w, 1e-6)), requires="flashkern"),
    Provider("torch", lambda x, w: (lambda: _hf_gemma_rmsnorm(x, w))),
    Provider("torch.compile", _compile_gemma),
    Provider("flashinfer", lambda x, w: (lambda: __import__("flashinfer").norm.gemma_rmsnorm(x, w, 1e-6)), "flashinfer", True),
]


# ---------------------------------------------------------------- fused_add_rmsnorm


def fused_add_rmsnorm_bytes(tokens, hidden, dtype):
    s = torch.finfo(dtype).bits // 8
    return 4 * tokens * hidden * s + hidden * s


def fused_add_rmsnorm_inputs(tokens, hidden, dtype):
    return lambda seed: (
        rand((tokens, hidden), dtype, seed),
        rand((tokens, hidden), dtype, 10**5 + seed),
        rand((hidden,), dtype, 10**6 + seed),
    )


def _torch_fused_add(x, r, w):
    def run():
        r.add_(x)
        x.copy_(F.rms_norm(r, (r.shape[-1],), w, 1e-6))

    return run


_compiled_fused_add = None


def _compile_fused_add(x, r, w):
    global _compiled_fused_add

    def fused(x, r, w):  # out of place: in-place versions trip inductor with dynamic shapes; same bytes
        s = x + r
        return _hf_rmsnorm(s, w), s

    _compiled_fused_add = _compiled_fused_add or _compiled(fused)
    return lambda: _compiled_fused_add(x, r, w)


def _vllm_fused_add(x, r, w):
    from vllm import _custom_ops

    return lambda: _custom_ops.fused_add_rms_norm(x, r, w, 1e-6)


FUSED_ADD_RMSNORM = [
    Provider("flashkern", lambda x, r, w: (lambda: _flashkern().fused_add_rmsnorm(x, r, w, 1e-6)), requires="flashkern"),
    Provider(PDL, lambda x, r, w: (lambda: _flashkern().fused_add_rmsnorm(x, r, w, 1e-6, enable_pdl=True)),
             "flashkern", True),
    Provider("torch", _torch_fused_add),
    Provider("torch.compile", _compile_fused_add),
    Provider("flashinfer", lambda x, r, w: (lambda: __import__("flashinfer").norm.fused_add_rmsnorm(x, r, w, 1e-6)),
             "flashinfer", True),
    Provider("vllm", _vllm_fused_add, "vllm._custom_ops", True),
    Provider("sglang", lambda x, r, w: (lambda: __import__("sgl_kernel").fused_add_rmsnorm(x, r, w, 1e-6)),
             "sgl_kernel", True),
]


# ---------------------------------------------------------------- silu_and_mul


def silu_and_mul_bytes(tokens, d, dtype):
    return 3 * tokens * d * (torch.finfo(dtype).bits // 8)


def silu_and_mul_inputs(tokens, d, dtype):
    return lambda seed: (rand((tokens, 2 * d), dtype, seed),)


_TORCH_ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _torch_act_and_mul(act):
    def fn(x):
        d = x.shape[-1] // 2
        return _TORCH_ACT[act](x[..., :d]) * x[..., d:]

    return fn


_compiled_act = {}


def _compile_act_and_mul(act):
    def make(x):
        if act not in _compiled_act:
            _compiled_act[act] = _compiled(_torch_act_and_mul(act))
        return lambda: _compiled_act[act](x)

    return make


def _vllm_act_and_mul(act):
    def make(x):
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        kernel = getattr(torch.ops._C, f"{act}_and_mul")
        return lambda: kernel(out, x)

    return make


def _liger_swiglu(x):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate, up = (t.contiguous() for t in x.chunk(2, dim=-1))  # Liger takes the halves as two tensors
    return lambda: LigerSiLUMulFunction.apply(gate, up)


def act_and_mul_providers(act):
    """silu_and_mul, gelu_and_mul, gelu_tanh_and_mul: the same providers, each with its activation."""
    name = f"{act}_and_mul"
    providers = [
        Provider("flashkern", lambda x: (lambda: getattr(_flashkern(), name)(x)), requires="flashkern"),
        Provider(PDL, lambda x: (lambda: getattr(_flashkern(), name)(x, enable_pdl=True)), "flashkern", True),
        Provider("torch", lambda x: (lambda: _torch_act_and_mul(act)(x))),
        Provider("torch.compile", _compile_act_and_mul(act)),
        Provider("flashinfer", lambda x: (lambda: getattr(__import__("flashinfer").activation, name)(x)),
                 "flashinfer", True),
        Provider("vllm", _vllm_act_and_mul(act), "vllm._custom_ops", True),
        Provider("sglang", lambda x: (lambda: getattr(__import__("sgl_kernel"), name)(x)), "sgl_kernel", True),
    ]
    if act == "silu":
        providers.append(Provider("liger", _liger_swiglu, "liger_kernel", True))
    return providers


SILU_AND_MUL = act_and_mul_providers("silu")


# ---------------------------------------------------------------- backward (training)


def rmsnorm_backward_bytes(tokens, hidden, dtype):
    s = torch.finfo(dtype).bits // 8
    return 3 * tokens * hidden * s + 2 * hidden * s  # read x, dy; write dx; read w, write dw


def rmsnorm_backward_inputs(tokens, hidden, dtype):
    return lambda seed: (
        rand((tokens, hidden), dtype, 10**5 + seed),
        rand((tokens, hidden), dtype, seed),
        rand((hidden,), dtype, 10**6 + seed),
    )


_compiled_rms_bwd = None


def _compile_rmsnorm_backward(dy, x, w):
    global _compiled_rms_bwd
    from flashkern import ref

    _compiled_rms_bwd = _compiled_rms_bwd or _compiled(ref.rmsnorm_backward)
    return lambda: _compiled_rms_bwd(dy, x, w)


RMSNORM_BACKWARD = [
    Provider("flashkern", lambda dy, x, w: (lambda: torch.ops.flashkern.rmsnorm_backward(dy, x, w, 1e-6, 0.0)),
             requires="flashkern"),
    Provider("torch", lambda dy, x, w: (lambda: _flashkern().ref.rmsnorm_backward(dy, x, w)), requires="flashkern"),
    Provider("torch.compile", _compile_rmsnorm_backward, requires="flashkern"),
]


def silu_and_mul_backward_bytes(tokens, d, dtype):
    return 5 * tokens * d * (torch.finfo(dtype).bits // 8)  # read x (2d), dy (d); write dx (2d)


def silu_and_mul_backward_inputs(tokens, d, dtype):
    return lambda seed: (rand((tokens, d), dtype, 10**5 + seed), rand((tokens, 2 * d), dtype, seed))


SILU_AND_MUL_BACKWARD = [
    Provider("flashkern", lambda dy, x: (lambda: torch.ops.flashkern.act_and_mul_backward(dy, x, "silu")),
             requires="flashkern"),
    Provider("torch", lambda dy, x: (lambda: _flashkern().ref.act_and_mul_backward(dy, x, "silu")), requires="flashkern"),
]


# ---------------------------------------------------------------- rope (in place, as in inference)

ROPE_HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "llama3-70b": (64, 8, 128)}


def rope_shapes():
    """[(label, tokens, (q_heads, k_heads, head_dim))]."""
    if BENCH_SET == "smoke":
        return [("tiny", 4, (2, 1, 64))]
    models = list(ROPE_HEADS.items()) if BENCH_SET == "full" else list(ROPE_HEADS.items())[:1]
    tokens = DECODE_TOKENS + PREFILL_TOKENS if BENCH_SET == "full" else [1, 64, 4096, 32768]
    return [(f"{name} t={t}", t, heads) for name, heads in models for t in tokens]


def rope_bytes(tokens, heads, dtype):
    q_heads, k_heads, head_dim = heads
    return 2 * tokens * (q_heads + k_heads) * head_dim * (torch.finfo(dtype).bits // 8) + 8 * tokens


def rope_inputs(tokens, heads, dtype):
    q_heads, k_heads, head_dim = heads
    return lambda seed: (
        rand((tokens, q_heads, head_dim), dtype, seed),
        rand((tokens, k_heads, head_dim), dtype, 10**5 + seed),
        torch.arange(tokens, device="cuda" if GPU else "cpu") + 1000 * seed,
    )


def _hf_rope(q, k, pos, inv_freq):
    """As Hugging Face models apply it: cos/sin from an fp32 outer product, rotate_half."""
    angle = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos()[:, None, :].to(q.dtype), emb.sin()[:, None, :].to(q.dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _torch_rope(q, k, pos):
    inv_freq = _flashkern().rope_scaling.theta_inv_freq(q.shape[-1], 1e4, device=q.device)
    return lambda: _hf_rope(q, k, pos, inv_freq)


_compiled_rope = None


def _compile_rope(q, k, pos):
    global _compiled_rope
    _compiled_rope = _compiled_rope or _compiled(_hf_rope)
    inv_freq = _flashkern().rope_scaling.theta_inv_freq(q.shape[-1], 1e4, device=q.device)
    return lambda: _compiled_rope(q, k, pos, inv_freq)


def _liger_rope(q, k, pos):
    from liger_kernel.ops.rope import LigerRopeFunction

    inv_freq = _flashkern().rope_scaling.theta_inv_freq(q.shape[-1], 1e4, device=q.device)
    angle = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angle, angle], dim=-1)[None]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    q4, k4 = q.transpose(0, 1)[None].contiguous(), k.transpose(0, 1)[None].contiguous()  # [1, heads, tokens, dim]
    return lambda: LigerRopeFunction.apply(q4, k4, cos, sin)


ROPE = [
    Provider("flashkern", lambda q, k, pos: (lambda: _flashkern().apply_rope_pos_ids_inplace(q, k, pos)),
             requires="flashkern"),
    Provider("torch", _torch_rope, requires="flashkern"),
    Provider("torch.compile", _compile_rope, requires="flashkern"),
    Provider("flashinfer", lambda q, k, pos: (lambda: __import__("flashinfer").rope.apply_rope_pos_ids_inplace(q, k, pos)),
             "flashinfer", True),
    Provider("liger", _liger_rope, "liger_kernel", True),
]


# ---------------------------------------------------------------- merge_states (split-KV, cascade)


def merge_shapes():
    """[(label, tokens, (num_states, heads, head_dim))]."""
    if BENCH_SET == "smoke":
        return [("tiny", 4, (2, 2, 64))]
    tokens = [1, 64, 256, 4096] if BENCH_SET == "full" else [64, 4096]
    return [(f"states={n} t={t}", t, (n, 32, 128)) for n in (2, 8) for t in tokens]


def merge_bytes(tokens, shape, dtype):
    n, heads, head_dim = shape
    s = torch.finfo(dtype).bits // 8
    return (n + 1) * tokens * heads * (head_dim * s + 4)


def merge_inputs(tokens, shape, dtype):
    n, heads, head_dim = shape
    return lambda seed: (rand((tokens, n, heads, head_dim), dtype, seed), rand((tokens, n, heads), torch.float32, 10**5 + seed))


_compiled_merge = None


def _compile_merge(v, s):
    global _compiled_merge
    _compiled_merge = _compiled_merge or _compiled(_flashkern().ref.merge_states)
    return lambda: _compiled_merge(v, s)


MERGE_STATES = [
    Provider("flashkern", lambda v, s: (lambda: _flashkern().merge_states(v, s)), requires="flashkern"),
    Provider("torch", lambda v, s: (lambda: _flashkern().ref.merge_states(v, s)), requires="flashkern"),
    Provider("torch.compile", _compile_merge, requires="flashkern"),
    # FlashInfer's log-sum-exp is base 2: the same bytes and work, another convention
    Provider("flashinfer", lambda v, s: (lambda: __import__("flashinfer").merge_states(v, s)), "flashinfer", True),
]


# ---------------------------------------------------------------- decode and cascade attention (paged KV)

# Llama-3 8B's attention: 8 KV heads of 128 dims (32 q heads: group 4); pages of 16 tokens. The smoke
# set (the CPU, in CI) shrinks everything.
KV_HEADS, HEAD_DIM, PAGE_SIZE = (1, 64, 16) if BENCH_SET == "smoke" else (8, 128, 16)


def decode_shapes():
    """[(label, batch, (kv length, GQA group))], every request of the batch that long."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, (40, 4))]
    if BENCH_SET == "full":
        grid = [(b, n, g) for b in (1, 4, 16, 64, 256) for n in (512, 2048, 8192, 32768) for g in (1, 4, 8)]
    else:
        grid = [(1, 32768, 4), (1, 4096, 8), (16, 4096, 1), (16, 4096, 4), (16, 4096, 8), (64, 2048, 4),
                (256, 512, 4), (256, 4096, 4), (256, 4096, 8)]
    return [(f"b={b} len={n} g={g}", b, (n, g)) for b, n, g in grid]


def cascade_shapes():
    """[(label, batch, (shared prefix, suffix per request))], GQA group 4."""
    if BENCH_SET == "smoke":
        return [("tiny", 3, (64, 5))]
    if BENCH_SET == "full":
        grid = [(b, p, s) for p in (1024, 8192, 32768) for b in (32, 128, 256) for s in (64, 256, 1024)]
    else:
        grid = [(128, 1024, 256), (128, 8192, 256), (128, 32768, 256), (32, 32768, 256), (256, 32768, 256),
                (128, 32768, 64), (128, 32768, 1024)]
    return [(f"b={b} prefix={p} suffix={s}", b, (p, s)) for b, p, s in grid]


# head_dim 512 (Gemma-style wide heads, GQA 16:1): the 16-row tiles only, beside SDPA and FlashInfer
WIDE_HEAD_DIM = 512


def decode_wide_shapes():
    """[(label, batch, (kv length, GQA group))] at head_dim 512."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, (40, 16))]
    return [(f"b={b} len={n} g=16", b, (n, 16)) for b, n in ((1, 32768), (16, 4096), (64, 4096))]


def _heads(group):
    return KV_HEADS * group, KV_HEADS


def decode_bytes(batch, shape, dtype, head_dim=HEAD_DIM):
    """q, the KV every request reads, the output and its LSE."""
    length, group = shape
    s = torch.finfo(dtype).bits // 8
    qo_heads, kv_heads = _heads(group)
    return 2 * batch * qo_heads * head_dim * s + 2 * batch * length * kv_heads * head_dim * s + 4 * batch * qo_heads


def cascade_bytes(batch, shape, dtype):
    """The problem's unique bytes, the same for every provider: the prefix once, every suffix, q and the output."""
    prefix, suffix = shape
    s = torch.finfo(dtype).bits // 8
    qo_heads, kv_heads = _heads(4)
    return 2 * batch * qo_heads * HEAD_DIM * s + 2 * (prefix + batch * suffix) * kv_heads * HEAD_DIM * s


def _page_table(lengths, first_page=0):
    """CSR page table of requests of these lengths on consecutive pages from first_page."""
    pages = [-(-n // PAGE_SIZE) for n in lengths]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(lengths, pages)], dtype=torch.int32)
    return indptr, first_page + torch.arange(sum(pages), dtype=torch.int32), last


def _workspace():
    return torch.empty(64 << 20, dtype=torch.uint8, device="cuda" if GPU else "cpu")


class PagedCase:
    """One input set: a paged cache in shuffled page order, its page tables, q, and planned wrappers."""

    def __init__(self, seed, batch, tables, qo_heads, kv_heads, dtype, cascade=None, head_dim=HEAD_DIM):
        device = "cuda" if GPU else "cpu"
        indptr, indices, last = tables
        num_pages = int(indices.numel()) if cascade is None else int(cascade[2][-1].max()) + 1
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(num_pages, generator=g).to(torch.int32)  # logical page -> place in the cache
        self.cache = rand((num_pages, 2, PAGE_SIZE, kv_heads, head_dim), dtype, seed)
        self.q = rand((batch, qo_heads, head_dim), dtype, 10**5 + seed)
        self.tables = (indptr.to(device), self.perm[indices.long()].to(device), last.to(device))
        self.heads, self.dtype, self.batch, self.head_dim = (qo_heads, kv_heads), dtype, batch, head_dim
        self.decode = _flashkern().BatchDecodeWithPagedKVCacheWrapper(_workspace())
        self.decode.plan(indptr, self.perm[indices.long()], last, qo_heads, kv_heads, head_dim, PAGE_SIZE,
                         q_data_type=dtype)
        self.cascade_tables = None
        if cascade is not None:
            qo, kv, idx, lasts = cascade
            idx = [self.perm[i.long()] for i in idx]
            self.cascade_tables = (qo, kv, idx, lasts)
            self.cascade = _flashkern().MultiLevelCascadeAttentionWrapper(2, _workspace())
            self.cascade.plan(qo, kv, idx, lasts, qo_heads, kv_heads, head_dim, PAGE_SIZE, q_data_type=dtype)


def decode_inputs(batch, shape, dtype, head_dim=HEAD_DIM):
    length, group = shape
    tables = _page_table([length] * batch)
    return lambda seed: (PagedCase(seed, batch, tables, *_heads(group), dtype, head_dim=head_dim),)


def cascade_inputs(batch, shape, dtype):
    """Level 0: the prefix's pages, shared by the whole batch; level 1: each request's suffix. The
    non-cascade page table lists the prefix pages again for every request."""
    prefix, suffix = shape
    n_prefix = prefix // PAGE_SIZE  # the prefix fills whole pages, so it can lead every request's list
    suffix_indptr, suffix_indices, suffix_last = _page_table([suffix] * batch, first_page=n_prefix)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    cascade = ([i32([0, batch]), torch.arange(batch + 1, dtype=torch.int32)],
               [i32([0, n_prefix]), suffix_indptr], [torch.arange(n_prefix, dtype=torch.int32), suffix_indices],
               [i32([PAGE_SIZE]), suffix_last])
    per_request = [torch.cat([torch.arange(n_prefix), suffix_indices[suffix_indptr[b] : suffix_indptr[b + 1]].long()])
                   for b in range(batch)]
    flat = (torch.tensor([0] + torch.tensor([len(r) for r in per_request]).cumsum(0).tolist(), dtype=torch.int32),
            torch.cat(per_request).to(torch.int32), suffix_last)
    return lambda seed: (PagedCase(seed, batch, flat, *_heads(4), dtype, cascade=cascade),)


def _sdpa(case):
    """torch's scaled_dot_product_attention (GQA) on the same KV laid out contiguously [batch, kv_heads, length, D]."""
    indptr, indices, last = (t.cpu() for t in case.tables)
    length = (int(indptr[1] - indptr[0]) - 1) * PAGE_SIZE + int(last[0])
    pages = indices.long().view(case.batch, -1).to(case.cache.device)
    k = case.cache[pages, 0].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    v = case.cache[pages, 1].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    q = case.q[:, :, None]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _flashinfer_decode(case):
    import flashinfer

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    wrapper.plan(*case.tables, *case.heads, case.head_dim, PAGE_SIZE, q_data_type=case.dtype)
    return lambda: wrapper.run(case.q, case.cache)


def _flashinfer_cascade(case):
    import flashinfer

    qo, kv, idx, last = case.cascade_tables
    device = case.cache.device
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, _workspace(), "NHD")
    wrapper.plan([t.to(device) for t in qo], [t.to(device) for t in kv], [t.to(device) for t in idx],
                 [t.to(device) for t in last], *case.heads, HEAD_DIM, PAGE_SIZE, q_data_type=case.dtype)
    return lambda: wrapper.run(case.q, case.cache)


# Batch-invariant plans (flashkern.invariance: fixed 1024-token chunks, tiles chosen per request) beside the
# default ones (goal on an H200: within 10 % at batch >= 16)
INVARIANT = "flashkern (batch-invariant)"


def _invariant_decode(case):
    wrapper = _flashkern().BatchDecodeWithPagedKVCacheWrapper(_workspace())
    wrapper.plan(*(t.cpu() for t in case.tables), *case.heads, case.head_dim, PAGE_SIZE, q_data_type=case.dtype,
                 batch_invariant=True)
    return lambda: wrapper.run(case.q, case.cache)


DECODE = [
    Provider("flashkern", lambda case: (lambda: case.decode.run(case.q, case.cache)), requires="flashkern"),
    Provider(INVARIANT, _invariant_decode, requires="flashkern"),
    Provider(PDL, lambda case: (lambda: case.decode.run(case.q, case.cache, enable_pdl=True)), "flashkern", True),
    Provider("torch", _sdpa),
    Provider("flashinfer", _flashinfer_decode, "flashinfer", True),
]

# An fp8 (e4m3) KV cache beside the same batch over the 16-bit cache: the same shapes and q dtype; per-head
# k_scale / v_scale tensors (what the kernels read on the device) for flashkern, FlashInfer's float scales.
FP8_BASELINE = "flashkern (16-bit cache)"


def decode_fp8_bytes(batch, shape, dtype, provider):
    """decode_bytes with the KV at one byte an element (the 16-bit baseline at its own two)."""
    length, group = shape
    s = torch.finfo(dtype).bits // 8
    kv_bytes = s if provider.name == FP8_BASELINE else 1
    qo_heads, kv_heads = _heads(group)
    return 2 * batch * qo_heads * HEAD_DIM * s + 2 * batch * length * kv_heads * HEAD_DIM * kv_bytes + 4 * batch * qo_heads


class Fp8DecodeCase(PagedCase):
    def __init__(self, seed, batch, tables, qo_heads, kv_heads, dtype):
        super().__init__(seed, batch, tables, qo_heads, kv_heads, dtype)
        self.cache_fp8 = self.cache.to(torch.float8_e4m3fn)  # rand's values are well inside e4m3's range
        self.scale = torch.ones(kv_heads, device=self.cache.device)
        self.fp8 = _flashkern().BatchDecodeWithPagedKVCacheWrapper(_workspace())
        self.fp8.plan(*(t.cpu() for t in self.tables), qo_heads, kv_heads, HEAD_DIM, PAGE_SIZE, q_data_type=dtype,
                      kv_data_type=torch.float8_e4m3fn)


def decode_fp8_inputs(batch, shape, dtype):
    length, group = shape
    tables = _page_table([length] * batch)
    return lambda seed: (Fp8DecodeCase(seed, batch, tables, *_heads(group), dtype),)


def _flashinfer_decode_fp8(case):
    import flashinfer

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    wrapper.plan(*case.tables, *case.heads, HEAD_DIM, PAGE_SIZE, q_data_type=case.dtype,
                 kv_data_type=torch.float8_e4m3fn)
    return lambda: wrapper.run(case.q, case.cache_fp8, k_scale=1.0, v_scale=1.0)


DECODE_FP8 = [
    Provider("flashkern", lambda case: (lambda: case.fp8.run(case.q, case.cache_fp8, k_scale=case.scale,
                                                            v_scale=case.scale)), requires="flashkern"),
    Provider(FP8_BASELINE, lambda case: (lambda: case.decode.run(case.q, case.cache)), requires="flashkern"),
    Provider("flashinfer", _flashinfer_decode_fp8, "flashinfer", True),
]

NO_CASCADE = "flashkern (no cascade)"  # the baseline cascade rows are compared with
CASCADE = [
    Provider("flashkern", lambda case: (lambda: case.cascade.run(case.q, case.cache)), requires="flashkern"),
    Provider(NO_CASCADE, lambda case: (lambda: case.decode.run(case.q, case.cache)), requires="flashkern"),
    Provider("flashinfer", _flashinfer_cascade, "flashinfer", True),
    Provider("flashinfer (no cascade)", _flashinfer_decode, "flashinfer", True),
]


def _flashkern():
    import flashkern

    return flashkern


# ---------------------------------------------------------------- prefill and append attention (ragged KV)

# Llama-3 8B's heads (32 q heads, 8 KV heads) at head_dim 128; head_dim 64 and 256 at the same width.
PREFILL_HEADS = (2, 1) if BENCH_SET == "smoke" else (32, 8)


def prefill_shapes():
    """[(label, requests, (qo_lens, kv_lens, head_dim, causal))]: self-attention of whole prompts
    (qo = kv), a batch of mixed lengths, and appends of a few tokens to a long cached prefix."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, ((40, 7), (40, 7), 64, True)), ("tiny d=512", 2, ((20, 7), (20, 7), 512, True))]
    shapes = []
    seqs = (512, 2048, 8192, 32768) if BENCH_SET == "full" else (512, 4096, 16384)
    for d in (64, 128, 256):
        for n in seqs:
            for causal in (True, False):
                batch = max(1, 16384 // n)
                shapes.append((f"seq={n} x{batch} d={d}{' causal' if causal else ''}", batch,
                               ((n,) * batch, (n,) * batch, d, causal)))
    for causal in (True, False):  # head_dim 512: 16-row tiles only
        shapes.append((f"seq=4096 x4 d=512{' causal' if causal else ''}", 4, ((4096,) * 4, (4096,) * 4, 512, causal)))
    mixed = (8192, 2048, 512, 512, 128, 4096, 1024, 64)
    shapes.append(("mixed x8 d=128 causal", 8, (mixed, mixed, 128, True)))
    for qo in (1, 16, 64):
        shapes.append((f"append {qo} to 32768 x4 d=128", 4, ((qo,) * 4, (32768,) * 4, 128, True)))
    return shapes


def prefill_visible_pairs(qo_lens, kv_lens, causal):
    """The (query, key) pairs attention computes: masked work is not counted."""
    pairs = 0
    for n, m in zip(qo_lens, kv_lens):
        pairs += sum(min(m, m - n + i + 1) for i in range(n)) if causal else n * m
    return pairs


def prefill_flops(shape):
    qo_lens, kv_lens, d, causal = shape
    return 4 * PREFILL_HEADS[0] * d * prefill_visible_pairs(qo_lens, kv_lens, causal)  # QK^T and PV, 2 flops a MAC


def prefill_bytes(shape, dtype):
    """q, k, v read once, out written once, and the LSE."""
    qo_lens, kv_lens, d, _ = shape
    s = torch.finfo(dtype).bits // 8
    qo_heads, kv_heads = PREFILL_HEADS
    q = sum(qo_lens)
    return 2 * q * qo_heads * d * s + 2 * sum(kv_lens) * kv_heads * d * s + 4 * q * qo_heads


class PrefillCase:
    """Ragged q, k, v and a planned BatchPrefillWithRaggedKVCacheWrapper."""

    def __init__(self, seed, shape, dtype):
        qo_lens, kv_lens, d, causal = shape
        qo_heads, kv_heads = PREFILL_HEADS
        self.q = rand((sum(qo_lens), qo_heads, d), dtype, seed)
        self.k = rand((sum(kv_lens), kv_heads, d), dtype, 10**5 + seed)
        self.v = rand((sum(kv_lens), kv_heads, d), dtype, 2 * 10**5 + seed)
        i32 = lambda values: torch.tensor([0] + torch.tensor(values).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
        self.indptr = (i32(qo_lens), i32(kv_lens))
        self.shape, self.dtype = shape, dtype
        self.wrapper = _flashkern().BatchPrefillWithRaggedKVCacheWrapper(_workspace())
        self.wrapper.plan(*self.indptr, qo_heads, kv_heads, d, causal=causal, q_data_type=dtype)


def prefill_inputs(shape, dtype):
    return lambda seed: (PrefillCase(seed, shape, dtype),)


def _sdpa_prefill(case):
    """torch SDPA (its flash / memory-efficient backends) per request, bottom-right causal as an append needs."""
    from torch.nn.attention.bias import causal_lower_right

    qo_lens, kv_lens, _, causal = case.shape
    qo, kv = case.indptr
    parts = []
    for b in range(len(qo_lens)):
        q = case.q[qo[b] : qo[b + 1]].transpose(0, 1)[None]
        k = case.k[kv[b] : kv[b + 1]].transpose(0, 1)[None]
        v = case.v[kv[b] : kv[b + 1]].transpose(0, 1)[None]
        mask = causal_lower_right(q.shape[2], k.shape[2]) if causal and q.shape[2] != k.shape[2] else None
        parts.append((q, k, v, mask, causal and mask is None))

    def run():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, enable_gqa=True)
                for q, k, v, m, c in parts]

    return run


def _flashinfer_prefill(case):
    import flashinfer

    qo_lens, kv_lens, d, causal = case.shape
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), "NHD")
    wrapper.plan(*(t.to(case.q.device) for t in case.indptr), *PREFILL_HEADS, d, causal=causal,
                 q_data_type=case.dtype)
    return lambda: wrapper.run(case.q, case.k, case.v)


def _invariant_prefill(case):
    _, _, d, causal = case.shape
    wrapper = _flashkern().BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    wrapper.plan(*case.indptr, *PREFILL_HEADS, d, causal=causal, q_data_type=case.dtype, batch_invariant=True)
    return lambda: wrapper.run(case.q, case.k, case.v)


PREFILL = [
    Provider("flashkern", lambda case: (lambda: case.wrapper.run(case.q, case.k, case.v)), requires="flashkern"),
    Provider(INVARIANT, _invariant_prefill, requires="flashkern"),
    Provider("torch", _sdpa_prefill),
    Provider("flashinfer", _flashinfer_prefill, "flashinfer", True),
]


# ---------------------------------------------------------------- sampling (one token per row of probabilities)

# Vocabularies of real models (32K, 128K, 256K). Probabilities are float32 softmax(LOGIT_STD * N(0, 1)):
# at std 4 a 128K row is peaked like a model's next-token distribution (largest probability ~0.13,
# the 0.9 nucleus ~700 tokens), not flat (std 1: the nucleus is 60% of the vocabulary).
VOCAB = {"llama2-7b": 32000, "llama3-8b": 128256, "gemma2-27b": 256000}
LOGIT_STD = 4.0
TOP_K, TOP_P, MIN_P = 50, 0.9, 0.1
SAMPLING_DTYPES = [torch.float32]  # the sampling ops take float32 probabilities; renorm is benchmarked alike


def sampling_shapes():
    """[(label, batch, vocab)]: top-k, top-p and top-k + top-p sampling at batch 1/32/256 x vocab 32K/128K/256K
    (quick: batch 1/32/256 at 128K, batch 32 at 32K and 256K)."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, 1024)]
    llama3 = VOCAB["llama3-8b"]
    if BENCH_SET == "full":
        grid = [(name, b, v) for name, v in VOCAB.items() for b in (1, 32, 256)]
    else:
        grid = [("llama3-8b", b, llama3) for b in (1, 32, 256)] + [
            (name, 32, v) for name, v in VOCAB.items() if v != llama3]
    return [(f"b={b} {name}", b, v) for name, b, v in grid]


def sampling_variant_shapes():
    """Plain and min-p sampling, renormalization and logit masking: batch 32 at 128K (full: the grid)."""
    if BENCH_SET != "quick":
        return sampling_shapes()
    return [("b=32 llama3-8b", 32, VOCAB["llama3-8b"])]


def speculative_shapes():
    """[(label, batch, (n draft tokens, vocab))]: chain speculative sampling at n = 4 and 8."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, (4, 1024))]
    grid = ([(b, name, v) for name, v in VOCAB.items() for b in (1, 32, 256)] if BENCH_SET == "full"
            else [(32, "llama3-8b", VOCAB["llama3-8b"])])
    return [(f"n={n} b={b} {name}", b, (n, v)) for b, name, v in grid for n in (4, 8)]


def sampling_bytes(batch, vocab):
    """Every probability read once, one int32 token written per row. Passes a kernel adds (rounds of
    a pivot search, top_k_first's renormalized copy) are its own cost, not counted."""
    return batch * vocab * 4 + batch * 4


def renorm_bytes(batch, vocab, dtype):
    """top_k_renorm_probs, top_p_renorm_probs, top_k_mask_logits: the row read once, written once."""
    return 2 * batch * vocab * (torch.finfo(dtype).bits // 8)


def softmax_bytes(batch, vocab, dtype):
    """softmax: the logits read once, float32 probabilities written once (the kernel's second read of a
    row is its own cost, mostly from L2)."""
    return batch * vocab * (torch.finfo(dtype).bits // 8 + 4)


def speculative_bytes(batch, shape):
    """Chain speculative sampling's minimum: at the first rejection the residual max(0, p - q) reads
    one full target row and one full draft row per request (speculative_inputs makes a rejection
    certain, so no request gets away with the bonus row alone); plus the draft token ids and the
    outputs. The p(t) and q(t) of the draft tokens are single values, not counted."""
    n, vocab = shape
    return 2 * batch * vocab * 4 + batch * n * 4 + batch * (n + 1) * 4 + 2 * batch * 4


def _probs(shape, seed):
    return torch.softmax(LOGIT_STD * rand(shape, torch.float32, seed), dim=-1)


def sampling_inputs(batch, vocab):
    return lambda seed: (_probs((batch, vocab), seed),)


def logits_inputs(batch, vocab):
    return lambda seed: (LOGIT_STD * rand((batch, vocab), torch.float32, seed),)


def speculative_inputs(batch, shape):
    """Target rows softmax(L), draft rows softmax(L + N(0, 1)) of the same logits (a draft token is
    accepted with probability sum(min(p, q)), about 0.6), draft tokens drawn from the draft rows. The
    last draft token's target probability is set to 0 (that row renormalized): a request that
    accepts the first n - 1 is rejected there, so every request reads the residual's two rows."""
    n, vocab = shape

    def make(seed):
        logits = LOGIT_STD * rand((batch, n + 1, vocab), torch.float32, seed)
        target = torch.softmax(logits, dim=-1)
        draft = torch.softmax(logits[:, :n] + rand((batch, n, vocab), torch.float32, 10**5 + seed), dim=-1)
        g = torch.Generator(device=draft.device).manual_seed(2 * 10**5 + seed)
        ids = torch.multinomial(draft.view(-1, vocab), 1, generator=g).view(batch, n).int()
        last = target[:, n - 1]
        last.scatter_(1, ids[:, n - 1 :].long(), 0.0)
        last.div_(last.sum(-1, keepdim=True))
        return draft, ids, target

    return make


def _race(weights):
    """One index per row with probability weights / sum: argmax of weights / Exp(1), what
    torch.multinomial(weights, 1) computes, without its validity checks (more passes over the rows
    and, in older torch, a host sync that a CUDA graph cannot capture); vLLM's sampler draws so."""
    noise = torch.empty_like(weights).exponential_()
    return torch.div(weights, noise, out=noise).argmax(-1)


def _torch_sample(probs, top_k=None, top_p=None):
    """Sort-based top-k / top-p (top-k first) sampling, as vLLM's reference sampler writes it: sort
    descending, zero past the k-th, renormalize, zero where the mass before reaches top_p, draw."""
    p, index = probs.sort(dim=-1, descending=True)
    if top_k is not None:
        p[:, top_k:] = 0
        p = p / p.sum(-1, keepdim=True)
    if top_p is not None:
        p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0)
    return index.gather(-1, _race(p)[:, None]).squeeze(-1)


def _torch_topk_sample(probs, top_k):
    """Top-k sampling with torch.topk instead of a full sort (vLLM's top-k-only path)."""
    values, index = probs.topk(top_k, dim=-1)
    return index.gather(-1, _race(values)[:, None]).squeeze(-1)


def _torch_min_p_sample(probs, min_p):
    return _race(probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0))


def _torch_top_k_renorm(probs, top_k):
    values, index = probs.topk(top_k, dim=-1)
    return torch.zeros_like(probs).scatter_(-1, index, values / values.sum(-1, keepdim=True))


def _torch_top_p_renorm(probs, top_p):
    p, index = probs.sort(dim=-1, descending=True)
    p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0)
    return torch.empty_like(probs).scatter_(-1, index, p / p.sum(-1, keepdim=True))


def _torch_top_k_mask_logits(logits, top_k):
    return logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))


def _torch_chain_speculative(draft, ids, target):
    """Vectorized chain rejection sampling (as vLLM's rejection sampler, reading only the rows it
    needs): draft token i passes when u * q(t) < p(t); the first failure stops the chain, and a token
    is drawn there from max(0, p - q), or after n acceptances from the bonus row p."""
    batch, n, _ = draft.shape
    t = ids.long()[..., None]
    passed = torch.rand(batch, n, device=draft.device) * draft.gather(2, t)[..., 0] < target[:, :n].gather(2, t)[..., 0]
    emitted = passed.int().cumprod(1).sum(1)
    rows = torch.arange(batch, device=draft.device)
    residual = target[rows, emitted] - draft[rows, emitted.clamp(max=n - 1)] * (emitted < n)[:, None]
    drawn = _race(residual.clamp_min_(0))
    tokens = torch.where(torch.arange(n + 1, device=draft.device) < emitted[:, None], F.pad(ids, (0, 1)), -1)
    return tokens.scatter_(1, emitted[:, None].long(), drawn[:, None].int()), passed.sum(1), emitted


def _flashinfer_sampling():
    import flashinfer.sampling

    return flashinfer.sampling


def sampling_providers(op, *args, torch_fn, **kwargs):
    """flashkern.`op` and flashinfer.sampling.`op` (the same name and signature), and torch_fn, on one
    input tensor with the same arguments."""
    return [
        Provider("flashkern", lambda x: (lambda: getattr(_flashkern(), op)(x, *args, **kwargs)), requires="flashkern"),
        Provider("torch", lambda x: (lambda: torch_fn(x, *args))),
        Provider("flashinfer", lambda x: (lambda: getattr(_flashinfer_sampling(), op)(x, *args, **kwargs)),
                 "flashinfer.sampling", True),
    ]


TOP_K_SAMPLING = sampling_providers("top_k_sampling_from_probs", TOP_K, torch_fn=lambda p, k: _torch_sample(p, top_k=k))
TOP_K_SAMPLING.insert(2, Provider("torch (topk)", lambda p: (lambda: _torch_topk_sample(p, TOP_K))))
TOP_P_SAMPLING = sampling_providers("top_p_sampling_from_probs", TOP_P, torch_fn=lambda p, q: _torch_sample(p, top_p=q))
# top_k_first (the default: top-p of the renormalized top k, FlashInfer's too) and joint (both filters
# on the row itself, one kernel); torch's sort-based code is top_k_first
TOP_K_TOP_P_SAMPLING = sampling_providers("top_k_top_p_sampling_from_probs", TOP_K, TOP_P,
                                          torch_fn=lambda p, k, q: _torch_sample(p, top_k=k, top_p=q)) + [
    Provider("flashkern (joint)", lambda p: (lambda: _flashkern().top_k_top_p_sampling_from_probs(
        p, TOP_K, TOP_P, filter_apply_order="joint")), requires="flashkern"),
    Provider("flashinfer (joint)", lambda p: (lambda: _flashinfer_sampling().top_k_top_p_sampling_from_probs(
        p, TOP_K, TOP_P, filter_apply_order="joint")), "flashinfer.sampling", True),
]
PLAIN_SAMPLING = sampling_providers("sampling_from_probs", torch_fn=_race)
MIN_P_SAMPLING = sampling_providers("min_p_sampling_from_probs", MIN_P, torch_fn=_torch_min_p_sample)
TOP_K_RENORM = sampling_providers("top_k_renorm_probs", TOP_K, torch_fn=_torch_top_k_renorm)
TOP_P_RENORM = sampling_providers("top_p_renorm_probs", TOP_P, torch_fn=_torch_top_p_renorm)
TOP_K_MASK_LOGITS = sampling_providers("top_k_mask_logits", TOP_K, torch_fn=_torch_top_k_mask_logits)
SOFTMAX_TEMPERATURE = 0.7
SOFTMAX = sampling_providers("softmax", SOFTMAX_TEMPERATURE,
                             torch_fn=lambda x, t: torch.softmax(x.float() / t, dim=-1))
SOFTMAX.insert(2, Provider("torch.compile", lambda x: (lambda: _compiled_softmax()(x, SOFTMAX_TEMPERATURE))))
_softmax_compiled = None


def _compiled_softmax():
    global _softmax_compiled
    _softmax_compiled = _softmax_compiled or _compiled(lambda x, t: torch.softmax(x.float() / t, dim=-1))
    return _softmax_compiled

CHAIN_SPECULATIVE = [
    Provider("flashkern", lambda d, ids, t: (lambda: _flashkern().chain_speculative_sampling(d, ids, t)),
             requires="flashkern"),
    Provider("torch", lambda d, ids, t: (lambda: _torch_chain_speculative(d, ids, t))),
    Provider("flashinfer", lambda d, ids, t: (lambda: _flashinfer_sampling().chain_speculative_sampling(d, ids, t)),
             "flashinfer.sampling", True),
]


# ---------------------------------------------------------------- the prefix cache


def prefix_cache_requests():
    """Requests per batch: the planner at 256 / 1K / 4K, the decode step at the sizes a GPU run affords."""
    return [48] if BENCH_SET == "smoke" else [256, 1024, 4096]


def prefix_decode_requests():
    return [48] if BENCH_SET == "smoke" else [256, 1024]


@functools.lru_cache(maxsize=None)
def prefix_cache_batch(requests, seed=0):
    """(cache, requests): a serving batch in a PrefixCache. Four system prompts (987 to 3001 tokens, off
    page boundaries; a sixteenth in the smoke set), each with four few-shot blocks (211 to 577 tokens)
    that half of its requests put after it; every request has its own question (20 to 300 tokens) and
    has generated 1 to 200 tokens. Prompts are published as they start, as after their prefill."""
    from flashkern.prefix_cache import PrefixCache

    rng = random.Random(seed)
    scale = 16 if BENCH_SET == "smoke" else 1
    words = lambda n: [rng.randrange(32000) for _ in range(max(1, n // scale))]  # noqa: E731
    systems = [words(n) for n in (987, 1531, 2203, 3001)]
    shots = [[words(rng.randrange(211, 578)) for _ in range(4)] for _ in systems]
    prompts, own = [], 0
    for _ in range(requests):
        s = rng.randrange(len(systems))
        shot = shots[s][rng.randrange(4)] if rng.random() < 0.5 else []
        question, generated = words(rng.randrange(20, 301)), words(rng.randrange(1, 201) * scale)
        prompts.append((systems[s] + shot + question, generated))
        own += len(question) + len(generated)
    shared = sum(map(len, systems)) + sum(len(b) for s in shots for b in s)
    cache = PrefixCache((shared + own) // PAGE_SIZE + 3 * requests + 64, PAGE_SIZE)
    batch = []
    for prompt, new in prompts:
        r = cache.start(prompt)
        cache.publish(r)
        cache.append(r, new)
        batch.append(r)
    return cache, batch


class PrefixDecodeCase:
    """One decode step of a prefix-cache batch: a random paged KV cache, q, and the batch planned both
    ways (the cascade's queries in plan.order: the same work in another layout)."""

    def __init__(self, seed, requests, dtype):
        cache, batch = prefix_cache_batch(requests)
        qo_heads, kv_heads = _heads(4)
        self.kv = rand((cache.num_pages, 2, PAGE_SIZE, kv_heads, HEAD_DIM), dtype, seed)
        self.q = rand((len(batch), qo_heads, HEAD_DIM), dtype, 10**5 + seed)
        self.decode = _flashkern().BatchDecodeWithPagedKVCacheWrapper(_workspace())
        self.decode.plan(*cache.plan_decode(batch), qo_heads, kv_heads, HEAD_DIM, PAGE_SIZE, q_data_type=dtype)
        plan = cache.plan_cascade(batch)
        self.cascade = _flashkern().MultiLevelCascadeAttentionWrapper(len(plan.qo_indptr_arr), _workspace())
        self.cascade.plan(plan.qo_indptr_arr, plan.paged_kv_indptr_arr, plan.paged_kv_indices_arr,
                          plan.paged_kv_last_page_len_arr, qo_heads, kv_heads, HEAD_DIM, PAGE_SIZE, q_data_type=dtype)


def prefix_decode_bytes(requests, dtype):
    """Unique bytes: every cached KV token of the batch once (what the cascade reads), q and the output."""
    cache, batch = prefix_cache_batch(requests)
    s = torch.finfo(dtype).bits // 8
    qo_heads, kv_heads = _heads(4)
    kv_tokens = cache.kv_tokens_read(cache.plan_cascade(batch))
    return 2 * len(batch) * qo_heads * HEAD_DIM * s + 2 * kv_tokens * kv_heads * HEAD_DIM * s


def prefix_decode_inputs(requests, dtype):
    return lambda seed: (PrefixDecodeCase(seed, requests, dtype),)


PREFIX_DECODE = [  # the batch through plan_cascade, and through plan_decode (the baseline)
    Provider("flashkern", lambda case: (lambda: case.cascade.run(case.q, case.kv)), requires="flashkern"),
    Provider("flashkern (plan_decode)", lambda case: (lambda: case.decode.run(case.q, case.kv)), requires="flashkern"),
]


# ---------------------------------------------------------------- the training step

OPTIM_DTYPES = [torch.float32, torch.bfloat16]


def optim_shapes():
    """[(label, parameters, tensors)]: one optimizer step over about 200 tensors."""
    if BENCH_SET == "smoke":
        return [("tiny", 100_000, 12)]
    totals = [8_000_000, 128_000_000] + ([1_000_000_000] if BENCH_SET == "full" else [])
    return [(f"{n // 1_000_000}M params", n, 200) for n in totals]


def optim_sizes(total, tensors):
    """A transformer's mix: a quarter of the tensors are norm weights of 4096 elements, the others share
    the rest (odd sizes: the last one takes the remainder)."""
    small = tensors // 4
    big = tensors - small
    each = (total - small * 4096) // big
    return [4096] * small + [each] * (big - 1) + [total - small * 4096 - each * (big - 1)]


def optim_bytes(total, dtype):
    """The least a fused step with global-norm clipping moves: each gradient read twice (the norm before
    any update), each parameter read and written, and fp32 exp_avg / exp_avg_sq read and written:
    4 * sizeof(dtype) + 16 bytes a parameter. torch's AdamW keeps 16-bit moments for 16-bit
    parameters (fewer bytes, and the eps trap); the same count is used for every row."""
    return total * (4 * (torch.finfo(dtype).bits // 8) + 16)


class OptimCase:
    def __init__(self, seed, total, tensors, dtype):
        device = "cuda" if GPU else "cpu"
        g = torch.Generator(device=device).manual_seed(seed)
        self.params = []
        for n in optim_sizes(total, tensors):
            p = torch.nn.Parameter(torch.randn(n, device=device, generator=g).to(dtype))
            p.grad = (torch.randn(n, device=device, generator=g) * 1e-2).to(dtype)
            self.params.append(p)


def optim_inputs(total, tensors, dtype):
    return lambda seed: (OptimCase(seed, total, tensors, dtype),)


def _flashkern_step(case):
    opt = _flashkern().optim.AdamW(case.params, lr=1e-4, max_grad_norm=1.0)
    return opt.step


def _torch_step(case):
    opt = torch.optim.AdamW(case.params, lr=1e-4, fused=True, capturable=GPU)

    def step():
        torch.nn.utils.clip_grad_norm_(case.params, 1.0, foreach=True)
        opt.step()

    return step


def _apex_step(case):
    from apex.optimizers import FusedAdam

    opt = FusedAdam(case.params, lr=1e-4, adam_w_mode=True, capturable=True)

    def step():
        torch.nn.utils.clip_grad_norm_(case.params, 1.0, foreach=True)
        opt.step()

    return step


OPTIM_STEP = [
    Provider("flashkern", _flashkern_step, requires="flashkern"),
    Provider("torch", _torch_step),  # fused AdamW + foreach clip_grad_norm_
    Provider("apex", _apex_step, "apex.optimizers", True),  # FusedAdam (adam_w_mode) + torch's clip
]


# ---------------------------------------------------------------- KV-cache compression

# The decode shapes' heads and pages; SnapKV-like selection keeps 10 % of each request's keys.
KV_KEEP = 0.1


def kv_compress_shapes():
    """[(label, batch, (kv length, GQA group))]: the issue's batch 64 at 32K, and a shorter batch."""
    if BENCH_SET == "smoke":
        return [("tiny", 2, (40, 4))]
    return [(f"b={b} len={n} g={g}", b, (n, g)) for b, n, g in ((64, 32768, 4), (16, 4096, 8))]


def decode_scores_bytes(batch, shape, dtype):
    """Decode's bytes and the running scores read and written (float32 a key and KV head): the least a score
    epilogue moves; the logits flashkern's kernels write and read back (8 bytes a query head and key) are
    not counted (they are the overhead)."""
    length, _ = shape
    return decode_bytes(batch, shape, dtype) + 8 * batch * length * KV_HEADS


def _kept(length):
    return max(1, int(length * KV_KEEP))


def decode_compressed_bytes(batch, shape, dtype, provider):
    """Decode's bytes over the kept keys, or over all of them (the uncompressed baseline)."""
    length, group = shape
    return decode_bytes(batch, (length if provider.name == DECODE_UNCOMPRESSED else _kept(length), group), dtype)


def kv_select_bytes(batch, shape, dtype):
    """Every score read once, the kept positions (int32 a KV head) written."""
    length, _ = shape
    return 4 * batch * length * KV_HEADS + 4 * batch * _kept(length) * KV_HEADS


def kv_compact_bytes(batch, shape, dtype):
    """The kept keys and values (and their scores) read once and written once; the positions read."""
    length, _ = shape
    s = torch.finfo(dtype).bits // 8
    n = batch * _kept(length) * KV_HEADS
    return 2 * n * (2 * HEAD_DIM * s + 4) + 4 * n


class KvCompressCase(PagedCase):
    """A decode case with H2O scores (float32, laid out like the cache), the kept positions of a 10 % budget
    per request and KV head, and the page table of a compaction in place (each request's first pages: a
    replay moves the same bytes again)."""

    def __init__(self, seed, batch, length, group, dtype):
        super().__init__(seed, batch, _page_table([length] * batch), *_heads(group), dtype)
        device = self.cache.device
        self.scores = torch.rand(self.cache.shape[0], KV_HEADS, PAGE_SIZE, device=device,
                                 generator=torch.Generator(device=device).manual_seed(seed))
        self.kept, self.kept_indptr = _flashkern().kv_compress.select_keys(self.scores, *self.tables, _kept(length))
        self.length, self.num_kept = length, int(self.kept.shape[0])
        indptr, indices, _ = self.tables
        pages = indices.long().view(batch, -1)
        need = -(-_kept(length) // PAGE_SIZE)
        self.out_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * need
        self.out_indices = pages[:, :need].flatten().to(torch.int32)
        # decode over the compacted table (the kept keys, whatever the bytes there: the time is what matters)
        kept_last = torch.full((batch,), _kept(length) - (need - 1) * PAGE_SIZE, dtype=torch.int32)
        self.compressed = _flashkern().BatchDecodeWithPagedKVCacheWrapper(_workspace())
        self.compressed.plan(self.out_indptr.cpu(), self.out_indices.cpu(), kept_last, *self.heads, HEAD_DIM,
                             PAGE_SIZE, q_data_type=dtype)
        # dense copies for torch: scores [batch, kv_heads, length], K and V [batch, length, kv_heads, D]
        self.dense_scores = self.scores[pages].permute(0, 2, 1, 3).flatten(2)[:, :, :length].contiguous()
        self.dense_k = self.cache[pages, 0].flatten(1, 2)[:, :length].contiguous()
        self.dense_v = self.cache[pages, 1].flatten(1, 2)[:, :length].contiguous()


def kv_compress_inputs(batch, shape, dtype):
    length, group = shape
    return lambda seed: (KvCompressCase(seed, batch, length, group, dtype),)


def _decode_with_scores(case):
    return lambda: case.decode.run(case.q, case.cache, kv_scores=case.scores)


def _flashkern_select(case):
    op = torch.ops.flashkern.kv_select
    return lambda: op(case.scores, *case.tables, case.kept_indptr, case.num_kept, 0, 0, 1)


def _torch_select(case):
    """torch.topk over each request's dense scores, then the kept positions in ascending order."""
    k = _kept(case.length)
    return lambda: torch.topk(case.dense_scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def _flashkern_compact(case):
    op = torch.ops.flashkern.kv_compact
    return lambda: op(case.cache[:, 0], case.cache[:, 1], case.scores, *case.tables[:2], case.kept, case.kept_indptr,
                      case.out_indptr, case.out_indices)


def _torch_compact(case):
    """torch.gather of the kept rows of dense K, V and scores (per request and KV head)."""
    kept = case.kept.long().view(case.batch, -1, KV_HEADS)  # [batch, n, kv_heads]
    index = kept[..., None].expand(-1, -1, -1, HEAD_DIM)

    def run():
        return (case.dense_k.gather(1, index), case.dense_v.gather(1, index),
                case.dense_scores.gather(2, kept.transpose(1, 2)))

    return run


DECODE_NO_SCORES = "flashkern (decode only)"
DECODE_SCORES = [
    Provider("flashkern", _decode_with_scores, requires="flashkern"),
    Provider(DECODE_NO_SCORES, lambda case: (lambda: case.decode.run(case.q, case.cache)), requires="flashkern"),
]
DECODE_UNCOMPRESSED = "flashkern (uncompressed)"
DECODE_COMPRESSED = [
    Provider("flashkern", lambda case: (lambda: case.compressed.run(case.q, case.cache)), requires="flashkern"),
    Provider(DECODE_UNCOMPRESSED, lambda case: (lambda: case.decode.run(case.q, case.cache)), requires="flashkern"),
]
KV_SELECT = [Provider("flashkern", _flashkern_select, requires="flashkern"), Provider("torch", _torch_select)]
KV_COMPACT = [Provider("flashkern", _flashkern_compact, requires="flashkern"), Provider("torch", _torch_compact)]
