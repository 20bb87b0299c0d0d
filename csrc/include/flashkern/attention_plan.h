// The host planner of batch attention (attention_work.h): validates the page tables, chooses how
// finely to split the KV (split-KV) and writes the plan the kernels read. Host code only; called
// by plan() of the Python wrappers through flashkern._C.plan_attention, and checked on the CPU
// by tests/test_attention_plan.py and by every test that runs a plan.
//
// Splitting: a block's cost is about the KV tokens it reads, so the chunk length is the total
// work over the number of blocks the device holds at once (cta_budget): every block then gets
// about the same share and a long shared prefix is cut into as many chunks as it needs, while a
// batch that fills the device already is not split at all. Chunks are multiples of 64 tokens
// (the kernels' KV tiles) and at least min_chunk long; they grow further if the workspace cannot
// hold the items or the partial states. Items are sorted longest chunk first, so blocks that
// loop over several items (a graph-captured launch has a fixed grid) stay balanced.
//
// Batch-invariant plans (PlanShape::invariant, docs/design.md): a query's bits depend only on its
// own request. The chunk is min_chunk exactly, counted from each sequence's start, never chosen
// from the batch or the device nor grown to fit the workspace (that fails instead); a request's
// tile is chosen from its own queries, and the groups of shared levels, whose queries come from
// several requests, all take one fixed tile (a row's result does not depend on the other rows of
// its tile). Each query's states merge in level order, then chunk order, as in every plan.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "flashkern/attention_work.h"

namespace fk {

struct PlanLevel {
  const int32_t* qo_indptr;      // [groups + 1], or nullptr: group j is query j (batch decode)
  const int32_t* kv_indptr;      // [groups + 1]
  const int32_t* last_page_len;  // [groups]
  int64_t groups;
  int64_t num_indices;  // entries of this level's kv_indices (identity: pages of the cache)
  bool causal;          // a group's n queries are its last n tokens, each seeing the tokens up to itself
  int64_t window_left = -1;  // >= 0: query i also sees no token before i + length - n - window_left
  bool custom_mask = false;  // the groups' masks, row-major [n, length] bits, each from a byte of its own (causal ignored)
  bool identity = false;     // kv_indices is the identity, not given (ragged KV: a page per token)
};

struct PlanShape {
  int64_t batch;       // queries
  int64_t page_size;
  int64_t group_size;  // q heads per KV head
  int64_t kv_heads;
  int64_t head_dim;
  int64_t cta_budget;  // blocks the device runs at once
  int64_t min_chunk;   // tokens
  int64_t item_capacity, slot_capacity;  // workspace_layout()
  bool invariant = false;  // batch-invariant: chunk = min_chunk, tiles chosen per request (above)
  // The caller's names of qo_indptr, kv_indptr, kv_indices and kv_last_page_len, for messages;
  // `indexed`: one per level, named name[level].
  std::string names[4] = {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"};
  bool indexed = false;
};

struct PlanResult {
  std::string error;  // empty when the plan was written
  int64_t words = 0;  // int32 words of the plan at out[0..words)
  int32_t count[kAttentionKinds] = {0, 0, 0};
  int64_t slots = 0;
  int64_t chunk = 0;  // tokens per chunk (at least the longest sequence when nothing is split)
  bool needs_merge = false;
};

inline constexpr int64_t kMaxKvLength = int64_t(1) << 30;
static_assert(kNoDiagonal >= kMaxKvLength, "visible_end: no diagonal must leave every chunk whole");

namespace plan_detail {

struct Entry {  // a group with queries and KV at one level
  AttentionWorkItem whole;  // its item over all of its KV: level, queries, pages, first, last, mask, length
  AttentionKind kind;
  int64_t row_tiles;
  int32_t tile_rows;
};

enum Arg { kQoIndptr, kKvIndptr, kKvIndices, kLastPageLen };

inline std::string arg(const PlanShape& s, Arg a, int level) {
  return s.indexed ? s.names[a] + "[" + std::to_string(level) + "]" : s.names[a];
}

inline int64_t chunks_of(int64_t length, int64_t chunk) { return (length + chunk - 1) / chunk; }

// The item of entry e over chunk c.
inline AttentionWorkItem chunk_item(const Entry& e, int64_t c, int64_t chunk) {
  AttentionWorkItem item = e.whole;
  item.kv_begin = int32_t(c * chunk);
  item.kv_end = int32_t(std::min<int64_t>(e.whole.length, (c + 1) * chunk));
  return item;
}

// The tile of every group of a level above the last in a batch-invariant plan: its queries may come
// from several requests, so the tile cannot follow their number (the widest one the head_dim runs).
inline AttentionKind shared_level_kind(int64_t head_dim) {
  return head_dim > kMaxWideHeadDim ? AttentionKind::tile16 : AttentionKind::tile64;
}

// The chunks [lo, hi] query i of entry e sees (lo > hi: none).
inline void chunks_seen(const Entry& e, int32_t i, int64_t chunk, int64_t& lo, int64_t& hi) {
  const int32_t b = visible_begin(e.whole, i), end = visible_end(e.whole, i);
  lo = b / chunk, hi = b < end ? (end - 1) / chunk : lo - 1;
}

// The chunks a row tile of entry e sees: from the first of its first query that sees any to the
// last of its last query. Both ends of a query's tokens grow with i, so no chunk in between is skipped.
inline void tile_chunks(const Entry& e, int64_t t, int64_t chunk, int64_t group, int64_t& lo, int64_t& hi) {
  const int64_t row0 = t * e.tile_rows, row1 = std::min<int64_t>(row0 + e.tile_rows, int64_t(e.whole.n_q) * group);
  int64_t a_lo, a_hi;
  chunks_seen(e, int32_t((row1 - 1) / group), chunk, a_lo, hi);
  lo = 0;
  if (a_lo > hi) {  // the last query sees nothing, so neither does any before it
    hi = -1;
    return;
  }
  for (int64_t i = row0 / group;; ++i) {
    chunks_seen(e, int32_t(i), chunk, lo, a_hi);
    if (lo <= a_hi) return;
  }
}

// The range [a, b) of entry e's queries that see chunk c (the ends of what a query sees grow with i).
inline void queries_seeing(const Entry& e, int64_t c, int64_t chunk, int32_t& a, int32_t& b) {
  const AttentionWorkItem item = chunk_item(e, c, chunk);
  auto first_true = [&](auto pred) {  // the first i in [0, n_q] with pred(i), pred monotone
    int32_t lo = 0, hi = e.whole.n_q;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo) / 2;
      if (pred(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  };
  a = first_true([&](int32_t i) { return int64_t(i) + item.last + 1 > item.kv_begin; });  // ends past the chunk's start
  b = first_true([&](int32_t i) { return int64_t(i) + item.first >= item.kv_end; });      // starts past its end
  if (b < a) b = a;
}

}  // namespace plan_detail

// Writes the plan into out[0..out_words); out == nullptr: only says what it would need (words, counts, slots).
inline PlanResult plan_attention(const PlanLevel* levels, int num_levels, const PlanShape& s, int32_t* out,
                                 int64_t out_words) {
  using namespace plan_detail;
  PlanResult r;
  auto fail = [&](std::string message) {
    r.error = std::move(message);
    return r;
  };
  if (num_levels < 1 || num_levels > kMaxLevels)
    return fail("num_levels must be between 1 and " + std::to_string(kMaxLevels) + ", got " + std::to_string(num_levels));
  if (s.page_size < 1) return fail("page_size must be positive, got " + std::to_string(s.page_size));
  if (s.batch < 0 || s.batch >= kMaxKvLength) return fail("the batch must have fewer than 2^30 queries");

  // ---- validate each level and collect its groups
  std::vector<Entry> entries;
  int32_t identity_levels = 0, masked_levels = 0;
  for (int l = 0; l < num_levels; ++l) {
    const PlanLevel& lv = levels[l];
    if (lv.custom_mask && ++masked_levels > 1)  // the kernels take one mask tensor, its bits from 0
      return fail("at most one level may have a custom mask");
    const std::string qo = arg(s, kQoIndptr, l), kv = arg(s, kKvIndptr, l), last = arg(s, kLastPageLen, l);
    if (lv.identity) identity_levels |= 1 << l;
    // a shared level's tile holds other requests' rows, which decide where a masked row's KV tiles start
    if (s.invariant && l + 1 < num_levels && (lv.causal || lv.window_left >= 0 || lv.custom_mask))
      return fail("a batch-invariant plan takes causal order, windows and masks on the last level only");
    if (lv.qo_indptr != nullptr) {
      if (lv.qo_indptr[0] != 0) return fail(qo + "[0] must be 0, got " + std::to_string(lv.qo_indptr[0]));
      if (lv.qo_indptr[lv.groups] != s.batch)
        return fail(qo + "[-1] must be the number of queries " + std::to_string(s.batch) + ", got " +
                    std::to_string(lv.qo_indptr[lv.groups]));
    } else if (lv.groups != s.batch) {
      return fail(kv + " must have batch + 1 = " + std::to_string(s.batch + 1) + " entries, got " +
                  std::to_string(lv.groups + 1));
    }
    if (lv.kv_indptr[0] < 0) return fail(kv + "[0] must be >= 0, got " + std::to_string(lv.kv_indptr[0]));
    if (lv.kv_indptr[lv.groups] > lv.num_indices)
      return fail(kv + "[-1] = " + std::to_string(lv.kv_indptr[lv.groups]) + " points past the " +
                  std::to_string(lv.num_indices) + " entries of " + arg(s, kKvIndices, l));
    int64_t mask_bits = 0;
    for (int64_t j = 0; j < lv.groups; ++j) {
      const int64_t q0 = lv.qo_indptr ? lv.qo_indptr[j] : j, q1 = lv.qo_indptr ? lv.qo_indptr[j + 1] : j + 1;
      if (q1 < q0)
        return fail(qo + " must be non-decreasing, got " + qo + "[" + std::to_string(j + 1) + "] = " +
                    std::to_string(q1) + " < " + std::to_string(q0));
      const int64_t p0 = lv.kv_indptr[j], p1 = lv.kv_indptr[j + 1];
      if (p1 < p0)
        return fail(kv + " must be non-decreasing, got " + kv + "[" + std::to_string(j + 1) + "] = " +
                    std::to_string(p1) + " < " + std::to_string(p0));
      const int64_t pages = p1 - p0, lp = lv.last_page_len[j];
      if (pages > 0 && (lp < 1 || lp > s.page_size))
        return fail(last + "[" + std::to_string(j) + "] must be in [1, page_size=" + std::to_string(s.page_size) +
                    "] for a request with pages, got " + std::to_string(lp));
      if (pages == 0 && lp != 0)
        return fail(last + "[" + std::to_string(j) + "] must be 0 for a request without pages, got " +
                    std::to_string(lp));
      const int64_t length = pages > 0 ? (pages - 1) * s.page_size + lp : 0;
      if (length >= kMaxKvLength)  // room for the kernels' look-ahead past a chunk in int32
        return fail("request " + std::to_string(j) + " of " + kv + " has " + std::to_string(length) +
                    " tokens; at most 2^30 - 1 are supported");
      const int64_t n_q = q1 - q0, mask = mask_bits;
      mask_bits += align_up(n_q * length, 8);  // each group's mask starts on a byte (FlashInfer's packed masks)
      if (lv.custom_mask && mask_bits >= (int64_t(1) << 31))
        return fail("the custom masks of " + kv + " hold " + std::to_string(mask_bits) +
                    " bits or more; fewer than 2^31 are supported");
      if (n_q * s.group_size >= (int64_t(1) << 31))
        return fail("request " + std::to_string(j) + " of " + qo + " has " + std::to_string(n_q) + " queries of " +
                    std::to_string(s.group_size) + " heads; fewer than 2^31 rows a request are supported");
      if (length == 0 || n_q == 0) continue;  // nothing to attend to, or nobody attending: no state
      const int64_t diagonal = length - n_q;  // query i is token i + diagonal
      const int64_t first = lv.window_left >= 0 ? std::max(diagonal - lv.window_left, -int64_t(kNoDiagonal))
                                                 : -int64_t(kNoDiagonal);
      const bool causal = lv.causal && !lv.custom_mask;
      Entry e{};
      e.whole = {int32_t(l), int32_t(q0), int32_t(n_q), 0, int32_t(p0), 0, int32_t(length), 0, int32_t(first),
                 causal ? int32_t(diagonal) : kNoDiagonal, lv.custom_mask ? int32_t(mask) : -1, int32_t(length)};
      e.kind = s.invariant && l + 1 < num_levels ? shared_level_kind(s.head_dim)
                                                 : attention_kind(n_q, s.group_size, int(s.head_dim));
      if (lv.custom_mask && e.kind == AttentionKind::decode) e.kind = AttentionKind::tile16;  // only tiles read masks
      e.tile_rows = kind_rows(e.kind);
      e.row_tiles = e.kind == AttentionKind::decode ? 1 : (n_q * s.group_size + e.tile_rows - 1) / e.tile_rows;
      entries.push_back(e);
    }
  }

  // ---- chunk length: the work spread evenly over the blocks the device runs at once
  int64_t max_length = 0, work = 0;
  for (const Entry& e : entries) {
    max_length = std::max<int64_t>(max_length, e.whole.length);
    for (int64_t t = 0; t < e.row_tiles; ++t) {  // the tokens its rows see, as whole tiles
      int64_t lo, hi;
      tile_chunks(e, t, 1, s.group_size, lo, hi);
      work += std::max<int64_t>(hi - lo + 1, 0) * s.kv_heads;
    }
  }
  const int64_t top = align_up(std::max<int64_t>(max_length, 1), 64);
  std::vector<int32_t> states(s.batch, 0);  // per query: the chunks it sees, over all levels
  auto count_states = [&](int64_t chunk) {
    std::fill(states.begin(), states.end(), 0);
    for (const Entry& e : entries)
      for (int32_t i = 0; i < e.whole.n_q; ++i) {
        int64_t lo, hi;
        chunks_seen(e, i, chunk, lo, hi);
        states[e.whole.q_begin + i] += int32_t(std::max<int64_t>(hi - lo + 1, 0));
      }
  };
  // The queries of entry e that see chunk c and merge: [ma, mb] (ma > mb: none); they take slots.
  auto merging = [&](const Entry& e, int64_t c, int64_t chunk, int32_t& ma, int32_t& mb) {
    int32_t a, b;
    queries_seeing(e, c, chunk, a, b);
    ma = a, mb = b - 1;
    while (ma <= mb && states[e.whole.q_begin + ma] < 2) ++ma;
    while (mb >= ma && states[e.whole.q_begin + mb] < 2) --mb;
  };
  auto demand = [&](int64_t chunk, int64_t& items, int64_t& slots) {
    items = slots = 0;
    count_states(chunk);
    for (const Entry& e : entries) {
      for (int64_t t = 0; t < e.row_tiles; ++t) {
        int64_t lo, hi;
        tile_chunks(e, t, chunk, s.group_size, lo, hi);
        items += std::max<int64_t>(hi - lo + 1, 0);
      }
      for (int64_t c = 0; c < chunks_of(e.whole.length, chunk); ++c) {
        int32_t ma, mb;
        merging(e, c, chunk, ma, mb);
        slots += std::max(mb - ma + 1, 0);
      }
    }
    return items <= s.item_capacity && slots <= s.slot_capacity;
  };
  const int64_t share = s.invariant ? 1 : (work + s.cta_budget - 1) / std::max<int64_t>(s.cta_budget, 1);
  int64_t chunk = std::min(align_up(std::max(std::max<int64_t>(1, share), s.min_chunk), 64), top);
  int64_t items = 0, slots = 0;
  const bool fits = demand(chunk, items, slots);
  if (!fits && s.invariant)
    return fail("the workspace is too small for this batch-invariant plan: at its fixed chunk of " +
                std::to_string(chunk) + " tokens it needs room for " + std::to_string(slots) + " partial states and " +
                std::to_string(items) + " work items, it holds " + std::to_string(s.slot_capacity) + " and " +
                std::to_string(s.item_capacity) + " (a batch-invariant chunk never grows to fit; give a larger "
                "workspace_buffer)");
  if (!fits) {  // the smallest chunk, a multiple of 64, that fits the workspace
    int64_t lo = chunk, hi = top;
    if (!demand(hi, items, slots))
      return fail("the workspace is too small for this batch: it needs room for " + std::to_string(slots) +
                  " partial states and " + std::to_string(items) + " work items, it holds " +
                  std::to_string(s.slot_capacity) + " and " + std::to_string(s.item_capacity));
    while (hi - lo > 64) {
      const int64_t mid = align_up((lo + hi) / 2, 64);
      if (mid >= hi) break;
      if (demand(mid, items, slots)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    chunk = hi;
    demand(chunk, items, slots);
  }
  const int64_t batch = s.batch;
  int64_t total_states = 0;
  for (int32_t n : states) total_states += n;
  const int64_t words = kHeaderWords + kItemWords * items + batch + 1 + total_states;
  r.words = words, r.slots = slots, r.chunk = chunk;
  for (int32_t n : states) r.needs_merge = r.needs_merge || n != 1;
  if (out == nullptr) {  // a dry run: what the plan needs (workspace_size()), nothing written
    for (const Entry& e : entries)
      for (int64_t t = 0; t < e.row_tiles; ++t) {
        int64_t lo, hi;
        tile_chunks(e, t, chunk, s.group_size, lo, hi);
        r.count[int(e.kind)] += int32_t(std::max<int64_t>(hi - lo + 1, 0));
      }
    return r;
  }
  if (words >= (int64_t(1) << 31)) return fail("the plan needs 2^31 int32 words or more; split the batch");
  if (words > out_words) return fail("internal: the plan buffer is too small");

  // ---- items, slots and merge lists
  PlanHeader h{};
  int64_t at = kHeaderWords + kItemWords * items;
  h.merge_indptr = int32_t(at);
  int32_t* indptr = out + at;
  indptr[0] = 0;
  for (int64_t q = 0; q < batch; ++q) indptr[q + 1] = indptr[q] + states[q];
  at += batch + 1;
  h.merge_indices = int32_t(at);
  int32_t* indices = out + at;
  std::vector<int32_t> cursor(indptr, indptr + batch);
  std::vector<AttentionWorkItem> by_kind[kAttentionKinds];
  int32_t next_slot = 0;
  for (const Entry& e : entries) {
    std::vector<int32_t> slot_base(chunks_of(e.whole.length, chunk));
    for (int64_t c = 0; c < int64_t(slot_base.size()); ++c) {  // this entry's slots, chunk by chunk
      int32_t ma, mb;
      merging(e, c, chunk, ma, mb);
      slot_base[c] = next_slot - (e.whole.q_begin + ma);
      int32_t a, b;
      queries_seeing(e, c, chunk, a, b);
      for (int32_t i = a; i < b; ++i) {
        const int32_t t = e.whole.q_begin + i;
        indices[cursor[t]++] = states[t] >= 2 ? slot_base[c] + t : -1;
      }
      next_slot += std::max(mb - ma + 1, 0);
    }
    for (int64_t t = 0; t < e.row_tiles; ++t) {
      int64_t lo, hi;
      tile_chunks(e, t, chunk, s.group_size, lo, hi);
      for (int64_t c = lo; c <= hi; ++c) {
        AttentionWorkItem item = chunk_item(e, c, chunk);
        item.row_begin = int32_t(t * e.tile_rows);
        item.slot_base = slot_base[c];
        by_kind[int(e.kind)].push_back(item);
      }
    }
  }
  at = kHeaderWords;
  for (int k = 0; k < kAttentionKinds; ++k) {
    auto& list = by_kind[k];
    std::stable_sort(list.begin(), list.end(), [](const AttentionWorkItem& a, const AttentionWorkItem& b) {
      return a.kv_end - a.kv_begin > b.kv_end - b.kv_begin;
    });
    h.count[k] = int32_t(list.size());
    h.items[k] = int32_t(at);
    for (const AttentionWorkItem& item : list) {
      const int32_t* w = &item.level;
      std::copy(w, w + kItemWords, out + at);
      at += kItemWords;
    }
    r.count[k] = h.count[k];
  }
  h.states = int32_t(total_states);
  h.magic = kPlanMagic;
  h.batch = int32_t(batch);
  h.identity_levels = identity_levels;
  std::copy(reinterpret_cast<const int32_t*>(&h), reinterpret_cast<const int32_t*>(&h) + kHeaderWords, out);
  return r;
}

}  // namespace fk
