// Writes the committed seed corpora and dictionaries of the fuzz targets:
//
//   build-fuzz/fuzz/fuzz_seeds fuzz     (from the source root)
//
// fuzz/corpus/<target>/<name>: valid inputs and near misses (one field
// wrong), small so every execution stays fast; fuzz/<target>.dict: the
// text-format field names (from the descriptors) and format keywords.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/text_format.h"
#include "proto/tensor.h"
#include "qstream/v1/checkpoint.pb.h"
#include "qstream/v1/experience.pb.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/network_spec.h"

namespace qstream {
namespace {

namespace fs = std::filesystem;
namespace pb = google::protobuf;

void Write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- transition_batch: varint-delimited TransitionBatch messages ----------

constexpr int kObsDim = 4;  // the fuzz target's network

v1::TransitionBatch StepBatch(const std::string& stream_id, uint64_t sequence, int count,
                              const std::vector<uint32_t>& env_ids = {}) {
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  b.set_stream_id(stream_id);
  b.set_sequence(sequence);
  b.set_count(count);
  std::vector<float> obs, next_obs, rewards;
  std::vector<int32_t> actions;
  for (int i = 0; i < count; ++i) {
    for (int d = 0; d < kObsDim; ++d) {
      obs.push_back(0.1f * (i + d));
      next_obs.push_back(0.1f * (i + d + 1));
    }
    actions.push_back(i % 2);
    rewards.push_back(i % 3 == 0 ? 1.0f : 0.0f);
  }
  wire::SetTensor(b.mutable_obs(), obs, {count, kObsDim});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {count, kObsDim});
  wire::SetTensor(b.mutable_actions(), actions, {count, 1});
  wire::SetTensor(b.mutable_rewards(), rewards, {count});
  wire::SetBoolTensor(b.mutable_done(), std::vector<bool>(count, false));
  if (!env_ids.empty()) wire::SetTensor(b.mutable_env_ids(), env_ids, {static_cast<int64_t>(env_ids.size())});
  b.set_policy_version(static_cast<int64_t>(sequence));
  return b;
}

std::string Delimited(const std::vector<std::string>& messages) {
  std::string out;
  {
    pb::io::StringOutputStream stream(&out);
    pb::io::CodedOutputStream coded(&stream);
    for (const std::string& m : messages) {
      coded.WriteVarint32(static_cast<uint32_t>(m.size()));
      coded.WriteRaw(m.data(), static_cast<int>(m.size()));
    }
  }
  return out;
}

std::string Delimited(const std::vector<v1::TransitionBatch>& batches) {
  std::vector<std::string> messages;
  for (const v1::TransitionBatch& b : batches) messages.push_back(b.SerializeAsString());
  return Delimited(messages);
}

void TransitionBatchSeeds(const fs::path& dir) {
  // One env over three batches, the episode ending in the second.
  v1::TransitionBatch a = StepBatch("actor-1", 1, 2);
  v1::TransitionBatch b = StepBatch("actor-1", 2, 3);
  wire::SetElement(b.mutable_done(), 2, uint8_t{1});
  v1::TransitionBatch c = StepBatch("actor-1", 3, 4);
  Write(dir / "step_one_env", Delimited({a, b, c}));

  // Interleaved envs, a time-limit cut, no stream_id.
  v1::TransitionBatch m1 = StepBatch("", 0, 4, {0, 1, 2, 1});
  wire::SetBoolTensor(m1.mutable_truncated(), {false, true, false, false});
  v1::TransitionBatch m2 = StepBatch("", 0, 3, {2, 0, 3});
  wire::SetElement(m2.mutable_done(), 0, uint8_t{1});
  Write(dir / "step_envs_truncated", Delimited({m1, m2}));

  // The step-stream form (no next_obs; final_obs at the rows that end),
  // interleaved with a full-form batch of the same envs.
  v1::TransitionBatch s1 = StepBatch("stream-1", 1, 4, {0, 1, 0, 1});
  s1.clear_next_obs();
  wire::SetBoolTensor(s1.mutable_done(), {false, false, true, false});
  wire::SetTensor(s1.mutable_final_obs(), std::vector<float>(kObsDim, 0.5f), {1, kObsDim});
  v1::TransitionBatch s2 = StepBatch("stream-1", 2, 2, {1, 0});
  v1::TransitionBatch s3 = StepBatch("stream-1", 3, 3, {0, 1, 1});
  s3.clear_next_obs();
  wire::SetBoolTensor(s3.mutable_truncated(), {false, true, false});
  wire::SetTensor(s3.mutable_final_obs(), std::vector<float>(kObsDim, -0.5f), {1, kObsDim});
  Write(dir / "step_stream_form", Delimited({s1, s2, s3}));

  // More envs than the session holds.
  Write(dir / "step_too_many_envs", Delimited({StepBatch("s", 1, 6, {0, 1, 2, 3, 4, 5})}));

  // Client-assembled n-step items.
  v1::TransitionBatch n = StepBatch("nstep@host:1", 1, 2);
  n.set_kind(v1::TransitionBatch::KIND_NSTEP);
  n.clear_done();
  wire::SetTensor(n.mutable_discounts(), std::vector<float>{0.729f, 0.0f}, {2});
  Write(dir / "nstep", Delimited({n}));

  // Near misses: one field wrong each.
  v1::TransitionBatch bad_id = StepBatch("has space", 1, 1);
  v1::TransitionBatch long_id = StepBatch(std::string(40, 'x'), 1, 1);
  v1::TransitionBatch short_obs = StepBatch("a", 1, 2);
  short_obs.mutable_obs()->mutable_data()->resize(short_obs.obs().data().size() - 4);
  v1::TransitionBatch bad_action = StepBatch("a", 2, 2);
  wire::SetElement(bad_action.mutable_actions(), 1, int32_t{2});
  v1::TransitionBatch nan_reward = StepBatch("a", 3, 1);
  wire::SetElement(nan_reward.mutable_rewards(), 0, std::numeric_limits<float>::quiet_NaN());
  v1::TransitionBatch done_and_truncated = StepBatch("a", 4, 1);
  wire::SetElement(done_and_truncated.mutable_done(), 0, uint8_t{1});
  wire::SetBoolTensor(done_and_truncated.mutable_truncated(), {true});
  v1::TransitionBatch unspecified = StepBatch("a", 5, 1);
  unspecified.set_kind(v1::TransitionBatch::KIND_UNSPECIFIED);
  v1::TransitionBatch bad_shape = StepBatch("a", 6, 2);
  bad_shape.mutable_obs()->set_shape(1, kObsDim + 1);
  v1::TransitionBatch bad_dtype = StepBatch("a", 7, 2);
  bad_dtype.mutable_actions()->set_dtype(v1::Tensor::DTYPE_UINT32);
  v1::TransitionBatch bad_flag = StepBatch("a", 8, 2);
  wire::SetElement(bad_flag.mutable_done(), 1, uint8_t{7});
  Write(dir / "near_misses", Delimited({bad_id, long_id, short_obs, bad_action, nan_reward,
                                        done_and_truncated, unspecified, bad_shape, bad_dtype, bad_flag}));

  // Bytes that do not parse, then a good batch on the same stream.
  const std::string good = StepBatch("a", 1, 1).SerializeAsString();
  Write(dir / "truncated_message", Delimited({good.substr(0, good.size() - 3), good}));
}

// ---- config: text-format TrainerConfig ------------------------------------

std::string Text(const pb::Message& m) {
  std::string text;
  pb::TextFormat::PrintToString(m, &text);
  return text;
}

void ConfigSeeds(const fs::path& dir) {
  Write(dir / "default", Text(DefaultConfig()));
  Write(dir / "bench_small", Text(*BenchConfig("small")));
  Write(dir / "minimal", "network { obs_dim: 4 branch_actions: [2, 3] }\n");
  Write(
      dir / "comments_and_lists",
      "# a comment\nnetwork { obs_dim: 8 trunk_hidden: [32, 32] head_hidden: 16 num_atoms: 11 "
      "v_min: -5 v_max: 5 }\nreplay < capacity: 1000 batch_size: 32 alpha: 0.6 >\n"
      "returns { n_step: 5 gamma: 0.99 }\nrate_limiter { min_size_to_sample: 100 samples_per_insert: 4 }\n");
  Write(dir / "out_of_range", "replay { alpha: 2 }\n");
  Write(dir / "min_size_above_capacity", "replay { capacity: 10 } rate_limiter { min_size_to_sample: 11 }\n");
  Write(dir / "nan", "optimizer { lr: nan }\n");
  Write(dir / "unknown_field", "network { obs_dim: 4 width: 3 }\n");
  Write(dir / "syntax_error", "network { obs_dim: 4\n");
}

// ---- checkpoint: u32 manifest length | manifest | listed files -------------

v1::TrainerConfig SmallNetworkConfig(int branches) {
  v1::TrainerConfig config = DefaultConfig();
  v1::NetworkConfig* net = config.mutable_network();
  net->set_obs_dim(2);
  net->clear_trunk_hidden();
  net->add_trunk_hidden(4);
  net->set_head_hidden(4);
  net->set_num_atoms(3);
  net->clear_branch_actions();
  for (int b = 0; b < branches; ++b) net->add_branch_actions(2 + b);
  config.mutable_replay()->set_capacity(4);
  config.mutable_rate_limiter()->set_min_size_to_sample(1);
  return config;
}

CheckpointData SmallCheckpoint(int branches, bool with_replay) {
  CheckpointData data;
  data.manifest.set_format_version(kCheckpointFormatVersion);
  *data.manifest.mutable_config() = SmallNetworkConfig(branches);
  const NetworkSpec spec = *NetworkSpec::Create(data.manifest.config().network());
  BackendState& s = data.state;
  s.steps = 7;
  s.applied_updates = 5;
  s.params = InitParams(spec, 1);
  s.target = InitParams(spec, 2);
  s.adam_m.assign(static_cast<size_t>(spec.num_params), 0.01f);
  s.adam_v.assign(static_cast<size_t>(spec.num_params), 0.001f);
  s.guard_trips = {0, 1, 0, 0, 0};
  s.has_replay = with_replay;
  data.manifest.set_learner_step(s.steps);
  data.manifest.set_optimizer_step(s.applied_updates);
  for (int64_t t : s.guard_trips) data.manifest.mutable_guard()->add_trips(t);
  v1::CheckpointManifest::Replay* r = data.manifest.mutable_replay();
  r->set_included(with_replay);
  r->set_capacity(4);
  r->set_max_priority(1);
  s.replay.capacity = 4;
  s.replay.rows.obs_dim = spec.obs_dim;
  s.replay.rows.num_branches = spec.num_branches();
  if (with_replay) {
    ReplayState& rs = s.replay;
    rs.size = 3;
    rs.cursor = 3;
    rs.rows.n = 3;
    for (int i = 0; i < 3; ++i) {
      for (int d = 0; d < spec.obs_dim; ++d) {
        rs.rows.obs.push_back(0.5f * i + d);
        rs.rows.next_obs.push_back(0.5f * i + d + 0.25f);
      }
      for (int b = 0; b < spec.num_branches(); ++b) rs.rows.actions.push_back(i % spec.branch_actions[b]);
      rs.rows.rewards.push_back(static_cast<float>(i));
      rs.rows.discounts.push_back(0.9f);
      rs.priorities.push_back(1.0f);
    }
    r->set_size(3);
    r->set_cursor(3);
  }
  return data;
}

std::string Le32(uint32_t n) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// The fuzz input for the checkpoint in `dir`, its manifest passed through `edit`.
std::string Pack(const fs::path& dir, const std::function<void(v1::CheckpointManifest*)>& edit = nullptr) {
  v1::CheckpointManifest m;
  if (!pb::TextFormat::ParseFromString(ReadAll(dir / "manifest.pbtxt"), &m)) std::exit(1);
  std::string files;
  for (const v1::CheckpointFile& f : m.files()) files += ReadAll(dir / f.name());
  if (edit) edit(&m);
  const std::string text = Text(m);
  return Le32(static_cast<uint32_t>(text.size())) + text + files;
}

void CheckpointSeeds(const fs::path& dir) {
  const fs::path tmp = fs::temp_directory_path() / absl::StrCat("fuzz_seeds.", ::getpid());
  struct Variant {
    const char* name;
    int branches;
    bool replay;
  };
  for (const Variant& v : {Variant{"weights_only", 1, false}, Variant{"with_replay", 1, true},
                           Variant{"two_branches_replay", 2, true}}) {
    absl::StatusOr<CheckpointWriteResult> written =
        WriteCheckpoint(tmp.string(), v.name, SmallCheckpoint(v.branches, v.replay));
    if (!written.ok()) {
      std::fprintf(stderr, "fuzz_seeds: %s\n", written.status().ToString().c_str());
      std::exit(1);
    }
    Write(dir / v.name, Pack(written->dir));
  }
  const fs::path ckpt = tmp / "with_replay";
  Write(dir / "crc_mismatch", Pack(ckpt, [](v1::CheckpointManifest* m) {
          m->mutable_files(0)->set_crc32c(m->files(0).crc32c() ^ 1);
        }));
  Write(dir / "wrong_network", Pack(ckpt, [](v1::CheckpointManifest* m) {
          m->mutable_config()->mutable_network()->set_trunk_hidden(0, 5);
        }));
  Write(dir / "replay_beyond_file", Pack(ckpt, [](v1::CheckpointManifest* m) {
          m->mutable_replay()->set_capacity(int64_t{1} << 40);
          m->mutable_replay()->set_size(int64_t{1} << 40);
          m->mutable_replay()->set_cursor(0);
        }));
  Write(dir / "format_version", Pack(ckpt, [](v1::CheckpointManifest* m) { m->set_format_version(2); }));
  Write(dir / "with_ingest", Pack(ckpt, [](v1::CheckpointManifest* m) {
          v1::IngestSessionState* s = m->mutable_ingest()->add_sessions();
          s->set_stream_id("actor-1");
          s->set_last_sequence(9);
          v1::NStepWindowState* w = s->add_windows();
          w->set_env_id(3);
          for (float x : {0.1f, 0.2f}) w->add_obs(x);
          w->add_actions(1);
          w->add_rewards(1);
          for (float x : {0.3f, 0.4f}) w->add_last_next_obs(x);
        }));
  fs::remove_all(tmp);
}

// ---- dictionaries -----------------------------------------------------------

void FieldNames(const pb::Descriptor* d, std::set<const pb::Descriptor*>* seen, std::set<std::string>* out) {
  if (!seen->insert(d).second) return;
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    out->insert(f->name());
    if (f->enum_type() != nullptr) {
      for (int v = 0; v < f->enum_type()->value_count(); ++v) out->insert(f->enum_type()->value(v)->name());
    }
    if (f->message_type() != nullptr) FieldNames(f->message_type(), seen, out);
  }
}

void WriteDict(const fs::path& path, const pb::Descriptor* root, const std::vector<std::string>& extra) {
  std::set<const pb::Descriptor*> seen;
  std::set<std::string> words(extra.begin(), extra.end());
  FieldNames(root, &seen, &words);
  std::string out = absl::StrCat("# Generated by fuzz/seeds.cc from ", root->full_name(), ".\n");
  for (const std::string& w : words) {
    std::string escaped;
    for (char c : w) {
      if (c == '"' || c == '\\') escaped += '\\';
      escaped += c;
    }
    absl::StrAppend(&out, "\"", escaped, "\"\n");
  }
  Write(path, out);
}

}  // namespace
}  // namespace qstream

int main(int argc, char** argv) {
  using namespace qstream;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <fuzz dir of the source tree>\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* target : {"transition_batch", "config", "checkpoint"})
    fs::remove_all(root / "corpus" / target);
  TransitionBatchSeeds(root / "corpus" / "transition_batch");
  ConfigSeeds(root / "corpus" / "config");
  CheckpointSeeds(root / "corpus" / "checkpoint");
  const std::vector<std::string> text_format = {"{",    "}",     "<",   ">",    ":",   "[",  "]",   ",", "#",
                                                "true", "false", "inf", "-inf", "nan", "0x", "1e9", "-1"};
  WriteDict(root / "config.dict", v1::TrainerConfig::descriptor(), text_format);
  std::vector<std::string> checkpoint = text_format;
  for (const char* w : {"manifest.pbtxt",
                        "manifest.crc32c",
                        "online.safetensors",
                        "target.safetensors",
                        "adam_m.safetensors",
                        "adam_v.safetensors",
                        "replay.safetensors",
                        "__metadata__",
                        "dtype",
                        "shape",
                        "data_offsets",
                        "F32",
                        "I32",
                        "F16",
                        "format",
                        "qstream",
                        "buffer",
                        "trunk.0.weight",
                        "trunk.0.bias",
                        "value_hidden.weight",
                        "value_out.bias",
                        "adv_hidden.weight",
                        "adv_out.weight",
                        "obs",
                        "next_obs",
                        "actions",
                        "rewards",
                        "discounts",
                        "priorities"}) {
    checkpoint.push_back(w);
  }
  WriteDict(root / "checkpoint.dict", v1::CheckpointManifest::descriptor(), checkpoint);
  return 0;
}
