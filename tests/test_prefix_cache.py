"""The prefix cache: a model-based test (thousands of random start / prefill / append / publish /
finish operations against a plain model of each request's tokens and a simulated KV cache, with
the invariants checked after every step), bad input, and the planner: for random request trees the
cascade planned by plan_cascade gives the attention of the flat plan_decode table, on every device,
and reads no more KV."""

import random

import pytest
import torch

from flashkern import BatchDecodeWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper
from flashkern.prefix_cache import PrefixCache


class Simulated:
    """A PrefixCache with a simulated KV cache: kv[page][slot] = the token whose KV sits there."""

    def __init__(self, num_pages, page_size):
        self.kv = [[None] * page_size for _ in range(num_pages)]
        self.cache = PrefixCache(num_pages, page_size, copy_page=self.copy)
        self.page_size = page_size

    def copy(self, src, dst):
        self.kv[dst] = list(self.kv[src])

    def write(self, request, positions):
        """The KV of request.tokens at `positions`: only into pages the request owns."""
        pages = request.pages
        for pos in positions:
            page = pages[pos // self.page_size]
            assert page in request.own, "a write into a shared page"
            self.kv[page][pos % self.page_size] = request.tokens[pos]

    def start(self, tokens):
        r = self.cache.start(tokens)
        self.write(r, range(r.cached_tokens, len(tokens)))
        return r

    def append(self, r, tokens):
        first = len(r.tokens)
        self.cache.append(r, tokens)
        self.write(r, range(first, len(r.tokens)))


def check_invariants(sim, model):
    cache, ps = sim.cache, sim.page_size
    nodes = list(cache._nodes())
    tree_pages = [n.page for n in nodes]
    own_pages = [p for r in cache.running for p in r.own]
    free = cache._free
    # every page in exactly one place: free, cached, or owned by one running request (no leak, no sharing of own pages)
    assert sorted(tree_pages + own_pages + free) == list(range(cache.num_pages))
    for node in nodes:
        assert node.refs == sum(node in r.path for r in cache.running)
    for r in cache.running:
        assert model[id(r)] == r.tokens
        pages = r.pages
        assert len(pages) == -(-len(r.tokens) // ps)
        spelled = [sim.kv[pages[i // ps]][i % ps] for i in range(len(r.tokens))]
        assert spelled == r.tokens
        for depth, node in enumerate(r.path):  # the path spells the tree's keys
            assert list(node.tokens) == r.tokens[depth * ps:(depth + 1) * ps]


def levels_per_request(plan):
    """Each request's (pages, last_page_len) per level of a cascade plan, in plan.order (one query each)."""
    out = [[] for _ in plan.order]
    for qo, kv, idx, last in zip(plan.qo_indptr_arr, plan.paged_kv_indptr_arr, plan.paged_kv_indices_arr,
                                 plan.paged_kv_last_page_len_arr):
        for g in range(len(qo) - 1):
            for k in range(int(qo[g]), int(qo[g + 1])):
                out[k].append((idx[kv[g]:kv[g + 1]].tolist(), int(last[g])))
    return out


def check_plans(cache, requests, max_levels):
    """Both plans spell every request's page table; a cascade level's last page is full except the
    request's own last page; requests sharing a group are adjacent by construction (CSR)."""
    ps = cache.page_size
    decode = cache.plan_decode(requests)
    assert decode.indptr.tolist() == [0] + [sum(len(r.pages) for r in requests[:i + 1]) for i in range(len(requests))]
    assert decode.indices.tolist() == [p for r in requests for p in r.pages]
    assert decode.last_page_len.tolist() == [len(r.tokens) - (len(r.pages) - 1) * ps if r.pages else 0 for r in requests]
    plan = cache.plan_cascade(requests, max_levels=max_levels)
    assert sorted(plan.order) == list(range(len(requests))) and 1 <= len(plan.qo_indptr_arr) <= max_levels
    for k, levels in enumerate(levels_per_request(plan)):
        r = requests[plan.order[k]]
        assert [p for pages, _ in levels for p in pages] == r.pages
        *upper, (own, own_last) = levels
        assert all(last == (ps if pages else 0) for pages, last in upper)
        assert own_last == (len(r.tokens) - (len(r.pages) - 1) * ps if own else 0)
    assert cache.kv_tokens_read(plan) <= cache.kv_tokens_read(decode)


@pytest.mark.parametrize("seed", range(4))
def test_model_based(seed):
    """Random operations with two alphabets of prefixes (shared system prompts, divergence inside pages,
    page sizes 1-5); a small pool makes eviction frequent, and running out raises without harm."""
    rng = random.Random(seed)
    page_size = [1, 3, 4, 5][seed]
    sim = Simulated(40, page_size)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    model, steps, out_of_pages = {}, 0, 0
    while steps < 1500:
        steps += 1
        running = sim.cache.running
        op = rng.random()
        try:
            if op < 0.3 or not running:
                tokens = rng.choice(prefixes)[: rng.randrange(0, 14)] + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
                r = sim.start(tokens)
                model[id(r)] = list(tokens)
            elif op < 0.6:
                r = rng.choice(running)
                new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
                sim.append(r, new)
                model[id(r)] += new
            elif op < 0.75:
                sim.cache.publish(rng.choice(running))
            else:
                r = rng.choice(running)
                sim.cache.finish(r)
                del model[id(r)]
        except RuntimeError as e:
            assert "out of pages" in str(e)
            out_of_pages += 1
        check_invariants(sim, model)
        running = sim.cache.running
        check_plans(sim.cache, rng.sample(running, rng.randrange(len(running) + 1)), rng.randrange(1, 9))
    for r in list(sim.cache.running):
        sim.cache.finish(r)
    check_invariants(sim, {})
    assert sim.cache.free_pages + len(list(sim.cache._nodes())) == 40
    assert out_of_pages > 0  # the pool did run short


def test_sharing_and_copy_on_write():
    sim = Simulated(16, 4)
    a = sim.start([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    sim.cache.publish(a)
    assert [n.page for n in a.path] == [0, 1] and a.own == [2]
    b = sim.start([1, 2, 3, 4, 5, 6, 70])  # shares page 0, diverges inside page 1: copied
    assert b.path == a.path[:1] and b.cached_tokens == 6 and b.own[0] not in a.pages
    assert sim.kv[b.own[0]][:2] == [5, 6]
    assert sim.cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == (8, [0, 1])
    sim.append(b, [71, 72])  # b's writes touch only its own pages
    assert sim.kv[1] == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="not running"):
        sim.cache.append(Simulated(4, 4).start([1]), 1)


def test_partial_leaf():
    """A finished request's partial last page stays cached: a request with the same first tokens copies it."""
    sim = Simulated(16, 4)
    a = sim.start([1, 2, 3, 4, 5, 6])
    sim.cache.finish(a)
    b = sim.start([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert b.cached_tokens == 6 and b.path[0].page == 0 and b.own[0] != 1
    assert sim.kv[b.own[0]][:2] == [5, 6]
    sim.cache.finish(sim.start([1, 2, 3, 4, 5, 6]))  # the same partial tokens again: not cached twice
    assert len([n for n in sim.cache._nodes() if len(n.tokens) < 4]) == 1


def test_copy_failure_leaks_nothing():
    def broken(src, dst):
        raise RuntimeError("device out of memory")

    cache = PrefixCache(8, 4, copy_page=broken)
    cache.finish(cache.start([1, 2, 3, 4, 5, 6]))
    with pytest.raises(RuntimeError, match="device out of memory"):
        cache.start([1, 2, 3, 4, 5, 7])  # diverges inside the cached partial page: a copy
    assert cache.free_pages + len(list(cache._nodes())) == 8 and all(n.refs == 0 for n in cache._nodes())


def test_deep_tree():
    """Requests that are nested prefixes of one sequence: every page held by a different number of
    requests, so as many runs as requests, merged down to max_levels."""
    cache = PrefixCache(200, 2)
    requests = []
    for i in range(40):
        r = cache.start(list(range(2 * (i + 1))))
        cache.publish(r)
        requests.append(r)
    for r in requests:
        cache.append(r, [99])
    for max_levels in range(1, 9):
        check_plans(cache, requests, max_levels)
    rng = random.Random(0)
    check_plans(cache, rng.sample(requests, 17), 3)


def test_eviction_and_exhaustion():
    sim = Simulated(4, 2)
    a = sim.start([1, 2, 3, 4])
    sim.cache.finish(a)  # two cached pages, unreferenced
    b = sim.start([9, 9, 9, 9, 9, 9])  # needs three: evicts the least recently used leaf, then its parent
    assert sim.cache.match([1, 2, 3, 4])[0] < 4
    c_tokens = [5] * 6
    with pytest.raises(RuntimeError, match="out of pages"):
        sim.start(c_tokens)  # b holds three pages, one is free
    assert b in sim.cache.running and sim.cache.free_pages >= 1


def test_bad_input():
    cache = PrefixCache(8, 4)
    with pytest.raises(TypeError, match="tokens"):
        cache.start(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="ints"):
        cache.start([1, 2.5])
    with pytest.raises(ValueError, match="positive"):
        PrefixCache(0, 4)
    with pytest.raises(ValueError, match="non-negative"):
        cache.start([5, -3, 2])
    with pytest.raises(ValueError, match="non-negative"):
        cache.start(torch.tensor([5, -1]))
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        cache.allocate(-1)
    r = cache.start([1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        cache.append(r, -2)
    with pytest.raises(ValueError, match="non-negative"):
        cache.append(r, [4, -7])
    with pytest.raises(ValueError, match="not an allocated page"):
        cache.free([r.own[0], r.own[0]])
    with pytest.raises(ValueError, match="not an allocated page"):
        cache.free([99])
    with pytest.raises(ValueError, match="max_levels"):
        cache.plan_cascade([r], max_levels=9)
    pages = cache.allocate(2)
    with pytest.raises(ValueError, match="appears twice"):
        cache.insert(list(range(8)), [pages[0], pages[0]])  # a page twice in one request
    with pytest.raises(ValueError, match="held by a running request"):
        cache.insert(list(range(8)), [pages[0], r.own[0]])
    assert cache.insert(list(range(8)), pages) == pages and cache.insert(list(range(8)), pages) == pages
    with pytest.raises(ValueError, match="twice"):
        cache.plan_cascade([r, r])
    with pytest.raises(ValueError, match="running"):
        cache.plan_decode([PrefixCache(8, 4).start([1])])
    with pytest.raises(ValueError, match="qo_lens"):
        cache.plan_cascade([r], qo_lens=[1, 2])
    done = cache.start([7])
    cache.finish(done)
    with pytest.raises(ValueError, match="running"):
        cache.plan_cascade([r, done])
    cache.append(r, [4, 5])
    cache._prev[r.own[1]] = r.own[1]  # a page table that loops: the planner checks every one
    with pytest.raises(ValueError, match="does not hold its 5 tokens"):
        cache.plan_decode([r])
    with pytest.raises(ValueError, match="does not hold its 5 tokens"):
        cache.plan_cascade([r])


def random_batch(rng, cache, n_requests, page_size, depth):
    """Requests over a random tree of prefixes `depth` levels deep (shared parts ending on and off page
    boundaries), published so that later requests share them, one decode token appended each."""
    prefixes = [[]]
    for _ in range(depth):
        prefixes = [p + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * page_size))]
                    for p in prefixes for _ in range(rng.randrange(1, 3))]
    requests = []
    for i in range(n_requests):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 2 * page_size))]
        r = cache.start(tokens)
        cache.publish(r)
        requests.append(r)
    for r in requests:
        cache.append(r, [rng.randrange(50)])
    return requests


@pytest.mark.parametrize("depth,max_levels,page_size", [(2, 8, 4), (3, 8, 1), (4, 8, 16), (6, 3, 4), (8, 2, 4)])
def test_cascade_equals_decode(device, depth, max_levels, page_size):
    rng = random.Random(depth * 100 + max_levels)
    cache = PrefixCache(400, page_size)
    requests = random_batch(rng, cache, 12, page_size, depth)
    decode_plan, cascade = cache.plan_decode(requests), cache.plan_cascade(requests, max_levels=max_levels)
    assert len(cascade.qo_indptr_arr) <= max_levels
    assert cache.kv_tokens_read(cascade) <= cache.kv_tokens_read(decode_plan)
    heads, kv_heads, dim = 4, 2, 64
    g = torch.Generator().manual_seed(depth)
    kv = torch.randn(400, 2, page_size, kv_heads, dim, generator=g).half().to(device)
    q = torch.randn(len(requests), heads, dim, generator=g).half().to(device)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    decode = BatchDecodeWithPagedKVCacheWrapper(workspace)
    decode.plan(*decode_plan, heads, kv_heads, dim, page_size, q_data_type=torch.float16)
    expected = decode.run(q, kv)
    levels = len(cascade.qo_indptr_arr)
    wrapper = MultiLevelCascadeAttentionWrapper(levels, workspace)
    wrapper.plan(cascade.qo_indptr_arr, cascade.paged_kv_indptr_arr, cascade.paged_kv_indices_arr,
                 cascade.paged_kv_last_page_len_arr, heads, kv_heads, dim, page_size, q_data_type=torch.float16)
    order = torch.tensor(cascade.order)
    out = wrapper.run(q[order.to(device)], kv)
    torch.testing.assert_close(out.float().cpu(), expected[order.to(device)].float().cpu(), atol=2e-3, rtol=2e-3)


def test_plan_shape():
    """Two system prompts of different lengths, four requests each: two shared groups at level 0, and
    the cascade reads each prompt once."""
    cache = PrefixCache(100, 4)
    system = [list(range(100, 111)), list(range(200, 221))]
    requests = []
    for i in range(8):
        r = cache.start(system[i % 2] + [i, i + 1])
        cache.publish(r)
        requests.append(r)
    plan = cache.plan_cascade(requests)
    assert len(plan.qo_indptr_arr) == 2
    assert plan.qo_indptr_arr[0].tolist() == [0, 4, 8] and plan.qo_indptr_arr[1].tolist() == list(range(9))
    assert sorted(plan.paged_kv_indptr_arr[0].diff().tolist()) == [2, 5]  # the prompts' full pages: 8 and 20 tokens
    assert sorted(plan.order[:4]) == [0, 2, 4, 6] or sorted(plan.order[:4]) == [1, 3, 5, 7]
    decode = cache.plan_decode(requests)
    assert cache.kv_tokens_read(plan) == 8 + 20 + sum(len(r.tokens) for r in requests) - 4 * 8 - 4 * 20
    assert cache.kv_tokens_read(decode) == sum(len(r.tokens) for r in requests)
