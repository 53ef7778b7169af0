#include "trainer/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "trainer/crc32c.h"

namespace qstream {
namespace {

using Json = nlohmann::ordered_json;

// Tensor bytes go to and from the file as they lie in memory; the format is
// little-endian.
static_assert(std::endian::native == std::endian::little);

// The reference implementation refuses headers above 100 MB; so do we, before
// allocating for one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Large enough that syscall overhead vanishes, small enough to keep the
// CRC'd chunk in cache before it is written.
constexpr size_t kIoChunk = size_t{4} << 20;

absl::Status Errno(absl::string_view op, absl::string_view path) {
  const int err = errno;
  return absl::ErrnoToStatus(err, absl::StrCat(op, " ", path));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Bytes of a tensor of `shape`, or nullopt on a negative dimension or overflow.
std::optional<uint64_t> TensorBytes(const std::vector<int64_t>& shape) {
  uint64_t bytes = kSafetensorsDtypeBytes;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
      return std::nullopt;
    bytes *= static_cast<uint64_t>(d);
  }
  return bytes;
}

std::optional<SafetensorsDtype> ParseDtype(absl::string_view s) {
  if (s == "F32") return SafetensorsDtype::kF32;
  if (s == "I32") return SafetensorsDtype::kI32;
  return std::nullopt;
}

uint64_t DecodeLe64(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

// The format needs three levels (header, tensor entry, shape); nlohmann's
// parser copies nested values recursively, so a header nested as deep as it
// is long would overflow the stack before any check ran.
constexpr int kMaxHeaderDepth = 64;

// Deepest nesting of arrays and objects in `json` (brackets in strings skipped).
int JsonNestingDepth(absl::string_view json) {
  int depth = 0;
  int deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// The header length N of a file of `size` bytes starting with `len_bytes`
// (read only when size >= 8), checked against the file and the limit before
// anything is allocated for it.
absl::StatusOr<uint64_t> HeaderLength(const unsigned char* len_bytes, uint64_t size, absl::string_view name) {
  if (size < 8)
    return absl::DataLossError(absl::StrCat(name, ": ", size, " bytes, too short for a safetensors header"));
  const uint64_t n = DecodeLe64(len_bytes);
  if (n > size - 8) {
    return absl::DataLossError(
        absl::StrCat(name, ": header length ", n, " exceeds the file (", size, " bytes)"));
  }
  if (n > kMaxHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat(name, ": header length ", n, " exceeds the ", kMaxHeaderBytes, "-byte limit"));
  }
  return n;
}

absl::Status PreadFully(int fd, void* out, uint64_t bytes, uint64_t offset, absl::string_view name) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(bytes, size_t{1} << 30));
    const ssize_t got = ::pread(fd, p, want, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return Errno("pread", name);
    }
    if (got == 0) return absl::DataLossError(absl::StrCat(name, ": unexpected end of file at byte ", offset));
    p += got;
    offset += static_cast<uint64_t>(got);
    bytes -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace

const char* SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kI32:
      return "I32";
  }
  return "?";
}

const SafetensorsTensorInfo* SafetensorsHeader::Find(absl::string_view name) const {
  for (const SafetensorsTensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(const std::vector<SafetensorsTensorRef>& tensors,
                                                    const SafetensorsMetadata& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  std::set<absl::string_view> seen;
  for (const SafetensorsTensorRef& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: invalid tensor name \"", t.name, "\""));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: duplicate tensor name \"", t.name, "\""));
    }
    const std::optional<uint64_t> bytes = TensorBytes(t.shape);
    if (!bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor ", t.name, ": invalid shape ", ShapeString(t.shape)));
    }
    if (*bytes > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", t.name, ": no data"));
    }
    header[t.name] = Json{{"dtype", SafetensorsDtypeName(t.dtype)},
                          {"shape", t.shape},
                          {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  std::string json = header.dump();
  // Padding keeps the buffer 8-byte aligned in the file (and in a mmap of it).
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;
  return out;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json, uint64_t buffer_bytes,
                                                         absl::string_view file) {
  auto fail = [&](absl::string_view why) { return absl::DataLossError(absl::StrCat(file, ": ", why)); };
  if (JsonNestingDepth(json) > kMaxHeaderDepth) {
    return fail(absl::StrCat("header nests deeper than ", kMaxHeaderDepth, " levels"));
  }
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const Json::exception& e) {  // parse_error, and out_of_range for a number beyond double
    return fail(absl::StrCat("header is not valid JSON (", e.what(), ")"));
  }
  if (!root.is_object()) return fail("header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = 8 + json.size();
  for (const auto& item : root.items()) {
    // Named copies, not structured bindings: clang 14 cannot capture those in the lambda below.
    const std::string key = item.key();
    const Json& value = item.value();
    if (key == "__metadata__") {
      if (!value.is_object()) return fail("__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return fail(absl::StrCat("__metadata__.", mk, " is not a string"));
        header.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    auto bad = [&](absl::string_view why) { return fail(absl::StrCat("tensor ", key, ": ", why)); };
    if (!value.is_object()) return bad("entry is not an object");
    SafetensorsTensorInfo info;
    info.name = key;

    const auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) return bad("missing dtype");
    const std::optional<SafetensorsDtype> parsed = ParseDtype(dtype->get<std::string>());
    if (!parsed) {
      return bad(absl::StrCat("unsupported dtype ",
                              dtype->dump(-1, ' ', false, Json::error_handler_t::replace),
                              " (expected F32 or I32)"));
    }
    info.dtype = *parsed;

    const auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array()) return bad("missing shape");
    for (const Json& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
        // Not shape->dump(): it recurses, and a nested array is as deep as the header is long.
        return bad(
            absl::StrCat("invalid shape: dimension ", info.shape.size(), " is not an integer in [0, 2^63)"));
      }
      info.shape.push_back(d.get<int64_t>());
    }

    const auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return bad("data_offsets is not [begin, end]");
    }
    info.begin = (*offsets)[0].get<uint64_t>();
    info.end = (*offsets)[1].get<uint64_t>();
    if (info.begin > info.end)
      return bad(absl::StrCat("data_offsets ", offsets->dump(), " end before begin"));
    if (info.end > buffer_bytes) {
      return bad(
          absl::StrCat("data_offsets ", offsets->dump(), " beyond the ", buffer_bytes, "-byte data buffer"));
    }
    const std::optional<uint64_t> bytes = TensorBytes(info.shape);
    if (!bytes || *bytes != info.end - info.begin) {
      return bad(absl::StrCat("shape ", ShapeString(info.shape), " x ", SafetensorsDtypeName(info.dtype),
                              " does not fit data_offsets ", offsets->dump(), " (", info.end - info.begin,
                              " bytes)"));
    }
    header.tensors.push_back(std::move(info));
  }

  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t covered = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo& t : header.tensors) {
    if (t.begin < covered) {
      return fail(absl::StrCat("tensor ", t.name, ": data_offsets [", t.begin, ", ", t.end,
                               "] overlap tensor ", prev->name));
    }
    if (t.begin > covered) {
      return fail(absl::StrCat("tensor ", t.name, ": gap of ", t.begin - covered,
                               " bytes before data_offsets [", t.begin, ", ", t.end, "]"));
    }
    covered = t.end;
    prev = &t;
  }
  if (covered != buffer_bytes) {
    return fail(absl::StrCat("tensors cover ", covered, " bytes of the ", buffer_bytes, "-byte data buffer"));
  }
  return header;
}

absl::StatusOr<WrittenFile> WriteNewFileDurably(const std::string& path,
                                                const std::vector<std::span<const char>>& pieces) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", path);
  WrittenFile result;
  absl::Status status = absl::OkStatus();
  for (std::span<const char> piece : pieces) {
    const char* p = piece.data();
    size_t left = piece.size();
    while (left > 0 && status.ok()) {
      const size_t chunk = std::min(left, kIoChunk);
      result.crc32c = Crc32cExtend(result.crc32c, p, chunk);
      size_t done = 0;
      while (done < chunk) {
        const ssize_t n = ::write(fd, p + done, chunk - done);
        if (n < 0) {
          if (errno == EINTR) continue;
          status = Errno("write", path);
          break;
        }
        done += static_cast<size_t>(n);
      }
      p += chunk;
      left -= chunk;
      result.bytes += chunk;
    }
    if (!status.ok()) break;
  }
  if (status.ok() && ::fsync(fd) != 0) status = Errno("fsync", path);
  if (::close(fd) != 0 && status.ok()) status = Errno("close", path);
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<WrittenFile> WriteSafetensors(const std::string& path,
                                             const std::vector<SafetensorsTensorRef>& tensors,
                                             const SafetensorsMetadata& metadata) {
  absl::StatusOr<std::string> header = EncodeSafetensorsHeader(tensors, metadata);
  if (!header.ok())
    return absl::Status(header.status().code(), absl::StrCat(path, ": ", header.status().message()));
  std::vector<std::span<const char>> pieces;
  pieces.reserve(tensors.size() + 1);
  pieces.emplace_back(header->data(), header->size());
  for (const SafetensorsTensorRef& t : tensors) {
    pieces.emplace_back(static_cast<const char*>(t.data), static_cast<size_t>(*TensorBytes(t.shape)));
  }
  return WriteNewFileDurably(path, pieces);
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path,
                                                                           std::string name) {
  if (name.empty()) name = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("open", name);
  // From here the reader owns fd, also on the error paths.
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader(fd, {}, name, SafetensorsHeader{}));
  struct stat st;
  if (::fstat(fd, &st) != 0) return Errno("fstat", name);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  unsigned char len_bytes[8];
  if (size >= 8) {
    if (absl::Status s = PreadFully(fd, len_bytes, 8, 0, name); !s.ok()) return s;
  }
  absl::StatusOr<uint64_t> n = HeaderLength(len_bytes, size, name);
  if (!n.ok()) return n.status();
  std::string json(*n, '\0');
  if (absl::Status s = PreadFully(fd, json.data(), *n, 8, name); !s.ok()) return s;
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(json, size - 8 - *n, name);
  if (!header.ok()) return header.status();
  reader->header_ = *std::move(header);
  return reader;
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::FromBytes(absl::string_view bytes,
                                                                                std::string name) {
  const uint64_t size = bytes.size();
  absl::StatusOr<uint64_t> n = HeaderLength(reinterpret_cast<const unsigned char*>(bytes.data()), size, name);
  if (!n.ok()) return n.status();
  absl::StatusOr<SafetensorsHeader> header =
      ParseSafetensorsHeader(bytes.substr(8, static_cast<size_t>(*n)), size - 8 - *n, name);
  if (!header.ok()) return header.status();
  return std::unique_ptr<SafetensorsReader>(
      new SafetensorsReader(-1, bytes, std::move(name), *std::move(header)));
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsReader::Check(
    absl::string_view tensor, SafetensorsDtype dtype, const std::vector<int64_t>& shape) const {
  const SafetensorsTensorInfo* info = header_.Find(tensor);
  if (info == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", tensor, " is missing"));
  if (info->dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", tensor, ": dtype ",
                                                   SafetensorsDtypeName(info->dtype), ", expected ",
                                                   SafetensorsDtypeName(dtype)));
  }
  if (info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": tensor ", tensor, ": shape ", ShapeString(info->shape), ", expected ", ShapeString(shape)));
  }
  return info;
}

absl::Status SafetensorsReader::ReadData(const SafetensorsTensorInfo& info, void* out,
                                         uint64_t out_bytes) const {
  const uint64_t bytes = info.end - info.begin;
  if (bytes != out_bytes) {
    return absl::InternalError(absl::StrCat(name_, ": tensor ", info.name, ": ", bytes, " bytes into a ",
                                            out_bytes, "-byte destination"));
  }
  char* p = static_cast<char*>(out);
  if (fd_ < 0) {
    // ParseSafetensorsHeader keeps every tensor inside the buffer.
    if (bytes > 0) std::memcpy(p, bytes_.data() + header_.data_start + info.begin, bytes);
    return absl::OkStatus();
  }
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t chunk = std::min<uint64_t>(bytes - done, kIoChunk);
    if (absl::Status s = PreadFully(fd_, p + done, chunk, header_.data_start + info.begin + done, name_);
        !s.ok()) {
      return s;
    }
    done += chunk;
  }
  return absl::OkStatus();
}

absl::Status SafetensorsReader::ReadF32(absl::string_view tensor, const std::vector<int64_t>& shape,
                                        std::span<float> out) const {
  absl::StatusOr<const SafetensorsTensorInfo*> info = Check(tensor, SafetensorsDtype::kF32, shape);
  if (!info.ok()) return info.status();
  return ReadData(**info, out.data(), out.size_bytes());
}

absl::Status SafetensorsReader::ReadI32(absl::string_view tensor, const std::vector<int64_t>& shape,
                                        std::span<int32_t> out) const {
  absl::StatusOr<const SafetensorsTensorInfo*> info = Check(tensor, SafetensorsDtype::kI32, shape);
  if (!info.ok()) return info.status();
  return ReadData(**info, out.data(), out.size_bytes());
}

absl::Status SafetensorsReader::CheckTensor(absl::string_view tensor, SafetensorsDtype dtype,
                                            const std::vector<int64_t>& shape) const {
  return Check(tensor, dtype, shape).status();
}

absl::Status SafetensorsReader::CheckNoOtherTensors(const std::vector<std::string>& expected) const {
  for (const SafetensorsTensorInfo& t : header_.tensors) {
    if (std::find(expected.begin(), expected.end(), t.name) == expected.end()) {
      return absl::InvalidArgumentError(absl::StrCat(name_, ": unexpected tensor ", t.name));
    }
  }
  return absl::OkStatus();
}

}  // namespace qstream
