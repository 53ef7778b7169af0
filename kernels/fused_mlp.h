// Fused MLP passes of the learner step (backend.h contract, steps 3 and 8):
// whole chains of Linear layers run inside one kernel, each block owning a
// tile of rows whose activations stay in shared memory between layers, and
// the weight gradients of every layer in one more kernel.
//
// Operands are fp32, TF32 (fp32 storage, rounded) or bf16; accumulation,
// bias, the logits and every weight gradient are fp32. Weights are read from
// a packed copy (LaunchPack, once per step from the fp32 master parameters):
// per op a zero-padded row-major [kp][np] matrix B of C = A B, i.e. W^T for
// a forward layer and W for the data gradient of a backward one. Every
// padded dimension is a multiple of kFusedPad, so tiles never straddle an
// edge and padded columns compute exact zeros.
//
// Reductions have a fixed order: a block sums its K slabs in order, one block
// owns each output element, and no atomics are used, so runs are bitwise
// reproducible.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qstream::kernels {

// Operand precision of the matrix products (config: matmul_precision).
enum class Precision : int32_t { kFp32 = 0, kTf32 = 1, kBf16 = 2 };
inline int OperandBytes(Precision p) { return p == Precision::kBf16 ? 2 : 4; }

inline constexpr int kFusedPad = 32;        // padded dims are multiples of this
inline constexpr int kFusedMaxWidth = 512;  // widest activation a block holds
inline constexpr int kFusedMaxOps = 12;     // ops per pass
inline constexpr int kFusedMaxPasses = 3;
inline constexpr int kFusedThreads = 256;  // 8 warps
inline constexpr int kFusedChunkN = 128;   // output columns per accumulator chunk
inline constexpr int kFusedSlabK = 64;     // K per pipelined stage
inline constexpr int kGradTile = 64;       // weight-gradient tile (out x in)
inline constexpr int kMaxGradTiles = 256;  // weight-gradient tiles = norm partials

inline int FusedPadded(int n) { return (n + kFusedPad - 1) / kFusedPad * kFusedPad; }

enum FusedAct : int32_t { kActNone = 0, kActRelu = 1, kActMask = 2 };

// C[rows][np] = A[rows][kp] B[kp][np] (+ bias), then act, stored where asked.
struct FusedOp {
  const void* b = nullptr;  // packed [kp][np], operand type
  int kp = 0;
  int np = 0;
  int n = 0;                    // valid columns; columns n..np are written as 0
  const float* bias = nullptr;  // np floats (padded with zeros) or null
  // A: resident in shared buffer a_buf (0 or 1) from column a_col, or, with
  // a_buf < 0, staged from global a_global[row][a_ld] (operand type; columns
  // at or past a_cols and rows past the pass's rows read as 0).
  int a_buf = 0;
  int a_col = 0;
  const void* a_global = nullptr;
  int a_ld = 0;
  int a_cols = 0;
  int act = kActNone;
  // kActMask: keep C where mask[row][col] > 0 (operand type, the forward
  // activation whose ReLU this differentiates).
  const void* mask = nullptr;
  int mask_ld = 0;
  int out_buf = -1;  // shared buffer (operand type) written from column out_col, or -1
  int out_col = 0;
  void* out_op = nullptr;  // global operand-type copy of the np columns, or null
  int out_op_ld = 0;
  float* out_f32 = nullptr;  // global fp32 copy of the n valid columns, or null
  int out_f32_ld = 0;
};

// One range of rows through a list of ops; global row r of a pass is row r
// of every global pointer in it.
struct alignas(16) FusedPass {
  int first_block = 0;  // blocks [first_block, first_block + ceil(rows / rows_per_block))
  int rows = 0;
  // Optional input loaded (fp32, converted, zero padded to in_kp columns)
  // into shared buffer in_buf before op 0, and its operand-type copy.
  const float* in = nullptr;
  int in_ld = 0;
  int in_cols = 0;
  int in_kp = 0;
  int in_buf = 1;
  void* in_copy = nullptr;
  int in_copy_ld = 0;
  int num_ops = 0;
  FusedOp ops[kFusedMaxOps];
};

// Elements per row of a chain block's shared activation buffers for
// activations up to `widest` (padded) features: 16 bytes of skew, so the eight
// rows an ldmatrix phase reads fall in distinct bank groups.
inline int FusedBufLd(int widest, Precision p) { return widest + 16 / OperandBytes(p); }

struct FusedProgram {
  Precision precision = Precision::kTf32;
  int rows_per_block = 32;  // 16 or 32
  int buf_ld = 0;           // elements per row of each shared buffer
  int num_passes = 0;
  int num_blocks = 0;
  FusedPass passes[kFusedMaxPasses];
};

// Dynamic shared memory a program's blocks need; the backend checks it
// against the device's opt-in limit at set-up.
size_t FusedSharedBytes(const FusedProgram& program);
// `device_program`: a copy of `program` in device memory (kept for the
// graph's lifetime). Sets the kernel's shared memory attribute once.
cudaError_t LaunchFusedChain(const FusedProgram& program, const FusedProgram* device_program,
                             cudaStream_t stream);

// Weight gradients: per job, dW[out][in] = sum_r dY[r][out] X[r][in] and
// db[out] = sum_r dY[r][out] over rows r < rows, written to fp32 grads.
struct GradJob {
  const void* dy = nullptr;  // operand type [rows][dy_ld], columns from here
  int dy_ld = 0;
  int dy_cols = 0;  // readable columns (>= out, padded); past them reads 0
  const void* x = nullptr;
  int x_ld = 0;
  int x_cols = 0;
  int out = 0;
  int in = 0;
  float* dw = nullptr;  // [out][in]
  float* db = nullptr;  // [out]
};

struct GradTile {
  int job = 0;
  int m0 = 0;  // first out row
  int n0 = 0;  // first in column; the n0 == 0 tile also writes db
};

inline constexpr int kMaxGradJobs = 16;

struct GradProgram {
  Precision precision = Precision::kTf32;
  int rows = 0;
  int num_jobs = 0;
  GradJob jobs[kMaxGradJobs];
  int num_tiles = 0;
  GradTile tiles[kMaxGradTiles];
};

// Tiles the jobs into kGradTile x kGradTile output blocks; false if more than kMaxGradTiles.
bool PlanGradTiles(GradProgram* program);
// Block t computes tile t over all rows in order and writes its elements,
// and partials[t] = the sum of squares of everything it wrote (the first
// stage of the global gradient norm; partials past num_tiles are untouched).
cudaError_t LaunchWeightGrad(const GradProgram& program, const GradProgram* device_program, float* partials,
                             cudaStream_t stream);

// Packs fp32 source matrices into operand-type (or fp32) destinations.
struct PackJob {
  const float* src = nullptr;  // [rows][cols] row-major
  int rows = 0;
  int cols = 0;
  bool transpose = false;  // dst[c][r] = src[r][c]
  bool to_f32 = false;     // destination is fp32 (biases), not the operand type
  void* dst = nullptr;     // dst[i][j] at dst + i * dst_ld + j
  int dst_ld = 0;
};

inline constexpr int kMaxPackJobs = 40;

struct PackProgram {
  Precision precision = Precision::kTf32;
  int num_jobs = 0;
  PackJob jobs[kMaxPackJobs];
};

// One launch: blockIdx.y = job, its 32 x 32 tiles grid-strided (transposed ones
// through shared memory, coalesced both ways). Padding is never
// written (the backend zeroes the destinations once).
cudaError_t LaunchPack(const PackProgram& program, const PackProgram* device_program, cudaStream_t stream);

}  // namespace qstream::kernels
