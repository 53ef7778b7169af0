// libqstream_native: the Python SDK's ExperienceService.Stream transport on
// gRPC C++ (qstream.native loads it with ctypes; qstream.stream's
// NativeExperienceStream drives it). The Python side keeps every decision of
// the stream (numbering, window, acks, reconnect, errors) and hands this
// library only serialized batches and the call's lifecycle; the library
// writes the batches in order and queues the serialized acks, on gRPC's own
// threads, without the GIL (ctypes releases it for every call here).
//
// Why: on grpc.aio each message costs ~170-190 us of client CPU whatever its
// size (bench/NOTES.md "Python Writer, stop 29": the write holds the GIL
// through an inline sendmsg, three threads wake per completion), which kept
// the SDK level with Reverb's C++ writer at 1024 transitions per message.
//
// The C ABI (all functions thread-safe unless said otherwise):
//   qsn_channel_open(target, ca, ca_len, key, key_len, cert, cert_len,
//                    arg_keys, arg_strs, arg_ints, n_args, err, err_cap)
//       a channel; TLS when ca or cert is given (PEM bytes; ca may be empty
//       with a cert: the default roots); each channel argument is a string
//       (arg_strs[i] != NULL) or an integer (arg_ints[i]). NULL on error,
//       with the reason in err.
//   qsn_channel_free(channel)
//   qsn_call_start(channel, method, md_keys, md_values, n_md)
//       starts a bidi streaming call with that metadata; never NULL.
//   qsn_call_write(call, data, len)   0: queued (written in order),
//                                     -1: the call has ended (nothing queued)
//   qsn_call_writes_done(call)        half-closes after the queued writes
//   qsn_call_read(call, buf, cap, timeout_s, size_out)
//       waits for the next ack: 1 and its size in size_out (copied into buf
//       and consumed when it fits in cap, else left queued: call again with
//       a buffer of size_out bytes); 0 once the daemon ended the reads (then
//       call qsn_call_finish); -1 when timeout_s (< 0: none) passed first.
//   qsn_call_cancel(call)             cancels the call (reads then end)
//   qsn_call_finish(call, details, cap)
//       stops the writes, waits until gRPC has ended the call and returns its
//       status code (details, NUL-terminated, truncated to cap).
//   qsn_call_free(call)               ends the call (as qsn_call_finish) and
//                                     frees it, on the calling thread.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"

namespace {

void CopyOut(const std::string& text, char* out, size_t cap) {
  if (out == nullptr || cap == 0) return;
  const size_t n = std::min(text.size(), cap - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// Once per process, before the first channel:
// - gRPC stays initialized until the process ends, instead of an init and a
//   grpc_shutdown (which 1.51 finishes on a detached thread) around every
//   Writer's channel.
// - gRPC C++ 1.51 prints its INFO lines (a GOAWAY at a daemon restart, ...)
//   into the Python program's stderr unless GRPC_VERBOSITY says otherwise;
//   grpcio prints only errors. Keep that default.
void InitOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_verbosity(GPR_LOG_SEVERITY_ERROR);
    grpc_init();  // never shut down: see above
  });
}

struct Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
};

// One ExperienceService.Stream call. A hold keeps gRPC from ending the call
// (OnDone) while the Python side may still start writes; Finish releases it.
// Start* calls are never made with mu_ held: gRPC may run a reaction inline.
class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Call(grpc::GenericStub& stub, const std::string& method) {
    stub.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
  }

  grpc::ClientContext& context() { return context_; }

  void Start() {
    AddHold();
    StartRead(&read_buffer_);
    StartCall();
  }

  int Write(const char* data, size_t len) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Slice slice(data, len);
    {
      absl::MutexLock lock(&mu_);
      if (finishing_ || write_failed_ || writes_done_) return -1;
      queued_.emplace_back(&slice, 1);
      if (writing_) return 0;
      writing_ = true;
      current_.Swap(&queued_.front());
      queued_.pop_front();
    }
    StartWrite(&current_);
    return 0;
  }

  void WritesDone() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (writes_done_ || finishing_) return;
      writes_done_ = true;
      if (writing_ || write_failed_) return;  // OnWriteDone half-closes
      writing_ = true;                        // the half-close is the last write
    }
    StartWritesDone();
  }

  int Read(char* buf, size_t cap, double timeout_s, size_t* size_out) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !acks_.empty() || reads_ended_; };
    if (timeout_s < 0) {
      mu_.Await(absl::Condition(&ready));
    } else if (!mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(timeout_s))) {
      return -1;
    }
    if (acks_.empty()) return 0;
    const std::string& ack = acks_.front();
    *size_out = ack.size();
    if (ack.size() <= cap) {
      std::copy(ack.begin(), ack.end(), buf);
      acks_.pop_front();
    }
    return 1;
  }

  void Cancel() { context_.TryCancel(); }

  int Finish(char* details, size_t cap) ABSL_LOCKS_EXCLUDED(mu_) {
    bool release = false;
    bool open = false;
    {
      absl::MutexLock lock(&mu_);
      if (!finishing_) {
        finishing_ = true;
        release = true;
        queued_.clear();
      }
      open = !reads_ended_;
    }
    // A call still open on both sides (an abort, or a reconnect while the
    // daemon keeps the call) must not wait for the daemon: cancel it (not
    // under mu_, like the Start* calls).
    if (open) context_.TryCancel();
    if (release) RemoveHold();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    CopyOut(status_.error_message(), details, cap);
    return static_cast<int>(status_.error_code());
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    bool half_close = false;
    {
      absl::MutexLock lock(&mu_);
      current_.Clear();
      if (!ok) {
        write_failed_ = true;
        queued_.clear();
      }
      if (!write_failed_ && !queued_.empty()) {
        current_.Swap(&queued_.front());
        queued_.pop_front();
      } else if (!write_failed_ && writes_done_ && !finishing_) {
        half_close = true;
      } else {
        writing_ = false;
        return;
      }
    }
    if (half_close) {
      StartWritesDone();
    } else {
      StartWrite(&current_);
    }
  }

  void OnWritesDoneDone(bool /*ok*/) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      reads_ended_ = true;
      return;
    }
    std::string ack;
    std::vector<grpc::Slice> slices;
    if (read_buffer_.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) ack.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    read_buffer_.Clear();
    {
      absl::MutexLock lock(&mu_);
      acks_.push_back(std::move(ack));
    }
    StartRead(&read_buffer_);
  }

  void OnDone(const grpc::Status& status) override ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      reads_ended_ = true;
      done_ = true;
    }
    returned_.store(true, std::memory_order_release);  // gRPC's last touch of this object
  }

  // Ends the call (as Finish, if the Python side has not) and deletes it on
  // the calling thread, never on gRPC's: the ClientContext may hold the last
  // reference to the channel, whose destructor joins gRPC's callback threads
  // and frees their completion queue. Run from OnDone (a callback thread),
  // that freed the queue under the thread's own feet ("ref_counted.h
  // assertion failed: prior > 0", a double free, in 3 of 20 Python exits).
  void Free() {
    Finish(nullptr, 0);
    while (!returned_.load(std::memory_order_acquire)) std::this_thread::yield();
    delete this;
  }

 private:
  std::atomic<bool> returned_{false};  // OnDone has run to its end
  grpc::ClientContext context_;
  grpc::ByteBuffer read_buffer_;  // the read in progress (one at a time)

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queued_ ABSL_GUARDED_BY(mu_);  // batches not yet started
  grpc::ByteBuffer current_;  // the write in progress; only the thread that set writing_ touches it
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::string> acks_ ABSL_GUARDED_BY(mu_);
  bool reads_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* qsn_channel_open(
    const char* target, const char* ca, size_t ca_len, const char* key, size_t key_len, const char* cert,
    size_t cert_len, const char* const* arg_keys, const char* const* arg_strs, const long long* arg_ints,
    int n_args, char* err, size_t err_cap) {
  InitOnce();
  try {
    grpc::ChannelArguments args;
    for (int i = 0; i < n_args; ++i) {
      if (arg_strs[i] != nullptr) {
        args.SetString(arg_keys[i], arg_strs[i]);
      } else {
        args.SetInt(arg_keys[i], static_cast<int>(arg_ints[i]));
      }
    }
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    if (ca != nullptr || cert != nullptr) {
      grpc::SslCredentialsOptions ssl;
      if (ca != nullptr) ssl.pem_root_certs.assign(ca, ca_len);
      if (cert != nullptr) {
        ssl.pem_cert_chain.assign(cert, cert_len);
        if (key != nullptr) ssl.pem_private_key.assign(key, key_len);
      }
      credentials = grpc::SslCredentials(ssl);
    } else {
      credentials = grpc::InsecureChannelCredentials();
    }
    auto channel = std::make_unique<Channel>();
    channel->channel = grpc::CreateCustomChannel(target, credentials, args);
    channel->stub = std::make_unique<grpc::GenericStub>(channel->channel);
    return channel.release();
  } catch (const std::exception& e) {
    CopyOut(std::string("cannot open a channel to ") + target + ": " + e.what(), err, err_cap);
    return nullptr;
  }
}

__attribute__((visibility("default"))) void qsn_channel_free(void* channel) {
  delete static_cast<Channel*>(channel);
}

__attribute__((visibility("default"))) void* qsn_call_start(void* channel, const char* method,
                                                            const char* const* md_keys,
                                                            const char* const* md_values, int n_md) {
  auto* call = new Call(*static_cast<Channel*>(channel)->stub, method);
  for (int i = 0; i < n_md; ++i) call->context().AddMetadata(md_keys[i], md_values[i]);
  call->Start();
  return call;
}

__attribute__((visibility("default"))) int qsn_call_write(void* call, const char* data, size_t len) {
  return static_cast<Call*>(call)->Write(data, len);
}

__attribute__((visibility("default"))) void qsn_call_writes_done(void* call) {
  static_cast<Call*>(call)->WritesDone();
}

__attribute__((visibility("default"))) int qsn_call_read(void* call, char* buf, size_t cap, double timeout_s,
                                                         size_t* size_out) {
  return static_cast<Call*>(call)->Read(buf, cap, timeout_s, size_out);
}

__attribute__((visibility("default"))) void qsn_call_cancel(void* call) {
  static_cast<Call*>(call)->Cancel();
}

__attribute__((visibility("default"))) int qsn_call_finish(void* call, char* details, size_t cap) {
  return static_cast<Call*>(call)->Finish(details, cap);
}

__attribute__((visibility("default"))) void qsn_call_free(void* call) { static_cast<Call*>(call)->Free(); }

}  // extern "C"
