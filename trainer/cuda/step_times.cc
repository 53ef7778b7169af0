#include "trainer/cuda/step_times.h"

#include "trainer/cuda/cuda_status.h"

namespace qstream::cuda {

absl::Status StepTimes::Init(cudaStream_t stream) {
  stream_ = stream;
  windows_.resize(kWindows);
  for (int i = 0; i < kWindows; ++i) {
    QS_RETURN_IF_ERROR(CreateEvent(&windows_[i].start, /*timing=*/true));
    QS_RETURN_IF_ERROR(CreateEvent(&windows_[i].end, /*timing=*/true));
    free_.push_back(i);
  }
  return absl::OkStatus();
}

absl::Status StepTimes::Open() {
  if (open_ >= 0 || free_.empty()) return absl::OkStatus();
  open_ = free_.front();
  free_.pop_front();
  windows_[open_].steps = 0;
  QS_CUDA_CHECK(cudaEventRecord(windows_[open_].start.get(), stream_));
  return absl::OkStatus();
}

void StepTimes::CountStep() {
  if (open_ >= 0) ++windows_[open_].steps;
}

absl::Status StepTimes::Close() {
  if (open_ < 0) return absl::OkStatus();
  const int w = open_;
  open_ = -1;
  if (windows_[w].steps == 0) {
    free_.push_back(w);
    return absl::OkStatus();
  }
  QS_CUDA_CHECK(cudaEventRecord(windows_[w].end.get(), stream_));
  pending_.push_back(w);
  return absl::OkStatus();
}

absl::Status StepTimes::Drain(std::vector<std::pair<double, int64_t>>* out) {
  absl::Status first;
  while (!pending_.empty()) {
    const int w = pending_.front();
    const cudaError_t q = cudaEventQuery(windows_[w].end.get());
    if (q == cudaErrorNotReady) break;
    pending_.pop_front();
    free_.push_back(w);
    float ms = 0;
    if (q != cudaSuccess ||
        cudaEventElapsedTime(&ms, windows_[w].start.get(), windows_[w].end.get()) != cudaSuccess) {
      if (first.ok()) first = ToStatus(q, "step time event", __FILE__, __LINE__);
      continue;
    }
    out->emplace_back(ms * 1e-3 / windows_[w].steps, windows_[w].steps);
  }
  return first;
}

}  // namespace qstream::cuda
