#include "server/committed_windows.h"

#include <algorithm>
#include <utility>

namespace qstream {

int64_t CommittedWindows::counted_bytes() const {
  return static_cast<int64_t>(windows_.size()) * assembler_->window_bytes() + log_bytes_;
}

int64_t CommittedWindows::Commit(IncomingBatch batch, int64_t bytes) {
  log_rows_ += batch.count();
  log_bytes_ += bytes;
  log_.push_back(std::move(batch));
  const int64_t windows = std::max<int64_t>(1, static_cast<int64_t>(windows_.size()));
  if (log_rows_ < kFoldRowsPerWindow * assembler_->n_step() * windows) return 0;
  return Fold();
}

int64_t CommittedWindows::Fold() {
  if (log_.empty()) return 0;
  const int64_t before = counted_bytes();
  std::vector<const IncomingBatch*> batches;
  batches.reserve(log_.size());
  for (const IncomingBatch& b : log_) batches.push_back(&b);
  assembler_->Fold(batches, &windows_);
  log_.clear();
  log_rows_ = 0;
  log_bytes_ = 0;
  return before - counted_bytes();
}

int64_t CommittedWindows::Clear() {
  const int64_t before = counted_bytes();
  windows_.clear();
  log_.clear();
  log_rows_ = 0;
  log_bytes_ = 0;
  return before;
}

void CommittedWindows::Reset(NStepWindows windows) {
  windows_ = std::move(windows);
  log_.clear();
  log_rows_ = 0;
  log_bytes_ = 0;
}

}  // namespace qstream
