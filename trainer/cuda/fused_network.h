// The network passes of the CUDA step on the fused path (kernels/fused_mlp.h):
// steps 3 and 8 of the learner step as four launches,
//   Pack      fp32 master parameters -> padded operand copies (online, target)
//   Forward   one chain kernel: online on s, online on s', target on s'
//   Backward  one chain kernel: data gradients of every layer on the s rows
//   WeightGrad one kernel: dW, db of every layer, and the grad-norm partials
// with every kernel argument built once here, at set-up.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/fused_mlp.h"
#include "trainer/cuda/device_memory.h"
#include "trainer/network_spec.h"

namespace qstream::cuda {

// The buffers the fused passes read and write outside their own.
struct FusedNetworkIo {
  const float* params = nullptr;   // online, NetworkSpec layout
  const float* target = nullptr;   // target, same layout
  float* grads = nullptr;          // written by WeightGrad
  const float* x = nullptr;        // fp32 [2B][obs_dim]: s rows, then s'
  float* norm_partials = nullptr;  // kernels::kMaxGradTiles, written by WeightGrad
};

// The automatic choice (QSTREAM_CUDA_PATH=auto) takes the fused path where
// it was measured faster than cuBLASLt (bench/NOTES.md, stop 28): networks
// whose widest padded activation is at most kFusedAutoWidth; up to
// kFusedAutoWidthTensor with bf16 operands, and with TF32 operands at batches
// of at least kFusedAutoBatchTf32. FP32 wider than kFusedAutoWidth stays on
// cuBLASLt.
inline constexpr int kFusedAutoWidth = 128;
inline constexpr int kFusedAutoWidthTensor = 256;
inline constexpr int kFusedAutoBatchTf32 = 512;

class FusedNetwork {
 public:
  static int WidestPadded(const NetworkSpec& spec);
  // Why the automatic choice does not take the fused path (empty when it does).
  static std::string AutoDeclines(const NetworkSpec& spec, int batch, kernels::Precision precision);
  // Why the fused path cannot run this network (empty when it can).
  static std::string Unsupported(const NetworkSpec& spec, int batch, kernels::Precision precision,
                                 size_t shared_limit);

  absl::Status Init(const NetworkSpec& spec, int batch, kernels::Precision precision,
                    const FusedNetworkIo& io, cudaStream_t stream);

  absl::Status EnqueuePack(cudaStream_t stream) const;
  absl::Status EnqueueForward(cudaStream_t stream) const;
  absl::Status EnqueueBackward(cudaStream_t stream) const;  // data gradients, then weight gradients

  // Logits, fp32: rows [0,B) online on s, [B,2B) online on s', [2B,3B) target on s'.
  const float* value_logits() const { return v_logits_.get(); }
  const float* adv_logits() const { return a_logits_.get(); }
  // Where the loss writes d loss / d logits (operand type, padded rows).
  void* d_value() const { return dv_.get(); }
  void* d_adv() const { return da_.get(); }
  int d_value_ld() const { return zp_; }
  int d_adv_ld() const { return azp_; }
  int num_grad_tiles() const { return grad_.num_tiles; }
  // The forward's stored activations of the online s rows (operand type), which
  // the backward's ReLU masks and weight gradients read: trunk layer k
  // (B x trunk_ld(k)), and the head hidden layers side by side (B x
  // head_ld(), value from column 0, advantage from head_adv_col()).
  const void* trunk_activations(int k) const { return t_op_[k].get(); }
  int trunk_ld(int k) const { return kernels::FusedPadded(spec_.trunk[k].out); }
  const void* head_activations() const { return h_op_.get(); }
  int head_ld() const { return 2 * hp_; }
  int head_adv_col() const { return hp_; }

 private:
  absl::Status Operand(size_t elements, DeviceBuffer<char>* buf) const;

  NetworkSpec spec_;
  int B_ = 0;
  kernels::Precision precision_ = kernels::Precision::kTf32;
  int elem_ = 4;
  int zp_ = 0, azp_ = 0, hp_ = 0;

  // Packed weights (operand type) and padded biases (fp32).
  DeviceBuffer<char> packed_;
  DeviceBuffer<float> biases_;
  // Activations of the online s rows (operand type), for the backward.
  DeviceBuffer<char> x_op_, h_op_, dv_, da_, dh_;
  std::vector<DeviceBuffer<char>> t_op_, dt_;
  DeviceBuffer<float> v_logits_, a_logits_;

  kernels::PackProgram pack_;
  kernels::FusedProgram forward_, backward_;
  kernels::GradProgram grad_;
  DeviceBuffer<kernels::PackProgram> d_pack_;
  DeviceBuffer<kernels::FusedProgram> d_forward_, d_backward_;
  DeviceBuffer<kernels::GradProgram> d_grad_;
  float* norm_partials_ = nullptr;
};

}  // namespace qstream::cuda
