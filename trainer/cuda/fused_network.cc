#include "trainer/cuda/fused_network.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "trainer/cuda/cuda_status.h"

namespace qstream::cuda {
namespace {

using kernels::FusedOp;
using kernels::FusedPadded;
using kernels::FusedPass;
using kernels::GradJob;
using kernels::PackJob;

// Rows per block of the chain kernels. The forward's three passes take 16
// rows per block while that keeps every block in one wave (3 ceil(B / 16)
// blocks at most one per SM), 32 beyond. H100, h200 config, us per step with
// 16 / 32 forward rows: B = 256 bf16 141 / 154, TF32 179 / 198; B = 1024 bf16
// 207 / 179, TF32 228 / 228 (bench/NOTES.md, stop 28). The backward (one
// pass) measured fastest at 16 rows at every batch.
constexpr int kMaxForwardRows = 32;
constexpr int kBackwardRows = 16;
int ForwardRows(int batch, int sm_count) {
  return 3 * ((batch + 15) / 16) <= sm_count ? 16 : kMaxForwardRows;
}
constexpr int kMaxTrunk = 4;

char* Offset(void* p, int64_t elements, int elem) { return static_cast<char*>(p) + elements * elem; }

}  // namespace

int FusedNetwork::WidestPadded(const NetworkSpec& spec) {
  int widest = std::max(FusedPadded(spec.obs_dim), 2 * FusedPadded(spec.head_hidden));
  for (const LinearView& l : spec.trunk) widest = std::max(widest, FusedPadded(l.out));
  return widest;
}

std::string FusedNetwork::AutoDeclines(const NetworkSpec& spec, int batch, kernels::Precision precision) {
  const int widest = WidestPadded(spec);
  if (widest <= kFusedAutoWidth) return "";
  if (widest <= kFusedAutoWidthTensor) {
    if (precision == kernels::Precision::kBf16) return "";
    if (precision == kernels::Precision::kTf32 && batch >= kFusedAutoBatchTf32) return "";
  }
  return absl::StrCat("auto: ", widest, " features > ", kFusedAutoWidth, " (bf16: > ", kFusedAutoWidthTensor,
                      "; tf32: > ", kFusedAutoWidthTensor, " or batch < ", kFusedAutoBatchTf32,
                      "), QSTREAM_CUDA_PATH=fused forces it");
}

std::string FusedNetwork::Unsupported(const NetworkSpec& spec, int batch, kernels::Precision precision,
                                      size_t shared_limit) {
  const int layers = static_cast<int>(spec.trunk.size());
  if (layers < 1 || layers > kMaxTrunk)
    return absl::StrCat("trunk of ", layers, " layers (fused: 1..", kMaxTrunk, ")");
  const int widest = WidestPadded(spec);
  if (widest > kernels::kFusedMaxWidth) {
    return absl::StrCat("a layer (or 2 x head_hidden) of ", widest,
                        " padded features (fused: <= ", kernels::kFusedMaxWidth, ")");
  }
  kernels::FusedProgram probe;
  probe.precision = precision;
  probe.rows_per_block = kMaxForwardRows;  // the larger of the two choices
  probe.buf_ld = kernels::FusedBufLd(widest, precision);
  // + the pass descriptor each block keeps in static shared memory.
  if (kernels::FusedSharedBytes(probe) + sizeof(kernels::FusedPass) + 128 > shared_limit) {
    return absl::StrCat("needs ", kernels::FusedSharedBytes(probe),
                        " bytes of shared memory per block, the device allows ", shared_limit);
  }
  int tiles = 0;
  for (const LinearView& l : spec.layers()) {
    tiles += ((l.out + kernels::kGradTile - 1) / kernels::kGradTile) *
             ((l.in + kernels::kGradTile - 1) / kernels::kGradTile);
  }
  if (tiles > kernels::kMaxGradTiles)
    return absl::StrCat(tiles, " weight-gradient tiles (fused: <= ", kernels::kMaxGradTiles, ")");
  if (batch < 1) return "batch_size < 1";
  return "";
}

absl::Status FusedNetwork::Operand(size_t elements, DeviceBuffer<char>* buf) const {
  return buf->Allocate(std::max<size_t>(elements, 1) * elem_);
}

absl::Status FusedNetwork::Init(const NetworkSpec& spec, int batch, kernels::Precision precision,
                                const FusedNetworkIo& io, cudaStream_t stream) {
  spec_ = spec;
  B_ = batch;
  precision_ = precision;
  elem_ = kernels::OperandBytes(precision);
  norm_partials_ = io.norm_partials;
  const int B = batch;
  const int L = static_cast<int>(spec.trunk.size());
  const int H = spec.head_hidden;
  const int Z = spec.num_atoms;
  const int AZ = spec.adv_out.out;
  hp_ = FusedPadded(H);
  zp_ = FusedPadded(Z);
  azp_ = FusedPadded(AZ);
  const int kp0 = FusedPadded(spec.obs_dim);
  std::vector<int> wp(L);  // padded trunk widths
  for (int k = 0; k < L; ++k) wp[k] = FusedPadded(spec.trunk[k].out);
  const int top = spec.trunk[L - 1].out;
  const int topp = wp[L - 1];
  const int hh = 2 * hp_;  // [value hidden | advantage hidden], each padded

  // Activation buffers (operand type unless noted).
  QS_RETURN_IF_ERROR(Operand(size_t(B) * kp0, &x_op_));
  t_op_.resize(L);
  dt_.resize(L);
  for (int k = 0; k < L; ++k) {
    QS_RETURN_IF_ERROR(Operand(size_t(B) * wp[k], &t_op_[k]));
    QS_RETURN_IF_ERROR(Operand(size_t(B) * wp[k], &dt_[k]));
  }
  QS_RETURN_IF_ERROR(Operand(size_t(B) * hh, &h_op_));
  QS_RETURN_IF_ERROR(Operand(size_t(B) * hh, &dh_));
  QS_RETURN_IF_ERROR(Operand(size_t(B) * zp_, &dv_));
  QS_RETURN_IF_ERROR(Operand(size_t(B) * azp_, &da_));
  QS_RETURN_IF_ERROR(v_logits_.Allocate(size_t(3 * B) * Z));
  QS_RETURN_IF_ERROR(a_logits_.Allocate(size_t(3 * B) * AZ));

  // Packed operands: forward (online, target) and backward (online) per op.
  struct Mat {
    int64_t offset;  // elements into packed_
    int kp, np;
  };
  int64_t packed_elems = 0;
  int64_t bias_elems = 0;
  auto mat = [&](int kp, int np) {
    Mat m{packed_elems, kp, np};
    packed_elems += int64_t{kp} * np;
    packed_elems = (packed_elems + 127) / 128 * 128;  // 256-byte aligned starts
    return m;
  };
  auto bias = [&](int np) {
    const int64_t o = bias_elems;
    bias_elems += int64_t{(np + 63) / 64} * 64;
    return o;
  };
  struct ForwardMats {
    std::vector<Mat> trunk;
    std::vector<int64_t> trunk_b;
    Mat heads, vo, ao;
    int64_t heads_b, vo_b, ao_b;
  };
  ForwardMats fwd[2];
  for (auto& f : fwd) {
    for (int k = 0; k < L; ++k) {
      f.trunk.push_back(mat(k == 0 ? kp0 : wp[k - 1], wp[k]));
      f.trunk_b.push_back(bias(wp[k]));
    }
    f.heads = mat(topp, hh);
    f.heads_b = bias(hh);
    f.vo = mat(hp_, zp_);
    f.vo_b = bias(zp_);
    f.ao = mat(hp_, azp_);
    f.ao_b = bias(azp_);
  }
  const Mat b_vo = mat(zp_, hp_);
  const Mat b_ao = mat(azp_, hp_);
  const Mat b_heads = mat(hh, topp);
  std::vector<Mat> b_trunk(L);
  for (int k = 1; k < L; ++k) b_trunk[k] = mat(wp[k], wp[k - 1]);
  QS_RETURN_IF_ERROR(Operand(packed_elems, &packed_));
  QS_RETURN_IF_ERROR(biases_.Allocate(std::max<int64_t>(bias_elems, 1)));
  auto mptr = [&](const Mat& m) { return Offset(packed_.get(), m.offset, elem_); };
  float* bb = biases_.get();

  // Pack jobs.
  pack_ = {};
  pack_.precision = precision;
  auto job = [&](const float* base, const LinearView& l, bool weight, bool transpose, void* dst, int ld) {
    PackJob j;
    j.src = base + (weight ? l.w_offset : l.b_offset);
    j.rows = weight ? l.out : 1;
    j.cols = weight ? l.in : l.out;
    j.transpose = transpose;
    j.to_f32 = !weight;
    j.dst = dst;
    j.dst_ld = ld;
    pack_.jobs[pack_.num_jobs++] = j;
  };
  for (int net = 0; net < 2; ++net) {
    const float* base = net == 0 ? io.params : io.target;
    const ForwardMats& f = fwd[net];
    for (int k = 0; k < L; ++k) {
      job(base, spec.trunk[k], true, true, mptr(f.trunk[k]), f.trunk[k].np);
      job(base, spec.trunk[k], false, false, bb + f.trunk_b[k], 0);
    }
    job(base, spec.value_hidden, true, true, mptr(f.heads), hh);
    job(base, spec.adv_hidden, true, true, Offset(mptr(f.heads), hp_, elem_), hh);
    job(base, spec.value_hidden, false, false, bb + f.heads_b, 0);
    job(base, spec.adv_hidden, false, false, bb + f.heads_b + hp_, 0);
    job(base, spec.value_out, true, true, mptr(f.vo), zp_);
    job(base, spec.value_out, false, false, bb + f.vo_b, 0);
    job(base, spec.adv_out, true, true, mptr(f.ao), azp_);
    job(base, spec.adv_out, false, false, bb + f.ao_b, 0);
  }
  job(io.params, spec.value_out, true, false, mptr(b_vo), hp_);
  job(io.params, spec.adv_out, true, false, mptr(b_ao), hp_);
  job(io.params, spec.value_hidden, true, false, mptr(b_heads), topp);
  job(io.params, spec.adv_hidden, true, false, Offset(mptr(b_heads), int64_t{hp_} * topp, elem_), topp);
  for (int k = 1; k < L; ++k) job(io.params, spec.trunk[k], true, false, mptr(b_trunk[k]), wp[k - 1]);
  if (pack_.num_jobs > kernels::kMaxPackJobs) return absl::InternalError("fused network: too many pack jobs");

  auto op_from = [&](const Mat& m, int n, const float* bias_ptr) {
    FusedOp op;
    op.b = mptr(m);
    op.kp = m.kp;
    op.np = m.np;
    op.n = n;
    op.bias = bias_ptr;
    return op;
  };

  // Forward: pass 0 online on s (keeps activations), 1 online on s', 2 target on s'.
  int widest = std::max(kp0, hh);
  for (int k = 0; k < L; ++k) widest = std::max(widest, wp[k]);
  forward_ = {};
  forward_.precision = precision;
  int device = 0;
  int sm_count = 0;
  QS_CUDA_CHECK(cudaGetDevice(&device));
  QS_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const int forward_rows = ForwardRows(B, sm_count);
  forward_.rows_per_block = forward_rows;
  forward_.buf_ld = kernels::FusedBufLd(widest, precision);
  forward_.num_passes = 3;
  const int fblocks = (B + forward_rows - 1) / forward_rows;
  for (int p = 0; p < 3; ++p) {
    const ForwardMats& f = fwd[p == 2 ? 1 : 0];
    const bool keep = p == 0;
    FusedPass& pass = forward_.passes[p];
    pass.first_block = p * fblocks;
    pass.rows = B;
    pass.in = io.x + (p == 0 ? 0 : int64_t{B} * spec.obs_dim);
    pass.in_ld = spec.obs_dim;
    pass.in_cols = spec.obs_dim;
    pass.in_kp = kp0;
    pass.in_buf = 1;
    pass.in_copy = keep ? x_op_.get() : nullptr;
    pass.in_copy_ld = kp0;
    int cur = 1;
    for (int k = 0; k < L; ++k) {
      FusedOp op = op_from(f.trunk[k], spec.trunk[k].out, bb + f.trunk_b[k]);
      op.a_buf = cur;
      op.act = kernels::kActRelu;
      op.out_buf = 1 - cur;
      if (keep) {
        op.out_op = t_op_[k].get();
        op.out_op_ld = wp[k];
      }
      pass.ops[pass.num_ops++] = op;
      cur = 1 - cur;
    }
    FusedOp heads = op_from(f.heads, hh, bb + f.heads_b);
    heads.a_buf = cur;
    heads.act = kernels::kActRelu;
    heads.out_buf = 1 - cur;
    if (keep) {
      heads.out_op = h_op_.get();
      heads.out_op_ld = hh;
    }
    pass.ops[pass.num_ops++] = heads;
    cur = 1 - cur;
    FusedOp vo = op_from(f.vo, Z, bb + f.vo_b);
    vo.a_buf = cur;
    vo.a_col = 0;
    vo.out_f32 = v_logits_.get() + int64_t{p} * B * Z;
    vo.out_f32_ld = Z;
    pass.ops[pass.num_ops++] = vo;
    FusedOp ao = op_from(f.ao, AZ, bb + f.ao_b);
    ao.a_buf = cur;
    ao.a_col = hp_;
    ao.out_f32 = a_logits_.get() + int64_t{p} * B * AZ;
    ao.out_f32_ld = AZ;
    pass.ops[pass.num_ops++] = ao;
  }
  forward_.num_blocks = 3 * fblocks;

  // Backward (data gradients) on the s rows.
  backward_ = {};
  backward_.precision = precision;
  backward_.rows_per_block = kBackwardRows;
  backward_.buf_ld = forward_.buf_ld;
  backward_.num_passes = 1;
  backward_.num_blocks = (B + kBackwardRows - 1) / kBackwardRows;
  {
    FusedPass& pass = backward_.passes[0];
    pass.rows = B;
    // d value hidden and d advantage hidden, side by side in buffer 0 (and
    // dh): d logits (global) times the output layer, masked by the ReLU.
    auto head_grad = [&](const Mat& m, void* d_logits, int ld, int col) {
      FusedOp op = op_from(m, H, nullptr);
      op.a_buf = -1;
      op.a_global = d_logits;
      op.a_ld = ld;
      op.a_cols = ld;
      op.act = kernels::kActMask;
      op.mask = Offset(h_op_.get(), col, elem_);
      op.mask_ld = hh;
      op.out_buf = 0;
      op.out_col = col;
      op.out_op = Offset(dh_.get(), col, elem_);
      op.out_op_ld = hh;
      pass.ops[pass.num_ops++] = op;
    };
    head_grad(b_vo, dv_.get(), zp_, 0);
    head_grad(b_ao, da_.get(), azp_, hp_);
    FusedOp dtop = op_from(b_heads, top, nullptr);
    dtop.a_buf = 0;
    dtop.act = kernels::kActMask;
    dtop.mask = t_op_[L - 1].get();
    dtop.mask_ld = topp;
    dtop.out_buf = 1;
    dtop.out_op = dt_[L - 1].get();
    dtop.out_op_ld = topp;
    pass.ops[pass.num_ops++] = dtop;
    int cur = 1;
    for (int k = L - 1; k >= 1; --k) {
      FusedOp d = op_from(b_trunk[k], spec.trunk[k - 1].out, nullptr);
      d.a_buf = cur;
      d.act = kernels::kActMask;
      d.mask = t_op_[k - 1].get();
      d.mask_ld = wp[k - 1];
      d.out_buf = k > 1 ? 1 - cur : -1;
      d.out_op = dt_[k - 1].get();
      d.out_op_ld = wp[k - 1];
      pass.ops[pass.num_ops++] = d;
      cur = 1 - cur;
    }
  }

  // Weight gradients of every layer.
  grad_ = {};
  grad_.precision = precision;
  grad_.rows = B;
  auto grad_job = [&](const LinearView& l, const void* dy, int dy_ld, int dy_cols, const void* x, int x_ld,
                      int x_cols) {
    GradJob j;
    j.dy = dy;
    j.dy_ld = dy_ld;
    j.dy_cols = dy_cols;
    j.x = x;
    j.x_ld = x_ld;
    j.x_cols = x_cols;
    j.out = l.out;
    j.in = l.in;
    j.dw = io.grads + l.w_offset;
    j.db = io.grads + l.b_offset;
    grad_.jobs[grad_.num_jobs++] = j;
  };
  for (int k = 0; k < L; ++k) {
    grad_job(spec.trunk[k], dt_[k].get(), wp[k], wp[k], k == 0 ? x_op_.get() : t_op_[k - 1].get(),
             k == 0 ? kp0 : wp[k - 1], k == 0 ? kp0 : wp[k - 1]);
  }
  grad_job(spec.value_hidden, dh_.get(), hh, hp_, t_op_[L - 1].get(), topp, topp);
  grad_job(spec.adv_hidden, Offset(dh_.get(), hp_, elem_), hh, hp_, t_op_[L - 1].get(), topp, topp);
  grad_job(spec.value_out, dv_.get(), zp_, zp_, h_op_.get(), hh, hp_);
  grad_job(spec.adv_out, da_.get(), azp_, azp_, Offset(h_op_.get(), hp_, elem_), hh, hp_);
  if (!kernels::PlanGradTiles(&grad_))
    return absl::InternalError("fused network: too many weight-gradient tiles");

  QS_RETURN_IF_ERROR(d_pack_.Allocate(1));
  QS_RETURN_IF_ERROR(d_forward_.Allocate(1));
  QS_RETURN_IF_ERROR(d_backward_.Allocate(1));
  QS_RETURN_IF_ERROR(d_grad_.Allocate(1));
  QS_CUDA_CHECK(cudaMemcpyAsync(d_pack_.get(), &pack_, sizeof(pack_), cudaMemcpyHostToDevice, stream));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(d_forward_.get(), &forward_, sizeof(forward_), cudaMemcpyHostToDevice, stream));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(d_backward_.get(), &backward_, sizeof(backward_), cudaMemcpyHostToDevice, stream));
  QS_CUDA_CHECK(cudaMemcpyAsync(d_grad_.get(), &grad_, sizeof(grad_), cudaMemcpyHostToDevice, stream));
  QS_CUDA_CHECK(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

absl::Status FusedNetwork::EnqueuePack(cudaStream_t stream) const {
  QS_CUDA_CHECK(kernels::LaunchPack(pack_, d_pack_.get(), stream));
  return absl::OkStatus();
}

absl::Status FusedNetwork::EnqueueForward(cudaStream_t stream) const {
  QS_CUDA_CHECK(kernels::LaunchFusedChain(forward_, d_forward_.get(), stream));
  return absl::OkStatus();
}

absl::Status FusedNetwork::EnqueueBackward(cudaStream_t stream) const {
  QS_CUDA_CHECK(kernels::LaunchFusedChain(backward_, d_backward_.get(), stream));
  QS_CUDA_CHECK(kernels::LaunchWeightGrad(grad_, d_grad_.get(), norm_partials_, stream));
  return absl::OkStatus();
}

}  // namespace qstream::cuda
