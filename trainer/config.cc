#include "trainer/config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "trainer/network_spec.h"

namespace qstream {

void FillDefaults(v1::TrainerConfig* config) {
  auto* net = config->mutable_network();
  if (net->trunk_hidden_size() == 0) {
    net->add_trunk_hidden(64);
    net->add_trunk_hidden(64);
  }
  if (net->branch_actions_size() == 0) net->add_branch_actions(2);
  // Touch every sub-message so the effective config prints all defaults.
  config->mutable_optimizer();
  config->mutable_replay();
  config->mutable_rate_limiter();
  config->mutable_guard();
  config->mutable_returns();
  config->mutable_server();
  // `loss` stays unset unless given: the config is copied into every
  // checkpoint manifest, and a daemon built before LossConfig existed can
  // then still restore checkpoints that do not use it.
}

v1::TrainerConfig DefaultConfig() {
  v1::TrainerConfig c;
  FillDefaults(&c);
  return c;
}

namespace {

absl::Status Bad(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

bool Finite(double x) { return std::isfinite(x); }

}  // namespace

v1::TrainerConfig::MatmulPrecision MatmulPrecision(const v1::TrainerConfig& c) {
  if (!c.has_matmul_precision() && c.has_allow_tf32() && !c.allow_tf32()) return v1::TrainerConfig::FP32;
  return c.matmul_precision();
}

absl::Status ValidateConfig(const v1::TrainerConfig& c) {
  if (auto spec = NetworkSpec::Create(c.network()); !spec.ok()) return spec.status();
  if (c.has_allow_tf32() && !c.allow_tf32() && c.has_matmul_precision() &&
      c.matmul_precision() != v1::TrainerConfig::FP32) {
    return Bad("matmul_precision", "contradicts allow_tf32: false (drop allow_tf32, it is deprecated)");
  }
  const auto& o = c.optimizer();
  if (!Finite(o.lr()) || o.lr() <= 0) return Bad("optimizer.lr", "must be > 0");
  if (!Finite(o.lr_end()) || o.lr_end() < 0) return Bad("optimizer.lr_end", "must be >= 0");
  if (o.lr_decay_steps() < 0) return Bad("optimizer.lr_decay_steps", "must be >= 0");
  if (!(o.beta1() >= 0 && o.beta1() < 1)) return Bad("optimizer.beta1", "must be in [0, 1)");
  if (!(o.beta2() >= 0 && o.beta2() < 1)) return Bad("optimizer.beta2", "must be in [0, 1)");
  if (!Finite(o.epsilon()) || o.epsilon() <= 0) return Bad("optimizer.epsilon", "must be > 0");
  if (!Finite(o.clip_grad_norm())) return Bad("optimizer.clip_grad_norm", "must be finite");
  if (!(o.target_tau() >= 0 && o.target_tau() <= 1)) return Bad("optimizer.target_tau", "must be in [0, 1]");
  if (o.target_update_period() < 0) return Bad("optimizer.target_update_period", "must be >= 0");
  const auto& r = c.replay();
  if (r.capacity() < 1 || r.capacity() > (int64_t{1} << 31)) return Bad("replay.capacity", "must be in [1, 2^31]");
  if (r.batch_size() < 1 || r.batch_size() > 65536) return Bad("replay.batch_size", "must be in [1, 65536]");
  if (!(r.alpha() >= 0 && r.alpha() <= 1)) return Bad("replay.alpha", "must be in [0, 1]");
  if (!(r.beta_start() >= 0 && r.beta_start() <= 1)) return Bad("replay.beta_start", "must be in [0, 1]");
  if (!(r.beta_end() >= 0 && r.beta_end() <= 1)) return Bad("replay.beta_end", "must be in [0, 1]");
  if (r.beta_anneal_steps() < 0) return Bad("replay.beta_anneal_steps", "must be >= 0");
  if (!Finite(r.priority_epsilon()) || r.priority_epsilon() <= 0)
    return Bad("replay.priority_epsilon", "must be > 0");
  const auto& l = c.rate_limiter();
  if (l.min_size_to_sample() < 1) return Bad("rate_limiter.min_size_to_sample", "must be >= 1");
  if (l.min_size_to_sample() > r.capacity())
    return Bad("rate_limiter.min_size_to_sample", "must be <= replay.capacity");
  if (!Finite(l.samples_per_insert())) return Bad("rate_limiter.samples_per_insert", "must be finite");
  if (!Finite(l.error_buffer()) || l.error_buffer() < 0) return Bad("rate_limiter.error_buffer", "must be >= 0");
  const auto& g = c.guard();
  if (!Finite(g.max_abs_q()) || g.max_abs_q() < 0) return Bad("guard.max_abs_q", "must be >= 0");
  if (!Finite(g.max_grad_norm()) || g.max_grad_norm() < 0) return Bad("guard.max_grad_norm", "must be >= 0");
  const auto& ret = c.returns();
  if (ret.n_step() < 1 || ret.n_step() > 1000) return Bad("returns.n_step", "must be in [1, 1000]");
  if (!(ret.gamma() >= 0 && ret.gamma() <= 1)) return Bad("returns.gamma", "must be in [0, 1]");
  const auto& s = c.server();
  if (s.max_batch_transitions() < 1) return Bad("server.max_batch_transitions", "must be >= 1");
  if (s.max_message_bytes() < 1024) return Bad("server.max_message_bytes", "must be >= 1024");
  if (s.publish_every() < 1) return Bad("server.publish_every", "must be >= 1");
  if (s.stats_every() < 1) return Bad("server.stats_every", "must be >= 1");
  if (s.max_streams() < 1) return Bad("server.max_streams", "must be >= 1");
  if (!Finite(s.stream_resume_seconds()) || s.stream_resume_seconds() < 0)
    return Bad("server.stream_resume_seconds", "must be >= 0");
  if (s.max_sessions() < 1) return Bad("server.max_sessions", "must be >= 1");
  if (!Finite(s.session_ttl_seconds()) || s.session_ttl_seconds() < s.stream_resume_seconds())
    return Bad("server.session_ttl_seconds", "must be >= server.stream_resume_seconds");
  if (s.max_stream_id_bytes() < 1 || s.max_stream_id_bytes() > 4096)
    return Bad("server.max_stream_id_bytes", "must be in [1, 4096]");
  if (s.max_envs_per_stream() < 1) return Bad("server.max_envs_per_stream", "must be >= 1");
  if (s.max_queued_bytes() < 1) return Bad("server.max_queued_bytes", "must be >= 1");
  if (s.max_in_flight_per_stream() < 1 || s.max_in_flight_per_stream() > 4096)
    return Bad("server.max_in_flight_per_stream", "must be in [1, 4096]");
  if (!Finite(s.liveness_timeout_seconds()) || s.liveness_timeout_seconds() < 0)
    return Bad("server.liveness_timeout_seconds", "must be >= 0 (0 disables)");
  if (s.max_evaluate_observations() < 1) return Bad("server.max_evaluate_observations", "must be >= 1");
  if (g.max_consecutive_trips() < 0) return Bad("guard.max_consecutive_trips", "must be >= 0");
  const auto& k = c.checkpoint();
  if (k.every_steps() < 0) return Bad("checkpoint.every_steps", "must be >= 0");
  if (!Finite(k.every_seconds()) || k.every_seconds() < 0) return Bad("checkpoint.every_seconds", "must be >= 0");
  if (k.keep() < 1) return Bad("checkpoint.keep", "must be >= 1");
  const auto& loss = c.loss();
  if (!(loss.label_smoothing() >= 0 && loss.label_smoothing() < 1))
    return Bad("loss.label_smoothing", "must be in [0, 1)");
  const auto& blend = loss.mse_blend();
  if (!(blend.start() >= 0 && blend.start() <= 1)) return Bad("loss.mse_blend.start", "must be in [0, 1]");
  if (!(blend.end() >= 0 && blend.end() <= 1)) return Bad("loss.mse_blend.end", "must be in [0, 1]");
  if (blend.steps() < 0) return Bad("loss.mse_blend.steps", "must be >= 0");
  const auto& d = c.distributed();
  if (d.world_size() < 1 || d.world_size() > 1024)
    return Bad("distributed.world_size", "must be in [1, 1024]");
  if (d.rank() < 0 || d.rank() >= d.world_size())
    return Bad("distributed.rank", absl::StrCat("must be in [0, world_size = ", d.world_size(), ")"));
  if (d.world_size() > 1 && d.rendezvous_address().empty())
    return Bad("distributed.rendezvous_address", "is required when world_size > 1 (host:port of rank 0)");
  if (!Finite(d.rendezvous_timeout_seconds()) || d.rendezvous_timeout_seconds() <= 0)
    return Bad("distributed.rendezvous_timeout_seconds", "must be > 0");
  return absl::OkStatus();
}

namespace {

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty()) first_ = absl::StrCat("line ", line + 1, ":", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

}  // namespace

absl::StatusOr<v1::TrainerConfig> ParseConfig(const std::string& text) {
  v1::TrainerConfig c;
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &c)) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", errors.first()));
  }
  FillDefaults(&c);
  if (auto st = ValidateConfig(c); !st.ok()) return st;
  return c;
}

absl::StatusOr<v1::TrainerConfig> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("config file not readable: ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseConfig(ss.str());
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

std::string ConfigSummary(const v1::TrainerConfig& c) {
  const auto& n = c.network();
  return absl::StrCat("obs=", n.obs_dim(), " trunk=[", absl::StrJoin(n.trunk_hidden(), ","),
                      "] head=", n.head_hidden(), " atoms=", n.num_atoms(), " branches=[",
                      absl::StrJoin(n.branch_actions(), ","), "] batch=", c.replay().batch_size(),
                      " capacity=", c.replay().capacity(), " n_step=", c.returns().n_step(),
                      " gamma=", c.returns().gamma(), " lr=", c.optimizer().lr(),
                      " spi=", c.rate_limiter().samples_per_insert());
}

absl::StatusOr<v1::TrainerConfig> BenchConfig(const std::string& name) {
  v1::TrainerConfig c;
  auto* n = c.mutable_network();
  if (name == "h200") {
    n->set_obs_dim(48);
    n->add_trunk_hidden(256);
    n->add_trunk_hidden(256);
    n->set_head_hidden(128);
    for (int i = 0; i < 4; ++i) n->add_branch_actions(5);
    c.mutable_replay()->set_capacity(int64_t{1} << 20);
    c.mutable_optimizer()->set_lr(1e-4f);
  } else if (name == "small") {
    n->set_obs_dim(4);
    n->add_trunk_hidden(64);
    n->add_trunk_hidden(64);
    n->set_head_hidden(64);
    n->add_branch_actions(2);
    c.mutable_replay()->set_capacity(int64_t{1} << 16);
    c.mutable_optimizer()->set_lr(1e-3f);
  } else {
    return absl::NotFoundError(absl::StrCat("unknown bench config '", name, "' (known: h200, small)"));
  }
  n->set_num_atoms(51);
  n->set_v_min(-10);
  n->set_v_max(10);
  c.mutable_returns()->set_n_step(3);
  c.mutable_returns()->set_gamma(0.99f);
  c.mutable_replay()->set_alpha(0.6f);
  c.mutable_replay()->set_beta_start(0.4f);
  c.mutable_optimizer()->set_clip_grad_norm(10);
  c.mutable_optimizer()->set_target_tau(0.005f);
  FillDefaults(&c);
  return c;
}

}  // namespace qstream
