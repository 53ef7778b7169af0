#include "trainer/cuda/device_replay.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/replay_commit.h"

namespace qstream::cuda {

// Column regions of `rows` rows each, in StagedRows' order.
DeviceReplay::StagingLayout DeviceReplay::LayoutFor(int64_t rows, int obs_dim, int num_branches) {
  StagingLayout l;
  const size_t r = static_cast<size_t>(rows);
  l.obs = 0;
  l.next_obs = l.obs + r * obs_dim;
  l.actions = l.next_obs + r * obs_dim;
  l.rewards = l.actions + r * num_branches;
  l.discounts = l.rewards + r;
  l.words = l.discounts + r;
  return l;
}

absl::StatusOr<std::unique_ptr<DeviceReplay>> DeviceReplay::Create(const NetworkSpec& spec, int64_t capacity,
                                                                   int64_t staging_rows, cudaStream_t stream,
                                                                   kernels::DeviceState* state) {
  if (capacity <= 0 || capacity > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("replay.capacity: ", capacity, " outside [1, 2^31)"));
  }
  std::unique_ptr<DeviceReplay> r(
      new DeviceReplay(spec, capacity, std::clamp<int64_t>(staging_rows, 1, capacity), stream, state));
  if (absl::Status s = r->Allocate(); !s.ok()) return s;
  return r;
}

DeviceReplay::DeviceReplay(const NetworkSpec& spec, int64_t capacity, int64_t staging_rows,
                           cudaStream_t stream, kernels::DeviceState* state)
    : obs_dim_(spec.obs_dim),
      num_branches_(spec.num_branches()),
      branch_actions_(spec.branch_actions),
      capacity_(capacity),
      staging_rows_(staging_rows),
      layout_(LayoutFor(staging_rows, obs_dim_, num_branches_)),
      stream_(stream),
      state_(state) {}

absl::Status DeviceReplay::Allocate() {
  const size_t c = static_cast<size_t>(capacity_);
  for (auto* b : {&obs_, &next_obs_}) {
    if (absl::Status s = b->Allocate(c * obs_dim_); !s.ok()) return s;
  }
  for (auto* b : {&rewards_, &discounts_, &priorities_}) {
    if (absl::Status s = b->Allocate(c); !s.ok()) return s;
  }
  if (absl::Status s = actions_.Allocate(c * num_branches_); !s.ok()) return s;
  static_assert(sizeof(float) == sizeof(int32_t), "staging regions are 32-bit words");
  for (Staging& st : staging_) {
    if (absl::Status s = st.host.Allocate(layout_.words); !s.ok()) return s;
    if (absl::Status s = st.dev.Allocate(layout_.words); !s.ok()) return s;
    for (Event* e : {&st.uploaded, &st.consumed}) {
      if (absl::Status s = CreateEvent(e, /*timing=*/false); !s.ok()) return s;
    }
  }
  return CreateStream(&copy_stream_);
}

absl::Status DeviceReplay::Save(ReplayState* out) {
  const int64_t n = size_;
  const int d = obs_dim_;
  const int nb = num_branches_;
  out->capacity = capacity_;
  out->size = n;
  out->cursor = cursor_;
  TransitionColumns& r = out->rows;
  r.n = n;
  r.obs_dim = d;
  r.num_branches = nb;
  r.obs.resize(n * d);
  r.next_obs.resize(n * d);
  r.actions.resize(n * nb);
  r.rewards.resize(n);
  r.discounts.resize(n);
  out->priorities.resize(n);
  auto get = [&](void* dst, const void* src, size_t bytes) -> absl::Status {
    if (bytes > 0) QS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  };
  QS_RETURN_IF_ERROR(get(r.obs.data(), obs_.get(), sizeof(float) * n * d));
  QS_RETURN_IF_ERROR(get(r.next_obs.data(), next_obs_.get(), sizeof(float) * n * d));
  QS_RETURN_IF_ERROR(get(r.actions.data(), actions_.get(), sizeof(int32_t) * n * nb));
  QS_RETURN_IF_ERROR(get(r.rewards.data(), rewards_.get(), sizeof(float) * n));
  QS_RETURN_IF_ERROR(get(r.discounts.data(), discounts_.get(), sizeof(float) * n));
  QS_RETURN_IF_ERROR(get(out->priorities.data(), priorities_.get(), sizeof(float) * n));
  kernels::DeviceState state;
  QS_RETURN_IF_ERROR(get(&state, state_, sizeof(state)));
  QS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  out->max_priority = state.max_priority;
  return absl::OkStatus();
}

absl::Status DeviceReplay::Load(const ReplayState& in) {
  if (in.capacity != capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("replay.capacity: state has ", in.capacity, ", this replay ", capacity_));
  }
  const int64_t n = in.size;
  const int d = obs_dim_;
  const int nb = num_branches_;
  const auto& r = in.rows;
  // Stream order: nothing before (a step, an upload) still reads these buffers.
  QS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  auto put = [&](void* dst, const void* src, size_t bytes) -> absl::Status {
    if (bytes > 0) QS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  };
  QS_CUDA_CHECK(cudaMemsetAsync(priorities_.get(), 0, sizeof(float) * capacity_, stream_));
  QS_RETURN_IF_ERROR(put(obs_.get(), r.obs.data(), sizeof(float) * n * d));
  QS_RETURN_IF_ERROR(put(next_obs_.get(), r.next_obs.data(), sizeof(float) * n * d));
  QS_RETURN_IF_ERROR(put(actions_.get(), r.actions.data(), sizeof(int32_t) * n * nb));
  QS_RETURN_IF_ERROR(put(rewards_.get(), r.rewards.data(), sizeof(float) * n));
  QS_RETURN_IF_ERROR(put(discounts_.get(), r.discounts.data(), sizeof(float) * n));
  QS_RETURN_IF_ERROR(put(priorities_.get(), in.priorities.data(), sizeof(float) * n));
  kernels::DeviceState state;
  QS_RETURN_IF_ERROR([&]() -> absl::Status {
    QS_CUDA_CHECK(cudaMemcpyAsync(&state, state_, sizeof(state), cudaMemcpyDeviceToHost, stream_));
    QS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }());
  state.replay_size = n;
  state.replay_cursor = in.cursor;
  state.max_priority = in.max_priority;
  QS_RETURN_IF_ERROR(put(state_, &state, sizeof(state)));
  QS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  size_ = n;
  cursor_ = in.cursor;
  return absl::OkStatus();
}

kernels::ReplayColumns DeviceReplay::columns() const {
  kernels::ReplayColumns c;
  c.obs = obs_.get();
  c.next_obs = next_obs_.get();
  c.actions = actions_.get();
  c.rewards = rewards_.get();
  c.discounts = discounts_.get();
  c.priorities = priorities_.get();
  c.capacity = capacity_;
  c.obs_dim = obs_dim_;
  c.num_branches = num_branches_;
  return c;
}

absl::Status DeviceReplay::Insert(const TransitionColumns& batch) {
  std::vector<absl::Status> statuses;
  InsertMany({&batch}, &statuses);
  return statuses[0];
}

void DeviceReplay::InsertMany(const std::vector<const TransitionColumns*>& batches,
                              std::vector<absl::Status>* statuses) {
  statuses->assign(batches.size(), absl::OkStatus());
  Staging* st = nullptr;
  int64_t filled = 0;
  size_t chunk_first = 0;  // first batch with rows in the staging buffer being filled
  auto fail_from = [&](size_t first, const absl::Status& error) {
    for (size_t j = first; j < batches.size(); ++j) (*statuses)[j] = error;
  };
  for (size_t i = 0; i < batches.size(); ++i) {
    const TransitionColumns& batch = *batches[i];
    if (auto s = CheckTransitionColumns(batch, obs_dim_, num_branches_, branch_actions_); !s.ok()) {
      (*statuses)[i] = s;
      continue;
    }
    // Only the last `capacity` items of an oversized batch would survive.
    int64_t row = std::max<int64_t>(0, batch.n - capacity_);
    while (row < batch.n) {
      if (st == nullptr) {
        absl::StatusOr<Staging*> next = AcquireStaging();
        if (!next.ok()) return fail_from(i, next.status());
        st = *next;
        chunk_first = i;
      }
      const int64_t rows = std::min(staging_rows_ - filled, batch.n - row);
      Pack(batch, row, rows, st, filled);
      filled += rows;
      row += rows;
      if (filled == staging_rows_) {
        if (absl::Status s = Commit(st, filled); !s.ok()) return fail_from(chunk_first, s);
        st = nullptr;
        filled = 0;
      }
    }
  }
  if (st != nullptr && filled > 0) {
    if (absl::Status s = Commit(st, filled); !s.ok()) fail_from(chunk_first, s);
  }
}

absl::StatusOr<DeviceReplay::Staging*> DeviceReplay::AcquireStaging() {
  Staging& st = staging_[next_staging_];
  next_staging_ ^= 1;
  // The buffer's previous upload must have read it before it is refilled.
  if (st.in_flight) {
    const cudaError_t done = cudaEventQuery(st.uploaded.get());
    if (done == cudaErrorNotReady) {
      const auto started = std::chrono::steady_clock::now();
      QS_CUDA_CHECK(cudaEventSynchronize(st.uploaded.get()));
      wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    } else {
      QS_CUDA_CHECK(done);
    }
    st.in_flight = false;
  }
  return &st;
}

void DeviceReplay::Pack(const TransitionColumns& batch, int64_t first_row, int64_t rows, Staging* st,
                        int64_t at) const {
  const int d = obs_dim_;
  const int nb = num_branches_;
  float* w = st->host.get();
  std::memcpy(w + layout_.obs + at * d, &batch.obs[first_row * d], sizeof(float) * rows * d);
  std::memcpy(w + layout_.next_obs + at * d, &batch.next_obs[first_row * d], sizeof(float) * rows * d);
  std::memcpy(w + layout_.actions + at * nb, &batch.actions[first_row * nb], sizeof(int32_t) * rows * nb);
  std::memcpy(w + layout_.rewards + at, &batch.rewards[first_row], sizeof(float) * rows);
  std::memcpy(w + layout_.discounts + at, &batch.discounts[first_row], sizeof(float) * rows);
}

absl::Status DeviceReplay::Commit(Staging* staging, int64_t rows) {
  Staging& st = *staging;
  const int d = obs_dim_;
  const int nb = num_branches_;
  cudaStream_t up = copy_stream_.get();
  float* host = st.host.get();
  float* dev = st.dev.get();
  // 1. Host -> device staging on the copy stream, beside the step in flight,
  //    once the learner stream has read this device buffer's previous rows.
  //    A full chunk is one copy; a partial one copies each pair of equally
  //    sized regions as one 2-D copy (pitch: the region's size).
  QS_CUDA_CHECK(cudaStreamWaitEvent(up, st.consumed.get(), 0));
  if (rows == staging_rows_) {
    QS_CUDA_CHECK(cudaMemcpyAsync(dev, host, sizeof(float) * layout_.words, cudaMemcpyHostToDevice, up));
  } else {
    const size_t obs_pitch = sizeof(float) * (layout_.next_obs - layout_.obs);
    QS_CUDA_CHECK(cudaMemcpy2DAsync(dev + layout_.obs, obs_pitch, host + layout_.obs, obs_pitch,
                                    sizeof(float) * rows * d, 2, cudaMemcpyHostToDevice, up));
    QS_CUDA_CHECK(cudaMemcpyAsync(dev + layout_.actions, host + layout_.actions, sizeof(int32_t) * rows * nb,
                                  cudaMemcpyHostToDevice, up));
    const size_t scalar_pitch = sizeof(float) * (layout_.discounts - layout_.rewards);
    QS_CUDA_CHECK(cudaMemcpy2DAsync(dev + layout_.rewards, scalar_pitch, host + layout_.rewards, scalar_pitch,
                                    sizeof(float) * rows, 2, cudaMemcpyHostToDevice, up));
  }
  QS_CUDA_CHECK(cudaEventRecord(st.uploaded.get(), up));

  // 2. Learner stream, after the steps before it and the upload: one kernel
  //    moves device staging into the ring at the cursor and commits it.
  QS_CUDA_CHECK(cudaStreamWaitEvent(stream_, st.uploaded.get(), 0));
  kernels::ReplayCommitArgs commit;
  commit.staged.obs = dev + layout_.obs;
  commit.staged.next_obs = dev + layout_.next_obs;
  commit.staged.actions = reinterpret_cast<const int32_t*>(dev + layout_.actions);
  commit.staged.rewards = dev + layout_.rewards;
  commit.staged.discounts = dev + layout_.discounts;
  commit.ring = columns();
  commit.first_slot = cursor_;
  commit.count = rows;  // <= staging_rows_ <= capacity_: the ring wraps at most once
  cursor_ = (cursor_ + rows) % capacity_;
  size_ = std::min(size_ + rows, capacity_);
  commit.new_size = size_;
  commit.new_cursor = cursor_;
  commit.state = state_;
  QS_CUDA_CHECK(kernels::LaunchReplayCommit(commit, stream_));
  QS_CUDA_CHECK(cudaEventRecord(st.consumed.get(), stream_));
  st.in_flight = true;
  return absl::OkStatus();
}

}  // namespace qstream::cuda
