// Division by a divisor fixed at launch: n / d and n % d as a multiply-high, a add and a shift
// (the round-up method of Granlund and Montgomery), for 0 <= n < 2^31 and 1 <= d < 2^31. The
// paged-KV kernels split a token position into (page, slot) with it. Host-device:
// tests/test_host_code.py checks it against plain division.
#pragma once

#include <cstdint>

#include "flashkern/platform.h"

namespace fk {

struct Divmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  // floor(2^32 (2^shift - d) / d) + 1
  uint32_t shift = 0;       // ceil(log2(d))

  Divmod() = default;
  FK_HOST_DEVICE explicit Divmod(uint32_t d) : divisor(d) {
    while ((uint64_t(1) << shift) < d) ++shift;
    multiplier = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  // n / d; t <= n < 2^31 keeps t + n inside 32 bits
  FK_HOST_DEVICE uint32_t div(uint32_t n) const {
    const uint32_t t = uint32_t((uint64_t(multiplier) * n) >> 32);
    return (t + n) >> shift;
  }
  FK_HOST_DEVICE void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

}  // namespace fk
