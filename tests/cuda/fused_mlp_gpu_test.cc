// The fused network passes (kernels/fused_mlp.h through cuda::FusedNetwork)
// against a double-precision reference on fresh random networks and inputs,
// for every operand precision and for shapes that exercise the padding (odd
// widths, a batch that is not a multiple of the row tile, one and three
// trunk layers, both row tiles of the forward): the forward logits of all three passes, every layer's
// weight and bias gradient, the norm partials, and bitwise repeatability.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/cuda/gpu_test_util.h"
#include "trainer/config.h"
#include "trainer/cuda/fused_network.h"
#include "trainer/network_spec.h"

namespace qstream {
namespace {

using kernels::Precision;
using testing::DeviceArray;
using testing::RandomUniform;
using testing::RelError;
using Mat = std::vector<double>;  // row-major

struct Shape {
  std::string name;
  int obs;
  std::vector<int> trunk;
  int head;
  int atoms;
  std::vector<int> branches;
  int batch;
};

// Host rounding to what the device stores for a precision.
float RoundTf32(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x1000u) & ~0x1FFFu;  // round to nearest (ties away), 10-bit mantissa
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
uint16_t ToBf16Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16Bits(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
float RoundTo(Precision p, float v) {
  if (p == Precision::kTf32) return RoundTf32(v);
  if (p == Precision::kBf16) return FromBf16Bits(ToBf16Bits(v));
  return v;
}

// y[r][o] = sum_i x[r][i] W[o][i] + b[o], optional ReLU; hidden outputs are
// rounded to the operand type as the device stores them (`round`).
Mat Linear(const LinearView& l, const std::vector<float>& p, const Mat& x, int rows, bool relu,
           Precision round) {
  Mat y(size_t(rows) * l.out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < l.out; ++o) {
      double s = p[l.b_offset + o];
      for (int i = 0; i < l.in; ++i) s += x[size_t(r) * l.in + i] * p[l.w_offset + size_t(o) * l.in + i];
      y[size_t(r) * l.out + o] = relu ? RoundTo(round, static_cast<float>(std::max(s, 0.0))) : s;
    }
  }
  return y;
}

struct Forward {
  std::vector<Mat> trunk;
  Mat vh, ah, v, a;
};

// The device's arithmetic in double: operands and stored activations rounded
// as it rounds them, products and sums exact, so only its fp32 accumulation
// order differs (and a ReLU or rounding decision flips only where that is
// within fp32 rounding).
Forward RunForward(const NetworkSpec& spec, const std::vector<float>& p, const Mat& x, int rows,
                   Precision round) {
  Forward f;
  f.trunk.reserve(spec.trunk.size());
  const Mat* in = &x;
  for (const LinearView& l : spec.trunk) {
    f.trunk.push_back(Linear(l, p, *in, rows, true, round));
    in = &f.trunk.back();
  }
  f.vh = Linear(spec.value_hidden, p, *in, rows, true, round);
  f.ah = Linear(spec.adv_hidden, p, *in, rows, true, round);
  f.v = Linear(spec.value_out, p, f.vh, rows, false, round);
  f.a = Linear(spec.adv_out, p, f.ah, rows, false, round);
  return f;
}

void RoundAll(Precision p, Mat* m) {
  for (double& v : *m) v = RoundTo(p, static_cast<float>(v));
}

// dx[r][i] = sum_o dy[r][o] W[o][i], masked by act > 0 when given.
Mat BackData(const LinearView& l, const std::vector<float>& p, const Mat& dy, int rows, const Mat* act) {
  Mat dx(size_t(rows) * l.in, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < l.in; ++i) {
      double s = 0;
      for (int o = 0; o < l.out; ++o) s += dy[size_t(r) * l.out + o] * p[l.w_offset + size_t(o) * l.in + i];
      if (act != nullptr && !((*act)[size_t(r) * l.in + i] > 0)) s = 0;
      dx[size_t(r) * l.in + i] = s;
    }
  }
  return dx;
}

void BackWeight(const LinearView& l, const Mat& dy, const Mat& x, int rows, std::vector<double>* g) {
  for (int o = 0; o < l.out; ++o) {
    double sb = 0;
    for (int r = 0; r < rows; ++r) sb += dy[size_t(r) * l.out + o];
    (*g)[l.b_offset + o] = sb;
    for (int i = 0; i < l.in; ++i) {
      double s = 0;
      for (int r = 0; r < rows; ++r) s += dy[size_t(r) * l.out + o] * x[size_t(r) * l.in + i];
      (*g)[l.w_offset + size_t(o) * l.in + i] = s;
    }
  }
}

Mat Rows(const std::vector<float>& x, int first, int rows, int cols) {
  return Mat(x.begin() + size_t(first) * cols, x.begin() + size_t(first + rows) * cols);
}

std::vector<float> Slice(const std::vector<float>& v, int64_t offset, int64_t n) {
  return std::vector<float>(v.begin() + offset, v.begin() + offset + n);
}

// Uploads host values as the operand type into a padded [rows][ld] device buffer.
void UploadOperand(Precision p, const std::vector<float>& values, int rows, int cols, int ld, void* dst) {
  if (p == Precision::kBf16) {
    std::vector<uint16_t> h(size_t(rows) * ld, 0);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) h[size_t(r) * ld + c] = ToBf16Bits(values[size_t(r) * cols + c]);
    ASSERT_EQ(cudaMemcpy(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  } else {
    std::vector<float> h(size_t(rows) * ld, 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) h[size_t(r) * ld + c] = values[size_t(r) * cols + c];
    ASSERT_EQ(cudaMemcpy(dst, h.data(), h.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
}

// `cols` columns from column `col` of a device [rows][ld] operand-type
// buffer, as doubles.
Mat DownloadOperand(Precision p, const void* src, int rows, int ld, int col, int cols) {
  Mat m(size_t(rows) * cols);
  if (p == Precision::kBf16) {
    std::vector<uint16_t> h(size_t(rows) * ld);
    EXPECT_EQ(cudaMemcpy(h.data(), src, h.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) m[size_t(r) * cols + c] = FromBf16Bits(h[size_t(r) * ld + col + c]);
  } else {
    std::vector<float> h(size_t(rows) * ld);
    EXPECT_EQ(cudaMemcpy(h.data(), src, h.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) m[size_t(r) * cols + c] = h[size_t(r) * ld + col + c];
  }
  return m;
}

// Against the emulation above: fp32 accumulation-order error (and, for the
// rounded types, the rare element whose rounding that flips).
double Tolerance(Precision p) { return p == Precision::kFp32 ? 2e-5 : 1e-3; }

const char* Name(Precision p) {
  return p == Precision::kFp32 ? "Fp32" : p == Precision::kTf32 ? "Tf32" : "Bf16";
}

class FusedNetworkTest : public ::testing::TestWithParam<std::tuple<Precision, int>> {};

const Shape kShapes[] = {
    {"Odd", 6, {40}, 20, 51, {3, 2}, 37},
    {"H200", 48, {256, 256}, 128, 51, {5, 5, 5, 5}, 64},
    {"Deep", 4, {64, 96, 64}, 64, 11, {2}, 100},
    // Past 3 ceil(B / 16) > SMs (132 on H100/H200) the forward takes 32 rows
    // per block; the smaller batches above take 16.
    {"Tall", 48, {256, 256}, 128, 51, {5, 5, 5, 5}, 1000},
};

TEST_P(FusedNetworkTest, ForwardAndGradientsMatchDoubleReference) {
  QS_SKIP_WITHOUT_GPU();
  const Precision prec = std::get<0>(GetParam());
  const Shape& shape = kShapes[std::get<1>(GetParam())];
  v1::NetworkConfig nc;
  nc.set_obs_dim(shape.obs);
  for (int w : shape.trunk) nc.add_trunk_hidden(w);
  nc.set_head_hidden(shape.head);
  nc.set_num_atoms(shape.atoms);
  for (int a : shape.branches) nc.add_branch_actions(a);
  auto spec_or = NetworkSpec::Create(nc);
  ASSERT_TRUE(spec_or.ok()) << spec_or.status();
  const NetworkSpec& spec = *spec_or;
  const int B = shape.batch;
  ASSERT_EQ(cuda::FusedNetwork::Unsupported(spec, B, prec, size_t{227} * 1024), "");

  std::mt19937_64 rng(std::random_device{}());
  // Params drawn like InitParams, then rounded to the operand type (the
  // reference multiplies exactly what the device multiplies).
  auto draw = [&](uint64_t seed) {
    std::vector<float> p = InitParams(spec, seed);
    for (float& v : p) v = RoundTo(prec, v * 1.5f);
    return p;
  };
  const std::vector<float> online = draw(rng());
  const std::vector<float> target = draw(rng());
  std::vector<float> x = RandomUniform(rng, size_t(2) * B * spec.obs_dim, -1, 1);
  for (float& v : x) v = RoundTo(prec, v);

  DeviceArray<float> d_online(online), d_target(target), d_x(x);
  DeviceArray<float> d_grads(size_t(spec.num_params)), d_partials(kernels::kMaxGradTiles);
  d_grads.Poison();
  d_partials.Poison();
  cudaStream_t stream = nullptr;
  QS_ASSERT_CUDA(cudaStreamCreate(&stream));
  cuda::FusedNetwork net;
  cuda::FusedNetworkIo io{d_online.get(), d_target.get(), d_grads.get(), d_x.get(), d_partials.get()};
  ASSERT_TRUE(net.Init(spec, B, prec, io, stream).ok());
  ASSERT_TRUE(net.EnqueuePack(stream).ok());
  ASSERT_TRUE(net.EnqueueForward(stream).ok());
  QS_ASSERT_CUDA(cudaStreamSynchronize(stream));

  // Forward: the three passes.
  const int Z = spec.num_atoms;
  const int AZ = spec.adv_out.out;
  std::vector<float> v_logits(size_t(3) * B * Z), a_logits(size_t(3) * B * AZ);
  QS_ASSERT_CUDA(
      cudaMemcpy(v_logits.data(), net.value_logits(), v_logits.size() * 4, cudaMemcpyDeviceToHost));
  QS_ASSERT_CUDA(cudaMemcpy(a_logits.data(), net.adv_logits(), a_logits.size() * 4, cudaMemcpyDeviceToHost));
  const Mat xs = Rows(x, 0, B, spec.obs_dim);
  const Mat xn = Rows(x, B, B, spec.obs_dim);
  const Forward ref[3] = {RunForward(spec, online, xs, B, prec), RunForward(spec, online, xn, B, prec),
                          RunForward(spec, target, xn, B, prec)};
  const double tol = Tolerance(prec);
  for (int p = 0; p < 3; ++p) {
    const double ev = RelError(Slice(v_logits, int64_t{p} * B * Z, int64_t{B} * Z), ref[p].v);
    const double ea = RelError(Slice(a_logits, int64_t{p} * B * AZ, int64_t{B} * AZ), ref[p].a);
    EXPECT_LE(ev, tol) << "value logits, pass " << p;
    EXPECT_LE(ea, tol) << "advantage logits, pass " << p;
    std::cout << "[ info ] " << shape.name << " " << Name(prec) << " pass " << p << " logits rel err " << ev
              << " / " << ea << "\n";
  }

  // Backward from fresh random d logits.
  std::vector<float> dv = RandomUniform(rng, size_t(B) * Z, -1e-2f, 1e-2f);
  std::vector<float> da = RandomUniform(rng, size_t(B) * AZ, -1e-2f, 1e-2f);
  for (float& v : dv) v = RoundTo(prec, v);
  for (float& v : da) v = RoundTo(prec, v);
  UploadOperand(prec, dv, B, Z, net.d_value_ld(), net.d_value());
  UploadOperand(prec, da, B, AZ, net.d_adv_ld(), net.d_adv());
  ASSERT_TRUE(net.EnqueueBackward(stream).ok());
  QS_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> grads = d_grads.Download();
  const std::vector<float> partials = d_partials.Download();

  // The reference backward runs on the device's own stored activations: a
  // ReLU whose input is within rounding of 0 (or an activation whose TF32 or
  // bf16 rounding flips) may go the other way on the device, and a mask
  // decision taken differently changes a gradient element by its whole value
  // (one such element moved dW of a layer by ~1.6 % at B = 64). They are
  // checked against the reference forward first, where a flip costs only its
  // rounding.
  Forward f = ref[0];
  const int H = spec.value_hidden.out;
  {
    const Mat vh = DownloadOperand(prec, net.head_activations(), B, net.head_ld(), 0, H);
    const Mat ah = DownloadOperand(prec, net.head_activations(), B, net.head_ld(), net.head_adv_col(), H);
    EXPECT_LE(RelError(vh, f.vh), tol) << "value hidden activations";
    EXPECT_LE(RelError(ah, f.ah), tol) << "advantage hidden activations";
    f.vh = vh;
    f.ah = ah;
    for (size_t k = 0; k < spec.trunk.size(); ++k) {
      const int k_int = static_cast<int>(k);
      Mat t =
          DownloadOperand(prec, net.trunk_activations(k_int), B, net.trunk_ld(k_int), 0, spec.trunk[k].out);
      EXPECT_LE(RelError(t, f.trunk[k]), tol) << "trunk activations, layer " << k;
      f.trunk[k] = std::move(t);
    }
  }
  std::vector<double> want(spec.num_params, 0.0);
  const Mat dvd(dv.begin(), dv.end()), dad(da.begin(), da.end());
  Mat d_vh = BackData(spec.value_out, online, dvd, B, &f.vh);
  Mat d_ah = BackData(spec.adv_out, online, dad, B, &f.ah);
  RoundAll(prec, &d_vh);
  RoundAll(prec, &d_ah);
  BackWeight(spec.value_out, dvd, f.vh, B, &want);
  BackWeight(spec.adv_out, dad, f.ah, B, &want);
  const int L = static_cast<int>(spec.trunk.size());
  const Mat& top = f.trunk[L - 1];
  BackWeight(spec.value_hidden, d_vh, top, B, &want);
  BackWeight(spec.adv_hidden, d_ah, top, B, &want);
  Mat d = BackData(spec.value_hidden, online, d_vh, B, &top);
  const Mat d2 = BackData(spec.adv_hidden, online, d_ah, B, &top);
  for (size_t i = 0; i < d.size(); ++i) d[i] += d2[i];
  RoundAll(prec, &d);
  for (int k = L - 1; k >= 0; --k) {
    const Mat& below = k > 0 ? f.trunk[k - 1] : xs;
    BackWeight(spec.trunk[k], d, below, B, &want);
    if (k > 0) {
      d = BackData(spec.trunk[k], online, d, B, &f.trunk[k - 1]);
      RoundAll(prec, &d);
    }
  }
  double norm_sq = 0;
  for (const LinearView& l : spec.layers()) {
    std::vector<double> w(want.begin() + l.w_offset, want.begin() + l.w_offset + int64_t{l.in} * l.out);
    std::vector<double> b(want.begin() + l.b_offset, want.begin() + l.b_offset + l.out);
    const double ew = RelError(Slice(grads, l.w_offset, int64_t{l.in} * l.out), w);
    const double eb = RelError(Slice(grads, l.b_offset, l.out), b);
    EXPECT_LE(ew, 3 * tol) << "dW of layer " << l.w_offset;
    EXPECT_LE(eb, 3 * tol) << "db of layer " << l.b_offset;
    std::cout << "[ info ] " << shape.name << " " << Name(prec) << " layer@" << l.w_offset << " dW " << ew
              << " db " << eb << "\n";
  }
  for (float g : grads) norm_sq += double(g) * g;
  double partial_sum = 0;
  for (int t = 0; t < net.num_grad_tiles(); ++t) partial_sum += partials[t];
  EXPECT_NEAR(partial_sum, norm_sq, 1e-4 * norm_sq) << "norm partials cover every gradient element once";

  // Bitwise repeatable.
  ASSERT_TRUE(net.EnqueuePack(stream).ok());
  ASSERT_TRUE(net.EnqueueForward(stream).ok());
  ASSERT_TRUE(net.EnqueueBackward(stream).ok());
  QS_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> again = d_grads.Download();
  EXPECT_EQ(std::memcmp(again.data(), grads.data(), grads.size() * 4), 0);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(AllPrecisions, FusedNetworkTest,
                         ::testing::Combine(::testing::Values(Precision::kFp32, Precision::kTf32,
                                                              Precision::kBf16),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const auto& info) {
                           return std::string(Name(std::get<0>(info.param))) + "_" +
                                  kShapes[std::get<1>(info.param)].name;
                         });

TEST(FusedNetwork, UnsupportedShapesSayWhy) {
  v1::NetworkConfig nc;
  nc.set_obs_dim(8);
  nc.add_trunk_hidden(1024);
  nc.set_head_hidden(64);
  nc.set_num_atoms(51);
  nc.add_branch_actions(2);
  auto spec = NetworkSpec::Create(nc);
  ASSERT_TRUE(spec.ok());
  EXPECT_NE(cuda::FusedNetwork::Unsupported(*spec, 32, Precision::kFp32, size_t{227} * 1024).find("1024"),
            std::string::npos);
  nc.clear_trunk_hidden();
  nc.add_trunk_hidden(256);
  spec = NetworkSpec::Create(nc);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(cuda::FusedNetwork::Unsupported(*spec, 32, Precision::kFp32, size_t{227} * 1024), "");
  EXPECT_NE(
      cuda::FusedNetwork::Unsupported(*spec, 32, Precision::kFp32, size_t{48} * 1024).find("shared memory"),
      std::string::npos);
}

// Where QSTREAM_CUDA_PATH=auto takes the fused path (no device needed).
TEST(FusedNetwork, AutoChoiceFollowsTheMeasuredCrossover) {
  auto h200 = BenchConfig("h200");
  auto small = BenchConfig("small");
  ASSERT_TRUE(h200.ok() && small.ok());
  auto wide = NetworkSpec::Create(h200->network());
  auto narrow = NetworkSpec::Create(small->network());
  ASSERT_TRUE(wide.ok() && narrow.ok());
  for (Precision p : {Precision::kFp32, Precision::kTf32, Precision::kBf16}) {
    EXPECT_EQ(cuda::FusedNetwork::AutoDeclines(*narrow, 64, p), "") << Name(p);
  }
  // h200 (256 wide): bf16 fused at every batch, TF32 from 512 on, FP32 never.
  EXPECT_EQ(cuda::FusedNetwork::AutoDeclines(*wide, 256, Precision::kBf16), "");
  EXPECT_EQ(cuda::FusedNetwork::AutoDeclines(*wide, 1024, Precision::kBf16), "");
  EXPECT_EQ(cuda::FusedNetwork::AutoDeclines(*wide, 1024, Precision::kTf32), "");
  EXPECT_NE(cuda::FusedNetwork::AutoDeclines(*wide, 256, Precision::kTf32), "");
  const std::string why = cuda::FusedNetwork::AutoDeclines(*wide, 1024, Precision::kFp32);
  EXPECT_NE(why.find("256 features"), std::string::npos) << why;
  EXPECT_NE(why.find("QSTREAM_CUDA_PATH=fused"), std::string::npos) << why;
}

}  // namespace
}  // namespace qstream
