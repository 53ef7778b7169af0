// Checkpoint reading as qstreamd --restore runs it, over bytes instead of a
// directory (DecodeCheckpoint: the same checks as ReadCheckpoint): manifest
// checksum and text format, format version, file names, sizes and CRC32C,
// safetensors headers, tensor names, dtypes and shapes against the manifest's
// network, replay counters; then CheckCompatible and the ingest sessions'
// n-step windows (NStepAssembler::Load) as the restore does.
//
// Input: u32 little-endian manifest length | manifest.pbtxt | the listed
// files' bytes back to back, in the manifest's order, each as long as its
// `bytes` says (the last takes what is left when the input is shorter).
// manifest.crc32c is computed, so inputs get past the manifest checksum.
// Each input is read twice: with the files' CRC32C as the manifest states
// them, and with the manifest rewritten to the files' real CRC32C (which a
// mutation cannot find by itself), so the safetensors and shape checks run.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_init.h"
#include "google/protobuf/text_format.h"
#include "server/nstep.h"
#include "trainer/backend_state.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/crc32c.h"

namespace qstream {
namespace {

constexpr char kManifest[] = "manifest.pbtxt";
constexpr char kManifestCrc[] = "manifest.crc32c";

void SetManifest(const std::string& text, std::map<std::string, std::string>* files) {
  (*files)[kManifest] = text;
  (*files)[kManifestCrc] = absl::StrFormat("%08x\n", Crc32c(text.data(), text.size()));
}

void Decode(const std::map<std::string, std::string>& files) {
  absl::StatusOr<CheckpointData> data = DecodeCheckpoint(files);
  if (!data.ok()) {
    FUZZ_CHECK(!data.status().message().empty());
    return;
  }
  // What the reader accepts, the backends' load accepts.
  v1::TrainerConfig config = data->manifest.config();
  FillDefaults(&config);
  absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(config.network());
  FUZZ_CHECK(spec.ok());
  FUZZ_CHECK(CheckNetworkState(data->state, spec->num_params).ok());
  if (data->state.has_replay) FUZZ_CHECK(CheckReplayState(data->state.replay, *spec).ok());
  std::vector<std::string> differences;
  FUZZ_CHECK(CheckCompatible(data->manifest.config(), data->manifest.config(), &differences).ok());
  FUZZ_CHECK(differences.empty());
  CheckCompatible(data->manifest.config(), DefaultConfig(), &differences).IgnoreError();

  // The daemon loads the windows under its running config, which is valid.
  if (!ValidateConfig(config).ok()) return;
  const NStepAssembler assembler(*spec, config.returns().n_step(), config.returns().gamma(),
                                 config.server().max_envs_per_stream());
  for (const v1::IngestSessionState& session : data->manifest.ingest().sessions()) {
    NStepWindows windows;
    if (!assembler.Load(session.windows(), &windows).ok()) continue;
    google::protobuf::RepeatedPtrField<v1::NStepWindowState> saved;
    assembler.Save(windows, &saved);
    NStepWindows again;
    FUZZ_CHECK(assembler.Load(saved, &again).ok());
    FUZZ_CHECK(NStepAssembler::Pending(again) == NStepAssembler::Pending(windows));
  }
}

}  // namespace
}  // namespace qstream

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qstream::QuietProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace qstream;
  if (size < 4) return 0;
  const uint32_t claimed =
      uint32_t{data[0]} | uint32_t{data[1]} << 8 | uint32_t{data[2]} << 16 | uint32_t{data[3]} << 24;
  const size_t manifest_bytes = std::min<size_t>(claimed, size - 4);
  const std::string text(reinterpret_cast<const char*>(data) + 4, manifest_bytes);
  absl::string_view rest(reinterpret_cast<const char*>(data) + 4 + manifest_bytes, size - 4 - manifest_bytes);

  std::map<std::string, std::string> files;
  SetManifest(text, &files);
  v1::CheckpointManifest manifest;
  const bool parsed = google::protobuf::TextFormat::ParseFromString(text, &manifest);
  if (parsed) {
    for (const v1::CheckpointFile& f : manifest.files()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(f.bytes(), rest.size()));
      files.emplace(f.name(), std::string(rest.substr(0, n)));  // the first of a name wins
      rest.remove_prefix(n);
    }
  }
  Decode(files);
  if (!parsed || manifest.files_size() == 0) return 0;

  for (v1::CheckpointFile& f : *manifest.mutable_files()) {
    if (f.name() == kManifest || f.name() == kManifestCrc) continue;
    auto it = files.find(f.name());
    if (it != files.end()) f.set_crc32c(Crc32c(it->second.data(), it->second.size()));
  }
  std::string fixed;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(manifest, &fixed));
  SetManifest(fixed, &files);
  Decode(files);
  return 0;
}
