"""Batch-invariant mode (flashkern.invariance): one request's output bits, computed alone, equal its
bits inside random batches of other requests (1 to 64 of them, random lengths, at a random position),
for split and unsplit plans and planners given other multiprocessor counts; compared with
torch.equal, never a tolerance. The CPU reference runs here; the kernels' own code runs the same
batches in tests/test_emulated_kernels.py (test_attention_kernels_are_batch_invariant and the row
ops' tests), where a mutant planner must fail them (tests/test_emulator_checks.py)."""

import random

import pytest
import torch
from conftest import rand, requires_gpu
from paged_kv import i32, paged, random_kv

import flashkern

KV_HEADS, PAGE_SIZE = 2, 16
DTYPE = torch.bfloat16
OTHERS = (1, 9, 64)  # batch sizes around the request


class Request:
    """One request's queries (its last q_len tokens) and KV, from its own seed."""

    def __init__(self, q_len, kv_len, group, head_dim, seed):
        self.q = rand((q_len, KV_HEADS * group, head_dim), DTYPE, "cpu", seed=seed)
        self.k, self.v = random_kv([kv_len], KV_HEADS, head_dim, seed + 1)[0]


def random_requests(n, rng, group, head_dim, q_len=None, max_kv=300, min_kv=1):
    """n requests of random lengths (q_len fixed for decode, else random up to 24 tokens)."""
    out = []
    for _ in range(n):
        kv_len = rng.randrange(min_kv, max_kv)
        q = q_len or rng.randrange(1, min(kv_len, 24) + 1)
        out.append(Request(q, max(kv_len, q), group, head_dim, rng.randrange(1 << 30)))
    return out


def plan_batch(path, requests, head_dim, options, cta_budget=None):
    """A planned wrapper over `requests` and (q, kv cache) to run it on: path "decode" (one query each,
    or q_len_per_req), "paged" or "ragged" prefill."""
    from test_prefill import indptr, ragged

    group = requests[0].q.shape[1] // KV_HEADS
    q = torch.cat([r.q for r in requests])
    kvs = [(r.k, r.v) for r in requests]
    workspace = torch.zeros(16 << 20, dtype=torch.uint8)
    if path == "ragged":
        wrapper = flashkern.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        kv = tuple(t[:, None] for t in ragged(kvs, DTYPE, "cpu"))  # [tokens, 1, heads, D]: one-token pages
    else:
        wrapper = (flashkern.BatchDecodeWithPagedKVCacheWrapper if path == "decode" else
                   flashkern.BatchPrefillWithPagedKVCacheWrapper)(workspace)
        kv, kv_indptr, indices, last = paged(kvs, PAGE_SIZE, "NHD", DTYPE, seed=len(requests))
    if cta_budget is not None:  # a device with other multiprocessor counts
        wrapper._core._cta_budget = cta_budget
    common = dict(q_data_type=DTYPE, **options)
    if path == "decode":
        wrapper.plan(kv_indptr, indices, last, KV_HEADS * group, KV_HEADS, head_dim, PAGE_SIZE,
                     q_len_per_req=requests[0].q.shape[0], **common)
    elif path == "paged":
        wrapper.plan(indptr([r.q.shape[0] for r in requests]), kv_indptr, indices, last, KV_HEADS * group, KV_HEADS,
                     head_dim, PAGE_SIZE, causal=True, **common)
    else:
        wrapper.plan(indptr([r.q.shape[0] for r in requests]), indptr([r.k.shape[0] for r in requests]),
                     KV_HEADS * group, KV_HEADS, head_dim, causal=True, **common)
    return wrapper, q, kv


def run_on_cpu(wrapper, q, kv):
    if isinstance(wrapper, flashkern.BatchPrefillWithRaggedKVCacheWrapper):
        return wrapper.run(q, kv[0][:, 0], kv[1][:, 0], return_lse=True)
    return wrapper.run(q, kv, return_lse=True)


def rows_of(requests, index):
    start = sum(r.q.shape[0] for r in requests[:index])
    return slice(start, start + requests[index].q.shape[0])


# The plans: the invariant chunk (unsplit at these lengths), a fixed split of 64 tokens, no split; each
# planned for devices of 4 and of 1000 blocks at once
SPLITS = [dict(), dict(fixed_split_size=4), dict(disable_split_kv=True)]


def attention_batches(path, group, head_dim, execute, others=OTHERS, seed=0, window_left=-1, splits=SPLITS,
                      batch_invariant=True, max_kv=300):
    """[(what, target alone, target in the batch)] as (out, lse) pairs: a random target request (max_kv to
    2 * max_kv tokens: split by a fixed split), alone and inside random batches of `others` other requests (up to max_kv tokens)
    at random positions, for every split and budget."""
    rng = random.Random(seed)
    q_len = 1 if path == "decode" else None
    target = random_requests(1, rng, group, head_dim, q_len, max_kv=2 * max_kv, min_kv=max_kv)[0]
    pairs = []
    for split in splits:
        options = dict(split, window_left=window_left, batch_invariant=batch_invariant)
        alone = execute(*plan_batch(path, [target], head_dim, options, cta_budget=4))
        for n in others:
            requests = random_requests(n, rng, group, head_dim, q_len, max_kv)
            at = rng.randrange(n + 1)
            requests.insert(at, target)
            for budget in (4, 1000):
                out, lse = execute(*plan_batch(path, requests, head_dim, options, cta_budget=budget))
                rows = rows_of(requests, at)
                pairs.append((f"{split} {n} others, target at {at}, budget {budget}", alone, (out[rows], lse[rows])))
    return pairs


def assert_same_bits(pairs):
    for what, (o1, s1), (o2, s2) in pairs:
        assert torch.equal(o1, o2) and torch.equal(s1, s2), f"{what}: the request's bits changed in the batch"


# ---------------------------------------------------------------- the mode itself


@requires_gpu
def test_batch_invariance_on_this_gpu():
    """flashkern check's batch invariance family on the GPU (`pytest -m gpu`, the device check): the kernels'
    bits for a request alone and in a batch, and on planners of 4 and 1000 blocks, on the hardware."""
    rows = flashkern.check(devices=["cuda"], families=["batch invariance"])
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]


def test_mode_switches_and_restores():
    assert not flashkern.is_batch_invariant()
    with flashkern.batch_invariant():
        assert flashkern.is_batch_invariant()
        with flashkern.batch_invariant(False):
            assert not flashkern.is_batch_invariant()
        assert flashkern.is_batch_invariant()
    assert not flashkern.is_batch_invariant()
    flashkern.set_batch_invariant(True)
    try:
        assert flashkern.is_batch_invariant()
    finally:
        flashkern.set_batch_invariant(False)
    with pytest.raises(TypeError, match="must be a bool"):
        flashkern.set_batch_invariant(1)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8))
    with pytest.raises(TypeError, match="batch_invariant must be a bool or None"):
        wrapper.plan(i32([0, 1]), i32([0]), i32([3]), 4, 2, 64, 16, batch_invariant="yes")


def test_plan_reads_the_mode_and_its_fixed_chunk():
    from flashkern.invariance import INVARIANT_CHUNK

    requests = random_requests(3, random.Random(1), 4, 64, q_len=1, max_kv=3000)
    with flashkern.batch_invariant():
        wrapper, _, _ = plan_batch("decode", requests, 64, {})
    info = wrapper._core._plan_info
    assert info["batch_invariant"] and info["chunk"] == INVARIANT_CHUNK
    wrapper, _, _ = plan_batch("decode", requests, 64, {})
    assert not wrapper._core._plan_info["batch_invariant"]


def test_invariant_plan_refuses_a_small_workspace_instead_of_growing_its_chunk():
    requests = random_requests(40, random.Random(2), 4, 64, q_len=1, max_kv=3000)
    cache_args = paged([(r.k, r.v) for r in requests], PAGE_SIZE, "NHD", DTYPE)[1:]
    small = torch.zeros(300 << 10, dtype=torch.uint8)
    flashkern.BatchDecodeWithPagedKVCacheWrapper(small).plan(*cache_args, 8, 2, 64, PAGE_SIZE, fixed_split_size=4)
    with pytest.raises(ValueError, match="batch-invariant plan.*never grows"):
        flashkern.BatchDecodeWithPagedKVCacheWrapper(small).plan(*cache_args, 8, 2, 64, PAGE_SIZE,
                                                                 fixed_split_size=4, batch_invariant=True)


def test_invariant_plan_refuses_causal_order_on_a_shared_level():
    """A shared level's tile holds other requests' rows, which would decide where a masked row's KV tiles start."""
    from flashkern import _C

    tables = [(i32([0, 2]), i32([0, 1]), i32([5])), (i32([0, 1, 2]), i32([0, 1, 2]), i32([3, 4]))]
    levels = [(qo.data_ptr(), kv.data_ptr(), last.data_ptr(), kv.numel() - 1, kv.numel() - 1, causal, -1, False, False)
              for (qo, kv, last), causal in zip(tables, (True, False))]
    out = torch.empty(1 << 12, dtype=torch.int32)
    args = (levels, 2, 16, 4, 2, 64, 16, 64, 1 << 20, 1 << 20, ("qo", "kv", "indices", "last"), True, out.data_ptr(),
            out.numel())
    _C.plan_attention(*args, False)
    with pytest.raises(ValueError, match="on the last level only"):
        _C.plan_attention(*args, True)


# ---------------------------------------------------------------- attention (the CPU reference)


@pytest.mark.parametrize("path,group", [("decode", 1), ("decode", 4), ("decode", 8), ("decode", 32),
                                        ("paged", 1), ("paged", 4), ("ragged", 2), ("ragged", 8)])
def test_attention_is_batch_invariant(path, group):
    """Decode (the decode kernel's groups, 16- and 64-row tiles) and causal prefill, paged and ragged."""
    assert_same_bits(attention_batches(path, group, 64, run_on_cpu, seed=group))


def test_attention_with_a_window_is_batch_invariant():
    assert_same_bits(attention_batches("ragged", 4, 128, run_on_cpu, seed=5, window_left=40, others=(7,)))


def test_the_check_fails_outside_the_mode():
    """The same comparison on default plans: their split follows the batch, and a long request's bits change
    (so the tests above can fail)."""
    pairs = attention_batches("decode", 4, 64, run_on_cpu, others=(64,), splits=[dict()], batch_invariant=False)
    with pytest.raises(AssertionError, match="bits changed"):
        assert_same_bits(pairs)


def cascade_batch(target_suffix, others, prefix, group, head_dim, shared_with):
    """A two-level cascade: `prefix` (k, v) shared by the target and the first `shared_with` others, the
    rest of the others under a prefix of their own; every request's suffix at the last level. Returns
    (wrapper, q, cache); the target is query 0."""
    g = torch.Generator().manual_seed(9)
    other_prefix = random_kv([int(torch.randint(1, 400, (1,), generator=g))], KV_HEADS, head_dim, 77)[0]
    members = [target_suffix] + others  # the target first within its group
    groups = [members[: shared_with + 1]] + ([members[shared_with + 1 :]] if len(members) > shared_with + 1 else [])
    prefixes = [prefix, other_prefix][: len(groups)]
    kvs = prefixes + [(r.k, r.v) for grp in groups for r in grp]
    cache, indptr, indices, last = paged(kvs, PAGE_SIZE, "NHD", DTYPE, seed=len(members))
    n_groups, batch = len(groups), len(members)
    sizes = [len(grp) for grp in groups]
    qo0 = i32([0] + torch.tensor(sizes).cumsum(0).tolist())
    levels = ([qo0, i32(list(range(batch + 1)))],
              [indptr[: n_groups + 1], indptr[n_groups:] - indptr[n_groups]],
              [indices[: indptr[n_groups]], indices[indptr[n_groups] :]],
              [last[:n_groups], last[n_groups:]])
    q = torch.cat([r.q for grp in groups for r in grp])
    wrapper = flashkern.MultiLevelCascadeAttentionWrapper(2, torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper.plan(*levels, KV_HEADS * group, KV_HEADS, head_dim, PAGE_SIZE, q_data_type=DTYPE, batch_invariant=True)
    return wrapper, q, cache


@pytest.mark.parametrize("group", [1, 4])
def test_cascade_is_batch_invariant(group, execute=None):
    """A request under a shared prefix: alone (its group has only it) and with 1 to 64 others, some sharing
    its prefix, some under another one (the shared level's tile holds other requests' rows)."""
    execute = execute or (lambda wrapper, q, cache: wrapper.run(q, cache, return_lse=True))
    rng = random.Random(group)
    prefix = random_kv([1500], KV_HEADS, 64, 70)[0]  # split at the invariant chunk
    target = random_requests(1, rng, group, 64, q_len=1)[0]
    alone_o, alone_s = execute(*cascade_batch(target, [], prefix, group, 64, 0))
    for n in OTHERS:
        others = random_requests(n, rng, group, 64, q_len=1)
        out, lse = execute(*cascade_batch(target, others, prefix, group, 64, rng.randrange(n + 1)))
        assert torch.equal(out[0], alone_o[0]) and torch.equal(lse[0], alone_s[0]), f"{n} others"


def test_prefix_cache_cascade_refused_in_the_mode():
    from flashkern.prefix_cache import PrefixCache

    cache = PrefixCache(num_pages=8, page_size=4)
    with flashkern.batch_invariant(), pytest.raises(ValueError, match="batch-invariant mode.*plan_decode"):
        cache.plan_cascade([])


# ---------------------------------------------------------------- row ops, sampling (the CPU reference)


def rows_alone_and_in_batches(op, make_rows, seed=0):
    """op over one row alone equals that row of op over random batches of 1 to 64 other rows: make_rows(n, g)
    gives n rows (a tuple of tensors with rows first) from generator g."""
    g = torch.Generator().manual_seed(seed)
    target = make_rows(1, g)
    alone = op(*target)
    for n in OTHERS:
        others = make_rows(n, g)
        at = int(torch.randint(0, n + 1, (1,), generator=g))
        batch = tuple(torch.cat([o[:at], t, o[at:]]) for o, t in zip(others, target))
        out = op(*batch)
        for a, b in zip(alone if isinstance(alone, tuple) else (alone,), out if isinstance(out, tuple) else (out,)):
            assert torch.equal(a[0], b[at]), f"{n} others, the row at {at}"


def random_rows(cols, dtype, count=1):
    return lambda n, g: tuple((torch.randn(n, cols, generator=g) * 3).to(dtype) for _ in range(count))


@pytest.mark.parametrize("cols", [7, 4096, 8200])  # a partial vector, a row in registers, a streamed row
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_row_ops_are_batch_invariant(cols, dtype):
    weight = torch.rand(cols).to(dtype)
    rows_alone_and_in_batches(lambda x: flashkern.rmsnorm(x, weight), random_rows(cols, dtype))
    rows_alone_and_in_batches(lambda x: flashkern.gemma_rmsnorm(x, weight), random_rows(cols, dtype))

    def fused(x, residual):
        x, residual = x.clone(), residual.clone()
        flashkern.fused_add_rmsnorm(x, residual, weight)
        return x, residual

    rows_alone_and_in_batches(fused, random_rows(cols, dtype, 2))
    for act in (flashkern.silu_and_mul, flashkern.gelu_and_mul, flashkern.gelu_tanh_and_mul):
        rows_alone_and_in_batches(act, random_rows(2 * cols, dtype))


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_is_batch_invariant(interleave):
    def rope(q, k, pos):
        return flashkern.apply_rope_pos_ids(q, k, pos[:, 0], interleave=interleave, rope_theta=5e5)

    def make(n, g):
        return (torch.randn(n, 8, 128, generator=g).to(DTYPE), torch.randn(n, 2, 128, generator=g).to(DTYPE),
                torch.randint(0, 1 << 16, (n, 1), generator=g))

    rows_alone_and_in_batches(rope, make)


def per_request_seeds(n, g):
    return (torch.randint(0, 1 << 62, (n,), generator=g), torch.randint(0, 1 << 20, (n,), generator=g))


def test_sampling_is_batch_invariant_with_a_seed_per_request():
    vocab = 5004  # rows on 16-byte boundaries (test_sampling_needs_aligned_rows_in_the_mode)

    def make(n, g):
        probs = torch.rand(n, vocab, generator=g) ** 4
        return (probs / probs.sum(-1, keepdim=True), torch.randint(1, 100, (n,), generator=g).int(),
                torch.rand(n, generator=g) * 0.9 + 0.05, *per_request_seeds(n, g))

    def sample(probs, top_k, top_p, seed, offset):
        with flashkern.batch_invariant():
            return (flashkern.sampling_from_probs(probs, seed=seed, offset=offset),
                    flashkern.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed=seed, offset=offset),
                    flashkern.min_p_sampling_from_probs(probs, top_p, seed=seed, offset=offset))

    rows_alone_and_in_batches(sample, make)


def test_softmax_and_renormalization_are_batch_invariant():
    def make(n, g):
        logits = torch.randn(n, 4100, generator=g) * 4
        return logits, torch.softmax(logits, -1), torch.rand(n, generator=g) + 0.5

    def rows(logits, probs, temperature):
        return (flashkern.softmax(logits, temperature), flashkern.top_k_renorm_probs(probs, 40),
                flashkern.top_p_renorm_probs(probs, 0.8), flashkern.top_k_mask_logits(logits, 40))

    rows_alone_and_in_batches(rows, make)


def test_speculative_sampling_is_batch_invariant_with_a_seed_per_request():
    vocab, n_draft = 304, 4

    def make(n, g):
        draft = torch.rand(n, n_draft, vocab, generator=g) ** 3
        target = torch.rand(n, n_draft + 1, vocab, generator=g) ** 3
        ids = torch.multinomial(draft.view(-1, vocab), 1, generator=g).view(n, n_draft).int()
        return (draft / draft.sum(-1, keepdim=True), ids, target / target.sum(-1, keepdim=True),
                *per_request_seeds(n, g))

    def speculate(draft, ids, target, seed, offset):
        with flashkern.batch_invariant():
            return flashkern.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)

    rows_alone_and_in_batches(speculate, make)


def test_sampling_needs_aligned_rows_in_the_mode():
    """The kernels' sums over a row follow where its 16-byte vectors start: in the mode rows must all start on one."""
    probs = torch.rand(3, 1003)
    seeds = dict(seed=torch.arange(3), offset=0)
    flashkern.sampling_from_probs(probs, **seeds)
    with flashkern.batch_invariant():
        flashkern.sampling_from_probs(torch.rand(3, 1004), **seeds)
        for call in (lambda: flashkern.sampling_from_probs(probs, **seeds), lambda: flashkern.softmax(probs),
                     lambda: flashkern.top_p_renorm_probs(probs, 0.5),
                     lambda: flashkern.sampling_from_probs(torch.rand(3, 1005)[:, 1:], **seeds)):
            with pytest.raises(ValueError, match="16-byte boundary"):
                call()


def test_sampling_needs_a_seed_per_request_in_the_mode():
    probs = torch.rand(3, 52)
    flashkern.sampling_from_probs(probs)  # outside the mode: one seed for the batch
    with flashkern.batch_invariant():
        flashkern.sampling_from_probs(probs[:1])  # one request: its seed is its own
        for seed, offset in ((None, None), (7, 0), (torch.tensor([7]), 0), (torch.arange(3), None)):
            with pytest.raises(ValueError, match="batch-invariant mode needs a seed per request"):
                flashkern.sampling_from_probs(probs, seed=seed, offset=offset)
        flashkern.top_p_sampling_from_probs(probs, 0.9, seed=torch.arange(3), offset=5)


# ---------------------------------------------------------------- a Hugging Face model, end to end


@pytest.fixture
def row_invariant_linear(monkeypatch):
    """torch's CPU matrix product takes other paths for few rows (one row: a matrix-vector product), so a
    model's linear layers are not batch-invariant by themselves; flashkern has no GEMM. Here every
    linear layer runs as products of 64 rows exactly (zero-padded), one fixed shape, as a batch-invariant
    GEMM would (a row's bits then depend on neither the row count nor its place)."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros((-flat.shape[0] % 64, flat.shape[1]))])
        out = torch.cat([torch.nn.functional.linear(block, self.weight, self.bias) for block in padded.split(64)])
        return out[: flat.shape[0]].view(*x.shape[:-1], -1)

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: a sliding window and a soft cap
def test_model_generates_the_same_alone_and_in_a_batch(model_type, restore_rope, row_invariant_linear):
    """apply_flashkern(attention=True) in the mode: a prompt's greedy generation alone equals its generation
    inside a left-padded batch of other prompts, token for token and logit for logit."""
    from test_integrations import make_attention_model

    from flashkern.integrations.transformers import apply_flashkern

    model = make_attention_model(model_type, torch.float32)
    apply_flashkern(model, attention=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (9, 4, 13, 7)]
    target = 3

    def generate(batch):
        longest = max(p.shape[0] for p in batch)
        ids = torch.stack([torch.cat([p.new_zeros(longest - p.shape[0]), p]) for p in batch])
        mask = torch.stack([torch.arange(longest) >= longest - p.shape[0] for p in batch]).long()
        with torch.no_grad(), flashkern.batch_invariant():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        return out.sequences[:, longest:], torch.stack(out.logits, 1)

    tokens, logits = generate([prompts[target]])
    batch_tokens, batch_logits = generate(prompts)
    assert torch.equal(batch_tokens[target], tokens[0])
    assert torch.equal(batch_logits[target], logits[0])
