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
  int64_t num_indices;  // entries of this level's kv_indices
  bool causal;          // a group's n queries are its last n tokens, each seeing the tokens up to itself
};

struct PlanShape {
  int64_t batch;       // queries
  int64_t page_size;
  int64_t group_size;  // q heads per KV head
  int64_t kv_heads;
  int64_t cta_budget;  // blocks the device runs at once
  int64_t min_chunk;   // tokens
  int64_t item_capacity, slot_capacity;  // workspace_layout()
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
  int32_t level, q_begin, n_q, page_begin, diagonal;
  int64_t length;
  AttentionKind kind;
  int64_t row_tiles;
};

enum Arg { kQoIndptr, kKvIndptr, kKvIndices, kLastPageLen };

inline std::string arg(const PlanShape& s, Arg a, int level) {
  return s.indexed ? s.names[a] + "[" + std::to_string(level) + "]" : s.names[a];
}

inline int64_t chunks_of(int64_t length, int64_t chunk) { return (length + chunk - 1) / chunk; }

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
  if (s.batch < 0 || s.batch >= (int64_t(1) << 31)) return fail("the batch must have fewer than 2^31 queries");

  // ---- validate each level and collect its groups
  std::vector<Entry> entries;
  for (int l = 0; l < num_levels; ++l) {
    const PlanLevel& lv = levels[l];
    const std::string qo = arg(s, kQoIndptr, l), kv = arg(s, kKvIndptr, l), last = arg(s, kLastPageLen, l);
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
      if (length == 0 || q1 == q0) continue;  // nothing to attend to, or nobody attending: no state
      const AttentionKind kind = attention_kind(q1 - q0, s.group_size);
      const int64_t rows = (q1 - q0) * s.group_size, tile = kind_rows(kind);
      const int32_t diagonal = lv.causal ? int32_t(length - (q1 - q0)) : kNoDiagonal;
      entries.push_back({int32_t(l), int32_t(q0), int32_t(q1 - q0), int32_t(p0), diagonal, length, kind,
                         kind == AttentionKind::tile64 ? (rows + tile - 1) / tile : 1});
    }
  }

  // ---- chunk length: the work spread evenly over the blocks the device runs at once
  int64_t max_length = 0, work = 0;
  for (const Entry& e : entries) {
    max_length = std::max(max_length, e.length);
    work += e.row_tiles * e.length * s.kv_heads;
  }
  const int64_t top = align_up(std::max<int64_t>(max_length, 1), 64);
  auto demand = [&](int64_t chunk, int64_t& items, int64_t& slots) {
    items = slots = 0;
    for (const Entry& e : entries) {
      items += e.row_tiles * chunks_of(e.length, chunk);
      slots += int64_t(e.n_q) * chunks_of(e.length, chunk);
    }
    return items <= s.item_capacity && slots <= s.slot_capacity;
  };
  int64_t chunk = align_up(std::max(std::max<int64_t>(1, (work + s.cta_budget - 1) / std::max<int64_t>(s.cta_budget, 1)),
                                    s.min_chunk),
                           64);
  chunk = std::min(chunk, top);
  int64_t items = 0, slots = 0;
  if (!demand(chunk, items, slots)) {  // the smallest chunk, a multiple of 64, that fits the workspace
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
  const int64_t words = kHeaderWords + kItemWords * items + batch + 1 + slots;
  if (out == nullptr) {  // a dry run: what the plan needs (workspace_size()), nothing written
    for (const Entry& e : entries) r.count[int(e.kind)] += int32_t(e.row_tiles * chunks_of(e.length, chunk));
    r.words = words, r.slots = slots, r.chunk = chunk;
    return r;
  }
  if (words > out_words) return fail("internal: the plan buffer is too small");

  // ---- items and slots
  std::vector<AttentionWorkItem> by_kind[kAttentionKinds];
  std::vector<int32_t> per_query(batch + 1, 0);
  int32_t next_slot = 0;
  for (const Entry& e : entries) {
    const int64_t n_chunks = chunks_of(e.length, chunk);
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int32_t kv_begin = int32_t(c * chunk), kv_end = int32_t(std::min(e.length, (c + 1) * chunk));
      for (int64_t t = 0; t < e.row_tiles; ++t)
        by_kind[int(e.kind)].push_back({e.level, e.q_begin, e.n_q, int32_t(t * kind_rows(e.kind)), e.page_begin,
                                        kv_begin, kv_end, next_slot, e.diagonal, {0, 0, 0}});
      for (int32_t q = 0; q < e.n_q; ++q) ++per_query[e.q_begin + q + 1];
      next_slot += e.n_q;
    }
  }
  PlanHeader h{};
  int64_t at = kHeaderWords;
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
  h.merge_indptr = int32_t(at);
  int32_t* indptr = out + at;
  indptr[0] = 0;
  for (int64_t q = 0; q < batch; ++q) {
    indptr[q + 1] = indptr[q] + per_query[q + 1];
    r.needs_merge = r.needs_merge || per_query[q + 1] != 1;
  }
  at += batch + 1;
  h.merge_indices = int32_t(at);
  int32_t* indices = out + at;
  std::vector<int32_t> cursor(indptr, indptr + batch);
  next_slot = 0;
  for (const Entry& e : entries) {
    for (int64_t c = 0; c < chunks_of(e.length, chunk); ++c) {
      for (int32_t q = 0; q < e.n_q; ++q) indices[cursor[e.q_begin + q]++] = next_slot + q;
      next_slot += e.n_q;
    }
  }
  at += slots;
  h.slots = int32_t(slots);
  h.batch = int32_t(batch);
  std::copy(reinterpret_cast<const int32_t*>(&h), reinterpret_cast<const int32_t*>(&h) + kHeaderWords, out);
  r.words = at;
  r.slots = slots;
  r.chunk = chunk;
  return r;
}

}  // namespace fk
