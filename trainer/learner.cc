#include "trainer/learner.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/policy/network.h"
#include "qstream/version.h"
#include "spdlog/spdlog.h"
#include "trainer/config.h"

namespace qstream {
namespace {

// Bound on buffered step-time windows when nobody drains them (e.g. no
// metrics exporter): beyond it, neighbouring windows are merged pairwise,
// which keeps the total step count and total time exact.
constexpr size_t kMaxStepTimeWindows = size_t{1} << 16;

void AppendStepTimes(std::vector<std::pair<double, int64_t>>* dst,
                     const std::vector<std::pair<double, int64_t>>& src) {
  dst->insert(dst->end(), src.begin(), src.end());
  if (dst->size() <= kMaxStepTimeWindows) return;
  std::vector<std::pair<double, int64_t>> merged;
  merged.reserve(dst->size() / 2 + 1);
  for (size_t i = 0; i + 1 < dst->size(); i += 2) {
    const auto& [s0, n0] = (*dst)[i];
    const auto& [s1, n1] = (*dst)[i + 1];
    const int64_t n = n0 + n1;
    merged.emplace_back(n > 0 ? (s0 * n0 + s1 * n1) / n : 0.0, n);
  }
  if (dst->size() % 2 == 1) merged.push_back(dst->back());
  *dst = std::move(merged);
}

// The network part of a state (what a guard rollback loads), without the replay.
std::shared_ptr<const Learner::GoodNetwork> NetworkPart(const BackendState& state) {
  auto good = std::make_shared<Learner::GoodNetwork>();
  good->step = state.steps;
  good->state.steps = state.steps;
  good->state.applied_updates = state.applied_updates;
  good->state.params = state.params;
  good->state.target = state.target;
  good->state.adam_m = state.adam_m;
  good->state.adam_v = state.adam_v;
  return good;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Learner>> Learner::Create(const v1::TrainerConfig& config,
                                                         std::unique_ptr<Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("learner: no backend");
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  const auto& rl = config.rate_limiter();
  // With the ratio on, a blocked insert must leave room to sample a whole
  // batch; otherwise inserts and samples would block each other forever.
  if (rl.samples_per_insert() > 0 && 2.0 * rl.error_buffer() < config.replay().batch_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rate_limiter.error_buffer: must be >= replay.batch_size / 2 (",
                     config.replay().batch_size() / 2.0, ") or the learner can deadlock"));
  }
  std::unique_ptr<Learner> learner(new Learner(config, std::move(backend)));
  learner->Publish();  // version 0: the initial weights
  return learner;
}

Learner::Learner(const v1::TrainerConfig& config, std::unique_ptr<Backend> backend)
    : config_(config), backend_(std::move(backend)), limiter_(config.rate_limiter()) {
  absl::MutexLock lock(&mu_);
  status_.backend = backend_->name();
  status_.device = backend_->device();
  status_.device_memory = backend_->device_memory();
  status_.steps = backend_->steps();
  status_.replay_size = backend_->replay_size();
  status_.replay_capacity = backend_->replay_capacity();
  status_.guard_trips.assign(kNumGuardReasons, 0);
}

Learner::~Learner() {
  Stop();
  if (policy_version_fd_ >= 0) close(policy_version_fd_);
}

namespace {

constexpr char kPolicyVersionFile[] = ".policy_version";

double SecondsBetween(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t SteadyNanos() {
  // Never 0 (0 marks "waiting" in busy_since_ns_).
  return std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now().time_since_epoch())
                                  .count());
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return SecondsBetween(t, std::chrono::steady_clock::now());
}

// Exponential moving average (the first sample sets it).
void Average(double* average, double sample) {
  *average = *average <= 0 ? sample : 0.9 * *average + 0.1 * sample;
}

// The high-water mark left by an earlier process (-1 when none).
int64_t ReadPolicyVersionMark(int fd) {
  char buf[32] = {};
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  return std::strtoll(buf, nullptr, 10);
}

}  // namespace

void Learner::Start() {
  absl::MutexLock lock(&mu_);
  if (running_ || stop_) return;
  running_ = true;
  thread_ = std::thread(&Learner::Run, this);
}

void Learner::Stop() {
  std::thread thread;
  bool started;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    started = running_ || thread_.joinable();
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
  callbacks_.WaitIdle();  // every insert callback has run when Stop returns
  // A checkpoint being written finishes before Stop returns.
  if (checkpointer_ != nullptr) checkpointer_->WaitIdle();
  if (started) {
    // Checkpoint requests the thread did not reach: WriteFinalCheckpoint may
    // still write the final state, but these callers learn now.
    std::deque<CheckpointRequest> requests;
    {
      absl::MutexLock lock(&mu_);
      requests.swap(checkpoint_requests_);
    }
    for (CheckpointRequest& r : requests) {
      if (r.done) r.done(absl::UnavailableError("the learner stopped before the checkpoint was taken"));
    }
    return;
  }
  // Never started: nobody else touches the backend, insert what was queued here.
  std::deque<Pending> batches;
  {
    absl::MutexLock lock(&mu_);
    batches.swap(pending_);
  }
  InsertBatches(&batches);
  callbacks_.WaitIdle();
}

void Learner::Enqueue(TransitionColumns batch, InsertDone done) {
  bool stopped;
  {
    absl::MutexLock lock(&mu_);
    stopped = stop_;
    if (stopped) {
      // Cancelled below, outside the lock.
    } else if (!parked_ || inline_insert_ || !pending_.empty() || !limiter_.CanInsert()) {
      pending_.push_back(Pending{std::move(batch), std::move(done)});
      return;
    } else {
      // The learner thread waits with nothing to do: insert on this thread
      // instead of waking it (one thread hop less per batch). That thread
      // cannot leave its wait while inline_insert_ is set.
      inline_insert_ = true;
      limiter_.Inserted(batch.n);
    }
  }
  if (stopped) {
    if (done) done(absl::CancelledError("learner stopped"), -1);
    return;
  }
  std::deque<Pending> one;
  one.push_back(Pending{std::move(batch), std::move(done)});
  InsertBatches(&one, /*hand_off=*/false);
  absl::MutexLock lock(&mu_);
  inline_insert_ = false;
  // A paused learner waits whatever the replay holds (Resume rechecks);
  // otherwise it re-reads the replay size and the limiter now.
  if (!paused_) recheck_ = true;
}

void Learner::Pause() {
  absl::MutexLock lock(&mu_);
  paused_ = true;
  // Return only once no step is in flight, so "paused" means no further step.
  mu_.Await(absl::Condition(
      +[](bool* stepping) { return !*stepping; }, &stepping_));
}

void Learner::PauseAtStep(int64_t step) {
  if (step <= 0) return Pause();
  absl::MutexLock lock(&mu_);
  pause_at_step_ = step;
  recheck_ = true;  // a parked learner past `step` pauses now
}

absl::Status Learner::SyncGroup() {
  if (absl::Status st = backend_->SyncGroup(); !st.ok()) return st;
  {
    absl::MutexLock lock(&mu_);
    status_.steps = backend_->steps();
    status_.last_stats = StepStats{};
    status_.last_stats.step = status_.steps;
  }
  Publish();
  return absl::OkStatus();
}

void Learner::Resume() {
  bool was_halted;
  {
    absl::MutexLock lock(&mu_);
    paused_ = false;
    pause_at_step_ = 0;
    pending_halt_reason_.clear();
    step_failed_.store(false, std::memory_order_relaxed);
    recheck_ = true;  // inline inserts while paused may have made sampling possible
    was_halted = halted_;
    halted_ = false;
    status_.halted = false;
    status_.halt_reason.clear();
    rollback_step_ = -1;
  }
  if (was_halted && halt_listener_) halt_listener_(false);
}

void Learner::SetHaltListener(HaltListener listener) { halt_listener_ = std::move(listener); }

void Learner::EnableCheckpoints(const std::string& root, SnapshotHook hook) {
  checkpointer_ = std::make_unique<Checkpointer>(root, config_.checkpoint().keep());
  snapshot_hook_ = std::move(hook);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  chmod(root.c_str(), 0700);
  const std::string mark = root + "/" + kPolicyVersionFile;
  policy_version_fd_ = open(mark.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (policy_version_fd_ < 0) {
    spdlog::warn("{}: {} (policy versions restart from the checkpoint's)", mark, std::strerror(errno));
  }
  absl::MutexLock lock(&mu_);
  status_.checkpoints_enabled = true;
  RestartCheckpointTimerLocked();
}

absl::Status Learner::Restore(const CheckpointData& data) {
  const v1::CheckpointManifest& m = data.manifest;
  std::vector<std::string> differences;
  if (absl::Status st = CheckCompatible(m.config(), config_, &differences); !st.ok()) return st;
  for (const std::string& d : differences) spdlog::warn("restore: config differs: {}", d);
  if (absl::Status st = backend_->LoadState(data.state, StateParts::kAll); !st.ok()) return st;
  const bool replay = data.state.has_replay;
  limiter_.Restore(replay ? m.rate_limiter().inserts() : 0, replay ? m.rate_limiter().samples() : 0);
  {
    absl::MutexLock lock(&mu_);
    status_.steps = backend_->steps();
    status_.replay_size = backend_->replay_size();
    status_.transitions_inserted = m.transitions_inserted();
    status_.guard_trips = data.state.guard_trips;
    status_.guard_trips.resize(kNumGuardReasons, 0);
    status_.last_stats = StepStats{};
    status_.last_stats.step = data.state.steps;
    checkpoint_step_ = data.state.steps;
    checkpoint_inserts_ = status_.batches_inserted;
    if (data.state.consecutive_trips == 0) good_network_ = NetworkPart(data.state);
  }
  refreshed_at_step_ = -1;
  int64_t version = m.policy_version();
  if (policy_version_fd_ >= 0) version = std::max(version, ReadPolicyVersionMark(policy_version_fd_));
  PublishVersion(version + 1);
  return absl::OkStatus();
}

void Learner::RequestCheckpoint(const std::string& name, CheckpointDone done) {
  if (checkpointer_ == nullptr) {
    if (done) done(absl::FailedPreconditionError("checkpoints are not enabled (qstreamd --checkpoint_dir)"));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      checkpoint_requests_.push_back(CheckpointRequest{name, std::move(done)});
      return;
    }
  }
  if (done) done(absl::UnavailableError("the learner is stopping"));
}

absl::StatusOr<CheckpointData> Learner::Snapshot() {
  // Every batch in the replay has its callback (the session's commit) run:
  // replay and sessions are one cut.
  callbacks_.WaitIdle();
  CheckpointData data;
  if (absl::Status st = backend_->SaveState(config_.checkpoint().include_replay(), &data.state); !st.ok()) {
    return st;
  }
  const BackendState& b = data.state;
  v1::CheckpointManifest& m = data.manifest;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_learner_step(b.steps);
  m.set_optimizer_step(b.applied_updates);
  m.mutable_rng()->set_algorithm("splitmix64-counter (trainer/rng.h)");
  m.mutable_rng()->set_seed(config_.seed());
  m.mutable_rng()->set_counter(static_cast<uint64_t>(b.steps));
  *m.mutable_config() = config_;
  auto* replay = m.mutable_replay();
  replay->set_included(b.has_replay);
  replay->set_capacity(b.has_replay ? b.replay.capacity : backend_->replay_capacity());
  replay->set_size(b.has_replay ? b.replay.size : 0);
  replay->set_cursor(b.has_replay ? b.replay.cursor : 0);
  replay->set_max_priority(b.has_replay ? b.replay.max_priority : 1.0f);
  m.mutable_rate_limiter()->set_inserts(limiter_.inserts());
  m.mutable_rate_limiter()->set_samples(limiter_.samples());
  for (int64_t t : b.guard_trips) m.mutable_guard()->add_trips(t);
  m.mutable_guard()->set_consecutive_trips(b.consecutive_trips);
  m.set_created_by(absl::StrCat("qstreamd ", QSTREAM_VERSION, " (", QSTREAM_GIT_COMMIT, ")"));
  m.set_backend(backend_->name());
  m.set_created_unix_seconds(absl::ToUnixSeconds(absl::Now()));
  {
    absl::MutexLock lock(&mu_);
    m.set_policy_version(policy_ ? policy_->version : 0);
    m.set_transitions_inserted(status_.transitions_inserted);
  }
  if (snapshot_hook_) snapshot_hook_(&m);
  return data;
}

void Learner::RestartCheckpointTimerLocked() {
  const double every = config_.checkpoint().every_seconds();
  next_checkpoint_time_ = every > 0 ? absl::Now() + absl::Seconds(every) : absl::InfiniteFuture();
}

bool Learner::CheckpointDueLocked(int64_t steps, absl::Time now) const {
  if (checkpointer_ == nullptr || writing_checkpoint_) return false;
  if (!checkpoint_requests_.empty()) return true;
  const bool changed = steps != checkpoint_step_ || status_.batches_inserted != checkpoint_inserts_;
  if (!changed) return false;
  const int64_t every = config_.checkpoint().every_steps();
  if (every > 0 && steps / every > std::max<int64_t>(checkpoint_step_, 0) / every) return true;
  return now >= next_checkpoint_time_;
}

void Learner::MaybeCheckpoint(int64_t steps) {
  if (checkpointer_ == nullptr) return;
  CheckpointRequest request;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (!CheckpointDueLocked(steps, now)) {
      // Nothing new: the time trigger starts over.
      if (!writing_checkpoint_ && now >= next_checkpoint_time_) RestartCheckpointTimerLocked();
      return;
    }
    if (!checkpoint_requests_.empty()) {
      request = std::move(checkpoint_requests_.front());
      checkpoint_requests_.pop_front();
    }
    writing_checkpoint_ = true;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CheckpointData> data = Snapshot();
  const double snapshot_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!data.ok()) {
    checkpointer_->RecordSnapshotFailure(data.status());
    spdlog::error("checkpoint snapshot failed: {}", data.status().ToString());
    {
      absl::MutexLock lock(&mu_);
      writing_checkpoint_ = false;
      RestartCheckpointTimerLocked();
    }
    if (request.done) request.done(data.status());
    return;
  }
  const int64_t step = data->state.steps;
  std::shared_ptr<const GoodNetwork> network;
  if (data->state.consecutive_trips == 0) network = NetworkPart(data->state);
  {
    absl::MutexLock lock(&mu_);
    checkpoint_step_ = step;
    checkpoint_inserts_ = status_.batches_inserted;
    RestartCheckpointTimerLocked();
  }
  const std::string name = request.name.empty() ? AutoCheckpointName(step) : request.name;
  checkpointer_->Write(
      name, *std::move(data), snapshot_seconds,
      [this, network, done = std::move(request.done)](const absl::StatusOr<CheckpointWriteResult>& result) {
        {
          absl::MutexLock lock(&mu_);
          writing_checkpoint_ = false;
          if (result.ok() && network != nullptr) good_network_ = network;
        }
        if (done) done(result);
      });
}

absl::Status Learner::WriteFinalCheckpoint() {
  if (checkpointer_ == nullptr) return absl::OkStatus();
  checkpointer_->WaitIdle();
  std::deque<CheckpointRequest> requests;
  {
    absl::MutexLock lock(&mu_);
    requests.swap(checkpoint_requests_);
  }
  for (CheckpointRequest& r : requests) {
    if (r.done) r.done(absl::UnavailableError("the learner stopped before the checkpoint was taken"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (running_) return absl::FailedPreconditionError("WriteFinalCheckpoint: the learner is running");
    if (backend_->steps() == checkpoint_step_ && status_.batches_inserted == checkpoint_inserts_) {
      return absl::OkStatus();  // the newest checkpoint already holds this state
    }
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CheckpointData> data = Snapshot();
  if (!data.ok()) {
    checkpointer_->RecordSnapshotFailure(data.status());
    return data.status();
  }
  const double snapshot_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t step = data->state.steps;
  absl::Status written;
  checkpointer_->Write(AutoCheckpointName(step), *std::move(data), snapshot_seconds,
                       [&written](const absl::StatusOr<CheckpointWriteResult>& r) { written = r.status(); });
  checkpointer_->WaitIdle();
  absl::MutexLock lock(&mu_);
  if (written.ok()) {
    checkpoint_step_ = step;
    checkpoint_inserts_ = status_.batches_inserted;
  }
  return written;
}

void Learner::HandleRepeatedTrips(const StepStats& stats, int64_t steps) {
  const int max_trips = config_.guard().max_consecutive_trips();
  if (max_trips <= 0 || stats.consecutive_trips < max_trips) return;
  const bool group = config_.distributed().world_size() > 1;
  // A group cannot roll back: each rank holds its own checkpoints.
  const bool rollback_wanted = config_.guard().on_repeated_trips() == v1::GuardConfig::ROLLBACK && !group;
  std::shared_ptr<const GoodNetwork> good;
  std::string why;
  {
    absl::MutexLock lock(&mu_);
    if (halted_ || !pending_halt_reason_.empty()) return;
    if (group) {
      // Every rank halts at the same step: the tripping run and its start are
      // the same on every rank (the guard decides on group values), and a
      // rank sees the run's statistics at most 2 stats windows + the steps in
      // flight after it crossed max_trips.
      const int64_t run_start = stats.step - stats.consecutive_trips;
      const int64_t margin = 2 * int64_t{std::max(1, config_.server().stats_every())} + 3;
      pause_at_step_ = std::max(run_start + max_trips + margin, steps);
      pending_halt_reason_ =
          absl::StrCat("guard: ", stats.consecutive_trips, " consecutive tripped steps (last reason ",
                       GuardReasonName(stats.guard), "); a data-parallel group halts at step ",
                       pause_at_step_, " on every rank");
      recheck_ = true;
      return;
    }
    const int64_t run_start = stats.step - stats.consecutive_trips;
    const bool tripping_since_rollback = rollback_step_ >= 0 && run_start <= rollback_step_;
    if (rollback_wanted && !tripping_since_rollback && good_network_ != nullptr &&
        good_network_->step <= run_start) {
      good = good_network_;
    } else {
      why = absl::StrCat("guard: ", stats.consecutive_trips, " consecutive tripped steps (last reason ",
                         GuardReasonName(stats.guard), ")",
                         !rollback_wanted          ? ""
                         : tripping_since_rollback ? "; still tripping after a rollback"
                                                   : "; no checkpoint from before the trips to roll back to");
    }
  }
  if (good != nullptr) {
    absl::Status st = backend_->LoadState(good->state, StateParts::kNetwork);
    if (st.ok()) {
      spdlog::error("guard: {} consecutive tripped steps; rolled back to the network of step {}",
                    stats.consecutive_trips, good->step);
      {
        absl::MutexLock lock(&mu_);
        rollback_step_ = steps;
        status_.guard_rollbacks += 1;
      }
      Publish();
      return;
    }
    why = absl::StrCat("guard: rollback failed: ", st.ToString());
  }
  spdlog::error("learner halted: {}", why);
  {
    absl::MutexLock lock(&mu_);
    halted_ = true;
    paused_ = true;
    status_.steps = steps;  // the halted step count, visible with the halt
    status_.halted = true;
    status_.halt_reason = why;
  }
  if (halt_listener_) halt_listener_(true);
}

LearnerStatus Learner::status() const {
  LearnerStatus s;
  {
    absl::MutexLock lock(&mu_);
    s = status_;
    s.pending_batches = static_cast<int64_t>(pending_.size());
    s.paused = paused_;
    s.pause_at_step = pause_at_step_;
    s.running = running_;
  }
  s.insert_rounds = insert_rounds_.load(std::memory_order_relaxed);
  s.insert_round_seconds = 1e-9 * static_cast<double>(insert_round_nanos_.load(std::memory_order_relaxed));
  s.insert_round_budget = insert_round_budget_.load(std::memory_order_relaxed);
  s.rate_limiter_inserts = limiter_.inserts();
  s.rate_limiter_samples = limiter_.samples();
  if (checkpointer_ != nullptr) s.checkpoints = checkpointer_->stats();
  return s;
}

Learner::Progress Learner::progress() const {
  const int64_t since = busy_since_ns_.load(std::memory_order_relaxed);
  const bool failed = step_failed_.load(std::memory_order_relaxed);
  if (since == 0) return {.waiting = true, .busy_seconds = 0, .step_failed = failed};
  return {.waiting = false,
          .busy_seconds = 1e-9 * static_cast<double>(std::max<int64_t>(0, SteadyNanos() - since)),
          .step_failed = failed};
}

std::shared_ptr<const PolicySnapshot> Learner::policy() const {
  absl::MutexLock lock(&mu_);
  return policy_;
}

int64_t Learner::AddPolicyListener(PolicyListener listener) {
  absl::MutexLock lock(&listener_mu_);
  const int64_t id = next_listener_id_++;
  listeners_.emplace(id, std::move(listener));
  return id;
}

void Learner::RemovePolicyListener(int64_t id) {
  absl::MutexLock lock(&listener_mu_);
  listeners_.erase(id);
}

std::vector<std::pair<double, int64_t>> Learner::DrainStepTimes() {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<double, int64_t>> out;
  out.swap(step_times_);
  return out;
}

absl::Status Learner::ComputeQ(const float* obs, int64_t n, std::vector<float>* q) const {
  if (n < 0) return absl::InvalidArgumentError("ComputeQ: negative count");
  if (n > 0 && obs == nullptr) return absl::InvalidArgumentError("ComputeQ: no observations");
  std::shared_ptr<const PolicySnapshot> snapshot = policy();
  // The actors' forward code, so Evaluate answers what an actor computes.
  absl::StatusOr<qstream::policy::Network> network =
      qstream::policy::Network::Create(snapshot->spec.ToArchitecture());
  if (!network.ok()) return network.status();
  q->resize(static_cast<size_t>(n) * network->total_actions());
  return network->QValues(snapshot->params, {obs, static_cast<size_t>(n) * network->obs_dim()}, *q);
}

void Learner::Publish() {
  int64_t version;
  {
    absl::MutexLock lock(&mu_);
    version = policy_ == nullptr ? 0 : policy_->version + 1;
  }
  PublishVersion(version);
}

void Learner::PublishVersion(int64_t version) {
  auto snapshot = std::make_shared<PolicySnapshot>();
  snapshot->learner_steps = backend_->steps();
  snapshot->spec = backend_->spec();
  snapshot->params = backend_->GetParams();
  snapshot->version = version;
  if (policy_version_fd_ >= 0) {
    // Fixed width, so a shorter number never leaves digits of a longer one.
    char buf[24];
    const int n = std::snprintf(buf, sizeof(buf), "%020lld\n", static_cast<long long>(version));
    if (pwrite(policy_version_fd_, buf, n, 0) != n) {
      spdlog::warn("writing the policy version mark: {}", std::strerror(errno));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    policy_ = snapshot;
    status_.policy_version = snapshot->version;
  }
  absl::MutexLock lock(&listener_mu_);
  for (auto& [id, listener] : listeners_) listener(snapshot);
}

// The rate limiter already counted these batches when they were taken; a
// batch the backend rejects (inconsistent columns, which ingest validation
// rules out) stays counted, and its callback gets the error. All of them go
// to the backend in one call (one upload on the CUDA backend) and their
// callbacks to the callback threads in one hand-off.
void Learner::InsertBatches(std::deque<Pending>* batches, bool hand_off) {
  if (batches->empty()) return;
  std::vector<const TransitionColumns*> columns;
  columns.reserve(batches->size());
  for (const Pending& p : *batches) columns.push_back(&p.batch);
  std::vector<absl::Status> statuses;
  const int64_t size_before = backend_->replay_size();
  const int64_t capacity = backend_->replay_capacity();
  backend_->InsertMany(columns, &statuses);
  const int64_t size = backend_->replay_size();
  int64_t inserted = 0;
  int64_t inserted_batches = 0;
  std::vector<std::function<void()>> callbacks;
  callbacks.reserve(batches->size());
  for (size_t i = 0; i < batches->size(); ++i) {
    Pending& p = (*batches)[i];
    if (statuses[i].ok()) {
      inserted += p.batch.n;
      ++inserted_batches;
    }
    if (p.done) {
      // The replay size right after this batch, as if they went in one by one.
      const int64_t after = std::min(capacity, size_before + inserted);
      callbacks.emplace_back([done = std::move(p.done), status = std::move(statuses[i]), after]() mutable {
        done(std::move(status), after);
      });
    }
  }
  batches->clear();  // the columns are in the replay; free them here, not on the callback threads
  {
    absl::MutexLock lock(&mu_);
    status_.replay_size = size;
    status_.transitions_inserted += inserted;
    status_.batches_inserted += inserted_batches;
  }
  if (hand_off) {
    callbacks_.Post(std::move(callbacks));
  } else {
    CallbackScope scope;  // acks of one stream made ready here go out together
    for (std::function<void()>& callback : callbacks) callback();
  }
}

int64_t Learner::InsertRoundRows() const {
  return period_seconds_ > 0 ? insert_round_rows_ : std::numeric_limits<int64_t>::max();
}

void Learner::AdaptInsertRound(double seconds, bool hit_budget) {
  if (period_seconds_ <= 0) return;
  // The round's own work: time spent waiting for the device to release a
  // staging buffer is the device's pace, not insert cost.
  const double cost = std::max(0.0, seconds - backend_->ConsumeInsertWaitSeconds());
  // Halve when a round's work took more than half of a step period (round
  // plus step); double when a round that the budget cut short took less than
  // a quarter. Whatever a round costs per batch and per row, the budget
  // settles where inserts take about half of this thread at most.
  constexpr int64_t kMaxRoundRows = int64_t{1} << 22;
  if (cost > 0.5 * period_seconds_) {
    insert_round_rows_ = std::max<int64_t>(1, insert_round_rows_ / 2);
  } else if (hit_budget && cost < 0.25 * period_seconds_) {
    insert_round_rows_ = std::min(kMaxRoundRows, insert_round_rows_ * 2);
  }
}

void Learner::RefreshStats(int64_t steps) {
  if (steps == refreshed_at_step_) return;
  refreshed_at_step_ = steps;
  StepStats stats = backend_->last_stats();
  std::vector<int64_t> trips = backend_->guard_trips();
  std::vector<std::pair<double, int64_t>> times;
  backend_->DrainStepTimes(&times);
  {
    absl::MutexLock lock(&mu_);
    status_.last_stats = stats;
    status_.guard_trips = std::move(trips);
    AppendStepTimes(&step_times_, times);
  }
  HandleRepeatedTrips(stats, steps);
}

void Learner::Run() {
  const int64_t batch_size = config_.replay().batch_size();
  const int64_t publish_every = config_.server().publish_every();
  const int64_t stats_every = config_.server().stats_every();
  int64_t steps = backend_->steps();
  int64_t replay_size = backend_->replay_size();

  for (;;) {
    busy_since_ns_.store(SteadyNanos(), std::memory_order_relaxed);
    MaybeCheckpoint(steps);
    std::deque<Pending> batches;
    bool stopping = false;
    bool step = false;
    bool refresh_before_waiting = false;
    bool round_hit_budget = false;
    bool halted_now = false;
    {
      absl::MutexLock lock(&mu_);
      stepping_ = false;
      status_.steps = steps;
      if (pause_at_step_ > 0 && steps >= pause_at_step_) {
        paused_ = true;
        pause_at_step_ = 0;
        if (!pending_halt_reason_.empty()) {
          spdlog::error("learner halted: {}", pending_halt_reason_);
          halted_ = true;
          status_.halted = true;
          status_.halt_reason = std::move(pending_halt_reason_);
          pending_halt_reason_.clear();
          halted_now = true;
        }
      }
      // Only this thread changes the limiter, so its answers hold while we wait.
      const bool can_sample = replay_size > 0 && limiter_.CanSample(batch_size);
      const bool can_insert = limiter_.CanInsert();
      const bool timed_checkpoints = checkpointer_ != nullptr && config_.checkpoint().every_seconds() > 0;
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (inline_insert_) return false;  // Enqueue is using the backend
        return stop_ || recheck_ || (!pending_.empty() && can_insert) || (!paused_ && can_sample) ||
               (!writing_checkpoint_ && !checkpoint_requests_.empty()) ||
               (timed_checkpoints && !writing_checkpoint_ && absl::Now() >= next_checkpoint_time_);
      };
      status_.sample_blocked = !paused_ && !can_sample;
      status_.insert_blocked = !pending_.empty() && !can_insert;
      if (!ready()) {
        // Going idle: first let status() show the latest step (outside the lock).
        refresh_before_waiting = steps != refreshed_at_step_;
        if (!refresh_before_waiting) {
          parked_ = true;
          busy_since_ns_.store(0, std::memory_order_relaxed);
          if (timed_checkpoints) {
            mu_.AwaitWithDeadline(absl::Condition(&ready), next_checkpoint_time_);
            // A deadline passed during an inline insert: wait for it to end.
            mu_.Await(absl::Condition(
                +[](bool* inline_insert) { return !*inline_insert; }, &inline_insert_));
          } else {
            mu_.Await(absl::Condition(&ready));
          }
          parked_ = false;
          busy_since_ns_.store(SteadyNanos(), std::memory_order_relaxed);
        }
      }
      if (recheck_) {
        // An inline insert, Resume or a pause step changed what to do: decide
        // again on a fresh replay size. Consumed here whether or not this
        // thread waited: one set while it was busy would otherwise keep
        // ready() true for good, and a paused learner would spin without
        // ever parking (Pause() waits for that and hung).
        recheck_ = false;
        refresh_before_waiting = true;
      }
      if (!refresh_before_waiting) {
        if (stop_) {
          batches.swap(pending_);
          stopping = true;
        } else {
          step = !paused_ && can_sample;
          // Reserve inserts batch by batch: a batch is admitted while the
          // limiter allows one more (it may overshoot by itself). Inserts and
          // steps interleave: when a step follows, this round takes at most
          // insert_round_rows_ rows (at least one batch), a budget kept near
          // what the inserts move in the time of one step, so ingest gets at
          // most about half of this thread.
          const int64_t budget = step ? InsertRoundRows() : std::numeric_limits<int64_t>::max();
          int64_t rows = 0;
          while (!pending_.empty() && limiter_.CanInsert() && (batches.empty() || rows < budget)) {
            rows += pending_.front().batch.n;
            limiter_.Inserted(pending_.front().batch.n);
            batches.push_back(std::move(pending_.front()));
            pending_.pop_front();
          }
          round_hit_budget = step && !pending_.empty() && rows >= budget;
        }
        status_.sample_blocked = !paused_ && !can_sample;
        status_.insert_blocked = !pending_.empty();
        stepping_ = true;
      }
    }
    if (halted_now && halt_listener_) halt_listener_(true);
    if (refresh_before_waiting) {
      last_step_started_.reset();  // an idle spell is no step period
      RefreshStats(steps);
      replay_size = backend_->replay_size();
      continue;
    }

    if (stopping) {
      // Nothing accepted is lost: insert everything left, limiter or not.
      for (const Pending& p : batches) limiter_.Inserted(p.batch.n);
      InsertBatches(&batches);
      RefreshStats(steps);
      absl::MutexLock lock(&mu_);
      status_.steps = steps;
      status_.sample_blocked = false;
      status_.insert_blocked = false;
      stepping_ = false;
      running_ = false;
      busy_since_ns_.store(0, std::memory_order_relaxed);
      return;
    }

    if (!batches.empty()) {
      const auto started = std::chrono::steady_clock::now();
      InsertBatches(&batches, /*hand_off=*/step);
      const double round_seconds = SecondsSince(started);
      if (step) AdaptInsertRound(round_seconds, round_hit_budget);
      // Observability only, written by this thread alone: no lock per round.
      insert_rounds_.fetch_add(1, std::memory_order_relaxed);
      insert_round_nanos_.fetch_add(static_cast<int64_t>(round_seconds * 1e9), std::memory_order_relaxed);
      insert_round_budget_.store(insert_round_rows_, std::memory_order_relaxed);
      replay_size = backend_->replay_size();
      // Inserts may have made sampling possible; re-evaluate before stepping.
      if (!step) {
        last_step_started_.reset();
        continue;
      }
    }
    if (!step) {
      last_step_started_.reset();
      continue;
    }

    const auto step_started = std::chrono::steady_clock::now();
    if (last_step_started_.has_value())
      Average(&period_seconds_, SecondsBetween(*last_step_started_, step_started));
    last_step_started_ = step_started;
    absl::Status s = backend_->Step();
    if (!s.ok()) {
      // A failing backend halts training (Resume retries) instead of spinning.
      spdlog::error("learner step failed, pausing (Admin Resume retries): {}", s.ToString());
      absl::MutexLock lock(&mu_);
      paused_ = true;
      status_.last_error = s.ToString();
      step_failed_.store(true, std::memory_order_relaxed);
      continue;
    }
    limiter_.Sampled(batch_size);
    ++steps;
    // The device statistics are read only every stats_every steps, so the
    // host does not wait on the device per step.
    if (steps % stats_every == 0) RefreshStats(steps);
    if (steps % publish_every == 0) Publish();
  }
}

}  // namespace qstream
