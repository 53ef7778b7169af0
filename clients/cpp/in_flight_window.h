// InFlightWindow: how many batches an ExperienceStream keeps unacknowledged
// under Ack.throttle (proto/qstream/v1/experience.proto).
#pragma once

namespace qstream::actor {

// The in-flight window under Ack.throttle (AIMD): halved on a throttled ack,
// at most once per window of acks (the first throttled ack cuts at once), and
// grown by one per unthrottled ack, within [1, max].
class InFlightWindow {
 public:
  explicit InFlightWindow(int max) : max_(max), window_(max), acks_since_cut_(max) {}
  void OnAck(bool throttle) {
    ++acks_since_cut_;
    if (throttle) {
      if (acks_since_cut_ >= window_) {
        window_ = window_ / 2 > 1 ? window_ / 2 : 1;
        acks_since_cut_ = 0;
      }
    } else if (window_ < max_) {
      ++window_;
    }
  }
  int size() const { return window_; }

 private:
  int max_;
  int window_;
  int acks_since_cut_;
};

}  // namespace qstream::actor
