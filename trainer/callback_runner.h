// CallbackRunner: a few threads that run callbacks handed over in groups.
// The learner gives it the insert callbacks of every batch it moved into the
// replay (the ingest sessions' commits and the acks they write), so the
// learner thread goes back to stepping at once and pays one hand-off per
// group instead of the callbacks' cost per batch.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace qstream {

// Calls held back to the end of a run of callbacks on one thread. While a
// CallbackScope is open on a thread (CallbackRunner opens one around each
// part it runs, the learner around the insert callbacks it runs itself, the
// ingest sessions around a pump), RunAtScopeEnd(key, fn) queues `fn` to run
// when the outermost scope closes, once per key however often it is asked;
// with no scope open it runs `fn` at once. The ack writer uses it: the acks
// a run of callbacks makes ready for one stream go out together (gRPC's
// buffer hint: one socket write) instead of one write each. A deferred call
// runs after every callback of the run, so nothing may wait inside a scope
// for one (none of the callbacks waits for an ack).
class CallbackScope {
 public:
  CallbackScope();
  // The outermost scope runs the deferred calls in the order first asked,
  // on this thread; a call they make to RunAtScopeEnd runs at once.
  ~CallbackScope();

  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;

  static void RunAtScopeEnd(const void* key, std::function<void()> fn);
};

class CallbackRunner {
 public:
  // `threads` >= 1 worker threads, started now.
  explicit CallbackRunner(int threads);
  // Runs what is still queued, then joins.
  ~CallbackRunner();

  CallbackRunner(const CallbackRunner&) = delete;
  CallbackRunner& operator=(const CallbackRunner&) = delete;

  // Queues `callbacks`: one wake-up per call; a group is split over the
  // threads in contiguous parts (each part runs in order on one thread;
  // parts run concurrently). A callback must not call WaitIdle.
  void Post(std::vector<std::function<void()>> callbacks) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns once every callback posted before the call has run.
  void WaitIdle() ABSL_LOCKS_EXCLUDED(mu_);

  int threads() const { return static_cast<int>(threads_.size()); }
  // The default for a machine: one thread per 8 cores, 1 to 4;
  // QSTREAM_CALLBACK_THREADS (1-64) overrides it (tests use it to run
  // callbacks of one round concurrently on a small machine).
  static int DefaultThreads();

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && running_ == 0; }
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  absl::Mutex mu_;
  std::deque<std::vector<std::function<void()>>> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // parts being run now
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace qstream
