// The distributional head of the learner step (backend.h contract, steps
// 4-7), fused: dueling combine at the logit level, softmax over atoms,
// double-DQN argmax on the online s' logits, target distribution at a*,
// categorical projection, cross-entropy against log_softmax(l(s, a)),
// the gradient of the batch loss w.r.t. the online V and A outputs, and the
// Q statistics of the online s rows. Log-probs stay in fp32 registers.
// Options (config.proto LossConfig): label smoothing of the projected target
// and a blend with an expected-value MSE whose weight follows the step count.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/fused_mlp.h"
#include "kernels/views.h"

namespace qstream::kernels {

// Most atoms the fused kernels hold in registers (8 per lane).
inline constexpr int kMaxAtoms = 256;

// config.proto LossConfig. The defaults give the plain CE, computed by the
// same instructions as without options.
struct LossOptions {
  // eps: the CE is taken against m' = (1 - eps) m + eps sum(m) / Z.
  float label_smoothing = 0;
  // alpha = step::MseBlendAlpha(start, end, steps, t) weighs the blend
  // L = (1 - alpha) CE + alpha MSE, MSE = 1/2 (Q - y)^2 / (v_max - v_min)^2,
  // Q = sum_z softmax(l(s, a))_z atom(z), y = sum_z m_z atom(z) (m unsmoothed).
  float mse_blend_start = 0;
  float mse_blend_end = 0;
  int64_t mse_blend_steps = 0;
};

struct C51LossArgs {
  HeadShape head;
  int batch = 0;
  const float* online_v = nullptr;  // 2B x Z: rows [0,B) on s, [B,2B) on s'
  const float* online_a = nullptr;  // 2B x (total_actions * Z), [branch][action][atom]
  const float* target_v = nullptr;  // B x Z on s'
  const float* target_a = nullptr;  // B x (total_actions * Z) on s'
  const int32_t* actions = nullptr; // B x num_branches
  const float* rewards = nullptr;   // B
  const float* discounts = nullptr; // B
  const float* weights = nullptr;   // B, raw IS weights (per_sample.h): w_b / max(0, max w) is used
  LossOptions options;
  // Reads t (steps before the running one) for the blend's alpha; the
  // finalize kernel advances it after this kernel. Null: t = 0.
  const DeviceState* state = nullptr;
  // d loss / d V(s) (B x Z) and d loss / d A(s) (B x total_actions * Z),
  // written as grad_precision (fp32, TF32-rounded fp32 or bf16) with row
  // strides dv_ld >= Z and da_ld >= total_actions * Z (0: dense; padding untouched).
  void* dv = nullptr;
  void* da = nullptr;
  int dv_ld = 0;
  int da_ld = 0;
  Precision grad_precision = Precision::kFp32;
  float* ce = nullptr;         // B: CE_b averaged over branches, written (the priority signal)
  float* item_loss = nullptr;  // B: L_b = (1 - alpha) CE_b + alpha MSE_b (CE_b when alpha = 0), written
  float* clip_mass = nullptr; // B: target mass outside the support, summed over branches
  float* q_min = nullptr;     // B: over the total_actions Q_online(s)
  float* q_max = nullptr;     // B
  float* q_sum = nullptr;     // B
  int32_t* q_bad = nullptr;   // B: 1 when some Q_online(s) is non-finite
  // Copy each sample's six logit rows into shared memory first when they fit
  // in the default 48 KB with the rest (bitwise the same results; false
  // reads them from global memory, as for larger heads).
  bool stage_rows = true;
};

// Dynamic shared memory the loss kernel needs; the backend checks it at set-up.
size_t C51LossSharedBytes(const HeadShape& head);

// Grid: one block per sample b, 4 warps; the block first stages the
// sample's rows of V and A (s, s', target s') in shared memory when they fit
// (args.stage_rows), then computes the dueling shift of every branch on s
// and s' and the online Q of every action on s and s' into shared memory
// (2 x total_actions rows, a power-of-two group of threads per row, each
// summing its atoms in order, then a fixed butterfly). Then warp w takes
// branches w, w+4, ...: a* and the Q statistics from those Q values, the
// target softmax, projection and CE with lane l on atoms l, l+32, ...
// (registers). Per branch the warp writes
// da[b][branch actions][*] and its d logit to shared memory; after a barrier
// the block sums the branches in order into dv[b][*] and thread 0 alone
// writes ce/clip/q stats of sample b. Projection as a gather: target atom i
// sums p_j * weight(i, j) over source atoms j in order, so no scatter races;
// with discount >= 0 only the run of j with i - 1 < b_j < i + 1 is visited
// (found by binary search, b_j being monotone in j), the same terms in the
// same order, so the result is bitwise that of the full scan.
// Gradient: d loss / d l(s, a_br)[z] = w_b / (B * branches) * (p_z sum(m) - m_z)
// (m' for m with label smoothing); with alpha > 0 that term times (1 - alpha)
// plus w_b / (B * branches) * alpha (Q - y) / (v_max - v_min)^2 p_z (atom(z) - Q).
// Every thread computes alpha from state->t; alpha == 0 (and eps == 0) skips
// the extra work, uniformly per block.
cudaError_t LaunchC51Loss(const C51LossArgs& args, cudaStream_t stream);

// Q-values of the online network: q[r][a] = sum_z softmax(l[a])[z] * atom(z)
// for n rows of V (n x Z) and A (n x total_actions*Z). One block per row,
// a warp per branch, lane 0 writes q[r][branch actions].
cudaError_t LaunchQValues(const HeadShape& head, const float* v, const float* a, int rows, float* q,
                          cudaStream_t stream);

}  // namespace qstream::kernels
