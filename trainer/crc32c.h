// CRC32C (Castagnoli, the iSCSI polynomial) of checkpoint files, computed
// with Intel ISA-L. Values are the standard finalized CRC:
// Crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qstream {

// The CRC32C of data[0, n) appended to a stream whose CRC32C is `crc`, so
// Crc32cExtend(Crc32c(a), b) == Crc32c(a + b). Start a stream with 0.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

}  // namespace qstream
