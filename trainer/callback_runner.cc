#include "trainer/callback_runner.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"

namespace qstream {

CallbackRunner::CallbackRunner(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Work(); });
}

CallbackRunner::~CallbackRunner() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

int CallbackRunner::DefaultThreads() {
  int threads = 0;
  if (const char* env = std::getenv("QSTREAM_CALLBACK_THREADS");
      env != nullptr && absl::SimpleAtoi(env, &threads)) {
    return std::clamp(threads, 1, 64);
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / 8, 1, 4);
}

void CallbackRunner::Post(std::vector<std::function<void()>> callbacks) {
  if (callbacks.empty()) return;
  const size_t parts = std::min(callbacks.size(), threads_.size());
  absl::MutexLock lock(&mu_);
  if (parts == 1) {
    queue_.push_back(std::move(callbacks));
    return;
  }
  const size_t per_part = (callbacks.size() + parts - 1) / parts;
  for (size_t first = 0; first < callbacks.size(); first += per_part) {
    const size_t last = std::min(callbacks.size(), first + per_part);
    queue_.emplace_back(std::make_move_iterator(callbacks.begin() + static_cast<std::ptrdiff_t>(first)),
                        std::make_move_iterator(callbacks.begin() + static_cast<std::ptrdiff_t>(last)));
  }
}

void CallbackRunner::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &CallbackRunner::Idle));
}

void CallbackRunner::Work() {
  for (;;) {
    std::vector<std::function<void()>> part;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &CallbackRunner::HasWorkOrStop));
      if (queue_.empty()) return;  // stopping, and nothing is left
      part = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    for (std::function<void()>& callback : part) callback();
    part.clear();  // the callbacks' captures go before the part counts as done
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace qstream
