#include "trainer/callback_runner.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"

namespace qstream {
namespace {

struct DeferredCalls {
  int depth = 0;
  std::vector<std::pair<const void*, std::function<void()>>> calls;
};

DeferredCalls& ThreadDeferredCalls() {
  thread_local DeferredCalls deferred;
  return deferred;
}

}  // namespace

CallbackScope::CallbackScope() { ++ThreadDeferredCalls().depth; }

CallbackScope::~CallbackScope() {
  DeferredCalls& deferred = ThreadDeferredCalls();
  if (--deferred.depth > 0) return;
  std::vector<std::pair<const void*, std::function<void()>>> calls;
  calls.swap(deferred.calls);
  for (auto& [key, fn] : calls) fn();
  // The buffer goes back for the next run (a call above that opened a scope
  // of its own has run that scope's calls already, so the list is empty).
  calls.clear();
  if (deferred.calls.empty()) deferred.calls.swap(calls);
}

void CallbackScope::RunAtScopeEnd(const void* key, std::function<void()> fn) {
  DeferredCalls& deferred = ThreadDeferredCalls();
  if (deferred.depth == 0) {
    fn();
    return;
  }
  // A run holds a few keys (the streams it acknowledges): a scan beats a hash.
  for (const auto& call : deferred.calls) {
    if (call.first == key) return;
  }
  deferred.calls.emplace_back(key, std::move(fn));
}

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
    {
      CallbackScope scope;
      for (std::function<void()>& callback : part) callback();
    }
    part.clear();  // the callbacks' captures go before the part counts as done
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace qstream
