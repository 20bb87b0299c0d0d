// Speculative decoding's verification: one block of 512 threads per request walks the tree of
// candidates from the root (ops.h: SpeculativeParams), reading the target (and draft) rows of the
// nodes on its path only, fp32 math.
//
// Sampling is SpecInfer's multi-candidate rejection rule, which makes the emitted tokens follow the
// target distribution whatever the draft: at node u with target p and draft q (the children drawn
// from q independently), child c is accepted with probability min(1, r(c) / q(c)), r the residual,
// at first p. After a rejection, r becomes norm(max(0, r - q)); for the same q this stays of the
// form max(0, p - a q) / z (a grows by the last normalizer z), so one value a and one reduction pass
// per rejected sibling suffice. Without a draft the children are fixed proposals (a point mass
// each): a rejection removes the child's token from r. When no child is accepted the emitted token
// is drawn from r (from p when r has no mass left: p == q); a leaf emits a token drawn from p.
// Coin of child c: draw c of the request's stream; the emitted token's draws follow the nodes'.
#pragma once

#include <type_traits>

#include "flashkern/kernels/sampling.cuh"

namespace fk {

// 512 threads leave the walk 128 registers (at 1024 it spilled); a request reads few rows.
inline constexpr int kSpeculativeThreads = 512;
inline constexpr int kMaxTreeNodes = 1024;  // the glue refuses larger trees (the excluded tokens sit in shared memory)

struct SpeculativeShared {
  SamplingShared sampling;
  int32_t excluded[kMaxTreeNodes];  // tokens removed from the residual (no draft)
  float f[kSamplingThreads / 32];
  uint32_t u[kSamplingThreads / 32];
};

// max(0, p - a q) / scale of a node's target p and draft q, or p without the excluded tokens.
template <int kVec>
struct ResidualMasses {
  const float* p;
  const float* q;  // nullptr: no draft
  float a;
  const int32_t* excluded;
  int excluded_count;
  RowSpan<kVec> span;  // head 0: the launcher takes 16-byte vectors only when every row starts on 16 bytes

  FK_DEVICE void operator()(int64_t v, float (&m)[kVec]) const {
    const int64_t first = span.first(v);
    const int n = span.size(v);
    Vec<float, kVec> pv, qv;
    pv.load(p + first, n);
    if (q != nullptr && a != 0.f) qv.load(q + first, n);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float x = pv.f(e);
      if (q != nullptr && a != 0.f) x -= a * qv.f(e);
      for (int i = 0; i < excluded_count; ++i) x = excluded[i] == first + e ? 0.f : x;
      m[e] = e < n && x > 0.f ? x : 0.f;
    }
  }
};

// A token drawn with probability mass(j) / sum(mass); bound: an estimate of the sum (the pass is
// repeated with the exact sum when it was too small, or the target fell past the mass). -1: no mass.
template <int kThreads, int kWarp, int kVec, typename Masses>
FK_DEVICE int64_t draw_token(const Masses& masses, float bound, const RowRandom& random, uint32_t& draw,
                             SamplingShared& sh) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const Drawn d = draw_by_mass<kThreads, kWarp, kVec>(masses, random.uniform(draw++) * bound, sh);
    if (!(d.mass > 0.f) || !finite(d.mass)) return -1;
    if (d.mass <= bound && d.token >= 0) return d.token;
    bound = d.mass;
  }
  return -1;
}

template <int kThreads, int kWarp, typename T, int kVec>
__global__ void FK_LAUNCH_BOUNDS(kThreads, 1) speculative_kernel(SpeculativeParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(SpeculativeShared, shared, [1]);
  SpeculativeShared& sh = shared[0];
  const int64_t vectors = ceil_div(p.vocab, kVec);
  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    const RowRandom random = row_random(p.rng, b);
    const auto parent = [&](int c) { return p.parents == nullptr ? c - 1 : p.parents[b * p.parents_stride + c]; };
    const auto token_of = [&](int c) { return p.candidates[b * p.cand_stride + c - p.first_candidate]; };
    const auto target_row = [&](int u) { return static_cast<const T*>(p.target) + b * p.target_strides[0] + u * p.target_strides[1]; };
    const auto draft_row = [&](int u) { return p.draft == nullptr ? nullptr : p.draft + b * p.draft_strides[0] + u * p.draft_strides[1]; };
    int32_t* out_tokens = p.out_tokens + b * p.out_len;
    int32_t* out_nodes = p.out_nodes == nullptr ? nullptr : p.out_nodes + b * (p.out_len - 1);

    int u = 0, accepted = 0;
    uint32_t draw = uint32_t(p.nodes);  // draws below `nodes` are the children's coins
    int64_t emitted = -1;
    const auto accept = [&](int c) {  // candidate c joins the accepted path; the walk moves to it
      if (threadIdx.x == 0) {
        out_tokens[accepted] = int32_t(token_of(c));
        if (out_nodes != nullptr) out_nodes[accepted] = c;
      }
      ++accepted;
      u = c;
    };
    while (emitted < 0) {
      if (p.mode == SpeculativeMode::greedy) {
        // The argmax of the target at u, ties to the lowest index.
        const RowValues<T, kVec> row{target_row(u), {p.vocab, 0}};
        float best = -INFINITY;
        int64_t best_index = INT64_MAX;
        for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
          float x[kVec];
          const int n = row.load(v, x);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (e < n && (x[e] > best || (x[e] == best && row.span.first(v) + e < best_index))) {
              best = x[e];
              best_index = row.span.first(v) + e;
            }
          }
        }
        const float top = block_reduce<kThreads, kWarp>(best, sh.f, MaxOp{});
        const uint32_t at = block_reduce<kThreads, kWarp>(
            best == top && best_index < p.vocab ? uint32_t(best_index) : 0xffffffffu, sh.u, MinOp{});
        const int64_t argmax = at == 0xffffffffu ? 0 : int64_t(at);  // every value NaN: token 0
        int next = -1;
        for (int c = u + 1; c < p.nodes && next < 0; ++c)
          if (parent(c) == u && token_of(c) == argmax) next = c;
        if (next < 0)
          emitted = argmax;
        else
          accept(next);
        continue;
      }
      if constexpr (std::is_same_v<T, float>) {  // sampling takes float32 probabilities (the glue checks)
      // Sampling: try u's children in order against the residual max(0, p - a q) / z.
      const float* pr = target_row(u);
      const float* qr = nullptr;
      float a = 0.f, z = 1.f;  // the target rows are taken to sum to 1
      int excluded = 0, next = -1;
      bool has_child = false;
      for (int c = u + 1; c < p.nodes && next < 0; ++c) {
        if (parent(c) != u) continue;
        if (!has_child) qr = draft_row(u), has_child = true;
        const int32_t t = token_of(c);
        const bool in_vocab = t >= 0 && t < p.vocab;
        float pt = in_vocab ? pr[t] : 0.f;
        if (qr != nullptr) {
          const float qt = in_vocab ? qr[t] : 0.f;
          const float r = (pt - a * qt > 0.f ? pt - a * qt : 0.f) / z;
          if (random.uniform(uint32_t(c)) * qt < r && in_vocab) {
            next = c;
            break;
          }
          a += z;
          // The next sibling needs the new normalizer: one pass (none after the last child).
          bool more = false;
          for (int s = c + 1; s < p.nodes && !more; ++s) more = parent(s) == u;
          if (more) {
            float sum = 0.f;
            const ResidualMasses<kVec> masses{pr, qr, a, sh.excluded, 0, {p.vocab, 0}};
            for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
              float m[kVec];
              masses(v, m);
#pragma unroll
              for (int e = 0; e < kVec; ++e) sum += m[e];
            }
            z = block_reduce<kThreads, kWarp>(sum, sh.f, SumOp{});
            if (!(z > 0.f)) break;  // the residual is empty: no sibling can be accepted
          }
        } else {
          for (int i = 0; i < excluded; ++i) pt = sh.excluded[i] == t ? 0.f : pt;
          if (random.uniform(uint32_t(c)) * z < pt && in_vocab) {
            next = c;
            break;
          }
          if (pt > 0.f) {  // remove t from the residual (excluded tokens have no mass left to remove)
            __syncthreads();  // every thread has read the excluded list
            if (threadIdx.x == 0) sh.excluded[excluded] = t;
            __syncthreads();
            ++excluded;
            z -= pt;
          }
        }
      }
      if (next >= 0) {
        accept(next);
        continue;
      }
      const ResidualMasses<kVec> residual{pr, qr, a, sh.excluded, excluded, {p.vocab, 0}};
      emitted = draw_token<kThreads, kWarp, kVec>(residual, z > 0.f ? z * kMassBound : 1.f, random, draw, sh.sampling);
      if (emitted < 0) {  // no residual mass left (p == q, or rounding): the target itself
        const ResidualMasses<kVec> target{pr, nullptr, 0.f, sh.excluded, 0, {p.vocab, 0}};
        emitted = draw_token<kThreads, kWarp, kVec>(target, kMassBound, random, draw, sh.sampling);
      }
      if (emitted < 0) emitted = 0;  // a target row without mass
      } else {
        emitted = 0;  // not reached: 16-bit targets are greedy only
      }
    }
    if (threadIdx.x == 0) {
      out_tokens[accepted] = int32_t(emitted);
      p.num_accepted[b] = accepted;
    }
    for (int i = accepted + 1 + int(threadIdx.x); i < p.out_len; i += kThreads) out_tokens[i] = -1;
    if (out_nodes != nullptr)
      for (int i = accepted + int(threadIdx.x); i < p.out_len - 1; i += kThreads) out_nodes[i] = -1;
    if (p.independent_accepted != nullptr) {  // chains: each draft token's own test, whatever came before
      const bool chain = p.parents == nullptr && p.mode == SpeculativeMode::sample;
      uint32_t passed = 0u;
      for (int c = 1 + int(threadIdx.x); chain && c < p.nodes; c += kThreads) {
        const int32_t t = token_of(c);
        if (t < 0 || t >= p.vocab) continue;
        const float pt = to_float(target_row(c - 1)[t]);
        const float qt = p.draft != nullptr ? draft_row(c - 1)[t] : 1.f;
        passed += random.uniform(uint32_t(c)) * qt < pt ? 1u : 0u;
      }
      passed = block_reduce<kThreads, kWarp>(passed, sh.u, SumOp{});
      if (threadIdx.x == 0) p.independent_accepted[b] = int32_t(passed);
    }
    __syncthreads();  // shared memory is free for the next request
  }
}

template <int kWarp>
const char* run_speculative(const SpeculativeParams& p, gpuStream_t stream) {
  if (p.batch == 0) return nullptr;
  return with_dtype(p.target_dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = kVec16<T>;  // 16 bytes of the target; a float draft (sampling: T is float) alike
    bool wide = p.vocab % kVec == 0 && p.target_strides[0] % kVec == 0 && p.target_strides[1] % kVec == 0 &&
                aligned16(p.target);
    if (p.draft != nullptr)
      wide = wide && p.draft_strides[0] % kVec == 0 && p.draft_strides[1] % kVec == 0 && aligned16(p.draft);
    return with_bool(wide, [&](auto wide_c) {
      constexpr int kV = decltype(wide_c)::value ? kVec : 1;
      const auto kernel = speculative_kernel<kSpeculativeThreads, kWarp, T, kV>;
      const int64_t blocks = p.batch < kMaxBlocks ? p.batch : kMaxBlocks;
      FK_LAUNCH(kernel, dim3(unsigned(blocks)), dim3(kSpeculativeThreads), stream)(p);
      return last_launch_error();
    });
  });
}

}  // namespace fk
