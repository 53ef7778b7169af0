#include "kernels/optimizer.h"

#include <algorithm>

#include "common/step_constants.h"
#include "kernels/launch.cuh"
#include "kernels/operand.cuh"
#include "kernels/priority_sums.cuh"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GradSumSquaresKernel(const float* __restrict__ g, int64_t n,
                                                                 float* __restrict__ partials) {
  WaitForPredecessor();
  __shared__ float scratch[kThreads / 32];
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  float s = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += g[i] * g[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// What every element of one Adam + target pass shares.
struct AdamStep {
  bool apply;
  float scale, bc1, bc2, lr;
  bool copy, ema;
};

__device__ __forceinline__ AdamStep AdamStepOf(const AdamArgs& a) {
  const DeviceState* s = a.state;
  AdamStep st;
  st.apply = s->apply != 0;
  st.scale = s->clip_scale;
  st.bc1 = s->bias_correction1;
  st.bc2 = s->bias_correction2;
  const int64_t t_next = s->t;  // already advanced by the finalize kernel
  st.lr = step::LearningRate(a.lr, a.lr_end, a.lr_decay_steps, t_next - 1);
  st.copy = a.target_period > 0 && t_next % a.target_period == 0;
  st.ema = a.target_period <= 0;
  return st;
}

// Updates element i of theta, m, v and the target; returns theta and *target_out.
__device__ __forceinline__ float AdamElement(const AdamArgs& a, const AdamStep& st, int64_t i,
                                             float* target_out) {
  float theta = a.params[i];
  if (st.apply) {
    const float g = a.grads[i] * st.scale;
    const float m = a.beta1 * a.m[i] + (1.0f - a.beta1) * g;
    const float v = a.beta2 * a.v[i] + (1.0f - a.beta2) * g * g;
    a.m[i] = m;
    a.v[i] = v;
    theta -= st.lr * (m / st.bc1) / (sqrtf(v / st.bc2) + a.epsilon);
    a.params[i] = theta;
  }
  float tg = a.target[i];
  if (st.copy) {
    tg = theta;
    a.target[i] = tg;
  } else if (st.ema) {
    tg = tg + a.tau * (theta - tg);
    a.target[i] = tg;
  }
  *target_out = tg;
  return theta;
}

// Blocks from `update_blocks` on: chunk blockIdx.x - update_blocks of the priority sums.
__device__ __forceinline__ bool PrioritySumsTail(const AdamArgs& a, int update_blocks) {
  if (static_cast<int>(blockIdx.x) < update_blocks) return false;
  SumPriorityChunk(a.sums, static_cast<int>(blockIdx.x) - update_blocks);
  return true;
}

__global__ void __launch_bounds__(kThreads) AdamTargetKernel(AdamArgs a, int update_blocks) {
  WaitForPredecessor();
  if (PrioritySumsTail(a, update_blocks)) return;
  const AdamStep st = AdamStepOf(a);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n;
       i += int64_t{update_blocks} * blockDim.x) {
    float tg;
    AdamElement(a, st, i, &tg);
  }
}

constexpr int kTile = kAdamPackTile;
constexpr int kTileRowStep = kThreads / kTile;

// Blocks grid-stride over the program's tiles in order (job j's tiles follow
// job j-1's). A tile's elements are updated with coalesced reads along rows;
// straight copies are stored at once, transposed ones through shared memory
// after a barrier, so their stores are coalesced too.
template <int P>
__global__ void __launch_bounds__(kThreads)
    AdamPackKernel(AdamArgs a, const AdamPackProgram* __restrict__ prog, int update_blocks) {
  WaitForPredecessor();
  if (PrioritySumsTail(a, update_blocks)) return;
  __shared__ float online[kTile][kTile + 1];
  __shared__ float target[kTile][kTile + 1];
  const AdamStep st = AdamStepOf(a);
  const int tx = static_cast<int>(threadIdx.x) % kTile;
  const int ty = static_cast<int>(threadIdx.x) / kTile;
  const int num_jobs = prog->num_jobs;
  int j = 0;
  for (int t = blockIdx.x; t < prog->num_tiles; t += update_blocks) {  // uniform per block: barriers are safe
    while (j + 1 < num_jobs && prog->jobs[j + 1].first_tile <= t) ++j;
    const AdamPackJob& job = prog->jobs[j];
    const int tiles_c = (job.cols + kTile - 1) / kTile;
    const int local = t - job.first_tile;
    const int r0 = (local / tiles_c) * kTile;
    const int c0 = (local % tiles_c) * kTile;
    __syncthreads();  // the previous tile's reads of the shared tiles are done
    for (int i = ty; i < kTile; i += kTileRowStep) {
      const int r = r0 + i, c = c0 + tx;
      if (r >= job.rows || c >= job.cols) continue;
      float tg;
      const float theta = AdamElement(a, st, job.offset + int64_t{r} * job.cols + c, &tg);
      online[i][tx] = theta;
      target[i][tx] = tg;
      for (int d = 0; d < job.num_dests; ++d) {
        const AdamPackDest& dest = job.dests[d];
        if (!dest.transpose)
          StorePacked<P>(dest.dst, dest.to_f32, int64_t{r} * dest.ld + c, dest.from_target ? tg : theta);
      }
    }
    __syncthreads();
    for (int i = ty; i < kTile; i += kTileRowStep) {
      const int c = c0 + i, r = r0 + tx;  // dst[c][r] = value[r][c]
      if (r >= job.rows || c >= job.cols) continue;
      for (int d = 0; d < job.num_dests; ++d) {
        const AdamPackDest& dest = job.dests[d];
        if (dest.transpose)
          StorePacked<P>(dest.dst, dest.to_f32, int64_t{c} * dest.ld + r,
                         dest.from_target ? target[tx][i] : online[tx][i]);
      }
    }
  }
}

constexpr int kMaxUpdateBlocks = 1056;  // 8 blocks per SM on 132 SMs; the rest is grid-stride

int GridFor(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxUpdateBlocks) blocks = kMaxUpdateBlocks;
  return static_cast<int>(blocks);
}

int SumsBlocks(const AdamArgs& a) { return a.sums.sums != nullptr ? a.sums.chunks : 0; }

}  // namespace

cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream) {
  return LaunchDependent(StepKernel::kGradNorm, GradSumSquaresKernel, kNormBlocks, kThreads, 0, stream, grads,
                         n, partials);
}

cudaError_t LaunchAdamTarget(const AdamArgs& a, cudaStream_t stream) {
  const int update_blocks = GridFor(a.n);
  return LaunchDependent(StepKernel::kAdam, AdamTargetKernel, update_blocks + SumsBlocks(a), kThreads, 0,
                         stream, a, update_blocks);
}

cudaError_t LaunchAdamPack(const AdamArgs& a, const AdamPackProgram& p, const AdamPackProgram* device_program,
                           cudaStream_t stream) {
  const int update_blocks = std::max(1, std::min(p.num_tiles, kMaxUpdateBlocks));
  void (*kernel)(AdamArgs, const AdamPackProgram*, int) = AdamPackKernel<0>;
  if (p.precision == Precision::kBf16) kernel = AdamPackKernel<2>;
  if (p.precision == Precision::kTf32) kernel = AdamPackKernel<1>;
  return LaunchDependent(StepKernel::kAdam, kernel, update_blocks + SumsBlocks(a), kThreads, 0, stream, a,
                         device_program, update_blocks);
}

}  // namespace qstream::kernels
