#include "trainer/distributed.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "trainer/config.h"

namespace qstream {

v1::TrainerConfig GroupLearnerConfig(const v1::TrainerConfig& config) {
  v1::TrainerConfig c = config;
  FillDefaults(&c);
  v1::TrainerConfig out;
  *out.mutable_network() = c.network();
  *out.mutable_optimizer() = c.optimizer();
  *out.mutable_guard() = c.guard();
  *out.mutable_loss() = c.loss();
  *out.mutable_returns() = c.returns();
  out.set_matmul_precision(MatmulPrecision(c));
  auto* r = out.mutable_replay();
  r->set_batch_size(c.replay().batch_size());
  r->set_alpha(c.replay().alpha());
  r->set_beta_start(c.replay().beta_start());
  r->set_beta_end(c.replay().beta_end());
  r->set_beta_anneal_steps(c.replay().beta_anneal_steps());
  r->set_priority_epsilon(c.replay().priority_epsilon());
  return out;
}

absl::Status CheckGroupConfig(const v1::TrainerConfig& rank0, const v1::TrainerConfig& joining, int rank) {
  google::protobuf::util::MessageDifferencer diff;
  // Unset and default are the same value here.
  diff.set_message_field_comparison(google::protobuf::util::MessageDifferencer::EQUIVALENT);
  std::string report;
  diff.ReportDifferencesToString(&report);
  if (diff.Compare(GroupLearnerConfig(rank0), GroupLearnerConfig(joining))) return absl::OkStatus();
  while (!report.empty() && report.back() == '\n') report.pop_back();
  return absl::FailedPreconditionError(
      absl::StrCat("distributed: rank ", rank,
                   "'s config differs from rank 0's (every rank must train the same network): ", report));
}

}  // namespace qstream
