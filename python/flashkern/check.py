"""`flashkern check`: every op family on every available device, against the float64 references.

Each family yields cases. A numeric case compares the op's answer with the float64 reference at the
dtype's tolerance (flashkern.tolerances). A verdict case is an exact or statistical property where the
answer is random or has no float64 twin: the tokens a sampling filter may draw (only those, and their
frequencies within a bound far beyond chance: the seeds are fixed, so a run repeats bit for bit on one
device and build), a speculative walk's outcome, an optimizer step against torch's AdamW, the prefix
cache's cascade against flat decode, a request's bits alone and in a batch (batch-invariant mode).
Sizes are small: the CPU reference path takes seconds a family.
"""

import torch

from . import _backend, activation, attention, cascade, decode, kv_compress, norm, optim, page, prefill, ref, rope, sampling, spec
from .prefix_cache import PrefixCache
from .rope_scaling import cos_sin_cache, theta_inv_freq
from .tolerances import tolerance

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = {"norm": [(1, 1), (37, 769), (4, 4096), (3, 5, 128)], "act": [(1, 2), (37, 2 * 769), (4, 2 * 4096)]}


class Verdict:
    """A case decided by a property: `metric` is reported, `passed` says whether it held."""

    def __init__(self, metric, passed):
        self.metric, self.passed = float(metric), bool(passed)


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _flat(*tensors):
    return torch.cat([t.double().flatten().cpu() for t in tensors])


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _emulated(device):
    return torch.device(device).type == "cpu" and _backend.get_backend() in _backend.EMULATED


# ---------------------------------------------------------------- families: (op, shape, actual, expected)


def _norms(device, dtype, gen):
    for shape in SHAPES["norm"]:
        x, res = _rand(shape, dtype, device, gen), _rand(shape, dtype, device, gen)
        w = _rand(shape[-1:], dtype, device, gen)
        for op, fn, offset in (("rmsnorm", norm.rmsnorm, 0.0), ("gemma_rmsnorm", norm.gemma_rmsnorm, 1.0)):
            yield op, shape, fn(x, w), ref.rmsnorm(x.double(), w.double(), 1e-6, offset)
        for op, fn, offset in (("fused_add_rmsnorm", norm.fused_add_rmsnorm, 0.0),
                               ("gemma_fused_add_rmsnorm", norm.gemma_fused_add_rmsnorm, 1.0)):
            xi, ri = x.clone(), res.clone()
            fn(xi, ri, w)
            expected_y, expected_r = ref.fused_add_rmsnorm(x.double(), res.double(), w.double(), 1e-6, offset)
            yield op, shape, _flat(xi, ri), _flat(expected_y, expected_r)


def _activations(device, dtype, gen):
    for shape in SHAPES["act"]:
        x = _rand(shape, dtype, device, gen)
        for name in ("silu", "gelu", "gelu_tanh"):
            yield f"{name}_and_mul", shape, getattr(activation, f"{name}_and_mul")(x), ref.act_and_mul(x.double(), name)
        d = shape[-1] // 2
        yield "act_mul", shape, activation.act_mul(x[..., :d], x[..., d:]), ref.act_and_mul(x.double(), "silu")


def _rope(device, dtype, gen):
    tokens = 37
    q, k = _rand((tokens, 8, 128), dtype, device, gen), _rand((tokens, 2, 128), dtype, device, gen)
    pos = torch.randint(0, 32768, (tokens,), generator=gen).to(device)
    inv_freq = theta_inv_freq(96, 5e5)
    for interleave in (False, True):
        actual = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=96, interleave=interleave, rope_theta=5e5)
        expected = ref.rope(q.double().cpu(), k.double().cpu(), pos.cpu(), inv_freq, interleave)
        yield "apply_rope_pos_ids" + (" (interleave)" if interleave else ""), tuple(q.shape), _flat(*actual), \
            _flat(*expected)
    cache = cos_sin_cache(theta_inv_freq(128, 1e4), 32768)
    actual = rope.apply_rope_with_cos_sin_cache(pos, q.flatten(1), k.flatten(1), 128, cache.to(device))
    expected = ref.rope(q.double().cpu(), k.double().cpu(), pos.cpu(), cache)
    yield "apply_rope_with_cos_sin_cache", tuple(q.shape), _flat(*actual), _flat(*expected)


def _merge(device, dtype, gen):
    v = _rand((37, 5, 8, 128), dtype, device, gen)
    s = (_rand((37, 5, 8), torch.float32, device, gen) * 4).float()
    s[3] = float("-inf")  # a token whose states are all empty
    yield "merge_states", tuple(v.shape), _flat(*attention.merge_states(v, s)), _flat(*ref.merge_states(v.double(),
                                                                                                          s.double()))
    a = attention.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    e = ref.merge_state(v[:, 0].double(), s[:, 0].double(), v[:, 1].double(), s[:, 1].double())
    yield "merge_state", tuple(v[:, 0].shape), _flat(*a), _flat(*e)


def _paged_cache(dtype, device, gen, lengths, kv_heads=2, head_dim=128, page_size=16):
    """A shuffled paged cache holding `lengths` tokens a request: (cache, indptr, indices, last, pages)."""
    pages = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages) + 2
    cache = _rand((num_pages, 2, page_size, kv_heads, head_dim), dtype, device, gen)
    indices = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = _i32([0] + torch.tensor(pages).cumsum(0).tolist())
    last = _i32([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)])
    return cache, indptr, indices, last, pages


def _decode(device, dtype, gen):
    """Batch decode (GQA groups 4 and 8: the decode and the 16-row kernels) and a single request."""
    if dtype == torch.float32:
        return
    kv_heads, head_dim, lengths = 2, 128, [1, 37, 0, 600]
    cache, indptr, indices, last, pages = _paged_cache(dtype, device, gen, lengths)
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    for group in (4, 8):
        q = _rand((len(lengths), kv_heads * group, head_dim), dtype, device, gen)
        wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, 16, q_data_type=dtype)
        out, lse = wrapper.run(q, cache, return_lse=True)
        e_out, e_lse = ref.batch_decode(q.double().cpu(), cache.double().cpu(), indptr, indices, last)
        yield f"batch_decode (group {group})", tuple(q.shape), _flat(out, lse), _flat(e_out, e_lse)
        # an fp8 cache with per-head scales: attention over its exactly dequantized values
        fp8, scale = cache.to(torch.float8_e4m3fn), torch.tensor([0.5, 2.0], device=device)
        wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, 16, q_data_type=dtype,
                     kv_data_type=torch.float8_e4m3fn)
        out, lse = wrapper.run(q, fp8, k_scale=scale, v_scale=scale, return_lse=True)
        exact = fp8.double().cpu() * scale.double().cpu()[:, None]  # [pages, K/V, slot, kv_heads, D] x [kv_heads, 1]
        e_out, e_lse = ref.batch_decode(q.double().cpu(), exact, indptr, indices, last)
        yield f"batch_decode (group {group}, fp8 e4m3 cache)", tuple(q.shape), _flat(out, lse), _flat(e_out, e_lse)
    # head_dim 512 (16-row tiles only), GQA 16:1 on one KV head
    cache512, indptr512, indices512, last512, _ = _paged_cache(dtype, device, gen, [300, 5], 1, 512)
    q = _rand((2, 16, 512), dtype, device, gen)
    wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr512, indices512, last512, 16, 1, 512, 16, q_data_type=dtype)
    out, lse = wrapper.run(q, cache512, return_lse=True)
    e_out, e_lse = ref.batch_decode(q.double().cpu(), cache512.double().cpu(), indptr512, indices512, last512)
    yield "batch_decode (head_dim 512, group 16)", tuple(q.shape), _flat(out, lse), _flat(e_out, e_lse)
    k, v = cache[indices[indptr[3]:].long()].transpose(0, 1).flatten(1, 2)[:, :600]
    q1 = _rand((8, head_dim), dtype, device, gen)
    out = decode.single_decode_with_kv_cache(q1, k, v)
    yield "single_decode_with_kv_cache", tuple(q1.shape), _flat(out), _flat(ref.decode_attention(
        q1.double().cpu(), k.double().cpu(), v.double().cpu())[0])


def _cascade(device, dtype, gen):
    """Two levels: request 3's 600 tokens shared by all four requests, then each request's own."""
    if dtype == torch.float32:
        return
    kv_heads, head_dim, lengths = 2, 128, [1, 37, 0, 600]
    cache, indptr, indices, last, pages = _paged_cache(dtype, device, gen, lengths)
    levels = [list(t) for t in zip((_i32([0, 4]), _i32([0, pages[3]]), indices[indptr[3]:], last[3:]),
                                   (_i32([0, 1, 2, 3, 4]), indptr, indices, last))]
    wrapper = cascade.MultiLevelCascadeAttentionWrapper(2, torch.empty(16 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(*levels, kv_heads * 4, kv_heads, head_dim, 16, q_data_type=dtype)
    q = _rand((4, kv_heads * 4, head_dim), dtype, device, gen)
    yield "cascade (2 levels)", tuple(q.shape), _flat(wrapper.run(q, cache)), \
        _flat(ref.cascade_decode(q.double().cpu(), cache.double().cpu(), *levels)[0])


def _prefill_expected(q, k, v, qo_lens, kv_lens, **options):
    rows, a, b = [], 0, 0
    for n, m in zip(qo_lens, kv_lens):
        rows.append(ref.attention.prefill_attention(q[a:a + n].double().cpu(), k[b:b + m].double().cpu(),
                                                    v[b:b + m].double().cpu(), **options)[0])
        a, b = a + n, b + m
    return torch.cat(rows)


def _prefill(device, dtype, gen):
    """Ragged prefill, causal (a request with more queries than keys among them), with a window, with a
    custom mask; paged prefill (causal); single prefill."""
    if dtype == torch.float32:
        return
    kv_heads, group, head_dim, qo_lens, kv_lens = 2, 4, 64, [5, 17, 40], [5, 60, 30]
    q = _rand((sum(qo_lens), kv_heads * group, head_dim), dtype, device, gen)
    k, v = _rand((sum(kv_lens), kv_heads, head_dim), dtype, device, gen), _rand((sum(kv_lens), kv_heads, head_dim),
                                                                                  dtype, device, gen)
    qo_indptr, kv_indptr = _i32([0, 5, 22, 62]), _i32([0, 5, 65, 95])
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    masks = [torch.rand(n, m, generator=gen) < 0.6 for n, m in zip(qo_lens, kv_lens)]
    for name, options, plan_options in (
            ("causal", {"causal": True}, {"causal": True}),
            ("window 8", {"causal": True, "window_left": 8}, {"causal": True, "window_left": 8}),
            ("custom mask", {}, {"custom_mask": torch.cat([m.flatten() for m in masks])})):
        wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(qo_indptr, kv_indptr, kv_heads * group, kv_heads, head_dim, q_data_type=dtype, **plan_options)
        if name == "custom mask":
            expected = torch.cat([ref.attention.prefill_attention(
                q[a:a + n].double().cpu(), k[b:b + m].double().cpu(), v[b:b + m].double().cpu(), mask=mask)[0]
                for n, m, a, b, mask in zip(qo_lens, kv_lens, qo_indptr.tolist(), kv_indptr.tolist(), masks)])
        else:
            expected = _prefill_expected(q, k, v, qo_lens, kv_lens, **options)
        yield f"ragged prefill ({name})", tuple(q.shape), _flat(wrapper.run(q, k, v)), _flat(expected)
    page_size = 16
    cache, indptr, indices, last, _ = _paged_cache(dtype, device, gen, kv_lens, kv_heads, head_dim, page_size)
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper(workspace)
    paged.plan(qo_indptr, indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, causal=True,
               q_data_type=dtype)
    kc = torch.cat([ref.attention.request_kv(cache[:, 0].cpu(), cache[:, 1].cpu(),
                                             indices[indptr[i]:indptr[i + 1]].long(), last[i])[0] for i in range(3)])
    vc = torch.cat([ref.attention.request_kv(cache[:, 0].cpu(), cache[:, 1].cpu(),
                                             indices[indptr[i]:indptr[i + 1]].long(), last[i])[1] for i in range(3)])
    yield "paged prefill (causal)", tuple(q.shape), _flat(paged.run(q, cache)), \
        _flat(_prefill_expected(q, kc, vc, qo_lens, kv_lens, causal=True))
    single = prefill.single_prefill_with_kv_cache(q[22:], k[65:], v[65:], causal=True)
    yield "single_prefill_with_kv_cache", tuple(q[22:].shape), _flat(single), \
        _flat(_prefill_expected(q[22:], k[65:], v[65:], [40], [30], causal=True))
    q, k, v = (_rand((n, heads, 512), dtype, device, gen) for n, heads in ((40, 16), (70, 1), (70, 1)))
    single = prefill.single_prefill_with_kv_cache(q, k, v, causal=True)  # head_dim 512, GQA 16:1
    yield "single_prefill_with_kv_cache (head_dim 512)", tuple(q.shape), _flat(single), \
        _flat(_prefill_expected(q, k, v, [40], [70], causal=True))


def _softmax(device, dtype, gen):
    logits = (_rand((5, 9000), torch.float32, device, gen) * 3).to(dtype)
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3])
    yield "softmax", tuple(logits.shape), sampling.softmax(logits, t.to(device)), \
        ref.sampling.softmax(logits.double().cpu(), t)


def _renorm(device, dtype, gen):
    """top-k / top-p renormalization and top-k logit masking (equal infinities match)."""
    logits = (_rand((5, 1027), torch.float32, device, gen) * 3).to(dtype)
    probs = torch.softmax(logits.float(), dim=-1).to(dtype)
    rows = torch.ones(5, dtype=torch.int64)
    for op, fn, x, kind, kw in (("top_k_renorm_probs", sampling.top_k_renorm_probs, probs, "top_k_probs", {"top_k": 40}),
                                ("top_p_renorm_probs", sampling.top_p_renorm_probs, probs, "top_p_probs", {"top_p": 0.7}),
                                ("top_k_mask_logits", sampling.top_k_mask_logits, logits, "top_k_logits", {"top_k": 40})):
        per_row = {name: rows * value for name, value in kw.items()}
        yield op, tuple(x.shape), fn(x, *kw.values()), ref.sampling.renorm(x.double().cpu(), kind, **per_row)


def _sampling(device, dtype, gen):
    """Each filter, n samples of one peaked row through `indices`: only kept tokens drawn, and the total
    variation distance from the renormalized kept probabilities under 6 / sqrt(n) (chance gives about
    sqrt(cells / n) / 2; a seed is fixed, so a run repeats)."""
    if dtype != torch.float32:
        return
    vocab = 40
    probs = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, 0).float()
    n = 64 if _emulated(device) else 20000  # the emulation runs a 1024-thread block per sample
    indices = torch.zeros(n, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int64)
    for op, fn, keep in (
            ("sampling_from_probs", lambda p: sampling.sampling_from_probs(p, indices, seed=1, offset=0), {}),
            ("top_k_sampling_from_probs", lambda p: sampling.top_k_sampling_from_probs(p, 5, indices, seed=2, offset=0),
             {"top_k": one * 5}),
            ("top_p_sampling_from_probs", lambda p: sampling.top_p_sampling_from_probs(p, 0.6, indices, seed=3, offset=0),
             {"top_p": one * 0.6}),
            ("min_p_sampling_from_probs", lambda p: sampling.min_p_sampling_from_probs(p, 0.2, indices, seed=4, offset=0),
             {"min_p": one * 0.2}),
            ("top_k_top_p_sampling_from_probs (joint)", lambda p: sampling.top_k_top_p_sampling_from_probs(
                p, 5, 0.6, indices, filter_apply_order="joint", seed=5, offset=0), {"top_k": one * 5, "top_p": one * 0.6})):
        drawn = fn(probs[None].to(device)).long().cpu()
        kept = ref.sampling.kept(probs[None], **keep)[0]
        expected = torch.where(kept, probs.double(), 0.0)
        expected /= expected.sum()
        frequency = torch.bincount(drawn, minlength=vocab).double() / n
        distance = 0.5 * float((frequency - expected).abs().sum())
        yield op, (n, vocab), Verdict(distance, bool(kept[drawn].all()) and distance <= 6 / n**0.5), None


def _speculative(device, dtype, gen):
    """Chain speculative sampling with the draft equal to the target (every draft token accepted) and
    one-hot target rows (the bonus token is certain); greedy tree verification against the reference's walk."""
    if dtype != torch.float32:
        return
    batch, n, vocab = 3, 4, 50
    ids = torch.randint(0, vocab, (batch, n), generator=gen, dtype=torch.int32)
    target = torch.zeros(batch, n + 1, vocab)
    target.scatter_(2, torch.cat([ids, ids[:, :1]], 1).long()[..., None], 1.0)
    tokens, accepted, emitted = sampling.chain_speculative_sampling(target[:, :n].to(device), ids.to(device),
                                                                    target.to(device), seed=1, offset=0)
    expected = torch.cat([ids, ids[:, :1]], 1)
    ok = torch.equal(tokens.cpu(), expected) and bool((accepted.cpu() == n).all()) and bool((emitted.cpu() == n).all())
    yield "chain_speculative_sampling", (batch, n, vocab), Verdict(0.0 if ok else 1.0, ok), None
    parents = [-1, 0, 0, 1, 1, 2, 3]
    candidates = torch.randint(0, vocab, (batch, len(parents)), generator=gen, dtype=torch.int32)
    logits = torch.randn(batch, len(parents), vocab, generator=gen)
    for b in range(batch):  # make the walk go deep: node 1's token is the root's argmax, node 3's node 1's
        logits[b, 0, candidates[b, 1]] = logits[b, 1, candidates[b, 3]] = 10.0
    got = spec.verify_tree_greedy(candidates.to(device), parents, logits.to(device))
    want = ref.sampling.speculative(logits, None, candidates, 0, torch.tensor(parents, dtype=torch.int32), "greedy",
                                    None)
    ok = all(torch.equal(g.cpu().long(), w.long()) for g, w in zip(got, want[:3]))
    yield "verify_tree_greedy", (batch, len(parents), vocab), Verdict(0.0 if ok else 1.0, ok), None


def _optimizer(device, dtype, gen):
    """Three AdamW steps with global clipping against torch.optim.AdamW after clip_grad_norm_, float32."""
    if dtype != torch.float32:
        return
    shapes, worst = [(7,), (33, 5), (4097,)], 0.0
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
    twins = [p.detach().clone().requires_grad_() for p in params]
    ours = optim.AdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    theirs = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        ours.step()
        torch.nn.utils.clip_grad_norm_(twins, 0.5)
        theirs.step()
    yield "optim.AdamW (clip 0.5, 3 steps)", (len(shapes),), _flat(*[p.detach() for p in params]), \
        _flat(*[t.detach() for t in twins])


def _prefix_cache(device, dtype, gen):
    """Three requests over shared prefixes: attention through the planned cascade equals flat decode."""
    if dtype != torch.float16:
        return
    page_size, kv_heads, head_dim = 4, 2, 64
    pc = PrefixCache(64, page_size)
    system = torch.randint(0, 1000, (13,), generator=gen).tolist()
    first = pc.start(system)
    pc.publish(first)
    requests = [first] + [pc.start(system[:8] + torch.randint(0, 1000, (m,), generator=gen).tolist()) for m in (3, 9)]
    cache = _rand((64, 2, page_size, kv_heads, head_dim), dtype, device, gen)
    q = _rand((3, kv_heads * 4, head_dim), dtype, device, gen)
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    flat = pc.plan_decode(requests)
    dec = decode.BatchDecodeWithPagedKVCacheWrapper(workspace)
    dec.plan(flat.indptr, flat.indices, flat.last_page_len, kv_heads * 4, kv_heads, head_dim, page_size,
             q_data_type=dtype)
    expected = dec.run(q, cache)
    plan = pc.plan_cascade(requests)
    casc = cascade.MultiLevelCascadeAttentionWrapper(len(plan.qo_indptr_arr),
                                                     torch.empty(16 << 20, dtype=torch.uint8, device=device))
    casc.plan(plan.qo_indptr_arr, plan.paged_kv_indptr_arr, plan.paged_kv_indices_arr, plan.paged_kv_last_page_len_arr,
              kv_heads * 4, kv_heads, head_dim, page_size, q_data_type=dtype)
    order = torch.tensor(plan.order)
    got = casc.run(q[order.to(device)], cache)
    yield f"prefix cache: cascade ({len(plan.qo_indptr_arr)} levels) = decode", tuple(q.shape), _flat(got), \
        _flat(expected[order.to(device)])


def _batch_invariance(device, dtype, gen):
    """Batch-invariant mode: a request decoded (GQA groups 1 and 8: the decode kernel and the 16-row tile) and
    prefilled (causal, ragged: 64-row tiles) alone, then inside a batch of 5 others, on planners told of 4 and
    of 1000 blocks at once; and one row of rmsnorm alone and among 63 others. Verdict: the bits are equal
    (metric: the largest difference). Requests are split: decode's lengths reach past the 1024-token chunk,
    prefill's past its fixed 128-token split."""
    if dtype == torch.float32:
        return
    lengths = [int(n) for n in torch.randint(1, 1500, (6,), generator=gen)]
    lengths[3] = 1100 + lengths[3] % 400  # the request watched: split in two
    cache, indptr, indices, last, pages = _paged_cache(dtype, device, gen, lengths)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)

    def verdict(alone, batched):
        diff = max(float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()) for a, b in zip(alone, batched))
        return Verdict(diff, all(torch.equal(a, b) for a, b in zip(alone, batched)))

    for group in (1, 8):
        q = _rand((6, 2 * group, 128), dtype, device, gen)
        runs = []
        for batch, budget in ((slice(3, 4), 4), (slice(0, 6), 4), (slice(0, 6), 1000)):
            b0, b1 = batch.start, batch.stop
            table = (indptr[b0 : b1 + 1] - indptr[b0], indices[indptr[b0] : indptr[b1]], last[b0:b1])
            wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(workspace)
            wrapper._core._cta_budget = budget
            wrapper.plan(*table, 2 * group, 2, 128, 16, q_data_type=dtype, batch_invariant=True)
            out, lse = wrapper.run(q[batch], cache, return_lse=True)
            runs.append((out[3 - b0], lse[3 - b0]))
        yield f"batch_decode (group {group}): alone = in a batch of 6", tuple(q.shape), \
            verdict(runs[0], runs[1]), None
        yield f"batch_decode (group {group}): 4 = 1000 blocks", tuple(q.shape), verdict(runs[1], runs[2]), None
    qo_lens = [int(n) for n in torch.randint(1, 40, (6,), generator=gen)]
    kv_lens = [max(q, n % 400) for q, n in zip(qo_lens, lengths)]  # split at a fixed 128 tokens below
    kv_lens[3] = 200 + kv_lens[3] % 200  # the request watched: 2 or 3 chunks
    q = _rand((sum(qo_lens), 8, 128), dtype, device, gen)
    k, v = (_rand((sum(kv_lens), 2, 128), dtype, device, gen) for _ in range(2))
    qo_at, kv_at = [0] + torch.tensor(qo_lens).cumsum(0).tolist(), [0] + torch.tensor(kv_lens).cumsum(0).tolist()
    runs = []
    for b0, b1 in ((3, 4), (0, 6)):
        wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(_i32([n - qo_at[b0] for n in qo_at[b0 : b1 + 1]]), _i32([n - kv_at[b0] for n in kv_at[b0 : b1 + 1]]),
                     8, 2, 128, causal=True, q_data_type=dtype, fixed_split_size=128, batch_invariant=True)
        out, lse = wrapper.run(q[qo_at[b0] : qo_at[b1]], k[kv_at[b0] : kv_at[b1]], v[kv_at[b0] : kv_at[b1]],
                               return_lse=True)
        rows = slice(qo_at[3] - qo_at[b0], qo_at[4] - qo_at[b0])
        runs.append((out[rows], lse[rows]))
    yield "batch_prefill (ragged, causal): alone = in a batch of 6", tuple(q.shape), verdict(*runs), None
    x, w = _rand((64, 4096), dtype, device, gen), _rand((4096,), dtype, device, gen)
    yield "rmsnorm: a row alone = among 64", (64, 4096), verdict([norm.rmsnorm(x[5:6], w)[0]],
                                                               [norm.rmsnorm(x, w)[5]]), None


def _kv_compress(device, dtype, gen):
    """SnapKV's steps on a paged cache: the window's key scores from a paged prefill's lse (against float64),
    the kept keys (exactly the reference's selection from the same scores), the cache compacted in place
    (bit for bit the reference's)."""
    if dtype == torch.float32:
        return
    kv_heads, group, head_dim, page_size, window = 2, 4, 64, 16, 8
    kv_lens = [9, 60, 203]
    qo_lens = [min(window, n) for n in kv_lens]
    cache, indptr, indices, last, _ = _paged_cache(dtype, device, gen, kv_lens, kv_heads, head_dim, page_size)
    qo_indptr = _i32([0] + torch.tensor(qo_lens).cumsum(0).tolist())
    q = _rand((sum(qo_lens), kv_heads * group, head_dim), dtype, device, gen)
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=device))
    paged.plan(qo_indptr, indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, causal=True,
               q_data_type=dtype)
    _, lse = paged.run(q, cache, return_lse=True)
    table = [t.to(device) for t in (indptr, indices, last)]
    scores = kv_compress.key_scores(q, lse, cache, qo_indptr.to(device), *table)
    expected = torch.zeros(scores.shape, dtype=torch.float64)
    ref.kv_compress.kv_scores(q.double().cpu(), lse.double().cpu(), cache[:, 0].double().cpu(), qo_indptr, indptr,
                              indices, last, expected, head_dim ** -0.5, 1.0, True, -1, 0.0, False)
    yield "key_scores (SnapKV window)", tuple(q.shape), _flat(scores), _flat(expected)
    budget, keep_first, kernel_size = [5, 20, 31], 2, 5
    kept, kept_indptr = kv_compress.select_keys(scores, *table, budget, window, keep_first, kernel_size)
    oracle = ref.kv_compress.kv_select(scores.cpu(), indptr, indices, last, kept_indptr.cpu(), kept.shape[0], window,
                                       keep_first, kernel_size)
    yield "select_keys (pooled, sinks, window)", tuple(kept.shape), \
        Verdict((kept.cpu() != oracle).sum(), torch.equal(kept.cpu(), oracle)), None
    compacted = cache.clone()
    kv_compress.compact(compacted, *table, kept, kept_indptr)
    want = cache.cpu().clone()
    ref.kv_compress.kv_compact(want[:, 0], want[:, 1], None, indptr, indices, kept.cpu(), kept_indptr.cpu(),
                               indptr, indices)
    yield "compact (in place)", tuple(cache.shape), \
        Verdict((compacted.cpu() != want).sum(), torch.equal(compacted.cpu(), want)), None


def _page(device, dtype, gen):
    """append_paged_kv_cache into a 16-bit and an fp8 (per-head scales) cache: bit for bit the reference's."""
    if dtype == torch.float32:
        return
    kv_lens, new = [9, 60, 203], [1, 5, 16]  # each request's length after the append, its appended tokens
    cache, indptr, indices, last, _ = _paged_cache(dtype, device, gen, kv_lens)
    append_indptr = _i32([0] + torch.tensor(new).cumsum(0).tolist()).to(device)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, _i32(kv_lens).to(device), sum(new))
    key, value = (_rand((sum(new), 2, 128), dtype, device, gen) for _ in range(2))
    table = [t.to(device) for t in (indices, indptr, last)]
    for name, cache_dtype, scale in (("16-bit", dtype, None), ("float8_e4m3fn", torch.float8_e4m3fn,
                                                              torch.tensor([0.5, 2.0], device=device))):
        got = cache.to(cache_dtype)
        want = got.cpu().clone()
        page.append_paged_kv_cache(key, value, batch_indices, positions, got, *table, k_scale=scale, v_scale=scale)
        ref.page.append_paged_kv_cache(key.cpu(), value.cpu(), batch_indices.cpu(), positions.cpu(), want[:, 0],
                                       want[:, 1], indices, indptr, last, None if scale is None else scale.cpu(),
                                       None if scale is None else scale.cpu())
        same = torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        yield f"append_paged_kv_cache ({name} cache)", tuple(key.shape), Verdict(0 if same else 1, same), None


def _tp_rank(rank, world, port, device, dtype, backend, out_dir):
    """One rank of the tensor-parallel family (a spawned process): its outputs to out_dir/rank<r>.pt."""
    import torch.distributed as dist

    from . import comm

    _backend.set_backend(backend)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        xs, residual, weight = _tp_inputs(world, dtype, device)
        x, res = xs[rank].clone(), residual.clone()
        comm.fused_allreduce_add_rmsnorm(x, res, weight)
        # the kernels where they run: auto on CPU ranks (the emulation's, or gloo), forced on a lone GPU (auto
        # would leave a group of one to the norm alone)
        lone_gpu = world == 1 and comm._kernel_obstacle(torch.device(device), dtype, 1024, 1) is None
        ws = comm.create_allreduce_fusion_workspace("symm_mem" if lone_gpu else "auto", max_token_num=7,
                                                    hidden_dim=xs[0].shape[1], dtype=dtype)
        res_out, norm_out = torch.empty_like(residual), torch.empty_like(residual)
        comm.allreduce_fusion(xs[rank], ws, comm.AllReduceFusionPattern.kARResidualRMSNorm, residual_in=residual,
                              residual_out=res_out, norm_out=norm_out, rms_gamma=weight, fp32_acc=True)
        torch.save([ws.engine] + [t.cpu() for t in (x, res, norm_out, res_out)], f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _tp_inputs(world, dtype, device):
    gen = torch.Generator().manual_seed(7)  # the same on every rank; rank r takes xs[r]
    xs = [_rand((7, 1024), dtype, device, gen) for _ in range(world)]
    return xs, _rand((7, 1024), dtype, device, gen), _rand((1024,), torch.float32, device, gen)


def _tensor_parallel(device, dtype, gen):
    """flashkern.comm across ranks: two spawned processes on gloo over 127.0.0.1 for the CPU, one NCCL rank on a
    GPU; the fused all-reduce + add + RMSNorm against float64 of every rank's input, every rank the same bits."""
    if dtype == torch.float32:
        return
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = 1 if device.startswith("cuda") else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = mp.start_processes(_tp_rank, args=(world, port, device, dtype, _backend.get_backend(), out_dir),
                                   nprocs=world, join=False, start_method="spawn")
        deadline = 120.0
        while not ranks.join(timeout=1.0):
            deadline -= 1.0
            if deadline <= 0:
                for p in ranks.processes:
                    p.terminate()
                raise RuntimeError(f"tensor parallel: the {world} ranks did not finish in 120 s")
        outs = [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]
    xs, residual, weight = _tp_inputs(world, dtype, "cpu")
    summed = residual.double() + sum(x.double() for x in xs)
    normed = ref.rmsnorm(summed, weight.double(), 1e-6, 0.0)
    shape = (world, *xs[0].shape)
    engine, outs = outs[0][0], [out[1:] for out in outs]
    yield "fused_allreduce_add_rmsnorm", shape, _flat(outs[0][0], outs[0][1]), _flat(normed, summed)
    yield f"allreduce_fusion ({engine}, add + RMSNorm)", shape, _flat(outs[0][2], outs[0][3]), _flat(normed, summed)
    same = all(torch.equal(a, b) for out in outs[1:] for a, b in zip(out, outs[0]))
    yield "every rank the same bits", shape, Verdict(0 if same else 1, same), None


FAMILIES = {"norms": _norms, "activations": _activations, "rope": _rope, "merge": _merge, "decode": _decode,
            "prefill": _prefill, "cascade": _cascade, "softmax": _softmax, "renorm": _renorm, "sampling": _sampling,
            "speculative": _speculative, "optimizer": _optimizer, "prefix cache": _prefix_cache,
            "kv compression": _kv_compress, "page": _page, "tensor parallel": _tensor_parallel,
            "batch invariance": _batch_invariance}


def _row(family, op, device, backend, dtype, shape, actual, expected):
    if isinstance(actual, Verdict):
        error, passed = actual.metric, actual.passed
    else:
        actual, expected = actual.double().cpu(), expected.double().cpu()
        tol = tolerance(dtype)
        err = torch.where(actual == expected, 0.0, (actual - expected).abs())  # equal infinities match
        error, passed = float(err.max()) if err.numel() else 0.0, bool((err <= tol["atol"] + tol["rtol"] *
                                                                        expected.abs()).all())
    return {"family": family, "op": op, "device": device, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
            "shape": tuple(shape), "max_abs_err": error, "passed": passed}


def check(devices=None, dtypes=DTYPES, families=None) -> list:
    """Rows of (family, op, device, backend, dtype, shape, max abs error or the case's metric, passed), one per
    case; an op that raises is a failed row (its error in "error"), never an aborted check."""
    if devices is None:
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    rows = []
    for device in devices:
        backend = _backend.backend_for(torch.device(device))
        for name, family in FAMILIES.items():
            if families is not None and name not in families:
                continue
            gen = torch.Generator().manual_seed(0)  # each family's inputs independent of the others
            for dtype in dtypes:
                try:
                    for op, shape, actual, expected in family(device, dtype, gen):
                        rows.append(_row(name, op, device, backend, dtype, shape, actual, expected))
                except Exception as e:  # noqa: BLE001 (reported as a failure, with its message)
                    rows.append({"family": name, "op": f"{name} (raised)", "device": device, "backend": backend,
                                 "dtype": str(dtype).replace("torch.", ""), "shape": (), "max_abs_err": float("nan"),
                                 "passed": False, "error": f"{type(e).__name__}: {e}"})
    return rows
