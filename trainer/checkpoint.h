// Checkpoint: one directory per checkpoint under a checkpoint root.
//
//   <root>/<name>/            name: ckpt-<learner_step> (automatic) or an
//     manifest.pbtxt            admin-given plain name; mode 0700
//     manifest.crc32c         CheckpointManifest (text format) and its CRC32C
//     online.safetensors      one tensor per layer, NetworkSpec names:
//     target.safetensors        "<layer>.weight" [out, in] F32, "<layer>.bias" [out] F32
//     adam_m.safetensors        with layer = trunk.<k> | value_hidden | value_out |
//     adam_v.safetensors        adv_hidden | adv_out (torch nn.Linear layout)
//     replay.safetensors      (when included) obs [size, obs_dim] F32, next_obs,
//                             actions [size, branches] I32, rewards [size],
//                             discounts [size], priorities [size] F32
//
// Files are 0600. A checkpoint is written into "<root>/.tmp-<name>-<pid>",
// each file fsynced, the directory fsynced, then renamed to <name> and the
// root fsynced, so a crash at any moment leaves every earlier checkpoint
// intact (an existing <name> is first renamed to ".old-<name>-<pid>", which
// stays readable until the new one is in place).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qstream/v1/checkpoint.pb.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend_state.h"
#include "trainer/network_spec.h"

namespace qstream {

inline constexpr uint32_t kCheckpointFormatVersion = 1;
inline constexpr char kCheckpointPrefix[] = "ckpt-";

// Everything one checkpoint holds. The manifest's files are filled by
// WriteCheckpoint; its replay block and counters must agree with `state`.
struct CheckpointData {
  v1::CheckpointManifest manifest;
  BackendState state;
};

struct CheckpointWriteResult {
  std::string name;
  int64_t learner_step = 0;
  std::string dir;  // host path (for logs, never for RPC clients)
  uint64_t bytes = 0;
  double seconds = 0;
};

// A checkpoint name given by a client: 1 to 128 characters of
// [A-Za-z0-9._-], not "." or "..", not starting with ".". InvalidArgument
// naming `name` otherwise (without echoing more than the first 128 bytes).
absl::Status ValidateCheckpointName(const std::string& name);

// "ckpt-<learner_step>".
std::string AutoCheckpointName(int64_t learner_step);

// Writes `data` as <root>/<name> (see above); creates <root> (0700) when
// missing. The manifest's `files` are replaced by the files written.
absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& root, const std::string& name,
                                                      const CheckpointData& data);

// Reads and verifies one checkpoint directory: manifest checksum and parse,
// format version, every listed file's size and CRC32C, safetensors headers,
// tensor names, dtypes and shapes against the network of the manifest's own
// config, counters against the replay block. Errors name the file and why
// (DataLoss for checksum/size/truncation, FailedPrecondition for a format
// version, InvalidArgument for shapes).
absl::StatusOr<CheckpointData> ReadCheckpoint(const std::string& dir);

// ReadCheckpoint over a checkpoint's files held in memory, by file name
// ("manifest.pbtxt", "manifest.crc32c", "online.safetensors", ...): the same
// checks and errors without the file system.
absl::StatusOr<CheckpointData> DecodeCheckpoint(const std::map<std::string, std::string>& files);

// Whether a checkpoint written with `saved` may continue under `running`:
// every field that changes the network shape (network.*) must be equal
// (FailedPrecondition naming the field otherwise). The other fields that
// differ are appended to `differences` as "field: saved -> running".
absl::Status CheckCompatible(const v1::TrainerConfig& saved, const v1::TrainerConfig& running,
                             std::vector<std::string>* differences);

struct CheckpointEntry {
  std::string name;
  std::string dir;
  int64_t learner_step = -1;  // from the manifest; -1 when unreadable
  bool automatic = false;     // ckpt-<step>
};

// Checkpoint directories under `root` (".tmp-*" excluded; ".old-*" included),
// newest first: by learner_step, then by name. NotFound when root is missing.
absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root);

// The newest checkpoint under `root` that reads cleanly (ReadCheckpoint) and
// is compatible with `running`; each one refused on the way is appended to
// `refused` as "<dir>: <why>". NotFound when root holds no checkpoint at all.
absl::StatusOr<CheckpointData> ReadLatestCheckpoint(const std::string& root, const v1::TrainerConfig& running,
                                                    std::vector<std::string>* refused,
                                                    std::string* dir_out = nullptr);

// Deletes automatic checkpoints beyond the newest `keep`, and leftover
// ".tmp-*" directories not owned by this process. Named checkpoints stay.
absl::Status PruneCheckpoints(const std::string& root, int keep);

}  // namespace qstream
