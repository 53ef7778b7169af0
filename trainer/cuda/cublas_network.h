// The network passes of the CUDA step on the cuBLASLt path (trainer/cuda/gemm.h):
// steps 3 and 8 of the learner step as one GEMM per layer and pass,
//   Forward   online on [s; s'] and target on [s'; 0] as one strided-batch
//             GEMM per layer (bias, ReLU and its bit mask in the epilogue)
//   Backward  per layer dW = dY^T X and dX = dY W of the online s rows, the
//             bias gradient and ReLU derivative in the epilogues
// The fallback of the fused passes (trainer/cuda/fused_network.h) for the
// shapes they do not handle or where cuBLASLt was measured faster.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/fused_mlp.h"
#include "trainer/cuda/device_memory.h"
#include "trainer/cuda/gemm.h"
#include "trainer/network_spec.h"

namespace qstream::cuda {

// The buffers the passes read and write outside their own.
struct CublasNetworkIo {
  const float* params = nullptr;  // [online | target], NetworkSpec layout each
  int64_t target_offset = 0;      // floats from the online to the target parameters
  float* grads = nullptr;         // written by the backward
  const float* x = nullptr;       // fp32 [3B][obs_dim]: s rows, s' rows, zeros
};

class CublasNetwork {
 public:
  // Allocates the activations and runs both passes once outside any capture
  // (cuBLASLt picks and loads its kernels on first use), falling back to an
  // unbatched forward, then to unfused epilogues, where cuBLASLt offers no
  // algorithm (QSTREAM_CUDA_EPILOGUES=unbatched|unfused forces them).
  absl::Status Init(const NetworkSpec& spec, int batch, kernels::Precision precision,
                    const CublasNetworkIo& io, cudaStream_t stream);

  absl::Status EnqueueForward(cudaStream_t stream) const;
  absl::Status EnqueueBackward(cudaStream_t stream) const;

  // The simpler paths taken ("" for none), for the backend's device name.
  const std::string& fallbacks() const { return fallbacks_; }

  // Logits, fp32: [0,B) online on s, [B,2B) online on s'; target_*: target on s'.
  const float* value_logits() const { return acts_.value.get(); }
  const float* adv_logits() const { return acts_.adv.get(); }
  const float* target_value_logits() const { return acts_.value.get() + acts_.stride(spec_.num_atoms); }
  const float* target_adv_logits() const { return acts_.adv.get() + acts_.stride(spec_.adv_out.out); }
  // Where the loss writes d loss / d logits (fp32, B rows).
  float* d_value() const { return d_value_.get(); }
  float* d_adv() const { return d_adv_.get(); }

 private:
  // Outputs of one network pass, row-major [rows][features], and the ReLU
  // bit masks of the hidden layers.
  struct Activations {
    int rows = 0;     // per batch
    int batches = 1;  // 2: [online; target] passes side by side (strided-batch GEMMs)
    std::vector<DeviceBuffer<float>> trunk;
    DeviceBuffer<float> value_hidden, value, adv_hidden, adv;
    std::vector<DeviceBuffer<char>> trunk_mask;
    DeviceBuffer<char> value_hidden_mask, adv_hidden_mask;

    static ReluMask Mask(const DeviceBuffer<char>& bits, int features);
    // Elements between the batches of a [rows][features] buffer.
    int64_t stride(int features) const { return int64_t{rows} * features; }
    absl::Status Allocate(const NetworkSpec& spec, int n, int num_batches);
  };

  NetworkSpec spec_;
  int B_ = 0;
  CublasNetworkIo io_;
  Gemm gemm_;
  Activations acts_;  // 2 batches of 2B rows: online on [s; s'], target on [s'; 0]
  // Backward: gradients of the online s rows.
  DeviceBuffer<float> d_value_, d_adv_, d_value_hidden_, d_adv_hidden_;
  std::vector<DeviceBuffer<float>> d_trunk_;
  // Bias/ReLU folded into cuBLASLt epilogues; false when cuBLASLt offers no
  // algorithm for them here, then small kernels do that work.
  bool fused_epilogues_ = true;
  // Online and target forward as one strided-batch GEMM per layer.
  bool batched_forward_ = true;
  std::string fallbacks_;
};

}  // namespace qstream::cuda
