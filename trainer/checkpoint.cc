#include "trainer/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "trainer/config.h"
#include "trainer/crc32c.h"
#include "trainer/safetensors.h"

namespace qstream {
namespace {

namespace fs = std::filesystem;
namespace pb = google::protobuf;

constexpr char kManifestFile[] = "manifest.pbtxt";
constexpr char kManifestCrcFile[] = "manifest.crc32c";
constexpr char kReplayFile[] = "replay.safetensors";
constexpr char kTmpPrefix[] = ".tmp-";
constexpr char kOldPrefix[] = ".old-";
constexpr size_t kMaxNameBytes = 128;
constexpr size_t kReadChunk = size_t{4} << 20;

// The four flat buffers of a BackendState, by file.
struct WeightBuffer {
  const char* buffer;  // "__metadata__" "buffer" value
  const char* file;
  std::vector<float> BackendState::*member;
};
constexpr WeightBuffer kWeightBuffers[] = {
    {"online", "online.safetensors", &BackendState::params},
    {"target", "target.safetensors", &BackendState::target},
    {"adam_m", "adam_m.safetensors", &BackendState::adam_m},
    {"adam_v", "adam_v.safetensors", &BackendState::adam_v},
};

absl::Status Errno(absl::string_view op, absl::string_view path) {
  const int err = errno;
  return absl::ErrnoToStatus(err, absl::StrCat(op, " ", path));
}

absl::Status Prefixed(absl::string_view prefix, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(prefix, ": ", s.message()));
}

std::string JoinPath(absl::string_view dir, absl::string_view name) { return absl::StrCat(dir, "/", name); }

struct NamedLayer {
  std::string name;
  LinearView view;
};

// NetworkSpec::layers() in buffer order with their tensor name prefixes.
std::vector<NamedLayer> NamedLayers(const NetworkSpec& spec) {
  std::vector<NamedLayer> out;
  for (size_t k = 0; k < spec.trunk.size(); ++k) out.push_back({absl::StrCat("trunk.", k), spec.trunk[k]});
  out.push_back({"value_hidden", spec.value_hidden});
  out.push_back({"value_out", spec.value_out});
  out.push_back({"adv_hidden", spec.adv_hidden});
  out.push_back({"adv_out", spec.adv_out});
  return out;
}

// The network a checkpoint's own config describes (defaults filled as the
// daemon fills them when it loads a config file).
absl::StatusOr<NetworkSpec> SpecOf(const v1::TrainerConfig& config) {
  v1::TrainerConfig filled = config;
  FillDefaults(&filled);
  return NetworkSpec::Create(filled.network());
}

std::vector<SafetensorsTensorRef> WeightTensors(const NetworkSpec& spec, const std::vector<float>& buffer) {
  std::vector<SafetensorsTensorRef> out;
  for (const NamedLayer& l : NamedLayers(spec)) {
    out.push_back({l.name + ".weight",
                   SafetensorsDtype::kF32,
                   {l.view.out, l.view.in},
                   buffer.data() + l.view.w_offset});
    out.push_back({l.name + ".bias", SafetensorsDtype::kF32, {l.view.out}, buffer.data() + l.view.b_offset});
  }
  return out;
}

std::vector<SafetensorsTensorRef> ReplayTensors(const ReplayState& r) {
  const TransitionColumns& c = r.rows;
  return {
      {"obs", SafetensorsDtype::kF32, {r.size, c.obs_dim}, c.obs.data()},
      {"next_obs", SafetensorsDtype::kF32, {r.size, c.obs_dim}, c.next_obs.data()},
      {"actions", SafetensorsDtype::kI32, {r.size, c.num_branches}, c.actions.data()},
      {"rewards", SafetensorsDtype::kF32, {r.size}, c.rewards.data()},
      {"discounts", SafetensorsDtype::kF32, {r.size}, c.discounts.data()},
      {"priorities", SafetensorsDtype::kF32, {r.size}, r.priorities.data()},
  };
}

// `state` must be what `manifest` says it is: the reader rebuilds one from the other.
absl::Status CheckStateMatchesManifest(const CheckpointData& data, const NetworkSpec& spec) {
  const BackendState& s = data.state;
  const v1::CheckpointManifest& m = data.manifest;
  for (const WeightBuffer& w : kWeightBuffers) {
    const auto n = static_cast<int64_t>((s.*w.member).size());
    if (n != spec.num_params) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.", w.buffer, ": ", n, " floats, the network has ", spec.num_params));
    }
  }
  auto mismatch = [](absl::string_view field, auto manifest, auto state) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest.", field, " is ", manifest, " but the backend state says ", state));
  };
  if (m.learner_step() != s.steps) return mismatch("learner_step", m.learner_step(), s.steps);
  if (m.optimizer_step() != s.applied_updates)
    return mismatch("optimizer_step", m.optimizer_step(), s.applied_updates);
  if (!std::equal(m.guard().trips().begin(), m.guard().trips().end(), s.guard_trips.begin(),
                  s.guard_trips.end())) {
    return mismatch("guard.trips", absl::StrJoin(m.guard().trips(), ","), absl::StrJoin(s.guard_trips, ","));
  }
  if (m.guard().consecutive_trips() != s.consecutive_trips) {
    return mismatch("guard.consecutive_trips", m.guard().consecutive_trips(), s.consecutive_trips);
  }
  const v1::CheckpointManifest::Replay& r = m.replay();
  if (r.included() != s.has_replay) return mismatch("replay.included", r.included(), s.has_replay);
  if (!s.has_replay) return absl::OkStatus();
  if (r.capacity() != s.replay.capacity) return mismatch("replay.capacity", r.capacity(), s.replay.capacity);
  if (r.size() != s.replay.size) return mismatch("replay.size", r.size(), s.replay.size);
  if (r.cursor() != s.replay.cursor) return mismatch("replay.cursor", r.cursor(), s.replay.cursor);
  if (r.max_priority() != s.replay.max_priority) {
    return mismatch("replay.max_priority", r.max_priority(), s.replay.max_priority);
  }
  return CheckReplayState(s.replay, spec);
}

// mkdir -p with mode 0700 for every directory it creates.
absl::Status MakeDirs(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint root is empty");
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(path, " is not a directory"));
    return absl::OkStatus();
  }
  if (errno != ENOENT) return Errno("stat", path);
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && parent != fs::path(path)) {
    if (absl::Status s = MakeDirs(parent.string()); !s.ok()) return s;
  }
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return Errno("mkdir", path);
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  absl::Status status = absl::OkStatus();
  if (::fsync(fd) != 0) status = Errno("fsync", path);
  if (::close(fd) != 0 && status.ok()) status = Errno("close", path);
  return status;
}

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("remove ", path, ": ", ec.message()));
  return absl::OkStatus();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// Writes every file of a checkpoint into `dir` (which exists and is empty);
// fills manifest->files and returns the bytes written.
absl::StatusOr<uint64_t> WriteFiles(const std::string& dir, const CheckpointData& data,
                                    const NetworkSpec& spec, v1::CheckpointManifest* manifest) {
  uint64_t total = 0;
  manifest->clear_files();
  auto record = [&](const std::string& name, const WrittenFile& f) {
    v1::CheckpointFile* file = manifest->add_files();
    file->set_name(name);
    file->set_bytes(f.bytes);
    file->set_crc32c(f.crc32c);
    total += f.bytes;
  };
  for (const WeightBuffer& w : kWeightBuffers) {
    absl::StatusOr<WrittenFile> f =
        WriteSafetensors(JoinPath(dir, w.file), WeightTensors(spec, data.state.*w.member),
                         {{"format", "qstream"}, {"buffer", w.buffer}});
    if (!f.ok()) return f.status();
    record(w.file, *f);
  }
  if (data.state.has_replay) {
    absl::StatusOr<WrittenFile> f =
        WriteSafetensors(JoinPath(dir, kReplayFile), ReplayTensors(data.state.replay),
                         {{"format", "qstream"}, {"buffer", "replay"}});
    if (!f.ok()) return f.status();
    record(kReplayFile, *f);
  }
  std::string text;
  if (!pb::TextFormat::PrintToString(*manifest, &text)) {
    return absl::InternalError("printing the checkpoint manifest failed");
  }
  absl::StatusOr<WrittenFile> m =
      WriteNewFileDurably(JoinPath(dir, kManifestFile), {{text.data(), text.size()}});
  if (!m.ok()) return m.status();
  const std::string crc = absl::StrFormat("%08x\n", m->crc32c);
  absl::StatusOr<WrittenFile> c =
      WriteNewFileDurably(JoinPath(dir, kManifestCrcFile), {{crc.data(), crc.size()}});
  if (!c.ok()) return c.status();
  return total + m->bytes + c->bytes;
}

// Reads the open `fd` to its end in chunks of `chunk_bytes`, handing each to
// `consume`, and closes it.
absl::Status ReadChunks(int fd, absl::string_view name, size_t chunk_bytes,
                        const std::function<void(const char*, size_t)>& consume) {
  std::vector<char> buf(chunk_bytes);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = Errno("read", name);
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    consume(buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  return absl::OkStatus();
}

// The whole small file at `path` (the manifest and its checksum).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view name) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("open", name);
  std::string out;
  if (absl::Status st = ReadChunks(fd, name, 1 << 16, [&](const char* p, size_t n) { out.append(p, n); });
      !st.ok()) {
    return st;
  }
  return out;
}

struct FileSum {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

absl::StatusOr<FileSum> ChecksumFile(const std::string& path, absl::string_view name) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::DataLossError(absl::StrCat(name, ": missing (listed in the manifest)"));
    return Errno("open", name);
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  FileSum sum;
  absl::Status st = ReadChunks(fd, name, kReadChunk, [&sum](const char* p, size_t n) {
    sum.crc32c = Crc32cExtend(sum.crc32c, p, n);
    sum.bytes += n;
  });
  if (!st.ok()) return st;
  return sum;
}

// A checkpoint's files by name: the directory it was written to, or bytes
// in memory (DecodeCheckpoint). The reader below runs the same checks on both.
class CheckpointFiles {
 public:
  virtual ~CheckpointFiles() = default;
  // The whole of a small file (the manifest and its checksum); NotFound when missing.
  virtual absl::StatusOr<std::string> ReadSmall(absl::string_view name) const = 0;
  // Size and CRC32C; DataLoss when missing.
  virtual absl::StatusOr<FileSum> Checksum(absl::string_view name) const = 0;
  virtual absl::StatusOr<std::unique_ptr<SafetensorsReader>> OpenSafetensors(
      absl::string_view name) const = 0;
};

class DirectoryFiles : public CheckpointFiles {
 public:
  explicit DirectoryFiles(std::string dir) : dir_(std::move(dir)) {}
  absl::StatusOr<std::string> ReadSmall(absl::string_view name) const override {
    return ReadSmallFile(JoinPath(dir_, name), name);
  }
  absl::StatusOr<FileSum> Checksum(absl::string_view name) const override {
    return ChecksumFile(JoinPath(dir_, name), name);
  }
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> OpenSafetensors(absl::string_view name) const override {
    return SafetensorsReader::Open(JoinPath(dir_, name), std::string(name));
  }

 private:
  std::string dir_;
};

class MemoryFiles : public CheckpointFiles {
 public:
  explicit MemoryFiles(const std::map<std::string, std::string>& files) : files_(files) {}
  absl::StatusOr<std::string> ReadSmall(absl::string_view name) const override {
    const std::string* f = Find(name);
    if (f == nullptr) return absl::NotFoundError(absl::StrCat("open ", name));
    return *f;
  }
  absl::StatusOr<FileSum> Checksum(absl::string_view name) const override {
    const std::string* f = Find(name);
    if (f == nullptr) return absl::DataLossError(absl::StrCat(name, ": missing (listed in the manifest)"));
    return FileSum{f->size(), Crc32c(f->data(), f->size())};
  }
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> OpenSafetensors(absl::string_view name) const override {
    const std::string* f = Find(name);
    if (f == nullptr) return absl::NotFoundError(absl::StrCat("open ", name));
    return SafetensorsReader::FromBytes(*f, std::string(name));
  }

 private:
  const std::string* Find(absl::string_view name) const {
    auto it = files_.find(std::string(name));
    return it == files_.end() ? nullptr : &it->second;
  }
  const std::map<std::string, std::string>& files_;
};

// manifest.pbtxt, verified against manifest.crc32c, and parsed.
absl::StatusOr<v1::CheckpointManifest> ReadManifest(const CheckpointFiles& files, bool verify) {
  absl::StatusOr<std::string> text = files.ReadSmall(kManifestFile);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) return absl::DataLossError(absl::StrCat(kManifestFile, ": missing"));
    return text.status();
  }
  if (verify) {
    absl::StatusOr<std::string> crc_text = files.ReadSmall(kManifestCrcFile);
    if (!crc_text.ok()) {
      return absl::DataLossError(
          absl::StrCat(kManifestFile, ": cannot verify, ", crc_text.status().message()));
    }
    uint32_t want = 0;
    const absl::string_view hex = absl::StripAsciiWhitespace(*crc_text);
    if (hex.size() != 8 || !absl::SimpleHexAtoi(hex, &want)) {
      return absl::DataLossError(
          absl::StrCat(kManifestFile, ": ", kManifestCrcFile, " does not hold 8 hex digits"));
    }
    const uint32_t got = Crc32c(text->data(), text->size());
    if (got != want) {
      return absl::DataLossError(absl::StrFormat("%s: checksum mismatch (CRC32C %08x, %s says %08x)",
                                                 kManifestFile, got, kManifestCrcFile, want));
    }
  }
  v1::CheckpointManifest manifest;
  if (!pb::TextFormat::ParseFromString(*text, &manifest)) {
    return absl::DataLossError(absl::StrCat(kManifestFile, ": not a valid CheckpointManifest"));
  }
  return manifest;
}

// Every tensor is checked against the header before the destination is
// sized: the sizes come from the manifest's config, the header is bounded by
// the file.
absl::Status ReadWeights(const CheckpointFiles& files, const WeightBuffer& w, const NetworkSpec& spec,
                         std::vector<float>* out) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> opened = files.OpenSafetensors(w.file);
  if (!opened.ok()) return opened.status();
  const SafetensorsReader& reader = **opened;
  const std::vector<NamedLayer> layers = NamedLayers(spec);
  std::vector<std::string> names;
  for (const NamedLayer& l : layers) {
    names.push_back(l.name + ".weight");
    names.push_back(l.name + ".bias");
    if (absl::Status s =
            reader.CheckTensor(names[names.size() - 2], SafetensorsDtype::kF32, {l.view.out, l.view.in});
        !s.ok())
      return s;
    if (absl::Status s = reader.CheckTensor(names.back(), SafetensorsDtype::kF32, {l.view.out}); !s.ok())
      return s;
  }
  if (absl::Status s = reader.CheckNoOtherTensors(names); !s.ok()) return s;
  out->assign(static_cast<size_t>(spec.num_params), 0.0f);
  for (size_t k = 0; k < layers.size(); ++k) {
    const LinearView& v = layers[k].view;
    std::span<float> weight(out->data() + v.w_offset, static_cast<size_t>(v.in) * v.out);
    std::span<float> bias(out->data() + v.b_offset, static_cast<size_t>(v.out));
    if (absl::Status s = reader.ReadF32(names[2 * k], {v.out, v.in}, weight); !s.ok()) return s;
    if (absl::Status s = reader.ReadF32(names[2 * k + 1], {v.out}, bias); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ReadReplay(const CheckpointFiles& files, const NetworkSpec& spec, ReplayState* r) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> opened = files.OpenSafetensors(kReplayFile);
  if (!opened.ok()) return opened.status();
  const SafetensorsReader& reader = **opened;
  TransitionColumns& c = r->rows;
  const std::vector<int64_t> rows = {r->size};
  const std::vector<int64_t> obs = {r->size, c.obs_dim};
  const std::vector<int64_t> actions = {r->size, c.num_branches};
  // The manifest's size is checked against the file before it sizes anything.
  for (absl::Status s :
       {reader.CheckTensor("obs", SafetensorsDtype::kF32, obs),
        reader.CheckTensor("next_obs", SafetensorsDtype::kF32, obs),
        reader.CheckTensor("actions", SafetensorsDtype::kI32, actions),
        reader.CheckTensor("rewards", SafetensorsDtype::kF32, rows),
        reader.CheckTensor("discounts", SafetensorsDtype::kF32, rows),
        reader.CheckTensor("priorities", SafetensorsDtype::kF32, rows),
        reader.CheckNoOtherTensors({"obs", "next_obs", "actions", "rewards", "discounts", "priorities"})}) {
    if (!s.ok()) return s;
  }
  const auto n = static_cast<size_t>(r->size);
  c.obs.resize(n * c.obs_dim);
  c.next_obs.resize(n * c.obs_dim);
  c.actions.resize(n * c.num_branches);
  c.rewards.resize(n);
  c.discounts.resize(n);
  r->priorities.resize(n);
  for (absl::Status s :
       {reader.ReadF32("obs", obs, c.obs), reader.ReadF32("next_obs", obs, c.next_obs),
        reader.ReadI32("actions", actions, c.actions), reader.ReadF32("rewards", rows, c.rewards),
        reader.ReadF32("discounts", rows, c.discounts), reader.ReadF32("priorities", rows, r->priorities)}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = CheckReplayState(*r, spec); !s.ok()) return Prefixed(kReplayFile, s);
  return absl::OkStatus();
}

// Values of one field for messages: "[64, 64]" for a repeated field.
std::string FieldString(const pb::Message& m, const pb::FieldDescriptor* f) {
  const pb::Reflection* r = m.GetReflection();
  auto one = [&](int i) -> std::string {
    const bool rep = f->is_repeated();
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
        return absl::StrCat(rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f));
      case pb::FieldDescriptor::CPPTYPE_INT64:
        return absl::StrCat(rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f));
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        return absl::StrCat(rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f));
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        return absl::StrCat(rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f));
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        return absl::StrCat(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f));
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        return absl::StrCat(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f));
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        return (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? "true" : "false";
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        return std::string((rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f))->name());
      case pb::FieldDescriptor::CPPTYPE_STRING:
        return absl::StrCat("\"", rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f), "\"");
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        return absl::StrCat(
            "{", (rep ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f)).ShortDebugString(), "}");
    }
    return "?";
  };
  if (!f->is_repeated()) return one(0);
  std::vector<std::string> items;
  for (int i = 0; i < r->FieldSize(m, f); ++i) items.push_back(one(i));
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

struct FieldDiff {
  std::string path;
  std::string saved;
  std::string running;
};

// Fields whose values differ, recursing into singular sub-messages. Values,
// not presence, are compared: an unset field equals its default.
void DiffMessages(const pb::Message& a, const pb::Message& b, const std::string& prefix,
                  std::vector<FieldDiff>* out) {
  const pb::Descriptor* d = a.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    const std::string path = absl::StrCat(prefix, f->name());
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated()) {
      DiffMessages(a.GetReflection()->GetMessage(a, f), b.GetReflection()->GetMessage(b, f), path + ".", out);
      continue;
    }
    std::string sa = FieldString(a, f);
    std::string sb = FieldString(b, f);
    if (sa != sb) out->push_back({path, std::move(sa), std::move(sb)});
  }
}

bool IsAutomaticName(absl::string_view name) {
  if (!absl::StartsWith(name, kCheckpointPrefix)) return false;
  const absl::string_view digits = name.substr(sizeof(kCheckpointPrefix) - 1);
  return !digits.empty() &&
         std::all_of(digits.begin(), digits.end(), [](char c) { return absl::ascii_isdigit(c); });
}

std::string OwnPidSuffix() { return absl::StrCat("-", ::getpid()); }

}  // namespace

absl::Status ValidateCheckpointName(const std::string& name) {
  const std::string shown = name.substr(0, kMaxNameBytes);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint name \"", absl::CHexEscape(shown), "\": ", why));
  };
  if (name.empty()) return bad("empty");
  if (name.size() > kMaxNameBytes) return bad(absl::StrCat("longer than ", kMaxNameBytes, " characters"));
  if (name == "." || name == "..") return bad("not a directory name");
  if (name[0] == '.') return bad("starts with '.'");
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-')
      return bad("only [A-Za-z0-9._-] allowed");
  }
  return absl::OkStatus();
}

std::string AutoCheckpointName(int64_t learner_step) { return absl::StrCat(kCheckpointPrefix, learner_step); }

absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& root, const std::string& name,
                                                      const CheckpointData& data) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = ValidateCheckpointName(name); !s.ok()) return s;
  absl::StatusOr<NetworkSpec> spec = SpecOf(data.manifest.config());
  if (!spec.ok()) return Prefixed("manifest.config.network", spec.status());
  if (absl::Status s = CheckStateMatchesManifest(data, *spec); !s.ok())
    return Prefixed("checkpoint " + name, s);

  if (absl::Status s = MakeDirs(root); !s.ok()) return s;
  const std::string pid = OwnPidSuffix();
  const std::string tmp = JoinPath(root, absl::StrCat(kTmpPrefix, name, pid));
  const std::string dir = JoinPath(root, name);
  const std::string old = JoinPath(root, absl::StrCat(kOldPrefix, name, pid));
  if (absl::Status s = RemoveTree(tmp); !s.ok()) return s;
  if (::mkdir(tmp.c_str(), 0700) != 0) return Errno("mkdir", tmp);

  v1::CheckpointManifest manifest = data.manifest;
  manifest.set_format_version(kCheckpointFormatVersion);
  absl::StatusOr<uint64_t> bytes = WriteFiles(tmp, data, *spec, &manifest);
  absl::Status status = bytes.status();
  if (status.ok()) status = FsyncDir(tmp);
  bool replaced = false;
  if (status.ok() && Exists(dir)) {
    // Keep the previous version readable under another name until the new
    // one is in place: rename(2) cannot replace a non-empty directory.
    status = RemoveTree(old);
    if (status.ok() && ::rename(dir.c_str(), old.c_str()) != 0) status = Errno("rename " + dir + " to", old);
    replaced = status.ok();
  }
  if (status.ok() && ::rename(tmp.c_str(), dir.c_str()) != 0) {
    status = Errno("rename " + tmp + " to", dir);
    if (replaced) ::rename(old.c_str(), dir.c_str());  // best effort: put the previous one back
    replaced = false;
  }
  if (!status.ok()) {
    RemoveTree(tmp).IgnoreError();
    return status;
  }
  if (absl::Status s = FsyncDir(root); !s.ok()) return s;
  if (replaced) {
    if (absl::Status s = RemoveTree(old); !s.ok()) return s;
  }

  CheckpointWriteResult result;
  result.name = name;
  result.learner_step = data.state.steps;
  result.dir = dir;
  result.bytes = *bytes;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

namespace {

absl::StatusOr<CheckpointData> ReadCheckpointFiles(const CheckpointFiles& files) {
  absl::StatusOr<v1::CheckpointManifest> manifest = ReadManifest(files, /*verify=*/true);
  if (!manifest.ok()) return manifest.status();
  const v1::CheckpointManifest& m = *manifest;
  if (m.format_version() != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(kManifestFile, ": checkpoint format version ",
                                                      m.format_version(), ", this qstreamd reads ",
                                                      kCheckpointFormatVersion));
  }

  for (const v1::CheckpointFile& f : m.files()) {
    if (f.name().empty() || absl::StrContains(f.name(), '/') || f.name() == "." || f.name() == ".." ||
        f.name() == kManifestFile || f.name() == kManifestCrcFile) {
      return absl::DataLossError(
          absl::StrCat(kManifestFile, ": invalid file name \"", absl::CHexEscape(f.name()), "\""));
    }
    absl::StatusOr<FileSum> sum = files.Checksum(f.name());
    if (!sum.ok()) return sum.status();
    if (sum->bytes != f.bytes()) {
      return absl::DataLossError(absl::StrCat(f.name(), ": ", sum->bytes, " bytes, manifest says ", f.bytes(),
                                              sum->bytes < f.bytes() ? " (truncated)" : ""));
    }
    if (sum->crc32c != f.crc32c()) {
      return absl::DataLossError(absl::StrFormat("%s: checksum mismatch (CRC32C %08x, manifest says %08x)",
                                                 f.name(), sum->crc32c, f.crc32c()));
    }
  }
  auto listed = [&](absl::string_view name) {
    return std::any_of(m.files().begin(), m.files().end(),
                       [&](const v1::CheckpointFile& f) { return f.name() == name; });
  };
  for (const WeightBuffer& w : kWeightBuffers) {
    if (!listed(w.file)) return absl::DataLossError(absl::StrCat(kManifestFile, ": does not list ", w.file));
  }
  if (listed(kReplayFile) != m.replay().included()) {
    return absl::DataLossError(absl::StrCat(kManifestFile, ": replay.included is ", m.replay().included(),
                                            " but ", kReplayFile,
                                            listed(kReplayFile) ? " is listed" : " is not listed"));
  }

  absl::StatusOr<NetworkSpec> spec = SpecOf(m.config());
  if (!spec.ok()) return Prefixed(absl::StrCat(kManifestFile, ": config.network"), spec.status());

  CheckpointData data;
  data.manifest = m;
  BackendState& s = data.state;
  s.steps = m.learner_step();
  s.applied_updates = m.optimizer_step();
  s.guard_trips.assign(m.guard().trips().begin(), m.guard().trips().end());
  s.consecutive_trips = m.guard().consecutive_trips();
  s.has_replay = m.replay().included();
  for (const WeightBuffer& w : kWeightBuffers) {
    if (absl::Status st = ReadWeights(files, w, *spec, &(s.*w.member)); !st.ok()) return st;
  }
  ReplayState& r = s.replay;
  r.capacity = m.replay().capacity();
  r.max_priority = m.replay().max_priority();
  r.rows.obs_dim = spec->obs_dim;
  r.rows.num_branches = spec->num_branches();
  if (s.has_replay) {
    r.size = m.replay().size();
    r.cursor = m.replay().cursor();
    if (r.size < 0 || r.size > r.capacity || r.cursor < 0 || r.cursor >= r.capacity) {
      return absl::InvalidArgumentError(absl::StrCat(kManifestFile, ": replay size ", r.size, " and cursor ",
                                                     r.cursor, " do not fit capacity ", r.capacity));
    }
    r.rows.n = r.size;
    if (absl::Status st = ReadReplay(files, *spec, &r); !st.ok()) return st;
  }
  return data;
}

}  // namespace

absl::StatusOr<CheckpointData> ReadCheckpoint(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return Errno("stat", dir);
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  return ReadCheckpointFiles(DirectoryFiles(dir));
}

absl::StatusOr<CheckpointData> DecodeCheckpoint(const std::map<std::string, std::string>& files) {
  return ReadCheckpointFiles(MemoryFiles(files));
}

absl::Status CheckCompatible(const v1::TrainerConfig& saved, const v1::TrainerConfig& running,
                             std::vector<std::string>* differences) {
  v1::TrainerConfig a = saved;
  v1::TrainerConfig b = running;
  FillDefaults(&a);
  FillDefaults(&b);
  std::vector<FieldDiff> diffs;
  DiffMessages(a, b, "", &diffs);
  std::vector<std::string> shape;
  for (const FieldDiff& d : diffs) {
    if (absl::StartsWith(d.path, "network.")) {
      shape.push_back(absl::StrCat(d.path, ": checkpoint ", d.saved, ", running ", d.running));
    } else if (differences != nullptr) {
      differences->push_back(absl::StrCat(d.path, ": ", d.saved, " -> ", d.running));
    }
  }
  if (!shape.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(absl::StrJoin(shape, "; "), " (changes the network shape)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root) {
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) {
      return absl::NotFoundError(absl::StrCat("checkpoint root ", root, " does not exist"));
    }
    return absl::InternalError(absl::StrCat("list ", root, ": ", ec.message()));
  }
  std::vector<CheckpointEntry> out;
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, kTmpPrefix) || !e.is_directory(ec)) continue;
    CheckpointEntry entry;
    entry.name = name;
    entry.dir = JoinPath(root, name);
    entry.automatic = IsAutomaticName(name);
    absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(DirectoryFiles(entry.dir), /*verify=*/false);
    if (m.ok()) entry.learner_step = m->learner_step();
    out.push_back(std::move(entry));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    if (a.learner_step != b.learner_step) return a.learner_step > b.learner_step;
    // A complete checkpoint before the ".old-" copy of the same step.
    const bool a_old = absl::StartsWith(a.name, kOldPrefix);
    const bool b_old = absl::StartsWith(b.name, kOldPrefix);
    if (a_old != b_old) return b_old;
    return a.name < b.name;
  });
  return out;
}

absl::StatusOr<CheckpointData> ReadLatestCheckpoint(const std::string& root, const v1::TrainerConfig& running,
                                                    std::vector<std::string>* refused, std::string* dir_out) {
  absl::StatusOr<std::vector<CheckpointEntry>> entries = ListCheckpoints(root);
  if (!entries.ok()) return entries.status();
  if (entries->empty()) return absl::NotFoundError(absl::StrCat("no checkpoint under ", root));
  std::string newest_refusal;
  for (const CheckpointEntry& e : *entries) {
    absl::StatusOr<CheckpointData> data = ReadCheckpoint(e.dir);
    absl::Status status = data.status();
    if (status.ok()) status = CheckCompatible(data->manifest.config(), running, nullptr);
    if (status.ok()) {
      if (dir_out != nullptr) *dir_out = e.dir;
      return data;
    }
    std::string why = absl::StrCat(e.dir, ": ", status.message());
    if (newest_refusal.empty()) newest_refusal = why;
    if (refused != nullptr) refused->push_back(std::move(why));
  }
  return absl::FailedPreconditionError(absl::StrCat("all ", entries->size(), " checkpoints under ", root,
                                                    " were refused; newest: ", newest_refusal));
}

absl::Status PruneCheckpoints(const std::string& root, int keep) {
  if (keep < 1)
    return absl::InvalidArgumentError(absl::StrCat("PruneCheckpoints: keep ", keep, " must be >= 1"));
  absl::StatusOr<std::vector<CheckpointEntry>> entries = ListCheckpoints(root);
  if (!entries.ok()) return entries.status();
  std::vector<std::string> doomed;
  int kept = 0;
  for (const CheckpointEntry& e : *entries) {
    if (e.automatic && ++kept > keep) doomed.push_back(e.dir);
  }
  // Leftovers of an interrupted write: a ".tmp-" directory of another
  // process, and an ".old-" copy whose replacement is complete.
  const std::string own = OwnPidSuffix();
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, kTmpPrefix) && !absl::EndsWith(name, own)) doomed.push_back(e.path().string());
    if (absl::StartsWith(name, kOldPrefix) && !absl::EndsWith(name, own)) {
      const absl::string_view rest = absl::string_view(name).substr(sizeof(kOldPrefix) - 1);
      const size_t dash = rest.rfind('-');
      if (dash != absl::string_view::npos && Exists(JoinPath(root, rest.substr(0, dash)))) {
        doomed.push_back(e.path().string());
      }
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", root, ": ", ec.message()));
  absl::Status status = absl::OkStatus();
  for (const std::string& d : doomed) {
    if (absl::Status s = RemoveTree(d); !s.ok() && status.ok()) status = s;
  }
  return status;
}

}  // namespace qstream
