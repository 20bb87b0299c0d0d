// How batch attention over a paged KV cache is cut into work, shared by the host planner
// (attention_plan.h), the kernels and the CPU executor of a plan (python/flashkern/_paged.py).
//
// A level is a set of groups; group j's queries qo_indptr[j]..qo_indptr[j+1] all attend to the
// same KV: the pages kv_indices[kv_indptr[j]..kv_indptr[j+1]], the last one holding
// last_page_len[j] tokens (batch decode: one level, a group per request; cascade: level 0 is the
// prefix shared by the most requests). Per KV head the rows of a group are its (query, q head of
// the GQA group) pairs, query-major. A work item is one block's job: a tile of a group's rows
// over a chunk of its KV (split-KV), for every KV head (blockIdx.y). A query's state in each chunk
// it sees (causal and sliding-window masks hide whole chunks from some queries) goes to the query's
// output when it is the query's only state, else to a slot of partial states; the merge kernel
// combines a query's slots, over every level and chunk. Only queries that merge have slots.
//
// The plan lives in the caller's workspace, so that run() only launches kernels (and a CUDA
// graph replays whatever the last plan() wrote): an int32 region of header, items and merge
// lists, then the fp32 partial states.
#pragma once

#include <cstdint>

#include "flashkern/platform.h"

namespace fk {

// The three kernels a work item can be for (kernels/batch_attention.cuh).
enum class AttentionKind : int32_t {
  decode = 0,   // one query, GQA group of at most kDecodeMaxGroup heads: CUDA cores, heads in registers
  tile16 = 1,   // at most 16 rows: the multi-query (matrix-unit) kernel, warps splitting the KV tile
  tile64 = 2,   // more rows: the multi-query kernel, 64-row tiles
};
inline constexpr int kAttentionKinds = 3;
inline constexpr int kDecodeMaxGroup = 4;
inline constexpr int kMaxLevels = 8;  // cascade levels: kv_indices pointers travel in the params
inline constexpr int32_t kNoDiagonal = int32_t(1) << 30;  // above every token index: no causal or window limit

FK_HOST_DEVICE int kind_rows(AttentionKind kind) {
  return kind == AttentionKind::tile64 ? 64 : kind == AttentionKind::tile16 ? 16 : kDecodeMaxGroup;
}

// Head dims above this run only 16-row tiles: a 64-row tile's q alone would fill HIP's 64 KB, and
// the decode kernel's sub-warp of head_dim / 8 lanes would be wider than a warp (design.md).
inline constexpr int kMaxWideHeadDim = 256;

// The kernel for a group of n_q queries with GQA groups of `group` q heads (its rows: n_q * group).
FK_HOST_DEVICE AttentionKind attention_kind(int64_t n_q, int64_t group, int head_dim) {
  if (head_dim > kMaxWideHeadDim) return AttentionKind::tile16;  // as many 16-row tiles as it takes
  if (n_q == 1 && group <= kDecodeMaxGroup) return AttentionKind::decode;
  return n_q * group <= kind_rows(AttentionKind::tile16) ? AttentionKind::tile16 : AttentionKind::tile64;
}

struct AttentionWorkItem {
  int32_t level;          // which kv_indices
  int32_t q_begin;        // the group's first query
  int32_t n_q;            // its number of queries
  int32_t row_begin;      // first row of this item's tile, in [0, n_q * group)
  int32_t page_begin;     // the group's first entry of kv_indices[level]
  int32_t kv_begin;       // this chunk's tokens: [kv_begin, kv_end) of the group's sequence
  int32_t kv_end;
  int32_t slot_base;      // query t's state slot for this chunk is slot_base + t (used only if t merges)
  int32_t first;          // query i of the group sees the tokens i + first <= j <= i + last: a sliding
  int32_t last;           //   window (else -kNoDiagonal) and the causal diagonal (else kNoDiagonal)
  int32_t mask;           // the group's custom mask starts at this bit (row i, token j: mask + i * length + j); -1: none
  int32_t length;         // the group's tokens
};
static_assert(sizeof(AttentionWorkItem) == 48, "items are copied to the device as int32 words");
inline constexpr int kItemWords = 12;

// The tokens [visible_begin, visible_end) a row of query i (of the item's group) may see in the
// item's chunk: causally, the group's queries are its last tokens, so query i sees up to token
// i + last (last = length - n_q); a sliding window of w tokens hides those before i + last - w.
// Empty (begin >= end) when the query sees nothing in the chunk.
FK_HOST_DEVICE int32_t visible_end(const AttentionWorkItem& item, int32_t i) {
  const int64_t end = int64_t(i) + item.last + 1;
  return end < item.kv_end ? int32_t(end) : item.kv_end;
}
FK_HOST_DEVICE int32_t visible_begin(const AttentionWorkItem& item, int32_t i) {  // in [kv_begin, kv_end]
  const int64_t begin = int64_t(i) + item.first;
  return begin <= item.kv_begin ? item.kv_begin : begin < item.kv_end ? int32_t(begin) : item.kv_end;
}
// Whether query i has any token of the chunk to see (then the item writes its state).
FK_HOST_DEVICE bool sees_chunk(const AttentionWorkItem& item, int32_t i) {
  return visible_begin(item, i) < visible_end(item, i);
}

// The first word of a plan: a workspace without it holds no plan (the CPU paths raise on that).
inline constexpr int32_t kPlanMagic = 0x4C504B46;  // "FKPL"

// The int32 words at the start of the workspace.
struct PlanHeader {
  int32_t magic;                    // kPlanMagic
  int32_t count[kAttentionKinds];   // items of each kind
  int32_t items[kAttentionKinds];   // where each kind's items start (words from the workspace start)
  int32_t merge_indptr;             // [batch + 1]: query t's states are merge_indices[indptr[t]..indptr[t+1]]
  int32_t merge_indices;            // their slots (-1 for a query with one state: it has no slot)
  int32_t states;                   // entries of merge_indices
  int32_t batch;
  int32_t identity_levels;          // bit l: level l's kv_indices is the identity (page e is entry e; ragged KV)
  int32_t reserved[4];
};
static_assert(sizeof(PlanHeader) == 64, "the header is 16 words");
inline constexpr int kHeaderWords = 16;

// Where things are in a workspace of `bytes` for this problem shape: the int32 region holds the
// header, up to item_capacity items and the merge lists of `batch` queries (up to slot_capacity +
// batch states: a query with one state has no slot); then slot_capacity partial states (s:
// [slots, qo_heads] fp32, v: [slots, qo_heads, head_dim] fp32). Depends on the shape only, never
// on the plan: run() is the same launch for every plan of a shape.
//
// Items need no room of their own beyond items_per_state() per slot and per query: an item has a
// query that sees its chunk; if that query merges, the item holds one of its slots, which at most
// that many items share (a query's rows straddle two 64-row tiles, or more for a GQA group of over
// 64 heads; 16-row tiles at head dims above kMaxWideHeadDim); if not, the query has one state, in at
// most that many items.
struct WorkspaceLayout {
  int64_t int_words;
  int64_t item_capacity;
  int64_t slot_capacity;
  int64_t partial_s_offset;  // bytes
  int64_t partial_v_offset;  // bytes
};

FK_HOST_DEVICE int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The most row tiles that one query's rows (one per head of its GQA group, at most qo_heads) touch:
// 64-row tiles, or 16-row ones at head dims above kMaxWideHeadDim (attention_kind).
FK_HOST_DEVICE int64_t items_per_state(int64_t qo_heads, int64_t head_dim) {
  return 2 + qo_heads / (head_dim > kMaxWideHeadDim ? 16 : 64);
}

// Per slot: its items, a merge index and the state.
FK_HOST_DEVICE int64_t workspace_slot_bytes(int64_t qo_heads, int64_t head_dim) {
  return 4 * (items_per_state(qo_heads, head_dim) * kItemWords + 1) + 4 * qo_heads * (head_dim + 1);
}
// Per query: its items, the merge_indptr entry and a merge index; plus the header and alignment.
FK_HOST_DEVICE int64_t workspace_fixed_bytes(int64_t batch, int64_t qo_heads, int64_t head_dim) {
  return 4 * (kHeaderWords + 1 + batch * (items_per_state(qo_heads, head_dim) * kItemWords + 2)) + 3 * 256;
}

// The bytes a workspace needs for `slots` partial states (the inverse of workspace_layout).
FK_HOST_DEVICE int64_t workspace_bytes(int64_t slots, int64_t batch, int64_t qo_heads, int64_t head_dim) {
  return workspace_fixed_bytes(batch, qo_heads, head_dim) + slots * workspace_slot_bytes(qo_heads, head_dim);
}

FK_HOST_DEVICE WorkspaceLayout workspace_layout(int64_t bytes, int64_t batch, int64_t qo_heads, int64_t head_dim) {
  const int64_t per_slot = workspace_slot_bytes(qo_heads, head_dim);
  const int64_t fixed = workspace_fixed_bytes(batch, qo_heads, head_dim);
  WorkspaceLayout w{};
  w.slot_capacity = bytes >= fixed ? (bytes - fixed) / per_slot : 0;
  w.item_capacity = bytes >= fixed ? items_per_state(qo_heads, head_dim) * (w.slot_capacity + batch) : 0;
  w.int_words = kHeaderWords + kItemWords * w.item_capacity + batch + 1 + w.slot_capacity + batch;
  w.partial_s_offset = align_up(4 * w.int_words, 256);
  w.partial_v_offset = align_up(w.partial_s_offset + 4 * w.slot_capacity * qo_heads, 256);
  return w;
}

}  // namespace fk
