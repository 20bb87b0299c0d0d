// Counter-based random numbers for the sampling kernels: Philox4x32-10 (Salmon et al., SC'11), the
// generator of cuRAND's and torch's CUDA RNG, as host-device code (unit-tested against Random123's
// known-answer vectors in tests/test_host_code.py). A counter-based generator needs no state in
// memory: draw i of output row b is a pure function of (seed, offset + i, b), so every thread can
// draw any number, a kernel replayed from a CUDA graph with a new seed tensor draws new numbers,
// and the emulator draws the GPU's exact numbers.
#pragma once

#include <cstdint>

#include "flashkern/platform.h"

namespace fk {

struct Philox4 {
  uint32_t v[4];
};

FK_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// Ten rounds of Philox4x32 over `counter` with `key` (Random123's philox4x32_10).
FK_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
  for (int round = 0; round < 10; ++round) {  // a constant trip count: unrolled by the compilers
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(0xD2511F53u, c0, hi0, lo0);
    mul_hi_lo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ key0, n2 = hi0 ^ c3 ^ key1;
    c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    key0 += 0x9E3779B9u;  // the Weyl sequence bumps the key between rounds
    key1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// A uniform float in [0, 1) from 24 random bits: every value a multiple of 2^-24, so u * x < x
// for any positive float x (the sampling kernels' targets stay below their totals).
FK_HOST_DEVICE float uniform_from_bits(uint32_t bits) { return float(bits >> 8) * 0x1p-24f; }

// The random stream of one output row: uniform(i) is the i-th draw (four per Philox call; the
// kernels take draws by index, so a draw's value never depends on how many were taken before).
struct RowRandom {
  uint32_t key0, key1;
  uint64_t offset;  // of the first draw, in Philox calls
  uint32_t row;

  FK_HOST_DEVICE RowRandom(uint64_t seed, uint64_t offset_, uint32_t row_)
      : key0(uint32_t(seed)), key1(uint32_t(seed >> 32)), offset(offset_), row(row_) {}

  FK_HOST_DEVICE float uniform(uint32_t i) const {
    const uint64_t call = offset + i / 4;
    const Philox4 r = philox4x32_10({{uint32_t(call), uint32_t(call >> 32), row, 0x5eed5eedu}}, key0, key1);
    const uint32_t w = i % 4;  // a select, not r.v[w]: a dynamic index would put r in scratch memory
    return uniform_from_bits(w == 0 ? r.v[0] : w == 1 ? r.v[1] : w == 2 ? r.v[2] : r.v[3]);
  }
};

}  // namespace fk
