#include "kernels/c51_loss.h"

#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>

#include "common/step_constants.h"
#include "kernels/is_weight.cuh"
#include "kernels/launch.cuh"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

// d logits as the backward's operand: fp32, TF32-rounded fp32 or bf16.
__device__ __forceinline__ void StoreGrad(void* base, int64_t i, float v, Precision p) {
  if (p == Precision::kBf16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(base)[i] = p == Precision::kTf32 ? nvcuda::wmma::__float_to_tf32(v) : v;
  }
}

constexpr int kLossWarps = 4;
// Per-branch statistics the loss kernel's warps hand to thread 0: CE, clip
// mass, Q min/max/sum, bad-Q flag, MSE.
constexpr int kLossStats = 7;

__device__ __forceinline__ float Atom(const HeadShape& h, int z) { return h.v_min + z * h.delta_z; }

// shift[z] = V[z] - mean_a A[a][z] over the n actions starting at `first`.
template <int kAtomsPerLane>
__device__ __forceinline__ void DuelingShift(const float* v_row, const float* a_row, int first, int n, int Z,
                                             int lane, float shift[kAtomsPerLane]) {
#pragma unroll
  for (int k = 0; k < kAtomsPerLane; ++k) {
    const int z = lane + 32 * k;
    float s = 0.0f;
    if (z < Z) {
      for (int a = 0; a < n; ++a) s += a_row[(first + a) * Z + z];
    }
    shift[k] = z < Z ? v_row[z] - s / n : 0.0f;
  }
}

// l[z] = A[z] + shift[z] (padding lanes -inf); returns the warp max.
template <int kAtomsPerLane>
__device__ __forceinline__ float DuelingLogits(const float* a_act, const float* shift, int Z, int lane,
                                               float l[kAtomsPerLane]) {
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kAtomsPerLane; ++k) {
    const int z = lane + 32 * k;
    l[k] = z < Z ? a_act[z] + shift[k] : -INFINITY;
    mx = fmaxf(mx, l[k]);
  }
  return WarpMax(mx);
}

// Softmax of l in place; returns Q = sum_z p_z atom(z).
template <int kAtomsPerLane>
__device__ __forceinline__ float SoftmaxQ(const HeadShape& h, float mx, int lane, float l[kAtomsPerLane]) {
  const int Z = h.num_atoms;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kAtomsPerLane; ++k) {
    const int z = lane + 32 * k;
    l[k] = z < Z ? expf(l[k] - mx) : 0.0f;
    s += l[k];
  }
  // One division per softmax (s >= 1: the max term is exp(0)), not one per
  // atom: an IEEE division per lane takes its slow path for the zero padding.
  const float inv_s = 1.0f / WarpSum(s);
  float q = 0.0f;
#pragma unroll
  for (int k = 0; k < kAtomsPerLane; ++k) {
    const int z = lane + 32 * k;
    l[k] = l[k] * inv_s;
    if (z < Z) q += l[k] * Atom(h, z);
  }
  return WarpSum(q);
}

// The dueling shift rows of every branch on s and on s' (shift[z] = V[z] -
// mean_a A[a][z] over the branch's actions), into `shift`: 2 x branches x Z,
// the s rows first. The whole block; the caller syncs.
__device__ __forceinline__ void BranchShifts(const HeadShape& h, const float* v_s, const float* a_s,
                                             const float* v_n, const float* a_n, float* __restrict__ shift) {
  const int Z = h.num_atoms;
  const int per_row = h.num_branches * Z;
  for (int i = threadIdx.x; i < 2 * per_row; i += blockDim.x) {
    const bool next = i >= per_row;
    const int br = (next ? i - per_row : i) / Z;
    const int z = (next ? i - per_row : i) - br * Z;
    const float* a_row = next ? a_n : a_s;
    const int first = h.branch_offset[br];
    const int n = h.branch_offset[br + 1] - first;
    float s = 0.0f;
    for (int act = 0; act < n; ++act) s += a_row[(first + act) * Z + z];
    shift[i] = (next ? v_n : v_s)[z] - s / n;
  }
}

// Q of every action on s and on s' into q: 2 x total_actions (the s row
// first), Q = sum_z e_z atom(z) / sum_z e_z with e_z = exp(l_z - max l),
// l = A[a] + shift[branch(a)]. `tpr` threads (a power of two <= 32) share a
// row: each walks atoms part, part + tpr, ... and a butterfly over the tpr
// lanes combines them, so the rows of a 4 x 5 head fill the block instead of
// taking one warp-wide reduction tree each. The whole block; the caller syncs.
__device__ __forceinline__ void ActionQValues(const HeadShape& h, const float* a_s, const float* a_n,
                                              const float* __restrict__ shift, int tpr,
                                              float* __restrict__ q) {
  const int Z = h.num_atoms;
  const int TA = h.total_actions;
  const int rows = 2 * TA;
  const int part = threadIdx.x & (tpr - 1);
  // Uniform trip count: every lane reaches the shuffles.
  for (int base = 0; base < rows * tpr; base += blockDim.x) {
    const int r = (base + threadIdx.x) / tpr;
    const bool live = r < rows;
    const bool next = r >= TA;
    const int act = live ? (next ? r - TA : r) : 0;
    int br = 0;
    while (act >= h.branch_offset[br + 1]) ++br;
    const float* a_row = (next ? a_n : a_s) + act * Z;
    const float* s_row = shift + (next ? h.num_branches + br : br) * Z;
    const int end = live ? Z : 0;
    float mx = -INFINITY;
    for (int z = part; z < end; z += tpr) mx = fmaxf(mx, a_row[z] + s_row[z]);
    for (int o = 1; o < tpr; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float se = 0.0f, sq = 0.0f;
    for (int z = part; z < end; z += tpr) {
      const float e = expf(a_row[z] + s_row[z] - mx);
      se += e;
      sq += e * Atom(h, z);
    }
    for (int o = 1; o < tpr; o <<= 1) {
      se += __shfl_xor_sync(0xffffffffu, se, o);
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
    }
    if (live && part == 0) q[r] = sq / se;
  }
}

// Threads per row of ActionQValues: the most (a power of two, at most a warp)
// with which the block still covers every row at once.
__device__ __forceinline__ int ThreadsPerRow(int rows) {
  int tpr = 1;
  while (tpr < 32 && 2 * tpr * rows <= static_cast<int>(blockDim.x)) tpr *= 2;
  return tpr;
}

// The sample's six logit rows (V and A on s, s' and the target's s'), copied
// into shared memory by the whole block before the branch loops, which then
// read them several times over at shared-memory latency. Without it, every
// warp walks its rows from global memory with dependent loads (ncu: the
// kernel was long-scoreboard bound).
struct StagedRows {
  const float* v_s;
  const float* a_s;
  const float* v_n;
  const float* a_n;
  const float* v_t;
  const float* a_t;
};

__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// `dst`: 16-byte aligned, 3 x (AZ + Z) floats: the three A rows, then the
// three V rows. A rows go by 16-byte vectors when they allow it (AZ a
// multiple of 4 and every row aligned: 1/4 of the instructions).
__device__ __forceinline__ void StageRows(StagedRows* r, int Z, int AZ, float* __restrict__ dst) {
  float* da = dst;
  float* dv = dst + 3 * AZ;
  for (int i = threadIdx.x; i < Z; i += blockDim.x) {
    const float x0 = r->v_s[i], x1 = r->v_n[i], x2 = r->v_t[i];
    dv[i] = x0;
    dv[Z + i] = x1;
    dv[2 * Z + i] = x2;
  }
  if (AZ % 4 == 0 && Aligned16(r->a_s) && Aligned16(r->a_n) && Aligned16(r->a_t)) {  // uniform per block
    const int n4 = AZ / 4;
    const auto* s0 = reinterpret_cast<const float4*>(r->a_s);
    const auto* s1 = reinterpret_cast<const float4*>(r->a_n);
    const auto* s2 = reinterpret_cast<const float4*>(r->a_t);
    auto* d = reinterpret_cast<float4*>(da);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      const float4 x0 = s0[i], x1 = s1[i], x2 = s2[i];
      d[i] = x0;
      d[n4 + i] = x1;
      d[2 * n4 + i] = x2;
    }
  } else {
#pragma unroll 2
    for (int i = threadIdx.x; i < AZ; i += blockDim.x) {
      const float x0 = r->a_s[i], x1 = r->a_n[i], x2 = r->a_t[i];
      da[i] = x0;
      da[AZ + i] = x1;
      da[2 * AZ + i] = x2;
    }
  }
  r->v_s = dv;
  r->v_n = dv + Z;
  r->v_t = dv + 2 * Z;
  r->a_s = da;
  r->a_n = da + AZ;
  r->a_t = da + 2 * AZ;
  __syncthreads();
}

// kAtomsPerLane = ceil(Z / 32) rounded to a power of two: the atom loops are
// unrolled over that many register slots per lane, no more. kOptions: label
// smoothing or the MSE blend is configured; without them the options' code
// is compiled out, so the plain CE costs no registers or branches for them.
// kStaged: the rows are copied into shared memory first, and every later read
// of them is a shared-memory load (not a generic one).
template <int kAtomsPerLane, bool kOptions, bool kStaged>
__global__ void __launch_bounds__(kLossWarps * 32) C51LossKernel(C51LossArgs a) {
  WaitForPredecessor();
  extern __shared__ float smem[];
  const HeadShape& h = a.head;
  const int Z = h.num_atoms;
  const int NB = h.num_branches;
  const int AZ = h.total_actions * Z;
  const int b = blockIdx.x;
  const int B = a.batch;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float* sh_dl = smem;                         // NB x Z
  float* sh_pt = sh_dl + NB * Z + warp * 2 * Z;  // Z: target probabilities
  float* sh_bj = sh_pt + Z;                      // Z: projected positions
  float* sh_stats = smem + NB * Z + kLossWarps * 2 * Z;  // kLossStats x NB
  float* st_ce = sh_stats;
  float* st_clip = st_ce + NB;
  float* st_qmin = st_clip + NB;
  float* st_qmax = st_qmin + NB;
  float* st_qsum = st_qmax + NB;
  float* st_bad = st_qsum + NB;
  float* st_mse = st_bad + NB;
  float* sh_shift = st_mse + NB;        // 2 x NB x Z: dueling shifts on s, then s'
  float* sh_q = sh_shift + 2 * NB * Z;  // 2 x total_actions: Q online on s, then s'

  __shared__ float sh_wmax[kLossWarps];
  const float w_max = MaxIsWeight(a.weights, B, sh_wmax);
  StagedRows rows{a.online_v + int64_t{b} * Z,     a.online_a + int64_t{b} * AZ,
                  a.online_v + int64_t{B + b} * Z, a.online_a + int64_t{B + b} * AZ,
                  a.target_v + int64_t{b} * Z,     a.target_a + int64_t{b} * AZ};
  if constexpr (kStaged) {  // the staged rows start 16-byte aligned
    float* dst = sh_q + 2 * h.total_actions;
    StageRows(&rows, Z, AZ, dst + ((4 - (reinterpret_cast<uintptr_t>(dst) / sizeof(float)) % 4) % 4));
  }
  const float* v_s = rows.v_s;
  const float* a_s = rows.a_s;
  const float* v_n = rows.v_n;
  const float* a_n = rows.a_n;
  const float* v_t = rows.v_t;
  const float* a_t = rows.a_t;
  const float reward = a.rewards[b];
  const float discount = a.discounts[b];
  const float coef = (a.weights[b] / w_max) / (static_cast<float>(B) * NB);
  // Loss options: the same on every thread, so the branches below are uniform.
  const float eps = a.options.label_smoothing;
  const float alpha =
      kOptions ? step::MseBlendAlpha(a.options.mse_blend_start, a.options.mse_blend_end,
                                     a.options.mse_blend_steps, a.state != nullptr ? a.state->t : 0)
               : 0.0f;
  const bool smooth = kOptions && eps > 0.0f;
  const bool blend = kOptions && alpha > 0.0f;
  const float coef_ce = blend ? (1.0f - alpha) * coef : coef;
  const float inv_width_sq = 1.0f / ((h.v_max - h.v_min) * (h.v_max - h.v_min));
  // A product, not a division per atom: the positions stay monotone in tz.
  const float inv_delta_z = 1.0f / h.delta_z;

  // Q online of every action on s and s' first, by the whole block (the
  // argmax on s' and the Q statistics on s need only these numbers).
  BranchShifts(h, v_s, a_s, v_n, a_n, sh_shift);
  __syncthreads();
  ActionQValues(h, a_s, a_n, sh_shift, ThreadsPerRow(2 * h.total_actions), sh_q);
  __syncthreads();

  float shift[kAtomsPerLane];
  float l[kAtomsPerLane];
  for (int br = warp; br < NB; br += kLossWarps) {
    const int first = h.branch_offset[br];
    const int n = h.branch_offset[br + 1] - first;

    // 5. Double DQN: a* = argmax_a Q_online(s') (ties: lowest a).
    float best = -INFINITY;
    int a_star = 0;
    for (int act = 0; act < n; ++act) {
      const float q = sh_q[h.total_actions + first + act];
      if (q > best) {
        best = q;
        a_star = act;
      }
    }
    // Target distribution p_target(s', a*).
    DuelingShift<kAtomsPerLane>(v_t, a_t, first, n, Z, lane, shift);
    {
      const float mx = DuelingLogits<kAtomsPerLane>(a_t + (first + a_star) * Z, shift, Z, lane, l);
      SoftmaxQ<kAtomsPerLane>(h, mx, lane, l);
    }
    // 6. Projection of Tz = R + discount * z.
    float clip = 0.0f;
    bool nonfinite = false;
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j < Z) {
        const float tz = reward + discount * Atom(h, j);
        if (tz < h.v_min || tz > h.v_max) clip += l[k];
        // Comparisons, not fminf/fmaxf, so that a NaN target stays NaN.
        const float tzc = tz < h.v_min ? h.v_min : (tz > h.v_max ? h.v_max : tz);
        float bj = (tzc - h.v_min) * inv_delta_z;
        bj = bj < 0.0f ? 0.0f : (bj > static_cast<float>(Z - 1) ? static_cast<float>(Z - 1) : bj);
        nonfinite = nonfinite || !isfinite(bj);
        sh_pt[j] = l[k];
        sh_bj[j] = bj;
      }
    }
    clip = WarpSum(clip);
    // A non-finite target poisons the whole projected distribution (as the
    // CPU oracle does) so the guard sees it.
    const bool poisoned = __any_sync(0xffffffffu, nonfinite);
    __syncwarp();
    // Source atom j reaches target atom i only when i - 1 < b_j < i + 1. With
    // discount >= 0 (the wire's range), b_j is nondecreasing in j (every
    // rounded op above is monotone), so those j are one run: a binary search
    // finds its start and the loop stops past its end. The same terms are
    // added in the same order as a scan over every j, so the sums are bitwise
    // those of the O(Z^2) gather, in O(Z log Z).
    const bool monotone = discount >= 0.0f;
    float m[kAtomsPerLane];
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) {
      const int i = lane + 32 * k;
      float acc = 0.0f;
      if (i < Z && !poisoned) {
        int j_first = 0;
        if (monotone) {
          const float below = static_cast<float>(i - 1);
          int hi = Z;
          while (j_first < hi) {
            const int mid = (j_first + hi) / 2;
            if (sh_bj[mid] > below) {
              hi = mid;
            } else {
              j_first = mid + 1;
            }
          }
        }
        const float above = static_cast<float>(i + 1);
        for (int j = j_first; j < Z; ++j) {
          const float bj = sh_bj[j];
          if (monotone && bj >= above) break;
          const float lo = floorf(bj);
          const float hi = ceilf(bj);
          const float pj = sh_pt[j];
          if (lo == hi) {
            if (static_cast<int>(lo) == i) acc += pj;
          } else if (static_cast<int>(lo) == i) {
            acc += pj * (hi - bj);
          } else if (static_cast<int>(hi) == i) {
            acc += pj * (bj - lo);
          }
        }
      }
      m[k] = poisoned ? NAN : acc;
    }
    __syncwarp();

    // Q statistics of the online s row, every action of the branch.
    float qmin = INFINITY, qmax = -INFINITY, qsum = 0.0f, bad = 0.0f;
    for (int act = 0; act < n; ++act) {
      const float q = sh_q[first + act];
      if (!isfinite(q)) bad = 1.0f;
      qmin = fminf(qmin, q);
      qmax = fmaxf(qmax, q);
      qsum += q;
    }
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) {
      const int z = lane + 32 * k;
      shift[k] = z < Z ? sh_shift[br * Z + z] : 0.0f;
    }
    // 7. CE against log_softmax(l(s, a_br)) and its gradient.
    int taken = a.actions[b * NB + br];
    taken = taken < 0 ? 0 : (taken >= n ? n - 1 : taken);
    const float mx = DuelingLogits<kAtomsPerLane>(a_s + (first + taken) * Z, shift, Z, lane, l);
    float se = 0.0f;
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) {
      if (lane + 32 * k < Z) se += expf(l[k] - mx);
    }
    const float lse = mx + logf(WarpSum(se));
    float mass = 0.0f;
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) mass += m[k];
    mass = WarpSum(mass);
    // MSE blend: y = E[m] (unsmoothed), Q = E[softmax(l(s, a_br))].
    float q = 0.0f, y = 0.0f;
    if (blend) {
#pragma unroll
      for (int k = 0; k < kAtomsPerLane; ++k) {
        const int z = lane + 32 * k;
        if (z < Z) {
          y += m[k] * Atom(h, z);
          q += expf(l[k] - lse) * Atom(h, z);
        }
      }
      y = WarpSum(y);
      q = WarpSum(q);
    }
    // Label smoothing: m' = (1 - eps) m + eps sum(m) / Z (NaN stays NaN).
    if (smooth) {
      const float spread = eps * mass / static_cast<float>(Z);
      float smoothed = 0.0f;
#pragma unroll
      for (int k = 0; k < kAtomsPerLane; ++k) {
        if (lane + 32 * k < Z) {
          m[k] = (1.0f - eps) * m[k] + spread;
          smoothed += m[k];
        }
      }
      mass = WarpSum(smoothed);
    }
    const float g_mse = blend ? coef * alpha * (q - y) * inv_width_sq : 0.0f;
    float ce = 0.0f;
    float dl[kAtomsPerLane];
#pragma unroll
    for (int k = 0; k < kAtomsPerLane; ++k) {
      const int z = lane + 32 * k;
      dl[k] = 0.0f;
      if (z < Z) {
        const float logp = l[k] - lse;
        ce -= m[k] * logp;
        dl[k] = coef_ce * (expf(logp) * mass - m[k]);
        if (blend) dl[k] += g_mse * expf(logp) * (Atom(h, z) - q);
        sh_dl[br * Z + z] = dl[k];
      }
    }
    ce = WarpSum(ce);
    for (int act = 0; act < n; ++act) {
      const int64_t out = int64_t{b} * a.da_ld + (first + act) * Z;
#pragma unroll
      for (int k = 0; k < kAtomsPerLane; ++k) {
        const int z = lane + 32 * k;
        if (z < Z) StoreGrad(a.da, out + z, (act == taken ? dl[k] : 0.0f) - dl[k] / n, a.grad_precision);
      }
    }
    if (lane == 0) {
      st_ce[br] = ce;
      st_clip[br] = clip;
      st_qmin[br] = qmin;
      st_qmax[br] = qmax;
      st_qsum[br] = qsum;
      st_bad[br] = bad;
      st_mse[br] = blend ? 0.5f * (q - y) * (q - y) * inv_width_sq : 0.0f;
    }
  }
  __syncthreads();
  for (int z = threadIdx.x; z < Z; z += blockDim.x) {
    float s = 0.0f;
    for (int br = 0; br < NB; ++br) s += sh_dl[br * Z + z];
    StoreGrad(a.dv, int64_t{b} * a.dv_ld + z, s, a.grad_precision);
  }
  if (threadIdx.x == 0) {
    float ce = 0.0f, mse = 0.0f, clip = 0.0f, qmin = INFINITY, qmax = -INFINITY, qsum = 0.0f, bad = 0.0f;
    for (int br = 0; br < NB; ++br) {
      ce += st_ce[br];
      mse += st_mse[br];
      clip += st_clip[br];
      qmin = fminf(qmin, st_qmin[br]);
      qmax = fmaxf(qmax, st_qmax[br]);
      qsum += st_qsum[br];
      bad = fmaxf(bad, st_bad[br]);
    }
    a.ce[b] = ce / NB;
    a.item_loss[b] = blend ? (1.0f - alpha) * (ce / NB) + alpha * (mse / NB) : ce / NB;
    a.clip_mass[b] = clip;
    a.q_min[b] = qmin;
    a.q_max[b] = qmax;
    a.q_sum[b] = qsum;
    a.q_bad[b] = bad > 0.0f ? 1 : 0;
  }
}

template <int kAtomsPerLane>
__global__ void __launch_bounds__(kLossWarps * 32)
    QValuesKernel(HeadShape h, const float* __restrict__ v, const float* __restrict__ adv, float* __restrict__ q) {
  const int Z = h.num_atoms;
  const int AZ = h.total_actions * Z;
  const int r = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const float* v_row = v + int64_t{r} * Z;
  const float* a_row = adv + int64_t{r} * AZ;
  float shift[kAtomsPerLane];
  float l[kAtomsPerLane];
  for (int br = warp; br < h.num_branches; br += kLossWarps) {
    const int first = h.branch_offset[br];
    const int n = h.branch_offset[br + 1] - first;
    DuelingShift<kAtomsPerLane>(v_row, a_row, first, n, Z, lane, shift);
    for (int act = 0; act < n; ++act) {
      const float mx = DuelingLogits<kAtomsPerLane>(a_row + (first + act) * Z, shift, Z, lane, l);
      const float value = SoftmaxQ<kAtomsPerLane>(h, mx, lane, l);
      if (lane == 0) q[int64_t{r} * h.total_actions + first + act] = value;
    }
  }
}

}  // namespace

size_t C51LossSharedBytes(const HeadShape& h) {
  return sizeof(float) *
         (3 * static_cast<size_t>(h.num_branches) * h.num_atoms + kLossWarps * 2 * h.num_atoms +
          kLossStats * static_cast<size_t>(h.num_branches) + 2 * static_cast<size_t>(h.total_actions));
}

// Register slots per lane for `atoms` atoms (1, 2, 4 or 8).
int AtomsPerLane(int atoms) {
  int k = 1;
  while (32 * k < atoms) k *= 2;
  return k;
}

namespace {

// Rows are staged when the block's shared memory stays within the default
// 48 KB (no opt-in attribute needed): up to ~3,900 logits per row on s.
constexpr size_t kStagedSharedLimit = 48 * 1024;

template <bool kOptions, bool kStaged>
cudaError_t LaunchLossKernel(const C51LossArgs& a, size_t smem, cudaStream_t stream) {
  void (*kernel)(C51LossArgs) = nullptr;
  switch (AtomsPerLane(a.head.num_atoms)) {
    case 1: kernel = C51LossKernel<1, kOptions, kStaged>; break;
    case 2: kernel = C51LossKernel<2, kOptions, kStaged>; break;
    case 4: kernel = C51LossKernel<4, kOptions, kStaged>; break;
    case 8: kernel = C51LossKernel<8, kOptions, kStaged>; break;
    default: return cudaErrorInvalidValue;
  }
  return LaunchDependent(StepKernel::kLoss, kernel, a.batch, kLossWarps * 32, smem, stream, a);
}

template <bool kOptions>
cudaError_t LaunchLossKernel(const C51LossArgs& a, size_t smem, cudaStream_t stream) {
  // + 12 bytes to align the staged rows to 16.
  const size_t staged_bytes =
      sizeof(float) * (3 * (static_cast<size_t>(a.head.num_atoms) * (1 + a.head.total_actions)) + 3);
  if (a.stage_rows && smem + staged_bytes <= kStagedSharedLimit) {
    return LaunchLossKernel<kOptions, true>(a, smem + staged_bytes, stream);
  }
  return LaunchLossKernel<kOptions, false>(a, smem, stream);
}

}  // namespace

cudaError_t LaunchC51Loss(const C51LossArgs& args, cudaStream_t stream) {
  C51LossArgs a = args;
  if (a.dv_ld == 0) a.dv_ld = a.head.num_atoms;
  if (a.da_ld == 0) a.da_ld = a.head.total_actions * a.head.num_atoms;
  const size_t smem = C51LossSharedBytes(a.head);
  const LossOptions& o = a.options;
  const bool options = o.label_smoothing > 0.0f || o.mse_blend_start > 0.0f || o.mse_blend_end > 0.0f;
  return options ? LaunchLossKernel<true>(a, smem, stream) : LaunchLossKernel<false>(a, smem, stream);
}

cudaError_t LaunchQValues(const HeadShape& head, const float* v, const float* a, int rows, float* q,
                          cudaStream_t stream) {
  switch (AtomsPerLane(head.num_atoms)) {
    case 1: QValuesKernel<1><<<rows, kLossWarps * 32, 0, stream>>>(head, v, a, q); break;
    case 2: QValuesKernel<2><<<rows, kLossWarps * 32, 0, stream>>>(head, v, a, q); break;
    case 4: QValuesKernel<4><<<rows, kLossWarps * 32, 0, stream>>>(head, v, a, q); break;
    case 8: QValuesKernel<8><<<rows, kLossWarps * 32, 0, stream>>>(head, v, a, q); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace qstream::kernels
