// The safetensors file format (https://github.com/huggingface/safetensors):
//
//   u64 little-endian N | N bytes of JSON header | data buffer
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end)} with offsets relative to the buffer, plus an optional
// "__metadata__" object of strings. Writers here pad the header with spaces
// to a multiple of 8 and lay the tensors out back to back in the order given,
// which is what the reference reader requires (the buffer is exactly covered).
//
// Files are streamed: tensor data goes from the caller's memory to the file
// and from the file into the caller's memory in chunks, never through one
// string holding the whole file (a replay ring can be hundreds of MB).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace qstream {

enum class SafetensorsDtype { kF32, kI32 };

const char* SafetensorsDtypeName(SafetensorsDtype dtype);  // "F32", "I32"
inline constexpr uint64_t kSafetensorsDtypeBytes = 4;      // every dtype used here

using SafetensorsMetadata = std::map<std::string, std::string>;

// One tensor to write; `data` (not owned) holds product(shape) elements.
struct SafetensorsTensorRef {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// One tensor of a parsed header; offsets are relative to the data buffer.
struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                     // 8 + N: file offset of the buffer
  std::vector<SafetensorsTensorInfo> tensors;  // sorted by offset
  SafetensorsMetadata metadata;

  const SafetensorsTensorInfo* Find(absl::string_view name) const;
};

// The 8-byte length and the padded JSON header for `tensors` laid out back
// to back. InvalidArgument for an empty or duplicate name, "__metadata__",
// a negative dimension or a null pointer with a non-empty shape.
absl::StatusOr<std::string> EncodeSafetensorsHeader(const std::vector<SafetensorsTensorRef>& tensors,
                                                    const SafetensorsMetadata& metadata);

// Parses and validates a JSON header for a buffer of `buffer_bytes`: known
// dtypes, non-negative shapes whose byte size equals the offsets' span,
// offsets inside the buffer, and tensors covering it exactly without
// overlap or gaps. DataLoss naming `file` and the tensor otherwise.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json, uint64_t buffer_bytes,
                                                         absl::string_view file);

struct WrittenFile {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

// Creates `path` (which must not exist) with mode 0600, writes the pieces in
// order, fsyncs and closes it, computing the CRC32C on the way. Errors name
// the system call and the path.
absl::StatusOr<WrittenFile> WriteNewFileDurably(const std::string& path,
                                                const std::vector<std::span<const char>>& pieces);

// Header + tensors through WriteNewFileDurably.
absl::StatusOr<WrittenFile> WriteSafetensors(const std::string& path,
                                             const std::vector<SafetensorsTensorRef>& tensors,
                                             const SafetensorsMetadata& metadata);

// An open safetensors file whose header has been read and validated against
// the file size. Tensor data is read on demand.
class SafetensorsReader {
 public:
  // `name` is how errors call the file (default: the path).
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path,
                                                                 std::string name = "");
  // The same checks over a whole file held in memory; `bytes` must outlive
  // the reader.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> FromBytes(absl::string_view bytes,
                                                                      std::string name);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  const std::string& name() const { return name_; }

  // Reads tensor `tensor` into `out`, which holds exactly its elements
  // (a slice of a flat buffer, say). InvalidArgument naming the file and the
  // tensor when it is missing or its dtype or shape differ.
  absl::Status ReadF32(absl::string_view tensor, const std::vector<int64_t>& shape,
                       std::span<float> out) const;
  absl::Status ReadI32(absl::string_view tensor, const std::vector<int64_t>& shape,
                       std::span<int32_t> out) const;

  // What ReadF32/ReadI32 check before reading: `tensor` exists with this
  // dtype and shape. Callers check every tensor before sizing a destination
  // from sizes they were told elsewhere (a manifest), so no allocation is
  // larger than the file.
  absl::Status CheckTensor(absl::string_view tensor, SafetensorsDtype dtype,
                           const std::vector<int64_t>& shape) const;

  // InvalidArgument naming the first tensor of the file not in `expected`.
  absl::Status CheckNoOtherTensors(const std::vector<std::string>& expected) const;

 private:
  SafetensorsReader(int fd, absl::string_view bytes, std::string name, SafetensorsHeader header)
      : fd_(fd), bytes_(bytes), name_(std::move(name)), header_(std::move(header)) {}
  absl::StatusOr<const SafetensorsTensorInfo*> Check(absl::string_view tensor, SafetensorsDtype dtype,
                                                     const std::vector<int64_t>& shape) const;
  absl::Status ReadData(const SafetensorsTensorInfo& info, void* out, uint64_t out_bytes) const;

  int fd_;                   // the open file, or -1 when reading `bytes_`
  absl::string_view bytes_;  // the whole file when fd_ < 0
  std::string name_;
  SafetensorsHeader header_;
};

}  // namespace qstream
