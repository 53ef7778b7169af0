#include "trainer/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace qstream {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  // ISA-L updates the raw register: the standard CRC is the register started
  // at ~0 and inverted at the end, so undo the previous inversion first.
  unsigned int state = ~crc;
  // crc32_iscsi takes an int length (and a non-const pointer it only reads).
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  constexpr size_t kChunk = size_t{1} << 30;
  static_assert(kChunk <= static_cast<size_t>(INT_MAX));
  while (n > 0) {
    const size_t len = std::min(n, kChunk);
    state = crc32_iscsi(p, static_cast<int>(len), state);
    p += len;
    n -= len;
  }
  return ~state;
}

}  // namespace qstream
