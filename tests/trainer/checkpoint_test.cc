#include "trainer/checkpoint.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/trainer/file_helpers.h"
#include "trainer/config.h"
#include "trainer/crc32c.h"

namespace qstream {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

using ::qstream::testing::ReadAll;
using ::qstream::testing::WriteAll;

std::string MakeTempDir() { return ::qstream::testing::MakeTempDir("checkpoint_test"); }

// Replaces a checkpoint's manifest (and its checksum) by an edited copy: a
// manifest that is intact but says something else.
void RewriteManifest(const std::string& dir, void (*edit)(v1::CheckpointManifest*)) {
  v1::CheckpointManifest m;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(ReadAll(dir + "/manifest.pbtxt"), &m));
  edit(&m);
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
  WriteAll(dir + "/manifest.pbtxt", text);
  WriteAll(dir + "/manifest.crc32c", absl::StrFormat("%08x\n", Crc32c(text.data(), text.size())));
}

int Uniform(std::mt19937_64& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n) {
  std::vector<float> out(n);
  std::normal_distribution<float> normal(0, 1);
  for (float& x : out) x = normal(rng);
  return out;
}

v1::TrainerConfig RandomConfig(std::mt19937_64& rng, int branches) {
  v1::TrainerConfig config;
  v1::NetworkConfig* net = config.mutable_network();
  net->set_obs_dim(Uniform(rng, 1, 8));
  for (int k = Uniform(rng, 1, 3); k > 0; --k) net->add_trunk_hidden(Uniform(rng, 1, 16));
  net->set_head_hidden(Uniform(rng, 1, 8));
  net->set_num_atoms(Uniform(rng, 2, 11));
  for (int b = 0; b < branches; ++b) net->add_branch_actions(Uniform(rng, 2, 5));
  config.mutable_optimizer()->set_lr(std::uniform_real_distribution<float>(1e-5f, 1e-2f)(rng));
  return config;
}

// A random, self-consistent checkpoint of a random network.
CheckpointData RandomData(std::mt19937_64& rng, bool with_replay, int branches) {
  CheckpointData data;
  const v1::TrainerConfig config = RandomConfig(rng, branches);
  absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(config.network());
  EXPECT_TRUE(spec.ok()) << spec.status();
  BackendState& s = data.state;
  s.steps = Uniform(rng, 0, 1 << 20);
  s.applied_updates = Uniform(rng, 0, static_cast<int>(s.steps));
  const auto n = static_cast<size_t>(spec->num_params);
  s.params = RandomFloats(rng, n);
  s.target = RandomFloats(rng, n);
  s.adam_m = RandomFloats(rng, n);
  s.adam_v = RandomFloats(rng, n);
  for (float& v : s.adam_v) v = v * v;
  s.guard_trips = {0, Uniform(rng, 0, 9), Uniform(rng, 0, 9), 0, Uniform(rng, 0, 9)};
  s.consecutive_trips = Uniform(rng, 0, 3);
  s.has_replay = with_replay;
  ReplayState& r = s.replay;
  r.capacity = Uniform(rng, 1, 40);
  r.rows.obs_dim = spec->obs_dim;
  r.rows.num_branches = spec->num_branches();
  if (with_replay) {
    r.size = Uniform(rng, 0, static_cast<int>(r.capacity));
    r.cursor = r.size < r.capacity ? r.size : Uniform(rng, 0, static_cast<int>(r.capacity - 1));
    r.max_priority = std::uniform_real_distribution<float>(0.5f, 4)(rng);
    r.rows.n = r.size;
    r.rows.obs = RandomFloats(rng, r.size * spec->obs_dim);
    r.rows.next_obs = RandomFloats(rng, r.size * spec->obs_dim);
    for (int64_t i = 0; i < r.size; ++i) {
      for (int b = 0; b < spec->num_branches(); ++b)
        r.rows.actions.push_back(Uniform(rng, 0, spec->branch_actions[b] - 1));
      r.priorities.push_back(std::uniform_real_distribution<float>(0, r.max_priority)(rng));
    }
    r.rows.rewards = RandomFloats(rng, r.size);
    r.rows.discounts = RandomFloats(rng, r.size);
  }

  v1::CheckpointManifest& m = data.manifest;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_learner_step(s.steps);
  m.set_optimizer_step(s.applied_updates);
  m.set_policy_version(Uniform(rng, 0, 100));
  *m.mutable_config() = config;
  m.mutable_replay()->set_included(with_replay);
  m.mutable_replay()->set_capacity(r.capacity);
  m.mutable_replay()->set_size(r.size);
  m.mutable_replay()->set_cursor(r.cursor);
  m.mutable_replay()->set_max_priority(r.max_priority);
  for (int64_t t : s.guard_trips) m.mutable_guard()->add_trips(t);
  m.mutable_guard()->set_consecutive_trips(s.consecutive_trips);
  m.set_backend("cpu");
  return data;
}

template <typename T>
bool BitEqual(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void ExpectSameState(const BackendState& got, const BackendState& want) {
  EXPECT_EQ(got.steps, want.steps);
  EXPECT_EQ(got.applied_updates, want.applied_updates);
  EXPECT_TRUE(BitEqual(got.params, want.params));
  EXPECT_TRUE(BitEqual(got.target, want.target));
  EXPECT_TRUE(BitEqual(got.adam_m, want.adam_m));
  EXPECT_TRUE(BitEqual(got.adam_v, want.adam_v));
  EXPECT_EQ(got.guard_trips, want.guard_trips);
  EXPECT_EQ(got.consecutive_trips, want.consecutive_trips);
  EXPECT_EQ(got.has_replay, want.has_replay);
  const ReplayState& a = got.replay;
  const ReplayState& b = want.replay;
  EXPECT_EQ(a.capacity, b.capacity);
  EXPECT_EQ(a.size, b.size);
  EXPECT_EQ(a.cursor, b.cursor);
  EXPECT_EQ(a.max_priority, b.max_priority);
  EXPECT_EQ(a.rows.n, b.rows.n);
  EXPECT_EQ(a.rows.obs_dim, b.rows.obs_dim);
  EXPECT_EQ(a.rows.num_branches, b.rows.num_branches);
  EXPECT_TRUE(BitEqual(a.rows.obs, b.rows.obs));
  EXPECT_TRUE(BitEqual(a.rows.next_obs, b.rows.next_obs));
  EXPECT_TRUE(BitEqual(a.rows.actions, b.rows.actions));
  EXPECT_TRUE(BitEqual(a.rows.rewards, b.rows.rewards));
  EXPECT_TRUE(BitEqual(a.rows.discounts, b.rows.discounts));
  EXPECT_TRUE(BitEqual(a.priorities, b.priorities));
}

std::string Write(const std::string& root, const std::string& name, const CheckpointData& data) {
  absl::StatusOr<CheckpointWriteResult> result = WriteCheckpoint(root, name, data);
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return "";
  EXPECT_EQ(result->name, name);
  EXPECT_EQ(result->dir, root + "/" + name);
  EXPECT_GT(result->bytes, 0u);
  EXPECT_GE(result->seconds, 0);
  return result->dir;
}

mode_t Mode(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

std::vector<std::string> DirNames(const std::string& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CheckpointTest, RoundTripIsBitwise) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir() + "/a/b";  // parents are created
  for (int trial = 0; trial < 12; ++trial) {
    const bool with_replay = trial % 2 == 0;
    const int branches = trial < 4 ? 2 : Uniform(rng, 1, 3);
    const CheckpointData data = RandomData(rng, with_replay, branches);
    const std::string dir = Write(root, AutoCheckpointName(trial), data);
    absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameState(read->state, data.state);
    EXPECT_EQ(read->manifest.policy_version(), data.manifest.policy_version());
    EXPECT_EQ(read->manifest.config().SerializeAsString(), data.manifest.config().SerializeAsString());
    std::vector<std::string> files;
    for (const v1::CheckpointFile& f : read->manifest.files()) {
      files.push_back(f.name());
      EXPECT_EQ(f.bytes(), fs::file_size(dir + "/" + f.name())) << f.name();
    }
    std::vector<std::string> want = {"online.safetensors", "target.safetensors", "adam_m.safetensors",
                                     "adam_v.safetensors"};
    if (with_replay) want.push_back("replay.safetensors");
    EXPECT_EQ(files, want);
    EXPECT_EQ(fs::exists(dir + "/replay.safetensors"), with_replay);
  }
}

TEST(CheckpointTest, DirectoriesAre0700AndFiles0600) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir() + "/root";
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, true, 2));
  EXPECT_EQ(Mode(root), 0700u);
  EXPECT_EQ(Mode(dir), 0700u);
  const std::vector<std::string> files = DirNames(dir);
  EXPECT_EQ(files.size(), 7u);
  for (const std::string& f : files) EXPECT_EQ(Mode(dir + "/" + f), 0600u) << f;
  EXPECT_THAT(DirNames(root), ElementsAre("ckpt-1"));  // no .tmp- or .old- left over
}

TEST(CheckpointTest, TruncatedReplayIsDataLossNamingTheFile) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, true, 2);
  const std::string dir = Write(root, "ckpt-1", data);
  const std::string replay = dir + "/replay.safetensors";
  const auto size = fs::file_size(replay);
  fs::resize_file(replay, size - 3);
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsDataLoss(read.status())) << read.status();
  EXPECT_EQ(read.status().message(),
            absl::StrCat("replay.safetensors: ", size - 3, " bytes, manifest says ", size, " (truncated)"));
}

TEST(CheckpointTest, FlippedByteIsAChecksumMismatch) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, false, 1));
  const std::string online = dir + "/online.safetensors";
  std::string bytes = ReadAll(online);
  bytes[std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng)] ^= 0x10;
  WriteAll(online, bytes);
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsDataLoss(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("online.safetensors: checksum mismatch"));
}

TEST(CheckpointTest, ManifestIsVerifiedFirst) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, true, 1));
  const std::string manifest = ReadAll(dir + "/manifest.pbtxt");
  WriteAll(dir + "/manifest.pbtxt", manifest + " ");
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsDataLoss(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("manifest.pbtxt: checksum mismatch"));

  WriteAll(dir + "/manifest.pbtxt", manifest);
  ASSERT_TRUE(ReadCheckpoint(dir).ok());
  fs::remove(dir + "/manifest.crc32c");
  read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsDataLoss(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("manifest.pbtxt"));
}

TEST(CheckpointTest, OtherFormatVersionIsRefused) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, false, 1));
  RewriteManifest(dir, [](v1::CheckpointManifest* m) { m->set_format_version(7); });
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsFailedPrecondition(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("format version 7, this qstreamd reads 1"));
}

TEST(CheckpointTest, TensorsAreCheckedAgainstTheManifestNetwork) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, false, 1));
  RewriteManifest(dir, [](v1::CheckpointManifest* m) {
    m->mutable_config()->mutable_network()->set_trunk_hidden(0, m->config().network().trunk_hidden(0) + 1);
  });
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("online.safetensors: tensor trunk.0.weight: shape"));
}

// The bytes of every file of a checkpoint directory, by name.
std::map<std::string, std::string> DirBytes(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    out[e.path().filename().string()] = ReadAll(e.path().string());
  return out;
}

TEST(CheckpointTest, DecodeFromMemoryReadsWhatTheDirectoryReads) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  for (int trial = 0; trial < 4; ++trial) {
    const CheckpointData data = RandomData(rng, trial % 2 == 0, 1 + trial % 2);
    const std::string dir = Write(root, AutoCheckpointName(trial), data);
    std::map<std::string, std::string> files = DirBytes(dir);
    absl::StatusOr<CheckpointData> decoded = DecodeCheckpoint(files);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectSameState(decoded->state, data.state);
    // The same checks: a flipped byte, a missing file.
    files["target.safetensors"][3] ^= 0x01;
    EXPECT_THAT(DecodeCheckpoint(files).status().message(),
                HasSubstr("target.safetensors: checksum mismatch"));
    files.erase("target.safetensors");
    EXPECT_EQ(DecodeCheckpoint(files).status().message(),
              "target.safetensors: missing (listed in the manifest)");
    files.erase("manifest.pbtxt");
    EXPECT_EQ(DecodeCheckpoint(files).status().message(), "manifest.pbtxt: missing");
  }
}

// Sizes a manifest claims (network widths, replay size) are checked against
// the tensors of the files before anything is allocated for them: a manifest
// of a 34 GB network or a 2^40-row replay over small files is refused, not
// allocated.
TEST(CheckpointTest, ClaimedSizesAreCheckedAgainstTheFilesBeforeAllocating) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, true, 1));
  const std::map<std::string, std::string> files = DirBytes(dir);
  RewriteManifest(dir, [](v1::CheckpointManifest* m) {
    v1::NetworkConfig* net = m->mutable_config()->mutable_network();
    net->set_obs_dim(65536);
    net->clear_trunk_hidden();
    net->add_trunk_hidden(65536);
    net->add_trunk_hidden(65536);
  });
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("online.safetensors: tensor trunk.0.weight: shape"));

  for (const auto& [name, bytes] : files) WriteAll(dir + "/" + name, bytes);
  RewriteManifest(dir, [](v1::CheckpointManifest* m) {
    m->mutable_replay()->set_capacity(int64_t{1} << 40);
    m->mutable_replay()->set_size(int64_t{1} << 40);
    m->mutable_replay()->set_cursor(0);
  });
  read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("replay.safetensors: tensor obs: shape"));
  EXPECT_THAT(read.status().message(), HasSubstr("expected [1099511627776, "));
}

TEST(CheckpointTest, ReplayListingMustMatchTheManifest) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const std::string dir = Write(root, "ckpt-1", RandomData(rng, true, 2));
  RewriteManifest(dir, [](v1::CheckpointManifest* m) { m->mutable_replay()->set_included(false); });
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  EXPECT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("replay.safetensors is listed"));
  RewriteManifest(dir, [](v1::CheckpointManifest* m) {
    m->mutable_replay()->set_included(true);
    m->mutable_replay()->set_cursor(m->replay().capacity());
  });
  read = ReadCheckpoint(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(read.status())) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("do not fit capacity"));
}

TEST(CheckpointTest, WriteRefusesAStateThatDisagreesWithTheManifest) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, true, 2);
  data.state.params.pop_back();
  EXPECT_THAT(WriteCheckpoint(root, "ckpt-1", data).status().message(), HasSubstr("state.online"));
  data = RandomData(rng, true, 2);
  data.manifest.set_learner_step(data.state.steps + 1);
  EXPECT_THAT(WriteCheckpoint(root, "ckpt-1", data).status().message(), HasSubstr("manifest.learner_step"));
  EXPECT_TRUE(absl::IsInvalidArgument(WriteCheckpoint(root, "../x", RandomData(rng, false, 1)).status()));
  EXPECT_THAT(DirNames(root), IsEmpty());
}

TEST(CheckpointTest, ReadLatestFallsBackToTheNewestGoodOne) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData older = RandomData(rng, true, 2);
  older.state.steps = 10;
  older.manifest.set_learner_step(10);
  CheckpointData newer = older;
  newer.state.steps = 20;
  newer.manifest.set_learner_step(20);
  newer.state.params[0] += 1;
  Write(root, "ckpt-10", older);
  const std::string bad = Write(root, "ckpt-20", newer);
  std::string bytes = ReadAll(bad + "/target.safetensors");
  bytes.back() ^= 1;
  WriteAll(bad + "/target.safetensors", bytes);

  std::vector<std::string> refused;
  std::string dir;
  absl::StatusOr<CheckpointData> read = ReadLatestCheckpoint(root, older.manifest.config(), &refused, &dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(dir, root + "/ckpt-10");
  ExpectSameState(read->state, older.state);
  EXPECT_THAT(refused,
              ElementsAre(AllOf(HasSubstr(bad + ": "), HasSubstr("target.safetensors: checksum mismatch"))));

  // An incompatible running config refuses the good one too.
  v1::TrainerConfig running = older.manifest.config();
  running.mutable_network()->add_trunk_hidden(3);
  refused.clear();
  read = ReadLatestCheckpoint(root, running, &refused);
  EXPECT_FALSE(read.ok());
  EXPECT_FALSE(absl::IsNotFound(read.status()));
  ASSERT_EQ(refused.size(), 2u);
  EXPECT_THAT(refused[1], AllOf(HasSubstr(root + "/ckpt-10: "), HasSubstr("network.trunk_hidden")));
}

// A checkpoint whose config has no `loss` block (written before LossConfig
// existed, or without the options) restores under a running config that
// sets them: the options are not a network-shape change, only a listed
// difference. Without them the manifest stays free of `loss`, so a daemon
// built before LossConfig can still read it.
TEST(CheckpointTest, LossOptionsMayDifferFromTheCheckpoint) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, true, 2);
  FillDefaults(data.manifest.mutable_config());
  ASSERT_FALSE(data.manifest.config().has_loss());
  const std::string dir = Write(root, "ckpt-7", data);
  EXPECT_THAT(ReadAll(dir + "/manifest.pbtxt"), Not(HasSubstr("loss")));

  v1::TrainerConfig running = data.manifest.config();
  running.mutable_loss()->set_label_smoothing(0.25f);
  running.mutable_loss()->mutable_mse_blend()->set_start(1.0f);
  running.mutable_loss()->mutable_mse_blend()->set_steps(1000);
  std::vector<std::string> refused;
  absl::StatusOr<CheckpointData> read = ReadLatestCheckpoint(root, running, &refused);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(refused, IsEmpty());
  ExpectSameState(read->state, data.state);
  std::vector<std::string> differences;
  ASSERT_TRUE(CheckCompatible(read->manifest.config(), running, &differences).ok());
  EXPECT_THAT(differences, ElementsAre("loss.label_smoothing: 0 -> 0.25", "loss.mse_blend.start: 0 -> 1",
                                       "loss.mse_blend.steps: 0 -> 1000"));
}

TEST(CheckpointTest, ReadLatestIsNotFoundWithoutCheckpoints) {
  const std::string root = MakeTempDir();
  std::vector<std::string> refused;
  EXPECT_TRUE(absl::IsNotFound(ReadLatestCheckpoint(root + "/missing", DefaultConfig(), &refused).status()));
  EXPECT_TRUE(absl::IsNotFound(ReadLatestCheckpoint(root, DefaultConfig(), &refused).status()));
  EXPECT_THAT(refused, IsEmpty());
}

TEST(CheckpointTest, LeftoverTmpDirectoryIsIgnored) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, true, 2);
  Write(root, AutoCheckpointName(data.state.steps), data);
  // What a crash in the middle of writing a newer one leaves behind.
  const std::string tmp = root + "/.tmp-ckpt-99999999-12345";
  fs::create_directory(tmp);
  WriteAll(tmp + "/online.safetensors", "partial");
  WriteAll(tmp + "/manifest.pbtxt", "learner_step: 99999999");

  absl::StatusOr<std::vector<CheckpointEntry>> entries = ListCheckpoints(root);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 1u);
  EXPECT_EQ((*entries)[0].learner_step, data.state.steps);
  EXPECT_TRUE((*entries)[0].automatic);
  std::vector<std::string> refused;
  absl::StatusOr<CheckpointData> read = ReadLatestCheckpoint(root, data.manifest.config(), &refused);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(refused, IsEmpty());
  ExpectSameState(read->state, data.state);
}

TEST(CheckpointTest, WritingAnExistingNameReplacesIt) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  const CheckpointData first = RandomData(rng, true, 2);
  const CheckpointData second = RandomData(rng, false, 3);
  Write(root, "before_exp.v2", first);
  const std::string dir = Write(root, "before_exp.v2", second);
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameState(read->state, second.state);
  EXPECT_FALSE(fs::exists(dir + "/replay.safetensors"));
  EXPECT_THAT(DirNames(root), ElementsAre("before_exp.v2"));
}

TEST(CheckpointTest, CheckCompatibleNamesTheShapeFieldAndListsTheRest) {
  v1::TrainerConfig saved;
  saved.mutable_network()->add_trunk_hidden(64);
  saved.mutable_network()->add_trunk_hidden(64);
  saved.mutable_optimizer()->set_lr(0.001f);
  v1::TrainerConfig running = saved;
  running.mutable_network()->set_trunk_hidden(0, 128);
  running.mutable_optimizer()->set_lr(0.0005f);
  std::vector<std::string> differences;
  absl::Status s = CheckCompatible(saved, running, &differences);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(s.message(),
            "network.trunk_hidden: checkpoint [64, 64], running [128, 64] (changes the network shape)");

  running.mutable_network()->set_trunk_hidden(0, 64);
  running.mutable_replay();  // an empty sub-message equals the defaults
  differences.clear();
  ASSERT_TRUE(CheckCompatible(saved, running, &differences).ok());
  EXPECT_THAT(differences, ElementsAre("optimizer.lr: 0.001 -> 0.0005"));

  // Defaults are filled on both sides: an empty trunk is [64, 64].
  v1::TrainerConfig bare;
  differences.clear();
  EXPECT_TRUE(CheckCompatible(bare, DefaultConfig(), &differences).ok());
  EXPECT_THAT(differences, IsEmpty());
  v1::TrainerConfig other_branches = DefaultConfig();
  other_branches.mutable_network()->set_branch_actions(0, 3);
  EXPECT_THAT(CheckCompatible(bare, other_branches, &differences).message(),
              HasSubstr("network.branch_actions: checkpoint [2], running [3]"));
}

TEST(CheckpointTest, ValidateCheckpointName) {
  for (const std::string& bad : {std::string(""), std::string("."), std::string(".."), std::string("a/b"),
                                 std::string("/abs"), std::string("a\0b", 3), std::string(129, 'x'),
                                 std::string(".hidden"), std::string("sp ace"), std::string("ü")}) {
    absl::Status s = ValidateCheckpointName(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << absl::CHexEscape(bad);
    EXPECT_LT(s.message().size(), 128u * 4 + 80) << absl::CHexEscape(bad);
  }
  for (const std::string& good :
       {std::string("ckpt-12"), std::string("before_exp.v2"), std::string(128, 'x')}) {
    EXPECT_TRUE(ValidateCheckpointName(good).ok()) << good;
  }
  EXPECT_EQ(AutoCheckpointName(12), "ckpt-12");
}

TEST(CheckpointTest, ListSortsNewestFirstAndUnreadableLast) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, false, 1);
  for (int64_t step : {5, 30, 12}) {
    data.state.steps = step;
    data.manifest.set_learner_step(step);
    Write(root, AutoCheckpointName(step), data);
  }
  Write(root, "named", data);  // step 12 too
  fs::create_directory(root + "/broken");
  absl::StatusOr<std::vector<CheckpointEntry>> entries = ListCheckpoints(root);
  ASSERT_TRUE(entries.ok()) << entries.status();
  std::vector<std::string> names;
  for (const CheckpointEntry& e : *entries)
    names.push_back(absl::StrCat(e.name, ":", e.learner_step, ":", e.automatic));
  EXPECT_THAT(names, ElementsAre("ckpt-30:30:1", "ckpt-12:12:1", "named:12:0", "ckpt-5:5:1", "broken:-1:0"));
  EXPECT_TRUE(absl::IsNotFound(ListCheckpoints(root + "/nope").status()));
}

TEST(CheckpointTest, PruneKeepsTheNewestAutomaticAndEveryNamedOne) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string root = MakeTempDir();
  CheckpointData data = RandomData(rng, false, 1);
  for (int64_t step = 1; step <= 5; ++step) {
    data.state.steps = step;
    data.manifest.set_learner_step(step);
    Write(root, AutoCheckpointName(step), data);
    if (step == 1) Write(root, "ancient", data);
  }
  const std::string own_tmp = absl::StrCat(".tmp-ckpt-6-", ::getpid());
  fs::create_directory(root + "/" + own_tmp);
  fs::create_directory(root + "/.tmp-ckpt-6-999999999");
  // A replaced copy whose replacement is complete is a leftover; one whose
  // replacement never arrived is the only copy and stays.
  fs::create_directory(root + "/.old-ckpt-5-999999999");
  fs::create_directory(root + "/.old-gone-999999999");
  ASSERT_TRUE(PruneCheckpoints(root, 2).ok());
  EXPECT_THAT(DirNames(root), ElementsAre(".old-gone-999999999", own_tmp, "ancient", "ckpt-4", "ckpt-5"));
  ASSERT_TRUE(PruneCheckpoints(root, 1).ok());
  EXPECT_THAT(DirNames(root), ElementsAre(".old-gone-999999999", own_tmp, "ancient", "ckpt-5"));
  EXPECT_TRUE(absl::IsInvalidArgument(PruneCheckpoints(root, 0)));
}

}  // namespace
}  // namespace qstream
