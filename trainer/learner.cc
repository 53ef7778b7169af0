#include "trainer/learner.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "trainer/config.h"
#include "trainer/cpu/forward.h"

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
  status_.steps = backend_->steps();
  status_.replay_size = backend_->replay_size();
  status_.replay_capacity = backend_->replay_capacity();
  status_.guard_trips.assign(kNumGuardReasons, 0);
}

Learner::~Learner() { Stop(); }

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
  if (started) return;
  // Never started: nobody else touches the backend, insert what was queued here.
  std::deque<Pending> batches;
  {
    absl::MutexLock lock(&mu_);
    batches.swap(pending_);
  }
  InsertBatches(&batches);
}

void Learner::Enqueue(TransitionColumns batch, InsertDone done) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      pending_.push_back(Pending{std::move(batch), std::move(done)});
      return;
    }
  }
  if (done) done(absl::CancelledError("learner stopped"), -1);
}

void Learner::Pause() {
  absl::MutexLock lock(&mu_);
  paused_ = true;
  // Return only once no step is in flight, so "paused" means no further step.
  mu_.Await(absl::Condition(
      +[](bool* stepping) { return !*stepping; }, &stepping_));
}

void Learner::Resume() {
  absl::MutexLock lock(&mu_);
  paused_ = false;
}

LearnerStatus Learner::status() const {
  LearnerStatus s;
  {
    absl::MutexLock lock(&mu_);
    s = status_;
    s.pending_batches = static_cast<int64_t>(pending_.size());
    s.paused = paused_;
    s.running = running_;
  }
  s.rate_limiter_inserts = limiter_.inserts();
  s.rate_limiter_samples = limiter_.samples();
  return s;
}

bool Learner::throttled() const { return !limiter_.CanInsert(); }

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
  q->resize(static_cast<size_t>(n) * snapshot->spec.total_actions());
  if (n > 0) ComputeQValues(snapshot->spec, snapshot->params.data(), obs, n, q->data());
  return absl::OkStatus();
}

absl::Status Learner::Checkpoint(const std::string& path) {
  std::shared_ptr<const PolicySnapshot> snapshot = policy();
  v1::Policy proto;
  proto.set_version(snapshot->version);
  proto.set_learner_steps(snapshot->learner_steps);
  *proto.mutable_architecture() = snapshot->spec.ToArchitecture();
  proto.mutable_weights()->Add(snapshot->params.begin(), snapshot->params.end());
  // Write then rename, so a reader never sees a half-written checkpoint.
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("checkpoint: cannot open ", tmp));
    if (!proto.SerializeToOstream(&out)) {
      return absl::DataLossError(absl::StrCat("checkpoint: serializing to ", tmp, " failed"));
    }
    out.close();
    if (!out) return absl::DataLossError(absl::StrCat("checkpoint: writing ", tmp, " failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("checkpoint: cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

void Learner::Publish() {
  auto snapshot = std::make_shared<PolicySnapshot>();
  snapshot->learner_steps = backend_->steps();
  snapshot->spec = backend_->spec();
  snapshot->params = backend_->GetParams();
  {
    absl::MutexLock lock(&mu_);
    snapshot->version = policy_ == nullptr ? 0 : policy_->version + 1;
    policy_ = snapshot;
    status_.policy_version = snapshot->version;
  }
  absl::MutexLock lock(&listener_mu_);
  for (auto& [id, listener] : listeners_) listener(snapshot);
}

// The rate limiter already counted these batches when they were taken; a
// batch the backend rejects (inconsistent columns, which ingest validation
// rules out) stays counted, and its callback gets the error.
void Learner::InsertBatches(std::deque<Pending>* batches) {
  for (Pending& p : *batches) {
    absl::Status s = backend_->Insert(p.batch);
    const int64_t size = backend_->replay_size();
    {
      absl::MutexLock lock(&mu_);
      status_.replay_size = size;
      if (s.ok()) {
        status_.transitions_inserted += p.batch.n;
        status_.batches_inserted += 1;
      }
    }
    if (p.done) p.done(s, size);
  }
  batches->clear();
}

void Learner::RefreshStats(int64_t steps) {
  if (steps == refreshed_at_step_) return;
  refreshed_at_step_ = steps;
  StepStats stats = backend_->last_stats();
  std::vector<int64_t> trips = backend_->guard_trips();
  std::vector<std::pair<double, int64_t>> times;
  backend_->DrainStepTimes(&times);
  absl::MutexLock lock(&mu_);
  status_.last_stats = stats;
  status_.guard_trips = std::move(trips);
  AppendStepTimes(&step_times_, times);
}

void Learner::Run() {
  const int64_t batch_size = config_.replay().batch_size();
  const int64_t publish_every = config_.server().publish_every();
  const int64_t stats_every = config_.server().stats_every();
  int64_t steps = backend_->steps();
  int64_t replay_size = backend_->replay_size();

  for (;;) {
    std::deque<Pending> batches;
    bool stopping = false;
    bool step = false;
    bool refresh_before_waiting = false;
    {
      absl::MutexLock lock(&mu_);
      stepping_ = false;
      status_.steps = steps;
      // Only this thread changes the limiter, so its answers hold while we wait.
      const bool can_sample = replay_size > 0 && limiter_.CanSample(batch_size);
      const bool can_insert = limiter_.CanInsert();
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (!pending_.empty() && can_insert) || (!paused_ && can_sample);
      };
      status_.sample_blocked = !paused_ && !can_sample;
      status_.insert_blocked = !pending_.empty() && !can_insert;
      if (!ready()) {
        // Going idle: first let status() show the latest step (outside the lock).
        refresh_before_waiting = steps != refreshed_at_step_;
        if (!refresh_before_waiting) mu_.Await(absl::Condition(&ready));
      }
      if (!refresh_before_waiting) {
        if (stop_) {
          batches.swap(pending_);
          stopping = true;
        } else {
          // Reserve inserts batch by batch: a batch is admitted while the
          // limiter allows one more (it may overshoot by itself).
          while (!pending_.empty() && limiter_.CanInsert()) {
            limiter_.Inserted(pending_.front().batch.n);
            batches.push_back(std::move(pending_.front()));
            pending_.pop_front();
          }
          step = !paused_ && can_sample;
        }
        status_.sample_blocked = !paused_ && !can_sample;
        status_.insert_blocked = !pending_.empty();
        stepping_ = true;
      }
    }
    if (refresh_before_waiting) {
      RefreshStats(steps);
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
      return;
    }

    if (!batches.empty()) {
      InsertBatches(&batches);
      replay_size = backend_->replay_size();
      // Inserts may have made sampling possible; re-evaluate before stepping.
      continue;
    }
    if (!step) continue;

    absl::Status s = backend_->Step();
    if (!s.ok()) {
      // A failing backend halts training (Resume retries) instead of spinning.
      std::fprintf(stderr, "qstream learner: step failed, pausing: %s\n", s.ToString().c_str());
      absl::MutexLock lock(&mu_);
      paused_ = true;
      status_.last_error = s.ToString();
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
