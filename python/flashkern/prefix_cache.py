"""A prefix cache: a page pool and a radix tree over token ids whose edges are whole KV pages, shared
by the requests that start with the same tokens, and the planner that turns a batch of running
requests into the levels of MultiLevelCascadeAttentionWrapper (or the flat page table of
BatchDecodeWithPagedKVCacheWrapper, for comparison).

The cache manages page indices only; the KV data lives in the caller's paged cache. Pages:
- A tree node is one full page of tokens (its edge), cached: immutable, shared by every request
  whose tokens start with the node's path. A running request references the nodes of its path
  (they cannot be evicted) and owns the pages after them, which nothing else sees.
- start(tokens): the longest cached prefix of whole pages is shared. When the next page of the
  request matches a cached page only in its first tokens (the requests diverge inside a page), that
  page is copied into a page of the request's own (copy-on-write: ``copy_page(src, dst)``, the
  caller's function that copies a page of its KV cache), and those tokens count as cached too.
- publish(request): the request's full pages become tree nodes (after its prefill: a later request
  with the same prefix shares them). Where another request published the same tokens first, the
  request switches to that page (same tokens at the same positions: the same KV) and frees its own.
- append(request, n): n more tokens (decode), with a new page when the last one is full.
- finish(request): publish, then release: its path is unreferenced and its partial last page stays
  in the tree as a leaf (a later request starting with those tokens copies it).
- publish and finish cache the KV in the request's pages: every token's KV must be written by then.
- Unreferenced leaves are evicted least recently used first when the pool runs short; running out
  with every page referenced raises RuntimeError.
- compact(requests, ...): KV-cache compression (flashkern.kv_compress) of running requests. Their kept
  keys and values move into fresh pages that become their own; shared pages are never written. A
  compressed request leaves the tree (its KV no longer matches its tokens): it publishes nothing, and
  finish frees its pages.

Planning is C++ (csrc/include/flashkern/prefix_plan.h): the cache keeps prev[page], the page before
each page in its holder's page table, so a request is its last page and its token count, kept in
arrays by request slot as the request changes.
"""

from array import array
from dataclasses import dataclass, field
from typing import List, NamedTuple

import torch

from . import _C, invariance


class _Node:
    __slots__ = ("tokens", "page", "parent", "children", "refs", "last_use")

    def __init__(self, tokens, page, parent):
        self.tokens, self.page, self.parent = tokens, page, parent
        self.children = {}  # the child's tokens (a tuple: a full page, or fewer at a partial leaf) -> node
        self.refs = 0        # running requests whose path includes this node
        self.last_use = 0


@dataclass(eq=False)
class Request:
    """A running request: its tokens, the tree nodes it shares (in order) and the pages it owns after
    them. ``pages`` is its whole page table."""

    tokens: List[int]
    path: List[_Node] = field(default_factory=list)
    own: List[int] = field(default_factory=list)
    cached_tokens: int = 0  # tokens whose KV was in the cache when the request started (no prefill needed)
    evicted: int = 0  # tokens whose KV compression removed (compact): its KV holds kv_tokens of its tokens
    finished: bool = False
    _cache: "PrefixCache" = field(default=None, repr=False)
    _slot: int = field(default=-1, repr=False)  # its entries in the cache's arrays for the planner

    @property
    def pages(self):
        return [n.page for n in self.path] + self.own

    @property
    def kv_tokens(self):
        """Tokens in its pages: all of its tokens, less those compression removed. The next token's
        position (RoPE) stays len(tokens)."""
        return len(self.tokens) - self.evicted

    @property
    def last_page(self):
        return self.own[-1] if self.own else self.path[-1].page if self.path else -1


class CascadePlan(NamedTuple):
    """The arguments of MultiLevelCascadeAttentionWrapper.plan (int32 CPU tensors, one per level) and
    ``order``: the position in ``requests`` of each query group, in the order the queries must be
    laid out (requests sharing a prefix are adjacent)."""

    qo_indptr_arr: list
    paged_kv_indptr_arr: list
    paged_kv_indices_arr: list
    paged_kv_last_page_len_arr: list
    order: list


class DecodePlan(NamedTuple):
    """The arguments of BatchDecodeWithPagedKVCacheWrapper.plan: (indptr, indices, last_page_len)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int, copy_page=None):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PrefixCache: {name} must be a positive int, got {value!r}")
        self.num_pages, self.page_size, self.copy_page = num_pages, page_size, copy_page
        self.root = _Node((), -1, None)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() takes the lowest page first
        self._prev = array("i", [-1]) * num_pages  # the page before each page in its holder's page table
        self._slot_last, self._slot_tokens, self._free_slots = array("i"), array("q"), []  # per running request
        self._clock = 0
        self.running = []

    # ---- the pool ----

    @property
    def free_pages(self):
        return len(self._free)

    def allocate(self, n):
        """n free pages, evicting unreferenced cached leaves (least recently used first) if needed."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"PrefixCache.allocate: n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            self._evict(n - len(self._free))
        if n > len(self._free):
            raise RuntimeError(f"PrefixCache: out of pages: {n} needed, {len(self._free)} free, and every cached "
                               f"page is held by a running request ({len(self.running)} running)")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages):
        """Return pages (allocated, not in the tree, not held by a running request) to the pool."""
        held = {p for r in self.running for p in r.own} | {n.page for n in self._nodes()}
        for page in pages:
            if not 0 <= page < self.num_pages or page in self._free or page in held:
                raise ValueError(f"PrefixCache.free: page {page} is not an allocated page the caller holds")
            self._free.append(page)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self, n):
        leaves = [node for node in self._nodes() if not node.children and node.refs == 0]
        leaves.sort(key=lambda node: node.last_use)
        while n > 0 and leaves:
            node = leaves.pop(0)
            del node.parent.children[node.tokens]
            self._free.append(node.page)
            n -= 1
            parent = node.parent
            if parent is not self.root and not parent.children and parent.refs == 0:  # the parent became a leaf
                leaves.append(parent)
                leaves.sort(key=lambda x: x.last_use)

    # ---- the tree ----

    def _touch(self, node):
        self._clock += 1
        while node is not self.root:
            node.last_use = self._clock
            node = node.parent

    def match(self, tokens):
        """(num_cached_tokens, pages): the longest prefix of ``tokens`` cached as whole pages."""
        tokens = _token_list("match", tokens)
        node, pages = self.root, []
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            child = node.children.get(tuple(tokens[start:start + self.page_size]))
            if child is None:
                break
            node = child
            pages.append(node.page)
        return len(pages) * self.page_size, pages

    def insert(self, tokens, pages):
        """Cache the full pages of ``tokens`` (their KV in ``pages``, allocated by the caller): pages for
        tokens already cached are freed; returns the cached pages of the prefix (in the tree's copy)."""
        tokens = _token_list("insert", tokens)
        full = len(tokens) // self.page_size
        pages = list(pages)
        if len(pages) < full:
            raise ValueError(f"PrefixCache.insert: {len(tokens)} tokens need {full} full pages, got {len(pages)}")
        cached = self.match(tokens)[1]  # re-inserting cached pages as they are is allowed
        held = ({p for r in self.running for p in r.own} | {n.page for n in self._nodes()} | set(self._free))
        for i, page in enumerate(pages[:full]):
            if not (isinstance(page, int) and 0 <= page < self.num_pages) or page in pages[:i]:
                raise ValueError(f"PrefixCache.insert: page {page!r} is not a page of the pool, or it appears twice")
            if page in held and not (i < len(cached) and cached[i] == page):
                raise ValueError(f"PrefixCache.insert: page {page} is free, cached or held by a running request; "
                                 "insert pages from allocate()")
        node, out = self.root, []
        for i in range(full):
            key = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            child = node.children.get(key)
            if child is None:
                child = self._add_node(node, key, pages[i])
            elif child.page != pages[i]:
                self._free.append(pages[i])
            node = child
            out.append(node.page)
        self._touch(node)
        return out

    # ---- requests ----

    def start(self, tokens):
        """A running request for ``tokens`` (its prompt): the cached prefix shared, a page diverging inside
        copied (copy_page), own pages allocated for the rest (the caller prefills
        ``tokens[request.cached_tokens:]`` into them)."""
        tokens = _token_list("start", tokens)
        request = Request(list(tokens))
        node = self.root
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            child = node.children.get(tuple(tokens[start:start + self.page_size]))
            if child is None:
                break
            node = child
            request.path.append(node)
        for n in request.path:
            n.refs += 1
        request.cached_tokens = len(request.path) * self.page_size
        self._touch(node)
        rest = len(tokens) - request.cached_tokens
        needed = -(-rest // self.page_size)
        # a cached page that begins with the next tokens: copy-on-write (the request will write after them)
        shared, source = 0, None
        remaining = tokens[request.cached_tokens:]
        for key, child in node.children.items():
            common = _common_prefix(key, remaining)
            if common > shared:
                shared, source = common, child
        try:
            request.own = self.allocate(max(needed, 1 if shared else 0))
            if shared and self.copy_page is not None:
                self.copy_page(source.page, request.own[0])
        except BaseException:  # out of pages, or the copy failed: nothing held, nothing leaked
            self._free.extend(reversed(request.own))
            for n in request.path:
                n.refs -= 1
            raise
        if shared:
            request.cached_tokens += shared
            source.last_use = self._clock
        if self._free_slots:
            request._slot = self._free_slots.pop()
        else:
            request._slot = len(self._slot_tokens)
            self._slot_last.append(-1)
            self._slot_tokens.append(-1)
        request._cache = self
        self._slot_tokens[request._slot] = len(request.tokens)
        self._link(request)
        self.running.append(request)
        return request

    def append(self, request, n=1):
        """n more tokens for a running request (their ids, or n placeholders -1 to be set later):
        allocates the pages they need."""
        self._check_running("append", request)
        if isinstance(n, int) and not isinstance(n, bool) and n < 0:
            raise ValueError(f"PrefixCache.append: n must be a non-negative int or token ids, got {n}")
        new = _token_list("append", n) if not isinstance(n, int) else [-1] * n
        needed = -(-(request.kv_tokens + len(new)) // self.page_size) - len(request.pages)
        if needed > 0:
            request.own += self.allocate(needed)
            self._link(request)
        request.tokens += new
        self._slot_tokens[request._slot] = request.kv_tokens

    def publish(self, request):
        """Cache the request's full pages (their tokens must be final): they become tree nodes, shared by
        later requests; where the same tokens are cached already, the request switches to that page."""
        self._check_running("publish", request)
        if request.evicted:
            raise ValueError("PrefixCache.publish: the request was compressed (compact): its KV is no longer that "
                             "of its tokens, so it cannot be shared")
        if any(t < 0 for t in request.tokens):
            raise ValueError("PrefixCache.publish: the request has placeholder tokens (-1); set them first")
        node = request.path[-1] if request.path else self.root
        full = len(request.tokens) // self.page_size
        while len(request.path) < full:
            i = len(request.path)
            key = tuple(request.tokens[i * self.page_size:(i + 1) * self.page_size])
            page = request.own.pop(0)
            child = node.children.get(key)
            if child is None:
                child = self._add_node(node, key, page)
            else:
                self._free.append(page)
            child.refs += 1
            request.path.append(child)
            node = child
        self._link(request)
        self._touch(node)

    def finish(self, request):
        """Publish the request's full pages, release its path and cache its partial last page as a leaf (a
        compressed request: free its pages)."""
        if request.evicted:
            self._check_running("finish", request)
            self._free.extend(reversed(request.own))
            request.own = []
        else:
            self.publish(request)
        for n in request.path:
            n.refs -= 1
        if request.own:  # one partial page: a leaf, unless the same tokens are cached there already
            node = request.path[-1] if request.path else self.root
            key = tuple(request.tokens[len(request.path) * self.page_size:])
            if key in node.children:
                self._free.append(request.own[0])
            else:
                self._add_node(node, key, request.own[0]).last_use = self._clock
        request.own, request.finished = [], True
        self.running.remove(request)
        self._slot_tokens[request._slot] = -1
        self._free_slots.append(request._slot)
        request._slot = -1

    def compact(self, requests, paged_kv_cache, kept, kept_indptr, kv_layout="NHD", scores=None):
        """KV-cache compression of running requests (:func:`flashkern.kv_compress.compact`): kept and
        kept_indptr from :func:`~flashkern.kv_compress.select_keys` over ``plan_decode(requests)``'s page
        table (requests in that order; scores, if given, move with the keys). Each request's kept keys and
        values move into fresh pages, which become its own: the pages it shares are never written and stay
        cached for the other requests; its path is released, its old own pages freed. Returns the batch's
        new DecodePlan."""
        from .kv_compress import compact

        plan = self.plan_decode(requests)  # checks: each running in this cache, once
        if not isinstance(kept_indptr, torch.Tensor) or kept_indptr.shape != (len(requests) + 1,):
            raise ValueError(f"PrefixCache.compact: kept_indptr must be a tensor of {len(requests) + 1} entries (one "
                             "more than the requests)")
        counts = kept_indptr.cpu().long().diff()
        need = (counts.clamp_min(0) + self.page_size - 1) // self.page_size
        pages = self.allocate(int(need.sum()))  # evicts only unreferenced leaves: none of these requests' pages
        device = kept_indptr.device
        out_indptr = torch.cat([need.new_zeros(1), need.cumsum(0)])
        try:
            compact(paged_kv_cache, *(x.to(device) for x in plan), kept, kept_indptr, kv_layout, scores,
                    out_indptr.to(torch.int32).to(device), torch.tensor(pages, dtype=torch.int32, device=device))
        except BaseException:  # a bad argument: nothing moved, nothing held
            self._free.extend(reversed(pages))
            raise
        for b, request in enumerate(requests):  # the cache learns the new page lists
            for n in request.path:
                n.refs -= 1
            self._free.extend(reversed(request.own))  # after the copy on the stream: a later writer is ordered after it
            request.evicted += request.kv_tokens - int(counts[b])
            request.path, request.own = [], pages[int(out_indptr[b]) : int(out_indptr[b + 1])]
            self._slot_tokens[request._slot] = request.kv_tokens
            self._link(request)
        return self.plan_decode(requests)

    def _add_node(self, parent, key, page):
        node = parent.children[key] = _Node(key, page, parent)
        self._prev[page] = parent.page
        return node

    def _link(self, request):
        """prev of the request's own pages (each after the one before it in its page table) and its last page."""
        before = request.path[-1].page if request.path else -1
        for page in request.own:
            self._prev[page] = before
            before = page
        self._slot_last[request._slot] = before

    def _check_running(self, op, request):
        if request._cache is not self or request.finished:
            raise ValueError(f"PrefixCache.{op}: the request is not running in this cache")

    # ---- planning ----

    def plan_decode(self, requests):
        """The flat page table of the batch: each request's whole KV in one level."""
        (level,), _ = self._plan("plan_decode", _C.plan_prefix_decode, requests, None, 1)
        return DecodePlan(*(_int32(x) for x in (level[1], level[2], level[3])))

    def plan_cascade(self, requests, max_levels=8, qo_lens=None):
        """The cascade levels of the batch: each run of tree nodes shared by the same two or more requests
        is one group's KV at the level of its depth (runs shared by more requests above); a request's
        other pages (its unshared nodes and its own pages) form its last level. With more levels than
        max_levels, the adjacent pair whose merge reads the fewest more KV tokens is merged, until they
        fit. qo_lens: query tokens per request (default 1: decode), in ``requests``' order. In batch-invariant
        mode (flashkern.invariance) it raises ValueError: a request's levels follow which other requests
        share its prefix; plan_decode's flat tables are invariant."""
        if invariance.is_batch_invariant():
            raise ValueError("PrefixCache.plan_cascade: in batch-invariant mode a request's cascade levels would depend "
                             "on which other requests share its prefix; use plan_decode (flat page tables)")
        if not isinstance(max_levels, int) or not 1 <= max_levels <= 8:
            raise ValueError(f"plan_cascade: max_levels must be 1 to 8, got {max_levels!r}")
        if qo_lens is not None:
            qo_lens = list(qo_lens)
            if len(qo_lens) != len(requests) or not all(isinstance(q, int) and q >= 0 for q in qo_lens):
                raise ValueError(f"plan_cascade: qo_lens must be {len(requests)} non-negative ints, one per request")
        levels, order = self._plan("plan_cascade", _C.plan_prefix_cascade, requests, qo_lens, max_levels)
        return CascadePlan(*([_int32(level[i]) for level in levels] for i in range(4)), _int32(order).tolist())

    def _plan(self, op, planner, requests, qo_lens, max_levels):
        """The C++ planner over the requests' slots (it checks that each is running, once)."""
        slots = array("i", [r._slot for r in requests if r._cache is self])
        if len(slots) != len(requests):
            raise ValueError(f"PrefixCache.{op}: every request must be running in this cache")
        qo = array("i", qo_lens) if qo_lens is not None else None
        try:
            return planner(self._prev.buffer_info()[0], self.num_pages, self.page_size, slots.buffer_info()[0],
                           len(slots), self._slot_last.buffer_info()[0], self._slot_tokens.buffer_info()[0],
                           len(self._slot_tokens), qo.buffer_info()[0] if qo is not None else 0, max_levels)
        except ValueError as e:
            raise ValueError(f"PrefixCache.{op}: {e}") from None

    def kv_tokens_read(self, plan):
        """Tokens of KV a plan (CascadePlan or DecodePlan) reads: every group's pages once."""
        if isinstance(plan, DecodePlan):
            levels = [(plan.indptr, plan.last_page_len)]
        else:
            levels = zip(plan.paged_kv_indptr_arr, plan.paged_kv_last_page_len_arr)
        total = 0
        for indptr, last in levels:
            pages = (indptr[1:] - indptr[:-1]).long()
            total += int(((pages - 1).clamp_min(0) * self.page_size + torch.where(pages > 0, last.long(), 0)).sum())
        return total


def _int32(buffer):
    return torch.frombuffer(buffer, dtype=torch.int32) if len(buffer) else torch.empty(0, dtype=torch.int32)


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _token_list(op, tokens):
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() != 1:
            raise TypeError(f"PrefixCache.{op}: tokens must be a 1-D int32 or int64 tensor, got {tokens.dtype} "
                            f"of shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    tokens = list(tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise TypeError(f"PrefixCache.{op}: tokens must be ints")
    if any(t < 0 for t in tokens):  # -1 marks a placeholder (append(n)); a token id is never negative
        raise ValueError(f"PrefixCache.{op}: token ids must be non-negative, got {min(tokens)}")
    return tokens
