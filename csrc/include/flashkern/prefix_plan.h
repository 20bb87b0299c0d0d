// The host planner of the prefix cache (python/flashkern/prefix_cache.py): turns a batch of running
// requests into the levels of MultiLevelCascadeAttentionWrapper, or into the flat page table of
// BatchDecodeWithPagedKVCacheWrapper. Host code only; called through flashkern._C.plan_prefix_cascade
// and plan_prefix_decode, checked by tests/test_prefix_cache.py.
//
// The cache describes every request by its last page and its token count: prev[page] is the page
// before it in the page table of whoever holds it (a tree node's parent, or a request's previous own
// page; -1 first), so a request's page table is the chain that ends at its last page, and two
// requests share exactly the pages their chains have in common, a prefix of both. Along a chain the
// number of requests holding a page never grows, and equal counts down a chain mean the same set of
// requests; so the pages held by two or more requests split into runs of equal count, each run one
// group's KV at the level of its depth (the pages of fewer requests deeper), and the rest of the chain
// is the request's own last level. Requests are ordered so that those sharing a run are adjacent.
// With more levels than allowed, the adjacent pair whose merge adds the fewest KV pages read is merged
// (a level's groups nest inside those of the level above, so the merged level has the deeper groups,
// each with its upper group's pages in front).
//
// Cost: each page of the batch's tree is walked once (a request's walk stops at the first page an
// earlier request walked), so planning is linear in the tree's pages plus the plan's output, not in
// the pages every request reads: the decode table copies shared prefixes it has written already.
// Levels hold only their groups with pages, a group's pages are a list shared with the levels it was
// merged from, and a merge recomputes the costs of its two neighbouring pairs only: a tree as deep
// as the batch is large (requests that are nested prefixes of one another) plans in O(n^2), the
// size of its plan, not O(n^3).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace fk {

struct PrefixPlanInput {
  const int32_t* prev;        // [num_pages]: the page before each page in its chain, -1 first
  int64_t num_pages;
  int64_t page_size;
  const int32_t* last_page;   // [n]: each request's last page (-1: no tokens)
  const int64_t* num_tokens;  // [n]
  const int32_t* qo_lens;     // [n] query tokens per request, or nullptr: one each (decode)
  int64_t n;
};

struct PrefixPlanLevel {
  std::vector<int32_t> qo_indptr, kv_indptr, kv_indices, last_page_len;
};

struct PrefixPlan {
  std::string error;  // empty when planned
  std::vector<PrefixPlanLevel> levels;
  std::vector<int32_t> order;  // the request (index into the input) of each query group, in layout order
};

// The batch's last pages and token counts, from the cache's arrays per request slot (slot_tokens -1:
// a free slot); the error names a request that is not running or that appears twice.
inline std::string gather_requests(const int32_t* slots, int64_t n, const int32_t* slot_last, const int64_t* slot_tokens,
                                   int64_t num_slots, std::vector<int32_t>& last, std::vector<int64_t>& tokens) {
  last.resize(n);
  tokens.resize(n);
  std::vector<bool> seen(num_slots, false);
  for (int64_t r = 0; r < n; ++r) {
    const int32_t slot = slots[r];
    if (slot < 0 || slot >= num_slots || slot_tokens[slot] < 0)
      return "request " + std::to_string(r) + " of the batch is not running in this cache";
    if (seen[slot]) return "request " + std::to_string(r) + " appears twice in the batch";
    seen[slot] = true;
    last[r] = slot_last[slot];
    tokens[r] = slot_tokens[slot];
  }
  return {};
}

namespace detail {

// Per-page scratch, as large as the pool, kept between calls (a pool has many more pages than a
// batch touches) and cleared again on the pages a call visited.
struct PageScratch {
  std::vector<int32_t> depth;      // position in its chains (-1: not visited, -2: being walked)
  std::vector<int32_t> count;      // requests of the batch whose chain holds the page
  std::vector<int32_t> run_key;    // the first page of its run (count >= 2)
  std::vector<int32_t> run_index;  // which run of the chain
  std::vector<int64_t> where;      // where the decode table holds it first
};

inline PageScratch& scratch() {
  static thread_local PageScratch s;
  return s;
}

// The union of the batch's chains: every page visited once, with its depth; per request the pages
// only it walked (visited[walk_start[r] .. walk_start[r + 1]), deepest first) and the page where its
// walk met an earlier one (junction[r], -1 at the root).
class Tree {
 public:
  explicit Tree(const PrefixPlanInput& in) : in(in), s(scratch()) {
    if (int64_t(s.depth.size()) < in.num_pages) {
      s.depth.resize(in.num_pages, -1);
      s.count.resize(in.num_pages, 0);
      s.run_key.resize(in.num_pages, -1);
      s.run_index.resize(in.num_pages, 0);
      s.where.resize(in.num_pages, 0);
    }
  }
  ~Tree() {
    for (int32_t page : visited) s.depth[page] = -1, s.count[page] = 0;
  }
  Tree(const Tree&) = delete;
  Tree& operator=(const Tree&) = delete;

  std::string walk() {
    const int64_t ps = in.page_size;
    if (ps < 1 || ps > std::numeric_limits<int32_t>::max()) return "page_size must be between 1 and 2^31 - 1";
    start.assign(in.n + 1, 0);
    for (int64_t r = 0; r < in.n; ++r) {
      const int64_t tokens = in.num_tokens[r], pages = tokens / ps + (tokens % ps != 0);
      if (tokens < 0 || pages > in.num_pages)
        return "request " + std::to_string(r) + " has " + std::to_string(tokens) + " tokens: not a page table of this pool";
      if (in.qo_lens != nullptr && in.qo_lens[r] < 0)
        return "request " + std::to_string(r) + " has a negative query length";
      start[r + 1] = start[r] + pages;
    }
    if (start[in.n] > std::numeric_limits<int32_t>::max()) return "the batch holds more than 2^31 - 1 pages";
    walk_start.assign(1, 0);
    junction.resize(in.n);
    for (int64_t r = 0; r < in.n; ++r) {
      const int64_t pages = start[r + 1] - start[r];
      int32_t page = in.last_page[r];
      int64_t steps = 0;
      for (; page >= 0 && page < in.num_pages && s.depth[page] == -1 && steps <= pages; ++steps) {
        visited.push_back(page);
        s.depth[page] = -2;
        page = in.prev[page];
      }
      const bool met = page >= 0 && page < in.num_pages && s.depth[page] >= 0;
      if ((page != -1 && !met) || (met ? s.depth[page] : -1) + 1 + steps != pages)
        return "request " + std::to_string(r) + "'s page table does not hold its " +
               std::to_string(in.num_tokens[r]) + " tokens (page " + std::to_string(in.last_page[r]) + ")";
      junction[r] = met ? page : -1;
      for (int64_t i = 0; i < steps; ++i) {
        const int32_t p = visited[walk_start[r] + i];
        s.depth[p] = int32_t(pages - 1 - i);
        s.where[p] = start[r] + pages - 1 - i;
      }
      walk_start.push_back(int64_t(visited.size()));
    }
    return {};
  }

  // count, then run_key / run_index: requests through a page are those ending there and those
  // through its children, so counts flow up the tree, deepest pages first (a counting sort by depth)
  void count_and_runs() {
    int32_t max_depth = -1;
    for (int32_t p : visited) max_depth = std::max(max_depth, s.depth[p]);
    std::vector<int64_t> at(max_depth + 2, 0);
    for (int32_t p : visited) ++at[s.depth[p] + 1];
    for (size_t d = 1; d < at.size(); ++d) at[d] += at[d - 1];
    std::vector<int32_t> by_depth(visited.size());
    for (int32_t p : visited) by_depth[at[s.depth[p]]++] = p;
    for (int64_t r = 0; r < in.n; ++r)
      if (in.last_page[r] >= 0) ++s.count[in.last_page[r]];
    for (auto it = by_depth.rbegin(); it != by_depth.rend(); ++it)
      if (in.prev[*it] >= 0) s.count[in.prev[*it]] += s.count[*it];
    for (int32_t p : by_depth) {
      if (s.count[p] < 2) continue;
      const int32_t up = in.prev[p];
      const bool same_run = up >= 0 && s.count[up] == s.count[p];  // counts never grow down a chain
      s.run_key[p] = same_run ? s.run_key[up] : p;
      s.run_index[p] = up < 0 ? 0 : s.run_index[up] + (same_run ? 0 : 1);
    }
  }

  const PrefixPlanInput& in;
  PageScratch& s;
  std::vector<int64_t> start;  // the decode table's offsets: start[r] .. start[r + 1] are request r's pages
  std::vector<int32_t> visited;
  std::vector<int64_t> walk_start;
  std::vector<int32_t> junction;
};

// The pages of a chain from `bottom` up to the page below `above` (-1: the root), in table order.
inline void append_chain(std::vector<int32_t>& out, const int32_t* prev, int32_t above, int32_t bottom) {
  const size_t first = out.size();
  for (int32_t p = bottom; p != above; p = prev[p]) out.push_back(p);
  std::reverse(out.begin() + first, out.end());
}

inline int32_t qo_len(const PrefixPlanInput& in, int64_t r) { return in.qo_lens ? in.qo_lens[r] : 1; }

inline int32_t last_page_len(const PrefixPlanInput& in, int64_t r, int64_t pages) {
  return int32_t(in.num_tokens[r] - (pages - 1) * in.page_size);
}

// The pages of a group while planning: a chain segment (the pages from `bottom` up to the page below
// `above`) or the concatenation of two lists, so that a merge shares its levels' lists instead of
// copying their pages; they are written out once, at the end.
struct PageList {
  int32_t first, second;  // concatenation of lists first + second, or -1
  int32_t above, bottom;  // a chain segment
  int64_t pages;
};

struct PageLists {
  std::vector<PageList> lists;
  int32_t segment(int32_t above, int32_t bottom, int64_t pages) {
    lists.push_back({-1, -1, above, bottom, pages});
    return int32_t(lists.size() - 1);
  }
  int32_t concat(int32_t a, int32_t b) {
    lists.push_back({a, b, -1, -1, lists[a].pages + lists[b].pages});
    return int32_t(lists.size() - 1);
  }
  void write(std::vector<int32_t>& out, const int32_t* prev, int32_t list) const {
    std::vector<int32_t> stack{list};  // depth-first, first before second
    while (!stack.empty()) {
      const PageList& l = lists[stack.back()];
      stack.pop_back();
      if (l.first >= 0) {
        stack.push_back(l.second);
        stack.push_back(l.first);
      } else {
        append_chain(out, prev, l.above, l.bottom);
      }
    }
  }
};

// A level while planning: its groups that have pages, in layout order; every request outside them
// is a group of its own without pages at this level. A level's groups nest inside the upper level's.
struct Group {
  int32_t begin, end;  // positions in the layout order
  int32_t list;        // PageLists index
};
using Level = std::vector<Group>;

// Calls f(lower group or a position of upper's group that no lower group covers, the upper group
// around it or nullptr) for the groups of merge(upper, lower), in order.
template <typename F>
void for_each_merged(const Level& upper, const Level& lower, F&& f) {
  size_t u = 0, g = 0;
  while (u < upper.size() || g < lower.size()) {
    if (u < upper.size() && (g == lower.size() || upper[u].begin < lower[g].end)) {
      const Group& up = upper[u];
      for (int32_t k = up.begin; k < up.end;) {  // up's range: lower groups and uncovered positions
        if (g < lower.size() && lower[g].begin == k) {
          f(lower[g], &up);
          k = lower[g++].end;
        } else {
          f(Group{k, k + 1, -1}, &up);
          ++k;
        }
      }
      ++u;
    } else {
      f(lower[g++], nullptr);
    }
  }
}

// Pages read more by merge(upper, lower) than by the two: each upper group's pages once per group
// of the lower level inside it, less once.
inline int64_t merge_cost(const PageLists& pl, const Level& upper, const Level& lower) {
  int64_t added = 0;
  for (const Group& up : upper) added -= pl.lists[up.list].pages;
  for_each_merged(upper, lower, [&](const Group&, const Group* up) {
    if (up != nullptr) added += pl.lists[up->list].pages;
  });
  return added;
}

// The level with each upper group's pages in front of the pages of each lower group inside it.
inline Level merge(PageLists& pl, const Level& upper, const Level& lower) {
  Level m;
  for_each_merged(upper, lower, [&](const Group& g, const Group* up) {
    m.push_back({g.begin, g.end, up == nullptr ? g.list : g.list < 0 ? up->list : pl.concat(up->list, g.list)});
  });
  return m;
}

}  // namespace detail

inline PrefixPlan plan_prefix_decode(const PrefixPlanInput& in) {
  PrefixPlan plan;
  detail::Tree tree(in);
  plan.error = tree.walk();
  if (!plan.error.empty()) return plan;
  PrefixPlanLevel level;
  level.kv_indptr.assign(tree.start.begin(), tree.start.end());
  std::vector<int32_t>& pages = level.kv_indices;
  pages.resize(tree.start[in.n]);
  for (int64_t r = 0; r < in.n; ++r) {
    int64_t i = tree.start[r];
    const int32_t j = tree.junction[r];
    if (j >= 0) {  // the prefix down to the junction, as an earlier request's table holds it
      const int64_t from = tree.s.where[j] - tree.s.depth[j];
      std::copy(pages.begin() + from, pages.begin() + tree.s.where[j] + 1, pages.begin() + i);
      i += tree.s.depth[j] + 1;
    }
    for (int64_t w = tree.walk_start[r + 1] - 1; w >= tree.walk_start[r]; --w) pages[i++] = tree.visited[w];
    const int64_t n = tree.start[r + 1] - tree.start[r];
    level.last_page_len.push_back(n ? detail::last_page_len(in, r, n) : 0);
  }
  plan.levels.push_back(std::move(level));
  plan.order.resize(in.n);
  std::iota(plan.order.begin(), plan.order.end(), 0);
  return plan;
}

inline PrefixPlan plan_prefix_cascade(const PrefixPlanInput& in, int max_levels) {
  PrefixPlan plan;
  if (max_levels < 1) {
    plan.error = "max_levels must be at least 1";
    return plan;
  }
  detail::Tree tree(in);
  plan.error = tree.walk();
  if (!plan.error.empty()) return plan;
  tree.count_and_runs();
  const int32_t* prev = in.prev;
  const std::vector<int32_t>& count = tree.s.count;
  const int64_t n = in.n;
  for (int64_t r = 0; r < n; ++r)  // a partial page is written by its request: never shared
    if (in.num_tokens[r] % in.page_size != 0 && count[in.last_page[r]] > 1) {
      plan.error = "page " + std::to_string(in.last_page[r]) + ", the partial last page of request " +
                   std::to_string(r) + ", is held by another request of the batch";
      return plan;
    }
  // Per request: its deepest shared page (-1: none) and the keys of its runs, from the root.
  std::vector<int32_t> deepest(n), keys;
  std::vector<int64_t> key_start(n + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    int32_t p = in.last_page[r];
    while (p >= 0 && count[p] < 2) p = prev[p];
    deepest[r] = p;
    const int64_t runs = p < 0 ? 0 : tree.s.run_index[p] + 1;
    keys.resize(key_start[r] + runs);
    for (int64_t l = runs - 1; l >= 0; --l) {  // the run above a run's key is the key's parent's run
      keys[key_start[r] + l] = tree.s.run_key[p];
      p = prev[keys[key_start[r] + l]];
    }
    key_start[r + 1] = int64_t(keys.size());
  }
  auto runs = [&](int64_t r) { return key_start[r + 1] - key_start[r]; };
  auto key = [&](int64_t r, int64_t l) { return keys[key_start[r] + l]; };
  // requests sharing a run are adjacent: order by the keys of their runs
  plan.order.resize(n);
  std::iota(plan.order.begin(), plan.order.end(), 0);
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int32_t a, int32_t b) {
    const int64_t common = std::min(runs(a), runs(b));
    for (int64_t l = 0; l < common; ++l)
      if (key(a, l) != key(b, l)) return key(a, l) < key(b, l);
    return runs(a) < runs(b);
  });
  int64_t depth = 0;
  for (int64_t r = 0; r < n; ++r) depth = std::max(depth, runs(r));
  detail::PageLists pl;
  std::vector<detail::Level> levels(depth + 1);
  for (int32_t k = 0; k < n; ++k) {
    const int64_t r = plan.order[k];
    for (int64_t l = 0; l < runs(r); ++l) {  // a run: from its key down to the next run's key, or the deepest shared
      detail::Level& level = levels[l];
      if (!level.empty() && level.back().end == k && key(plan.order[k - 1], l) == key(r, l)) {
        ++level.back().end;
        continue;
      }
      const int32_t bottom = l + 1 < runs(r) ? prev[key(r, l + 1)] : deepest[r];
      level.push_back({k, k + 1, pl.segment(prev[key(r, l)], bottom, tree.s.depth[bottom] - tree.s.depth[key(r, l)] + 1)});
    }
    if (in.last_page[r] != deepest[r])  // the request's own: the pages after the deepest shared one
      levels[depth].push_back({k, k + 1, pl.segment(deepest[r], in.last_page[r],
                                                    tree.s.depth[in.last_page[r]] - (deepest[r] < 0 ? -1 : tree.s.depth[deepest[r]]))});
  }
  // merge the cheapest adjacent pair until the levels fit; costs kept, the merged pair's neighbours redone
  std::vector<int64_t> cost(levels.size() > 1 ? levels.size() - 1 : 0);
  for (size_t l = 0; l < cost.size(); ++l) cost[l] = detail::merge_cost(pl, levels[l], levels[l + 1]);
  while (int64_t(levels.size()) > max_levels) {
    const size_t best = size_t(std::min_element(cost.begin(), cost.end()) - cost.begin());
    levels[best] = detail::merge(pl, levels[best], levels[best + 1]);
    levels.erase(levels.begin() + best + 1);
    cost.erase(cost.begin() + best);
    if (best > 0) cost[best - 1] = detail::merge_cost(pl, levels[best - 1], levels[best]);
    if (best < cost.size()) cost[best] = detail::merge_cost(pl, levels[best], levels[best + 1]);
  }
  for (size_t l = 0; l < levels.size(); ++l) {
    const bool last_level = l + 1 == levels.size();
    PrefixPlanLevel out;
    out.qo_indptr.assign(1, 0);
    out.kv_indptr.assign(1, 0);
    int64_t qo = 0;
    size_t g = 0;
    for (int32_t k = 0; k < n;) {  // the level's groups, and a group without pages for every other request
      const bool has = g < levels[l].size() && levels[l][g].begin == k;
      const int32_t end = has ? levels[l][g].end : k + 1;
      for (; k < end; ++k) qo += detail::qo_len(in, plan.order[k]);
      if (qo > std::numeric_limits<int32_t>::max()) {
        plan.error = "the batch has more than 2^31 - 1 query tokens";
        return plan;
      }
      out.qo_indptr.push_back(int32_t(qo));
      if (has) pl.write(out.kv_indices, prev, levels[l][g++].list);
      if (out.kv_indices.size() > size_t(std::numeric_limits<int32_t>::max())) {
        plan.error = "a cascade level holds more than 2^31 - 1 pages";
        return plan;
      }
      const bool pages = int64_t(out.kv_indices.size()) > out.kv_indptr.back();
      out.kv_indptr.push_back(int32_t(out.kv_indices.size()));
      // a level's last page is full, except in the last level: the request's last page
      const int64_t r = plan.order[end - 1];
      out.last_page_len.push_back(!pages       ? 0
                                  : last_level ? detail::last_page_len(in, r, tree.start[r + 1] - tree.start[r])
                                               : int32_t(in.page_size));
    }
    plan.levels.push_back(std::move(out));
  }
  return plan;
}

}  // namespace fk
