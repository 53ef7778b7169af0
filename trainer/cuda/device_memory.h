// RAII owners of device resources: device and pinned host buffers, streams,
// events, executable graphs. Move-only; each frees its resource once.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_status.h"

namespace qstream::cuda {

// n elements of T in device memory, zero-filled at allocation.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }

  absl::Status Allocate(size_t n) {
    Reset();
    if (n == 0) return absl::OkStatus();
    void* p = nullptr;
    QS_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    ptr_ = static_cast<T*>(p);
    size_ = n;
    QS_CUDA_CHECK(cudaMemset(ptr_, 0, n * sizeof(T)));
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  T* get() const { return ptr_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

// n elements of T in page-locked host memory (async copies need it).
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~PinnedBuffer() { Reset(); }

  absl::Status Allocate(size_t n) {
    Reset();
    void* p = nullptr;
    QS_CUDA_CHECK(cudaHostAlloc(&p, n * sizeof(T), cudaHostAllocDefault));
    ptr_ = static_cast<T*>(p);
    size_ = n;
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  T* get() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

// Generic move-only handle: Traits::Destroy(handle) when non-null.
template <typename H, cudaError_t (*Destroy)(H)>
class Handle {
 public:
  Handle() = default;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      Reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~Handle() { Reset(); }
  void Reset(H h = nullptr) {
    if (h_ != nullptr) Destroy(h_);
    h_ = h;
  }
  H get() const { return h_; }

 private:
  H h_ = nullptr;
};

using Stream = Handle<cudaStream_t, cudaStreamDestroy>;
using Event = Handle<cudaEvent_t, cudaEventDestroy>;
using GraphExec = Handle<cudaGraphExec_t, cudaGraphExecDestroy>;
using Graph = Handle<cudaGraph_t, cudaGraphDestroy>;

inline absl::Status CreateStream(Stream* s) {
  cudaStream_t h = nullptr;
  QS_CUDA_CHECK(cudaStreamCreateWithFlags(&h, cudaStreamNonBlocking));
  s->Reset(h);
  return absl::OkStatus();
}

inline absl::Status CreateEvent(Event* e, bool timing) {
  cudaEvent_t h = nullptr;
  QS_CUDA_CHECK(cudaEventCreateWithFlags(&h, timing ? cudaEventDefault : cudaEventDisableTiming));
  e->Reset(h);
  return absl::OkStatus();
}

}  // namespace qstream::cuda
