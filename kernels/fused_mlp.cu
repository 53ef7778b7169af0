#include "kernels/fused_mlp.h"

#include <cuda_bf16.h>
#include <mma.h>

#include <type_traits>
#include <utility>

#include "kernels/launch.cuh"

namespace qstream::kernels {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = kFusedThreads / 32;  // weight-gradient blocks
constexpr int kChainThreads = 256;          // chain blocks: 8 warps, a 16-column tile of every row tile each
constexpr int kChainWarps = kChainThreads / 32;
constexpr int kSkew = 8;  // elements added to every shared row (bank spread, keeps 32-byte alignment)
constexpr int kGLd = kGradTile + kSkew;
constexpr int kStageLd = 16;  // per-warp accumulator staging, 16 x 16 floats

template <int P>
using Elem = std::conditional_t<P == int(Precision::kBf16), __nv_bfloat16, float>;

template <int P>
__device__ __forceinline__ Elem<P> Round(float v) {
  if constexpr (P == int(Precision::kBf16)) {
    return __float2bfloat16_rn(v);
  } else if constexpr (P == int(Precision::kTf32)) {
    return wmma::__float_to_tf32(v);
  } else {
    return v;
  }
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// 16 bytes global -> shared, asynchronously; zero-filled when !valid.
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void CommitAsync() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void WaitAsync() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// f(std::integral_constant<int, I>) for I = 0 .. N-1, unrolled at compile time.
template <class F, int... I>
__device__ __forceinline__ void StaticForEach(F& f, std::integer_sequence<int, I...> /*unused*/) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
__device__ __forceinline__ void StaticFor(F&& f) {
  StaticForEach(f, std::make_integer_sequence<int, N>{});
}

// Four 8 x 8 b16 matrices from shared memory; lane l gives the address of
// row l % 8 of matrix l / 8. Trans: each matrix is read transposed.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrices(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  }
}

// c[16 x 8] += a[16 x K] b[K x 8], fp32 accumulators, in the fragment
// layouts of PTX's mma: bf16 operands m16n8k16, TF32 operands m16n8k8.
template <int P>
__device__ __forceinline__ void Mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (P == int(Precision::kBf16)) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// kRowsT x kColsT elements of src[r][ld] into dst[r][kDstLd] by kThreads
// threads; rows >= valid_rows and columns >= valid_cols (a multiple of 16
// bytes' worth) read 0. Each thread keeps one 16-byte column and walks rows.
template <class T, int kRowsT, int kColsT, int kDstLd, int kThreads>
__device__ __forceinline__ void StageTile(T* dst, const T* src, int ld, int valid_rows, int valid_cols) {
  constexpr int kPer = 16 / sizeof(T);
  constexpr int kPerRow = kColsT / kPer;
  static_assert(kColsT % kPer == 0 && kThreads % kPerRow == 0, "whole 16-byte chunks, whole rows per pass");
  constexpr int kRowStep = kThreads / kPerRow;
  const int c = (static_cast<int>(threadIdx.x) % kPerRow) * kPer;
  const int r0 = static_cast<int>(threadIdx.x) / kPerRow;
  const bool col_ok = c < valid_cols;
  const T* s = src + int64_t{r0} * ld + c;
  T* d = dst + r0 * kDstLd + c;
  const int64_t step = int64_t{kRowStep} * ld;
#pragma unroll
  for (int j = 0; j < (kRowsT + kRowStep - 1) / kRowStep; ++j) {
    const int r = r0 + j * kRowStep;
    if (kRowsT % kRowStep == 0 || r < kRowsT) {
      const bool valid = col_ok && r < valid_rows;
      CopyAsync16(d, valid ? s : src, valid);
    }
    s += step;
    d += kRowStep * kDstLd;
  }
}

// ---------------------------------------------------------------------------
// Fused chain: block = kRows rows of one pass through all of its ops.
//
// One software pipeline runs over the whole pass: stage g is (op, chunk of
// kFusedChunkN output columns, K slab of kFusedSlabK), its B slab (and A slab
// for a global A) copied by cp.async kStages - 1 stages ahead, so the next
// op's weights stream in while this op finishes.

// Output columns per accumulator chunk: bf16 slabs are half the bytes, so
// each warp takes two 16-column tiles of a 256-wide chunk (twice the MMAs per
// staged slab); fp32/TF32 keep 128 (one tile per warp) to fit shared memory.
template <int P>
constexpr int ChunkN() {
  return P == int(Precision::kBf16) ? 2 * kFusedChunkN : kFusedChunkN;
}
template <int P>
constexpr int BLd() {
  return ChunkN<P>() + kSkew;
}
// A slabs staged from global memory: rows skewed by 16 bytes, so the eight
// rows an ldmatrix phase reads fall in distinct bank groups.
template <int P>
constexpr int ALd() {
  return kFusedSlabK + 16 / static_cast<int>(sizeof(Elem<P>));
}

template <int P>
constexpr int ChainStages() {
  return P == int(Precision::kBf16) ? 4 : 3;
}

template <int P, int kRows>
struct ChainShared {
  using T = Elem<P>;
  static constexpr int kStages = ChainStages<P>();
  T* buf[2];
  T* a_base;
  T* b_base;

  __device__ ChainShared(char* base, int buf_ld) {
    T* p = reinterpret_cast<T*>(base);
    buf[0] = p;
    buf[1] = p + kRows * buf_ld;
    p += 2 * kRows * buf_ld;
    a_base = p;
    p += kStages * kRows * ALd<P>();
    b_base = p;
  }
  __device__ T* a_stage(int slot) const { return a_base + slot * (kRows * ALd<P>()); }
  __device__ T* b_stage(int slot) const { return b_base + slot * (kFusedSlabK * BLd<P>()); }
  __device__ T* buffer(int i) const { return i == 0 ? buf[0] : buf[1]; }
  static size_t Bytes(int buf_ld) {
    return sizeof(T) * (2 * kRows * buf_ld + kStages * kRows * ALd<P>() + kStages * kFusedSlabK * BLd<P>());
  }
};

// What an epilogue needs of its op, in registers.
struct EmitArgs {
  const float* bias;
  const void* mask;
  void* out_op;
  float* out_f32;
  int n, act, mask_ld, out_col, out_op_ld, out_f32_ld, rows, out_buf;
  __device__ explicit EmitArgs(const FusedOp& op, int pass_rows)
      : bias(op.bias),
        mask(op.mask),
        out_op(op.out_op),
        out_f32(op.out_f32),
        n(op.n),
        act(op.act),
        mask_ld(op.mask_ld),
        out_col(op.out_col),
        out_op_ld(op.out_op_ld),
        out_f32_ld(op.out_f32_ld),
        rows(pass_rows),
        out_buf(op.out_buf) {}
};

// kBytes between src and dst, both aligned to the widest of 16, 8 or 4
// bytes that divides kBytes.
template <int kBytes>
__device__ __forceinline__ void CopyVec(void* dst, const void* src) {
  static_assert(kBytes % 4 == 0, "4-byte multiples");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) static_cast<uint2*>(dst)[i] = static_cast<const uint2*>(src)[i];
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i)
      static_cast<unsigned*>(dst)[i] = static_cast<const unsigned*>(src)[i];
  }
}

// kN consecutive output columns n..n+kN of row r (global row grow): bias,
// activation (columns >= e.n become 0), then the stores. v: the fp32 sums.
template <int P, int kN>
__device__ __forceinline__ void EmitRun(const EmitArgs& e, Elem<P>* out_buf, int buf_ld, int r, int grow,
                                        int n, float (&v)[kN]) {
  using T = Elem<P>;
  const bool row_ok = grow < e.rows;
  float bias[kN];
  if (e.bias != nullptr) {
    CopyVec<kN * 4>(bias, e.bias + n);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) bias[j] = 0.0f;
  }
  T mask[kN];
  if (e.act == kActMask) {
    if (row_ok) {
      CopyVec<kN * sizeof(T)>(mask, static_cast<const T*>(e.mask) + int64_t{grow} * e.mask_ld + n);
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j) mask[j] = Round<P>(0.0f);
    }
  }
  T rv[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    float x = v[j] + bias[j];
    if (e.act == kActRelu) {
      x = x < 0.0f ? 0.0f : x;  // NaN stays NaN, as the CPU oracle's max
    } else if (e.act == kActMask) {
      x = ToFloat(mask[j]) > 0.0f ? x : 0.0f;
    }
    if (n + j >= e.n) x = 0.0f;
    v[j] = x;
    rv[j] = Round<P>(x);
  }
  if (out_buf != nullptr) CopyVec<kN * sizeof(T)>(out_buf + r * buf_ld + e.out_col + n, rv);
  if (row_ok) {
    if (e.out_op != nullptr)
      CopyVec<kN * sizeof(T)>(static_cast<T*>(e.out_op) + int64_t{grow} * e.out_op_ld + n, rv);
    if (e.out_f32 != nullptr) {
      float* o = e.out_f32 + int64_t{grow} * e.out_f32_ld;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (n + j < e.n) o[n + j] = v[j];
      }
    }
  }
}

__device__ __forceinline__ int OpSlabs(const FusedOp& op) { return (op.kp + kFusedSlabK - 1) / kFusedSlabK; }
template <int kChunk>
__device__ __forceinline__ int OpStages(const FusedOp& op) {
  return OpSlabs(op) * ((op.np + kChunk - 1) / kChunk);
}

template <int P, int kRows>
__global__ void __launch_bounds__(kChainThreads) FusedChainKernel(const FusedProgram* __restrict__ prog) {
  WaitForPredecessor();
  using T = Elem<P>;
  using Shared = ChainShared<P, kRows>;
  constexpr int kStages = Shared::kStages;
  constexpr bool kTensor = P != int(Precision::kFp32);
  constexpr int kK = P == int(Precision::kBf16) ? 16 : 8;  // mma k
  constexpr int kALd = ALd<P>();
  constexpr int kRowTiles = kRows / 16;
  constexpr int kMr = kRows / kChainWarps;  // SIMT rows per thread
  constexpr int kChunk = ChunkN<P>();
  constexpr int kBLd = BLd<P>();
  constexpr int kColTiles = kChunk / 16 / kChainWarps;  // tensor path: 16-column tiles per warp
  constexpr int kCols = kChunk / 32;                    // SIMT columns per thread
  static_assert(kTensor || kCols == 4, "the SIMT path covers 4 columns per lane");
  extern __shared__ __align__(128) char smem[];
  __shared__ FusedPass pass;
  __shared__ int pass_index;
  __shared__ int stage_begin[kFusedMaxOps + 1];
  if (threadIdx.x == 0) {
    int p = 0;
    while (p + 1 < prog->num_passes && static_cast<int>(blockIdx.x) >= prog->passes[p + 1].first_block) ++p;
    pass_index = p;
  }
  __syncthreads();
  {
    const int4* src = reinterpret_cast<const int4*>(&prog->passes[pass_index]);
    int4* dst = reinterpret_cast<int4*>(&pass);
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(FusedPass) / sizeof(int4)); i += blockDim.x)
      dst[i] = src[i];
  }
  const int buf_ld = prog->buf_ld;
  __syncthreads();
  if (threadIdx.x == 0) {
    stage_begin[0] = 0;
    for (int o = 0; o < pass.num_ops; ++o)
      stage_begin[o + 1] = stage_begin[o] + OpStages<kChunk>(pass.ops[o]);
  }
  Shared sh(smem, buf_ld);
  const int row0 = (static_cast<int>(blockIdx.x) - pass.first_block) * kRows;
  const int valid_rows = pass.rows - row0;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();
  const int total = stage_begin[pass.num_ops];

  auto locate = [&](int g, int* o, int* s) {
    int k = 0;
    while (g >= stage_begin[k + 1]) ++k;
    *o = k;
    *s = g - stage_begin[k];
  };
  auto issue = [&](int g) {
    if (g < total) {
      int o, st;
      locate(g, &o, &st);
      const FusedOp& op = pass.ops[o];
      const int slabs = OpSlabs(op);
      const int k0 = (st % slabs) * kFusedSlabK;
      const int n0 = (st / slabs) * kChunk;
      const int nc = min(kChunk, op.np - n0);
      const int slot = g % kStages;
      StageTile<T, kFusedSlabK, kChunk, kBLd, kChainThreads>(
          sh.b_stage(slot), static_cast<const T*>(op.b) + int64_t{k0} * op.np + n0, op.np, op.kp - k0, nc);
      if (op.a_buf < 0) {
        StageTile<T, kRows, kFusedSlabK, kALd, kChainThreads>(
            sh.a_stage(slot), static_cast<const T*>(op.a_global) + int64_t{row0} * op.a_ld + k0, op.a_ld,
            valid_rows, op.a_cols - k0);
      }
    }
    CommitAsync();  // an empty group past the end keeps the counting uniform
  };

  // The input rows, converted into the operand type.
  if (pass.in != nullptr) {
    T* dst = sh.buffer(pass.in_buf);
    for (int i = threadIdx.x; i < kRows * pass.in_kp; i += blockDim.x) {
      const int r = i / pass.in_kp;
      const int c = i % pass.in_kp;
      const int grow = row0 + r;
      const float v = grow < pass.rows && c < pass.in_cols ? pass.in[int64_t{grow} * pass.in_ld + c] : 0.0f;
      const T rv = Round<P>(v);
      dst[r * buf_ld + c] = rv;
      if (pass.in_copy != nullptr && grow < pass.rows) {
        static_cast<T*>(pass.in_copy)[int64_t{grow} * pass.in_copy_ld + c] = rv;
      }
    }
  }

  // Tensor path: warp w owns column tiles w + 8 j (j < kColTiles) of each
  // chunk, all row tiles: A fragments feed kColTiles products, B fragments
  // kRowTiles. PTX mma (bf16 m16n8k16, TF32 m16n8k8) on fragments loaded
  // by ldmatrix (A; bf16 B transposed) or by single loads (TF32 B);
  // macc[j][i][h] holds the 8 columns h of 16 x 16 tile (i, j).
  float macc[kColTiles][kRowTiles][2][4];
  float sacc[kMr][kCols];
  auto clear = [&]() {
    if constexpr (kTensor) {
#pragma unroll
      for (int j = 0; j < kColTiles; ++j)
#pragma unroll
        for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < 4; ++q) macc[j][i][h][q] = 0.0f;
    } else {
#pragma unroll
      for (int i = 0; i < kMr; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) sacc[i][j] = 0.0f;
    }
  };
  clear();
  for (int g = 0; g < kStages - 1; ++g) issue(g);
  for (int g = 0; g < total; ++g) {
    WaitAsync<kStages - 2>();
    __syncthreads();  // stage g landed for all; stage g-1's slot is free; earlier epilogues visible
    issue(g + kStages - 1);
    int o, st;
    locate(g, &o, &st);
    const FusedOp& op = pass.ops[o];
    const int slabs = OpSlabs(op);
    const int slab = st % slabs;
    const int k0 = slab * kFusedSlabK;
    const int kvalid = min(kFusedSlabK, op.kp - k0);
    const int n0 = (st / slabs) * kChunk;
    const int nc = min(kChunk, op.np - n0);
    const int slot = g % kStages;
    const bool a_global = op.a_buf < 0;
    const T* a_tile = a_global ? sh.a_stage(slot) : sh.buffer(op.a_buf) + op.a_col + k0;
    const int a_ld = a_global ? kALd : buf_ld;
    const T* b_tile = sh.b_stage(slot);
    if constexpr (kTensor) {
      if (warp * 16 < nc) {
        // ldmatrix lanes: A rows lane % 16, 16-byte column group lane / 16.
        // bf16 B (read transposed from [k][n]): k rows lane % 16, n half
        // lane / 16. TF32 B: k row lane % 4 (+ 4), column lane / 4 (+ 8).
        const T* a_lane = a_tile + (lane % 16) * a_ld + (lane / 16) * (16 / static_cast<int>(sizeof(T)));
        const T* b_lane = P == int(Precision::kBf16) ? b_tile + (lane % 16) * kBLd + (lane / 16) * 8
                                                     : b_tile + (lane % 4) * kBLd + lane / 4;
#pragma unroll 2
        for (int kk = 0; kk < kvalid; kk += kK) {
          unsigned af[kRowTiles][4];
#pragma unroll
          for (int i = 0; i < kRowTiles; ++i) LoadMatrices<false>(af[i], a_lane + (i * 16) * a_ld + kk);
#pragma unroll
          for (int j = 0; j < kColTiles; ++j) {
            const int ct = warp + kChainWarps * j;
            if (ct * 16 < nc) {
              unsigned bf[4];  // k 0-7 | k 8-15 (TF32: 0-3 | 4-7) of columns 0-7, then of columns 8-15
              const T* bp = b_lane + kk * kBLd + ct * 16;
              if constexpr (P == int(Precision::kBf16)) {
                LoadMatrices<true>(bf, bp);
              } else {
                bf[0] = __float_as_uint(bp[0]);
                bf[1] = __float_as_uint(bp[4 * kBLd]);
                bf[2] = __float_as_uint(bp[8]);
                bf[3] = __float_as_uint(bp[4 * kBLd + 8]);
              }
#pragma unroll
              for (int i = 0; i < kRowTiles; ++i) {
                Mma<P>(macc[j][i][0], af[i], bf[0], bf[1]);
                Mma<P>(macc[j][i][1], af[i], bf[2], bf[3]);
              }
            }
          }
        }
      }
    } else {
      // Thread (warp, lane): rows warp*kMr.., columns lane*4..+4 of the chunk.
      if (lane * 4 < nc) {
#pragma unroll 4
        for (int kk = 0; kk < kvalid; ++kk) {
          const float4 bv = *reinterpret_cast<const float4*>(b_tile + kk * kBLd + lane * 4);
#pragma unroll
          for (int i = 0; i < kMr; ++i) {
            const float av = a_tile[(warp * kMr + i) * a_ld + kk];
            sacc[i][0] += av * bv.x;
            sacc[i][1] += av * bv.y;
            sacc[i][2] += av * bv.z;
            sacc[i][3] += av * bv.w;
          }
        }
      }
    }
    if (slab == slabs - 1) {
      // Epilogue of this chunk: the accumulators are final.
      const EmitArgs e(op, pass.rows);
      T* out_buf = e.out_buf >= 0 ? sh.buffer(e.out_buf) : nullptr;
      if constexpr (kTensor) {
        // Lane: rows lane / 4 and lane / 4 + 8, columns 2 (lane % 4) .. + 2 of each 16 x 8 half.
        const int tr = lane / 4;
        const int tc = (lane % 4) * 2;
        // Compile-time indices keep macc in registers (a runtime-indexed
        // loop here put it in local memory).
        StaticFor<kColTiles * kRowTiles * 4>([&](auto q) {
          constexpr int kQ = decltype(q)::value;
          constexpr int j = kQ / (kRowTiles * 4), i = kQ / 4 % kRowTiles, h = kQ / 2 % 2, half = kQ % 2;
          const int ct = warp + kChainWarps * j;
          if (ct * 16 < nc) {
            float v[2] = {macc[j][i][h][2 * half], macc[j][i][h][2 * half + 1]};
            const int r = i * 16 + half * 8 + tr;
            EmitRun<P, 2>(e, out_buf, buf_ld, r, row0 + r, n0 + ct * 16 + h * 8 + tc, v);
          }
        });
      } else {
        if (lane * 4 < nc) {
#pragma unroll
          for (int i = 0; i < kMr; ++i) {
            const int r = warp * kMr + i;
            EmitRun<P, 4>(e, out_buf, buf_ld, r, row0 + r, n0 + lane * 4, sacc[i]);
          }
        }
      }
      clear();
    }
  }
  WaitAsync<0>();
}

// ---------------------------------------------------------------------------
// Weight gradients: one block per 64 x 64 tile of one job's dW, K = rows.

template <int P>
constexpr int GradStages() {
  return P == int(Precision::kBf16) ? 4 : 3;
}

template <int P>
constexpr size_t GradSharedBytes() {
  return sizeof(Elem<P>) * GradStages<P>() * 2 * kFusedSlabK * kGLd;
}

template <int P>
__global__ void __launch_bounds__(kFusedThreads)
    WeightGradKernel(const GradProgram* __restrict__ prog, float* __restrict__ partials) {
  WaitForPredecessor();
  using T = Elem<P>;
  constexpr bool kTensor = P != int(Precision::kFp32);
  constexpr int kK = P == int(Precision::kBf16) ? 16 : 8;
  constexpr int kStages = GradStages<P>();
  extern __shared__ __align__(128) char smem[];
  // Per stage: dY slab (rows x out columns), then X slab (rows x in columns).
  T* stages = reinterpret_cast<T*>(smem);
  __shared__ __align__(128) float c_stage[kWarps][16 * kStageLd];
  __shared__ float colsum[kFusedThreads];
  __shared__ float warp_sq[kWarps];
  const GradTile tile = prog->tiles[blockIdx.x];
  const GradJob job = prog->jobs[tile.job];
  const int rows = prog->rows;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const T* dy = static_cast<const T*>(job.dy) + tile.m0;
  const T* x = static_cast<const T*>(job.x) + tile.n0;
  const bool bias_tile = tile.n0 == 0;
  const int slabs = (rows + kFusedSlabK - 1) / kFusedSlabK;
  auto a_of = [&](int slot) { return stages + slot * 2 * kFusedSlabK * kGLd; };
  auto x_of = [&](int slot) { return stages + (slot * 2 + 1) * kFusedSlabK * kGLd; };
  auto issue = [&](int s) {
    if (s < slabs) {
      const int r0 = s * kFusedSlabK;
      StageTile<T, kFusedSlabK, kGradTile, kGLd, kFusedThreads>(
          a_of(s % kStages), dy + int64_t{r0} * job.dy_ld, job.dy_ld, rows - r0, job.dy_cols - tile.m0);
      StageTile<T, kFusedSlabK, kGradTile, kGLd, kFusedThreads>(x_of(s % kStages), x + int64_t{r0} * job.x_ld,
                                                                job.x_ld, rows - r0, job.x_cols - tile.n0);
    }
    CommitAsync();
  };
  // Tensor path: warp w owns m fragment w % 4 and n fragments 2 (w / 4) + {0, 1}.
  using Prec = std::conditional_t<kK == 8, wmma::precision::tf32, __nv_bfloat16>;
  wmma::fragment<wmma::accumulator, 16, 16, kK, float> acc[2];
  float sacc[4][4] = {};
  if constexpr (kTensor) {
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
  }
  // Bias: thread t sums column t % 64 of dY over rows (t / 64) * 16 .. + 16 of
  // every slab; the four quarter sums are added in order at the end.
  float bias_sum = 0.0f;
  const int mi = warp % 4;
  const int nj = (warp / 4) * 2;
  const int ty = threadIdx.x / 16;  // SIMT: m rows ty*4..+4
  const int tx = threadIdx.x % 16;  //       n cols tx*4..+4
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  for (int s = 0; s < slabs; ++s) {
    WaitAsync<kStages - 2>();
    __syncthreads();
    issue(s + kStages - 1);
    const T* as = a_of(s % kStages);
    const T* xs = x_of(s % kStages);
    if constexpr (kTensor) {
#pragma unroll
      for (int kk = 0; kk < kFusedSlabK; kk += kK) {
        wmma::fragment<wmma::matrix_a, 16, 16, kK, Prec, wmma::col_major> af;
        wmma::load_matrix_sync(af, as + kk * kGLd + mi * 16, kGLd);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, kK, Prec, wmma::row_major> bf;
          wmma::load_matrix_sync(bf, xs + kk * kGLd + (nj + j) * 16, kGLd);
          wmma::mma_sync(acc[j], af, bf, acc[j]);
        }
      }
    } else {
#pragma unroll 8
      for (int kk = 0; kk < kFusedSlabK; ++kk) {
        const float4 xv = *reinterpret_cast<const float4*>(xs + kk * kGLd + tx * 4);
        const float4 av = *reinterpret_cast<const float4*>(as + kk * kGLd + ty * 4);
        const float a4[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sacc[i][0] += a4[i] * xv.x;
          sacc[i][1] += a4[i] * xv.y;
          sacc[i][2] += a4[i] * xv.z;
          sacc[i][3] += a4[i] * xv.w;
        }
      }
    }
    if (bias_tile) {
      const int q = threadIdx.x / kGradTile;
      float part = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kFusedSlabK / 4; ++kk)
        part += ToFloat(as[(q * (kFusedSlabK / 4) + kk) * kGLd + threadIdx.x % kGradTile]);
      bias_sum += part;
    }
  }
  WaitAsync<0>();

  float sq = 0.0f;
  auto emit = [&](int m, int n, float v) {
    if (m < job.out && n < job.in) {
      job.dw[int64_t{m} * job.in + n] = v;
      sq += v * v;
    }
  };
  if constexpr (kTensor) {
    float* st = c_stage[warp];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(st, acc[j], kStageLd, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        emit(tile.m0 + mi * 16 + e / 16, tile.n0 + (nj + j) * 16 + e % 16, st[(e / 16) * kStageLd + e % 16]);
      }
      __syncwarp();
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) emit(tile.m0 + ty * 4 + i, tile.n0 + tx * 4 + j, sacc[i][j]);
  }
  if (bias_tile) colsum[threadIdx.x] = bias_sum;
    // Fixed-order block sum of squares: warp trees, then warp 0 over the warps.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  if (lane == 0) warp_sq[warp] = sq;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += warp_sq[w];
    if (bias_tile) {
      for (int m = 0; m < kGradTile && tile.m0 + m < job.out; ++m) {
        const float v =
            ((colsum[m] + colsum[m + kGradTile]) + colsum[m + 2 * kGradTile]) + colsum[m + 3 * kGradTile];
        job.db[tile.m0 + m] = v;
        total += v * v;
      }
    }
    partials[blockIdx.x] = total;
  }
}

// ---------------------------------------------------------------------------

// One job per blockIdx.y; its 32 x 32 tiles grid-strided over blockIdx.x.
// A transposed tile goes through shared memory, so both the reads of src
// rows and the writes of dst rows are coalesced.
constexpr int kPackTile = 32;
constexpr int kPackThreads = 256;

template <int P>
__device__ __forceinline__ void PackStore(const PackJob& job, int64_t d, float v) {
  if (job.to_f32) {
    static_cast<float*>(job.dst)[d] = v;
  } else {
    static_cast<Elem<P>*>(job.dst)[d] = Round<P>(v);
  }
}

template <int P>
__global__ void __launch_bounds__(kPackThreads) PackKernel(const PackProgram* __restrict__ prog) {
  WaitForPredecessor();
  __shared__ float tile[kPackTile][kPackTile + 1];
  const PackJob& job = prog->jobs[blockIdx.y];
  const int tiles_c = (job.cols + kPackTile - 1) / kPackTile;
  const int tiles = ((job.rows + kPackTile - 1) / kPackTile) * tiles_c;
  const int tx = static_cast<int>(threadIdx.x) % kPackTile;
  const int ty = static_cast<int>(threadIdx.x) / kPackTile;
  constexpr int kRowStep = kPackThreads / kPackTile;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {  // uniform per block: barriers are safe
    const int r0 = (t / tiles_c) * kPackTile;
    const int c0 = (t % tiles_c) * kPackTile;
    if (!job.transpose) {
      for (int i = ty; i < kPackTile; i += kRowStep) {
        const int r = r0 + i, c = c0 + tx;
        if (r < job.rows && c < job.cols)
          PackStore<P>(job, int64_t{r} * job.dst_ld + c, job.src[int64_t{r} * job.cols + c]);
      }
      continue;
    }
    __syncthreads();  // the previous tile's reads of `tile` are done
    for (int i = ty; i < kPackTile; i += kRowStep) {
      const int r = r0 + i, c = c0 + tx;
      tile[i][tx] = r < job.rows && c < job.cols ? job.src[int64_t{r} * job.cols + c] : 0.0f;
    }
    __syncthreads();
    for (int i = ty; i < kPackTile; i += kRowStep) {
      const int c = c0 + i, r = r0 + tx;  // dst[c][r] = src[r][c]
      if (r < job.rows && c < job.cols) PackStore<P>(job, int64_t{c} * job.dst_ld + r, tile[tx][i]);
    }
  }
}

template <int P, int kRows>
cudaError_t LaunchChain(const FusedProgram& program, const FusedProgram* device_program,
                        cudaStream_t stream) {
  const size_t bytes = ChainShared<P, kRows>::Bytes(program.buf_ld);
  static_assert(sizeof(FusedPass) % sizeof(int4) == 0, "FusedPass is copied as int4");
  cudaError_t err = cudaFuncSetAttribute(
      FusedChainKernel<P, kRows>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  return LaunchDependent(StepKernel::kChain, FusedChainKernel<P, kRows>, program.num_blocks, kChainThreads,
                         bytes, stream, device_program);
}

template <int P>
cudaError_t LaunchChainRows(const FusedProgram& program, const FusedProgram* device_program,
                            cudaStream_t stream) {
  return program.rows_per_block == 16 ? LaunchChain<P, 16>(program, device_program, stream)
                                      : LaunchChain<P, 32>(program, device_program, stream);
}

}  // namespace

size_t FusedSharedBytes(const FusedProgram& p) {
  const bool rows16 = p.rows_per_block == 16;
  switch (p.precision) {
    case Precision::kBf16:
      return rows16 ? ChainShared<2, 16>::Bytes(p.buf_ld) : ChainShared<2, 32>::Bytes(p.buf_ld);
    case Precision::kTf32:
      return rows16 ? ChainShared<1, 16>::Bytes(p.buf_ld) : ChainShared<1, 32>::Bytes(p.buf_ld);
    default: return rows16 ? ChainShared<0, 16>::Bytes(p.buf_ld) : ChainShared<0, 32>::Bytes(p.buf_ld);
  }
}

cudaError_t LaunchFusedChain(const FusedProgram& p, const FusedProgram* device_program, cudaStream_t stream) {
  switch (p.precision) {
    case Precision::kBf16: return LaunchChainRows<2>(p, device_program, stream);
    case Precision::kTf32: return LaunchChainRows<1>(p, device_program, stream);
    default: return LaunchChainRows<0>(p, device_program, stream);
  }
}

bool PlanGradTiles(GradProgram* p) {
  p->num_tiles = 0;
  for (int j = 0; j < p->num_jobs; ++j) {
    const GradJob& job = p->jobs[j];
    for (int m0 = 0; m0 < job.out; m0 += kGradTile) {
      for (int n0 = 0; n0 < job.in; n0 += kGradTile) {
        if (p->num_tiles == kMaxGradTiles) return false;
        p->tiles[p->num_tiles++] = GradTile{j, m0, n0};
      }
    }
  }
  return true;
}

template <int P>
cudaError_t LaunchGrad(const GradProgram& p, const GradProgram* device_program, float* partials,
                       cudaStream_t stream) {
  constexpr size_t bytes = GradSharedBytes<P>();
  const cudaError_t err = cudaFuncSetAttribute(
      WeightGradKernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  return LaunchDependent(StepKernel::kWeightGrad, WeightGradKernel<P>, p.num_tiles, kFusedThreads, bytes,
                         stream, device_program, partials);
}

cudaError_t LaunchWeightGrad(const GradProgram& p, const GradProgram* device_program, float* partials,
                             cudaStream_t stream) {
  switch (p.precision) {
    case Precision::kBf16: return LaunchGrad<2>(p, device_program, partials, stream);
    case Precision::kTf32: return LaunchGrad<1>(p, device_program, partials, stream);
    default: return LaunchGrad<0>(p, device_program, partials, stream);
  }
}

cudaError_t LaunchPack(const PackProgram& p, const PackProgram* device_program, cudaStream_t stream) {
  const dim3 grid(64, p.num_jobs);  // 64 tiles of 32 x 32 = a 256 x 256 layer in one pass
  void (*kernel)(const PackProgram*) = PackKernel<0>;
  if (p.precision == Precision::kBf16) kernel = PackKernel<2>;
  if (p.precision == Precision::kTf32) kernel = PackKernel<1>;
  return LaunchDependent(StepKernel::kPack, kernel, grid, kPackThreads, 0, stream, device_program);
}

}  // namespace qstream::kernels
