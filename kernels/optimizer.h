// The optimizer stages of the learner step (backend.h contract, steps 9-10)
// over the one flat parameter buffer: the first stage of the global grad norm
// (the cuBLASLt path; the fused path's weight-gradient kernel writes the same
// partials) and clip + Adam + target update in one pass. The second norm stage,
// the guard, statistics and priority write-back are kernels/step_finalize.h.
// On the fused path the same pass also writes the packed operand copies of
// both networks that the next step's passes read (LaunchAdamPack).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/fused_mlp.h"
#include "kernels/per_sample.h"
#include "kernels/views.h"

namespace qstream::kernels {

// Blocks of the first norm stage; fixed so the summation order is fixed.
inline constexpr int kNormBlocks = 256;

// Stage 1: block k sums g_i^2 over the contiguous chunk k of n/kNormBlocks
// elements (threads strided inside it, then a fixed block tree) and alone
// writes partials[k]. Grid: kNormBlocks x 256.
cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream);

struct AdamArgs {
  float* params = nullptr;
  const float* grads = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* target = nullptr;
  int64_t n = 0;
  float lr = 0;
  float lr_end = 0;            // with lr_decay_steps > 0: step::LearningRate at state->t - 1
  int64_t lr_decay_steps = 0;  // 0: lr throughout
  float beta1 = 0;
  float beta2 = 0;
  float epsilon = 0;
  float tau = 0;
  int32_t target_period = 0;  // > 0: hard copy every period steps; 0: EMA
  const DeviceState* state = nullptr;
  // The sampler's priority sums (per_sample.h), or sums.sums null: blocks
  // after the update's own sum every chunk again, beside the update, from the
  // priorities the finalize kernel before this one wrote back, so the next
  // step's sampler finds them current.
  PrioritySums sums;
};

// One pass, thread i (grid-stride) owns element i: when the guard passed,
// g = grads[i] * clip_scale; m, v, theta Adam update with the step's bias
// corrections; then (tripped or not) the target: copy when period > 0 and
// (t+1) % period == 0 (state->t already holds t+1 here), EMA
// target += tau (theta - target) when period == 0.
cudaError_t LaunchAdamTarget(const AdamArgs& args, cudaStream_t stream);

// The fused path's variant: LaunchAdamTarget's update, element for element the
// same arithmetic, walked as the PackProgram's 32 x 32 tiles so that each
// updated value is also stored where the Pack kernel would put it (the online
// network's copies from the new theta, the target's from the new target),
// which saves the step its Pack node. Its program groups the pack jobs by
// the parameters they read.
inline constexpr int kAdamPackTile = 32;
inline constexpr int kMaxAdamPackDests = 4;  // copies of one matrix: online fwd + bwd, target fwd

struct AdamPackDest {
  void* dst = nullptr;  // dst[i][j] at dst + i * ld + j, operand type (or fp32 with to_f32)
  int ld = 0;
  bool transpose = false;    // dst[c][r] = value[r][c]
  bool to_f32 = false;       // fp32 destination (biases), not the operand type
  bool from_target = false;  // the target network's value, not the online one
};

struct AdamPackJob {
  int64_t offset = 0;  // of element [0][0] in the flat parameter layout
  int rows = 0;
  int cols = 0;
  int first_tile = 0;  // tiles of the jobs before this one
  int num_dests = 0;
  AdamPackDest dests[kMaxAdamPackDests];
};

struct AdamPackProgram {
  Precision precision = Precision::kTf32;
  int num_jobs = 0;
  int num_tiles = 0;
  AdamPackJob jobs[kMaxPackJobs];  // by offset, together covering [0, n) once
};

// Builds the program from `pack`, whose jobs read the online parameters at
// `params` or the target at `target` (n floats each): one job per source
// matrix, its copies as destinations. Returns why not (empty on success):
// a source outside both networks, two jobs of one source disagreeing on its
// shape, more than kMaxAdamPackDests copies, or jobs that do not tile
// [0, n) exactly (an element nobody packs would miss its update).
std::string PlanAdamPack(const PackProgram& pack, const float* params, const float* target, int64_t n,
                         AdamPackProgram* out);

// Launches the fused update; `device_program` is `program` in device memory.
cudaError_t LaunchAdamPack(const AdamArgs& args, const AdamPackProgram& program,
                           const AdamPackProgram* device_program, cudaStream_t stream);

}  // namespace qstream::kernels
