#include "clients/cpp/writer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/episode_limits.h"
#include "proto/tensor.h"

namespace qstream::actor {

// The columns of one batch being filled, sized for flush_transitions rows.
struct Writer::Columns {
  explicit Columns(const WriterOptions& o)
      : obs(static_cast<size_t>(o.flush_transitions) * o.obs_dim),
        next_obs(obs.size()),
        actions(static_cast<size_t>(o.flush_transitions) * o.num_branches),
        rewards(o.flush_transitions),
        done(o.flush_transitions),
        truncated(o.flush_transitions),
        env_ids(o.flush_transitions) {}

  // One message from the first `count` rows (one copy per column) and the
  // episode reports; with no row, the reports alone.
  v1::TransitionBatch ToBatch(const WriterOptions& o) const {
    const int64_t n = count;
    v1::TransitionBatch b;
    b.set_kind(v1::TransitionBatch::KIND_STEP);
    b.set_count(static_cast<uint32_t>(n));
    if (!episodes.empty()) {
      b.set_env(o.env);
      b.mutable_episodes()->Add(episodes.begin(), episodes.end());
    }
    if (n == 0) {
      int64_t oldest = std::numeric_limits<int64_t>::max();
      for (const auto& e : episodes) oldest = std::min(oldest, e.policy_version());
      b.set_policy_version(episodes.empty() ? 0 : oldest);
      return b;
    }
    b.set_policy_version(policy_version);
    wire::SetTensor(b.mutable_obs(), obs.data(), n * o.obs_dim, {n, o.obs_dim});
    if (full_form || !o.step_stream) {
      wire::SetTensor(b.mutable_next_obs(), next_obs.data(), n * o.obs_dim, {n, o.obs_dim});
    } else {
      // The step-stream form: no next_obs, the final obs of the rows that end.
      std::vector<float> final_obs;
      for (int64_t i = 0; i < n; ++i) {
        if (done[i] != 0 || truncated[i] != 0) {
          final_obs.insert(final_obs.end(), next_obs.begin() + i * o.obs_dim,
                           next_obs.begin() + (i + 1) * o.obs_dim);
        }
      }
      const auto ends = static_cast<int64_t>(final_obs.size()) / o.obs_dim;
      if (ends > 0) wire::SetTensor(b.mutable_final_obs(), final_obs, {ends, o.obs_dim});
    }
    wire::SetTensor(b.mutable_actions(), actions.data(), n * o.num_branches, {n, o.num_branches});
    wire::SetTensor(b.mutable_rewards(), rewards.data(), n, {n});
    wire::SetTensor(b.mutable_done(), done.data(), n, {n});
    if (any_truncated) wire::SetTensor(b.mutable_truncated(), truncated.data(), n, {n});
    wire::SetTensor(b.mutable_env_ids(), env_ids.data(), n, {n});
    return b;
  }

  void Clear() {
    count = 0;
    full_form = false;
    any_truncated = false;
    policy_version = std::numeric_limits<int64_t>::max();
    episodes.clear();
  }

  bool empty() const { return count == 0 && episodes.empty(); }

  std::vector<float> obs;
  std::vector<float> next_obs;
  std::vector<int32_t> actions;
  std::vector<float> rewards;
  std::vector<uint8_t> done;
  std::vector<uint8_t> truncated;
  std::vector<uint32_t> env_ids;
  int count = 0;
  // Sent with next_obs for every row (Flush, Close): the newest step of each
  // env then has its next state and leaves the daemon's window at the
  // stream's close. Else the step-stream form.
  bool full_form = false;
  bool any_truncated = false;  // an all-false truncated column is left unset
  int64_t policy_version = std::numeric_limits<int64_t>::max();  // oldest of the rows
  absl::Time first_append;                                       // of row 0
  std::vector<v1::EpisodeReport> episodes;                       // reported since the last hand-over
};

namespace {

absl::Status SizeError(const char* field, size_t got, size_t want) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", got, " values, expected ", want));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Writer>> Writer::Create(ExperienceStream& stream,
                                                       const WriterOptions& options) {
  if (options.obs_dim < 1) return absl::InvalidArgumentError("obs_dim must be >= 1");
  if (options.num_branches < 1) return absl::InvalidArgumentError("num_branches must be >= 1");
  if (options.num_envs < 1) return absl::InvalidArgumentError("num_envs must be >= 1");
  // One AppendStep then needs at most one buffer hand-over.
  if (options.flush_transitions < options.num_envs) {
    return absl::InvalidArgumentError("flush_transitions must be >= num_envs");
  }
  if (options.flush_after <= absl::ZeroDuration())
    return absl::InvalidArgumentError("flush_after must be > 0");
  if (static_cast<int64_t>(options.env.size()) > wire::kMaxEnvBytes ||
      wire::FirstBadEnvChar(options.env) >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("env: '", options.env, "' is not up to ",
                                                   wire::kMaxEnvBytes, " bytes of [A-Za-z0-9_.:/-]"));
  }
  return std::unique_ptr<Writer>(new Writer(stream, options));
}

Writer::Writer(ExperienceStream& stream, const WriterOptions& options)
    : options_(options),
      stream_(stream),
      filling_(std::make_unique<Columns>(options)),
      spare_(std::make_unique<Columns>(options)),
      accepted_at_start_(stream.totals().accepted_transitions) {
  sender_ = std::thread([this] { SendLoop(); });
}

Writer::~Writer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (sender_.joinable()) sender_.join();
}

void Writer::set_policy_version(int64_t version) {
  absl::MutexLock lock(&mu_);
  policy_version_ = version;
}

absl::Status Writer::ReportEpisode(double episode_return, int64_t length,
                                   std::optional<int64_t> policy_version) {
  if (!std::isfinite(episode_return) || std::abs(episode_return) > wire::kMaxAbsEpisodeReturn) {
    return absl::InvalidArgumentError(
        absl::StrCat("episode_return: ", episode_return, " is not a finite number in [-1e12, 1e12]"));
  }
  if (length < 1 || length > wire::kMaxEpisodeLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("length: ", length, " is not in [1, ", wire::kMaxEpisodeLength, "]"));
  }
  if (policy_version.has_value() && *policy_version < 0) {
    return absl::InvalidArgumentError(absl::StrCat("policy_version: ", *policy_version, " is negative"));
  }
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  if (closed_) return absl::FailedPreconditionError("writer is closed");
  if (static_cast<int>(filling_->episodes.size()) >= wire::kMaxEpisodesPerBatch) {
    if (!options_.block && spare_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("writer: ", wire::kMaxEpisodesPerBatch,
                       " episode reports wait while the daemon acknowledges earlier batches; retry later"));
    }
    auto spare_free = [this]()
                          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return spare_ != nullptr || !error_.ok(); };
    mu_.Await(absl::Condition(&spare_free));
    if (!error_.ok()) return error_;
    // The sender may have taken a full buffer meanwhile, reports and all.
    if (static_cast<int>(filling_->episodes.size()) >= wire::kMaxEpisodesPerBatch) HandOverLocked();
  }
  v1::EpisodeReport& r = filling_->episodes.emplace_back();
  r.set_episode_return(episode_return);
  r.set_length(static_cast<uint32_t>(length));
  r.set_policy_version(policy_version.value_or(policy_version_));
  return absl::OkStatus();
}

absl::Status Writer::Append(int env_id, std::span<const float> obs, std::span<const int32_t> actions,
                            float reward, bool terminated, bool truncated, std::span<const float> next_obs) {
  if (env_id < 0 || env_id >= options_.num_envs) {
    return absl::InvalidArgumentError(
        absl::StrCat("env_id ", env_id, " not in [0, ", options_.num_envs, ")"));
  }
  const uint8_t term = terminated ? 1 : 0;
  const uint8_t trunc = truncated ? 1 : 0;
  const VectorStep one{obs, actions, {&reward, 1}, {&term, 1}, {&trunc, 1}, next_obs};
  return AppendRows(one, 1, static_cast<uint32_t>(env_id));
}

absl::Status Writer::AppendStep(const VectorStep& step) { return AppendRows(step, options_.num_envs, 0); }

bool Writer::DueLocked(absl::Time now) const {
  return filling_->count > 0 && now >= filling_->first_append + options_.flush_after;
}

// Callers hold rows or reports in filling_ and a free spare_.
void Writer::HandOverLocked() {
  ready_ = std::move(filling_);
  filling_ = std::move(spare_);
}

absl::Status Writer::AppendRows(const VectorStep& rows, int count, uint32_t first_env) {
  const size_t n = static_cast<size_t>(count);
  const size_t obs_n = n * options_.obs_dim;
  if (rows.obs.size() != obs_n) return SizeError("obs", rows.obs.size(), obs_n);
  if (rows.next_obs.size() != obs_n) return SizeError("next_obs", rows.next_obs.size(), obs_n);
  if (rows.actions.size() != n * options_.num_branches) {
    return SizeError("actions", rows.actions.size(), n * options_.num_branches);
  }
  if (rows.rewards.size() != n) return SizeError("rewards", rows.rewards.size(), n);
  if (rows.terminated.size() != n) return SizeError("terminated", rows.terminated.size(), n);
  if (!rows.truncated.empty() && rows.truncated.size() != n) {
    return SizeError("truncated", rows.truncated.size(), n);
  }

  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  if (closed_) return absl::FailedPreconditionError("writer is closed");
  const int capacity = options_.flush_transitions;
  if (!options_.block && count > capacity - filling_->count && spare_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("writer: both buffers of ", capacity,
                                                     " transitions are full while the daemon acknowledges "
                                                     "earlier batches; nothing appended, retry later"));
  }
  const absl::Time now = absl::Now();
  // Back-pressure: the sender holds the other buffer until the stream has
  // room; once it is back, the sender may also have taken the full one.
  auto room = [this, capacity]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return spare_ != nullptr || filling_->count < capacity || !error_.ok();
  };
  const int obs_dim = options_.obs_dim;
  const int branches = options_.num_branches;
  for (int row = 0; row < count;) {
    if (filling_->count == capacity) {
      mu_.Await(absl::Condition(&room));
      if (!error_.ok()) return error_;
      if (filling_->count == capacity) HandOverLocked();
    }
    Columns& c = *filling_;
    const int take = std::min(count - row, capacity - c.count);
    if (c.count == 0) c.first_append = now;
    const size_t at = c.count;
    std::memcpy(&c.obs[at * obs_dim], &rows.obs[static_cast<size_t>(row) * obs_dim],
                sizeof(float) * take * obs_dim);
    std::memcpy(&c.next_obs[at * obs_dim], &rows.next_obs[static_cast<size_t>(row) * obs_dim],
                sizeof(float) * take * obs_dim);
    std::memcpy(&c.actions[at * branches], &rows.actions[static_cast<size_t>(row) * branches],
                sizeof(int32_t) * take * branches);
    std::memcpy(&c.rewards[at], &rows.rewards[row], sizeof(float) * take);
    for (int i = 0; i < take; ++i) {
      const bool terminated = rows.terminated[row + i] != 0;
      // The daemon refuses both flags: a terminal state is never bootstrapped.
      const bool truncated = !rows.truncated.empty() && rows.truncated[row + i] != 0 && !terminated;
      c.done[at + i] = terminated ? 1 : 0;
      c.truncated[at + i] = truncated ? 1 : 0;
      c.any_truncated = c.any_truncated || truncated;

      c.env_ids[at + i] = first_env + static_cast<uint32_t>(row + i);
    }
    c.policy_version = std::min(c.policy_version, policy_version_);
    c.count += take;
    row += take;
  }
  if (spare_ != nullptr && (filling_->count == capacity || DueLocked(now))) HandOverLocked();
  return absl::OkStatus();
}

void Writer::SendLoop() {
  while (true) {
    std::unique_ptr<Columns> batch;
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || ready_ != nullptr; };
      while (!stop_ && ready_ == nullptr) {
        if (filling_->count == 0) {
          // Sleeps until the first row arrives, which starts the clock.
          auto has_rows = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return stop_ || ready_ != nullptr || filling_->count > 0;
          };
          mu_.Await(absl::Condition(&has_rows));
        } else if (DueLocked(absl::Now())) {
          HandOverLocked();  // spare_ is free: the sender holds nothing
        } else {
          mu_.AwaitWithDeadline(absl::Condition(&woken), filling_->first_append + options_.flush_after);
        }
      }
      if (stop_) return;
      batch = std::move(ready_);
    }
    absl::Status sent = stream_.Send(batch->ToBatch(options_));
    batch->Clear();
    absl::MutexLock lock(&mu_);
    spare_ = std::move(batch);
    if (!sent.ok() && error_.ok()) error_ = sent;
    // The caller may have filled its buffer while this one was out.
    if (filling_->count == options_.flush_transitions) HandOverLocked();
  }
}

absl::StatusOr<int64_t> Writer::Flush() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("writer is closed");
    // The sender may take the rows itself (flush_after) while this waits.
    auto can_hand_over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return spare_ != nullptr || filling_->empty() || !error_.ok();
    };
    mu_.Await(absl::Condition(&can_hand_over));
    if (!error_.ok()) return error_;
    if (!filling_->empty()) {
      filling_->full_form = true;
      HandOverLocked();
    }
    auto spare_free = [this]()
                          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return spare_ != nullptr || !error_.ok(); };
    // The spare is back once the sender handed the last batch to the stream.
    mu_.Await(absl::Condition(&spare_free));
    if (!error_.ok()) return error_;
  }
  if (absl::Status s = stream_.Flush(); !s.ok()) {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = s;
    return s;
  }
  return stream_.totals().accepted_transitions - accepted_at_start_;
}

absl::StatusOr<int64_t> Writer::Close() {
  absl::StatusOr<int64_t> flushed = Flush();
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    stop_ = true;
  }
  if (sender_.joinable()) sender_.join();
  return flushed;
}

}  // namespace qstream::actor
