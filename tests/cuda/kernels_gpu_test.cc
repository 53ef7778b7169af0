// Every CUDA kernel against the CPU reference (trainer/cpu, run in double
// where it is templated) on fresh random inputs, outputs poisoned first.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/rng.h"
#include "kernels/bias_act.h"
#include "kernels/c51_loss.h"
#include "kernels/optimizer.h"
#include "kernels/per_sample.h"
#include "kernels/replay_commit.h"
#include "kernels/step_finalize.h"
#include "kernels/views.h"
#include "tests/cuda/gpu_test_util.h"
#include "trainer/cpu/c51_loss.h"
#include "trainer/cpu/optimizer.h"
#include "trainer/cuda/gemm.h"
#include "trainer/network_spec.h"

namespace qstream {
namespace {

using testing::DeviceArray;
using testing::RandomUniform;
using testing::RelError;

constexpr double kExactTol = 1e-5;
constexpr double kTf32Tol = 3e-3;

NetworkSpec MakeSpec(std::vector<int> branches, int atoms = 51) {
  v1::NetworkConfig c;
  c.set_obs_dim(6);
  c.add_trunk_hidden(16);
  c.set_head_hidden(8);
  c.set_num_atoms(atoms);
  c.set_v_min(-10);
  c.set_v_max(10);
  for (int b : branches) c.add_branch_actions(b);
  return *NetworkSpec::Create(c);
}

kernels::HeadShape MakeHead(const NetworkSpec& s) {
  kernels::HeadShape h;
  h.num_atoms = s.num_atoms;
  h.num_branches = s.num_branches();
  h.total_actions = s.total_actions();
  h.v_min = s.v_min;
  h.v_max = s.v_max;
  h.delta_z = s.delta_z();
  for (int br = 0; br <= s.num_branches(); ++br) h.branch_offset[br] = s.branch_offset(br);
  return h;
}

// Dueling logits of one (row, action) in double: A + (V - mean_a A).
std::vector<double> Logits(const NetworkSpec& s, const float* v, const float* a, int br, int act) {
  const int Z = s.num_atoms;
  const int first = s.branch_offset(br);
  const int n = s.branch_actions[br];
  std::vector<double> l(Z);
  for (int z = 0; z < Z; ++z) {
    double mean = 0;
    for (int k = 0; k < n; ++k) mean += a[(first + k) * Z + z];
    mean /= n;
    l[z] = a[(first + act) * Z + z] + (v[z] - mean);
  }
  return l;
}

std::vector<double> Softmax(const std::vector<double>& l) {
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double s = 0;
  for (size_t z = 0; z < l.size(); ++z) s += p[z] = std::exp(l[z] - mx);
  for (double& x : p) x /= s;
  return p;
}

double Expectation(const NetworkSpec& s, const std::vector<double>& p) {
  double q = 0;
  for (int z = 0; z < s.num_atoms; ++z) q += p[z] * s.atom(z);
  return q;
}

// Random inputs of the loss kernel: rewards beyond the support (clipped
// mass), terminal items, a target landing on atoms (the l == u case),
// discounts at 1, near 0 and below 0.
struct LossInputs {
  NetworkSpec spec;
  int B = 37;
  std::vector<float> ov, oa, tv, ta, rewards, discounts, weights;
  std::vector<int32_t> actions;

  LossInputs(const std::vector<int>& branches, uint64_t seed) : spec(MakeSpec(branches)) {
    const int Z = spec.num_atoms, NB = spec.num_branches(), AZ = spec.total_actions() * Z;
    std::mt19937_64 rng(seed);
    ov = RandomUniform(rng, size_t(2 * B) * Z, -2, 2);
    oa = RandomUniform(rng, size_t(2 * B) * AZ, -2, 2);
    tv = RandomUniform(rng, size_t(B) * Z, -2, 2);
    ta = RandomUniform(rng, size_t(B) * AZ, -2, 2);
    actions.resize(size_t(B) * NB);
    for (int b = 0; b < B; ++b) {
      for (int br = 0; br < NB; ++br) actions[b * NB + br] = int(rng() % spec.branch_actions[br]);
    }
    rewards = RandomUniform(rng, B, -14, 14);
    discounts = RandomUniform(rng, B, 0.5f, 0.99f);
    for (int b = 0; b < B; b += 5) discounts[b] = 0.0f;
    rewards[1] = 3.0f;  // integer positions on the support: the l == u case
    discounts[1] = 0.0f;
    discounts[2] = 1.0f;   // the support shifted whole, no contraction
    discounts[3] = 1e-4f;  // every atom lands on one or two neighbours
    // Negative: outside the wire's range, but the kernel's projection must
    // still match (it scans every source atom when b_j is not monotone).
    discounts[4] = -0.5f;
    // Raw IS weights (the sampler's): the kernel divides by their max.
    weights = RandomUniform(rng, B, 0.1f, 7.0f);
  }
};

template <typename T>
struct LossOutputs {
  std::vector<T> dv, da, ce, item_loss, clip, qmin, qmax, qsum;
  std::vector<int32_t> qbad;
};

// The loss kernel on `in` with every output poisoned first; state->t = t.
LossOutputs<float> RunLossKernel(const LossInputs& in, const kernels::LossOptions& options, int64_t t,
                                 bool stage_rows = true) {
  const int B = in.B, Z = in.spec.num_atoms, AZ = in.spec.total_actions() * Z;
  DeviceArray<float> d_ov(in.ov), d_oa(in.oa), d_tv(in.tv), d_ta(in.ta), d_r(in.rewards), d_d(in.discounts),
      d_w(in.weights);
  DeviceArray<int32_t> d_act(in.actions);
  DeviceArray<float> dv(size_t(B) * Z), da(size_t(B) * AZ), ce(B), item_loss(B), clip(B), qmin(B), qmax(B),
      qsum(B);
  DeviceArray<int32_t> qbad(B);
  for (auto* a : {&dv, &da, &ce, &item_loss, &clip, &qmin, &qmax, &qsum}) a->Poison();
  qbad.Poison();
  kernels::DeviceState state;
  state.t = t;
  DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});
  kernels::C51LossArgs args;
  args.head = MakeHead(in.spec);
  args.batch = B;
  args.online_v = d_ov.get();
  args.online_a = d_oa.get();
  args.target_v = d_tv.get();
  args.target_a = d_ta.get();
  args.actions = d_act.get();
  args.rewards = d_r.get();
  args.discounts = d_d.get();
  args.weights = d_w.get();
  args.options = options;
  args.state = d_state.get();
  args.dv = dv.get();
  args.da = da.get();
  args.ce = ce.get();
  args.item_loss = item_loss.get();
  args.clip_mass = clip.get();
  args.q_min = qmin.get();
  args.q_max = qmax.get();
  args.q_sum = qsum.get();
  args.q_bad = qbad.get();
  args.stage_rows = stage_rows;
  EXPECT_EQ(kernels::LaunchC51Loss(args, nullptr), cudaSuccess);
  EXPECT_EQ(d_state.Download()[0].t, t) << "the loss kernel only reads the step counter";
  return {dv.Download(),   da.Download(),   ce.Download(),   item_loss.Download(), clip.Download(),
          qmin.Download(), qmax.Download(), qsum.Download(), qbad.Download()};
}

// The same outputs in double from the CPU oracle's pieces (trainer/cpu/c51_loss.h):
// projection, label smoothing eps, CE weighted (1 - alpha), MSE weighted alpha.
LossOutputs<double> ReferenceLoss(const LossInputs& in, double eps, double alpha) {
  const NetworkSpec& spec = in.spec;
  const int B = in.B, Z = spec.num_atoms, NB = spec.num_branches(), AZ = spec.total_actions() * Z;
  const auto& ov = in.ov;
  const auto& oa = in.oa;
  LossOutputs<double> r;
  r.dv.assign(size_t(B) * Z, 0.0);
  r.da.assign(size_t(B) * AZ, 0.0);
  for (int b = 0; b < B; ++b) {
    double ce_sum = 0, mse_sum = 0, clip_sum = 0, qlo = 1e30, qhi = -1e30, qs = 0;
    const double scale =
        double(in.weights[b]) / *std::max_element(in.weights.begin(), in.weights.end()) / (B * NB);
    for (int br = 0; br < NB; ++br) {
      const int first = spec.branch_offset(br), n = spec.branch_actions[br];
      int best = 0;
      double best_q = -1e30;
      for (int a = 0; a < n; ++a) {
        const double q =
            Expectation(spec, Softmax(Logits(spec, &ov[size_t(B + b) * Z], &oa[size_t(B + b) * AZ], br, a)));
        if (q > best_q) best_q = q, best = a;
      }
      const auto pt = Softmax(Logits(spec, &in.tv[size_t(b) * Z], &in.ta[size_t(b) * AZ], br, best));
      std::vector<double> m(Z, 0.0);
      clip_sum += cpu::ProjectDistribution<double>(spec, pt.data(), in.rewards[b], in.discounts[b], m.data());
      for (int a = 0; a < n; ++a) {
        const double q =
            Expectation(spec, Softmax(Logits(spec, &ov[size_t(b) * Z], &oa[size_t(b) * AZ], br, a)));
        qlo = std::min(qlo, q), qhi = std::max(qhi, q), qs += q;
      }
      const int taken = in.actions[b * NB + br];
      const auto l = Logits(spec, &ov[size_t(b) * Z], &oa[size_t(b) * AZ], br, taken);
      std::vector<double> smoothed = m, dl(Z);
      if (eps > 0) cpu::SmoothDistribution<double>(smoothed.data(), Z, eps);
      ce_sum +=
          cpu::SoftmaxCrossEntropy<double>(l.data(), smoothed.data(), Z, (1 - alpha) * scale, dl.data());
      if (alpha > 0)
        mse_sum += cpu::ExpectedValueMse<double>(spec, l.data(), m.data(), alpha * scale, dl.data());
      for (int z = 0; z < Z; ++z) {
        r.dv[size_t(b) * Z + z] += dl[z];
        for (int a = 0; a < n; ++a)
          r.da[size_t(b) * AZ + size_t(first + a) * Z + z] = (a == taken ? dl[z] : 0.0) - dl[z] / n;
      }
    }
    r.ce.push_back(ce_sum / NB);
    r.item_loss.push_back((1 - alpha) * ce_sum / NB + alpha * mse_sum / NB);
    r.clip.push_back(clip_sum);
    r.qmin.push_back(qlo);
    r.qmax.push_back(qhi);
    r.qsum.push_back(qs);
  }
  return r;
}

void ExpectLossNear(const LossOutputs<float>& got, const LossOutputs<double>& want) {
  EXPECT_LE(RelError(got.dv, want.dv), kExactTol);
  EXPECT_LE(RelError(got.da, want.da), kExactTol);
  EXPECT_LE(RelError(got.ce, want.ce), kExactTol);
  EXPECT_LE(RelError(got.item_loss, want.item_loss), kExactTol);
  EXPECT_LE(RelError(got.clip, want.clip), kExactTol);
  EXPECT_LE(RelError(got.qmin, want.qmin), kExactTol);
  EXPECT_LE(RelError(got.qmax, want.qmax), kExactTol);
  EXPECT_LE(RelError(got.qsum, want.qsum), kExactTol);
  for (int32_t bad : got.qbad) EXPECT_EQ(bad, 0);
}

class C51LossTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(C51LossTest, MatchesCpuReference) {
  QS_SKIP_WITHOUT_GPU();
  const LossInputs in(GetParam(), 1234 + GetParam().size());
  const LossOutputs<float> got = RunLossKernel(in, kernels::LossOptions{}, 0);
  const LossOutputs<double> want = ReferenceLoss(in, 0.0, 0.0);
  ExpectLossNear(got, want);
  EXPECT_EQ(got.item_loss, got.ce) << "without options the item loss is the CE";
  // Rows staged in shared memory or read from global memory: bitwise the same.
  const LossOutputs<float> unstaged = RunLossKernel(in, kernels::LossOptions{}, 0, /*stage_rows=*/false);
  EXPECT_EQ(got.dv, unstaged.dv);
  EXPECT_EQ(got.da, unstaged.da);
  EXPECT_EQ(got.ce, unstaged.ce);
  EXPECT_EQ(got.clip, unstaged.clip);
  EXPECT_EQ(got.qsum, unstaged.qsum);
  double clipped = 0;
  for (double c : want.clip) clipped += c;
  EXPECT_GT(clipped, 0.0) << "inputs must exercise clipping";
}

// The last shape's rows (3 x 51 x 82 floats) exceed the staging limit, so
// the kernel reads them from global memory.
INSTANTIATE_TEST_SUITE_P(Shapes, C51LossTest,
                         ::testing::Values(std::vector<int>{2}, std::vector<int>{5, 5, 5, 5},
                                           std::vector<int>{3, 1, 7, 2, 4}, std::vector<int>{41, 40}));

// Label smoothing and the MSE blend at a step t of the schedule: the kernel
// reads t from the device state and matches the oracle with alpha computed
// here in double, start + (end - start) min(1, t / steps).
struct LossOptionsCase {
  const char* name;
  float eps;
  float start, end;
  int64_t steps;
  int64_t t;
};

void PrintTo(const LossOptionsCase& c, std::ostream* os) {
  *os << c.name << " {eps " << c.eps << ", blend " << c.start << " -> " << c.end << " over " << c.steps
      << ", t " << c.t << "}";
}

class C51LossKernelOptionsTest
    : public ::testing::TestWithParam<std::tuple<std::vector<int>, LossOptionsCase>> {};

TEST_P(C51LossKernelOptionsTest, MatchesCpuReference) {
  QS_SKIP_WITHOUT_GPU();
  const auto& [branches, c] = GetParam();
  const LossInputs in(branches, 99 + branches.size());
  kernels::LossOptions options;
  options.label_smoothing = c.eps;
  options.mse_blend_start = c.start;
  options.mse_blend_end = c.end;
  options.mse_blend_steps = c.steps;
  const double progress = c.steps == 0 ? 1.0 : std::min(1.0, double(c.t) / double(c.steps));
  const double alpha = c.start + (double(c.end) - c.start) * progress;
  const LossOutputs<float> got = RunLossKernel(in, options, c.t);
  ExpectLossNear(got, ReferenceLoss(in, c.eps, alpha));
  // The options change what they should: the CE (smoothing) and the item loss (blend).
  const LossOutputs<double> plain = ReferenceLoss(in, 0.0, 0.0);
  if (c.eps > 0) {
    EXPECT_GT(RelError(got.ce, plain.ce), 100 * kExactTol);
  }
  if (alpha > 0) {
    EXPECT_GT(RelError(got.item_loss, plain.item_loss), 100 * kExactTol);
  }
  if (alpha == 0 && c.eps == 0) {
    // Options configured but off at this step: bitwise the plain kernel.
    const LossOutputs<float> off = RunLossKernel(in, kernels::LossOptions{}, c.t);
    EXPECT_EQ(got.dv, off.dv);
    EXPECT_EQ(got.da, off.da);
    EXPECT_EQ(got.item_loss, off.item_loss);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedule, C51LossKernelOptionsTest,
    ::testing::Combine(::testing::Values(std::vector<int>{2}, std::vector<int>{3, 1, 7, 2, 4}),
                       ::testing::Values(LossOptionsCase{"smoothing", 0.1f, 0, 0, 0, 5},
                                         LossOptionsCase{"mse_only", 0, 1, 1, 0, 5},
                                         LossOptionsCase{"both_at_start", 0.1f, 1, 0, 10, 0},
                                         LossOptionsCase{"both_mid_schedule", 0.1f, 1, 0, 10, 3},
                                         LossOptionsCase{"rising", 0.05f, 0.2f, 0.9f, 1000, 777},
                                         LossOptionsCase{"blend_done", 0, 1, 0, 10, 25})),
    [](const auto& info) {
      return std::string(std::get<1>(info.param).name) + "_" +
             std::to_string(std::get<0>(info.param).size()) + "branches";
    });

TEST(QValuesKernel, MatchesCpuReference) {
  QS_SKIP_WITHOUT_GPU();
  const NetworkSpec spec = MakeSpec({4, 3});
  const int rows = 19, Z = spec.num_atoms, AZ = spec.total_actions() * Z, TA = spec.total_actions();
  std::mt19937_64 rng(77);
  const auto v = RandomUniform(rng, size_t(rows) * Z, -3, 3);
  const auto a = RandomUniform(rng, size_t(rows) * AZ, -3, 3);
  DeviceArray<float> dv(v), da(a), q(size_t(rows) * TA);
  q.Poison();
  QS_ASSERT_CUDA(kernels::LaunchQValues(MakeHead(spec), dv.get(), da.get(), rows, q.get(), nullptr));
  std::vector<double> ref(size_t(rows) * TA);
  for (int r = 0; r < rows; ++r) {
    for (int br = 0; br < spec.num_branches(); ++br) {
      for (int act = 0; act < spec.branch_actions[br]; ++act) {
        ref[r * TA + spec.branch_offset(br) + act] =
            Expectation(spec, Softmax(Logits(spec, &v[r * Z], &a[size_t(r) * AZ], br, act)));
      }
    }
  }
  EXPECT_LE(RelError(q.Download(), ref), kExactTol);
}

// Sequential double-precision prefix: the sum tree's answer up to rounding.
TEST(PrioritySample, MatchesSequentialPrefixSearch) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  const int64_t capacity = 5000, size = 3700;
  const int B = 256;
  auto prio = RandomUniform(rng, capacity, 0.01f, 3.0f);
  for (int64_t i = size; i < capacity; ++i) prio[i] = 0.0f;
  kernels::DeviceState state;
  state.t = 4321;
  state.replay_size = size;
  DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});
  DeviceArray<float> d_prio(prio);
  DeviceArray<uint64_t> sums(kernels::PrioritySumWords(capacity));
  DeviceArray<int32_t> idx(B);
  DeviceArray<float> w(B);
  idx.Poison();
  w.Poison();
  kernels::PrioritySampleArgs a;
  a.replay.priorities = d_prio.get();
  a.replay.capacity = capacity;
  a.sums = sums.get();
  a.fixed_shift = kernels::FixedPointShift(capacity);
  a.state = d_state.get();
  a.seed = 99;
  a.batch = B;
  a.beta_start = 0.4f;
  a.beta_end = 1.0f;
  a.beta_anneal_steps = 10000;
  a.indices = idx.get();
  a.weights = w.get();
  QS_ASSERT_CUDA(kernels::LaunchPrioritySample(a, nullptr));
  const auto got_idx = idx.Download();
  const auto got_w = w.Download();

  std::vector<double> prefix_ref(capacity);
  double total = 0;
  for (int64_t i = 0; i < capacity; ++i) prefix_ref[i] = total += prio[i];
  const double beta = 0.4 + 0.6 * std::min(1.0, 4321.0 / 10000.0);
  std::vector<double> ref_w(B);
  for (int b = 0; b < B; ++b) {
    const double u = (b + static_cast<double>(Uniform01(99, 4321, b))) / B * total;
    const int64_t j = std::upper_bound(prefix_ref.begin(), prefix_ref.end(), u) - prefix_ref.begin();
    const int64_t slot = std::min(j, size - 1);
    EXPECT_EQ(got_idx[b], slot) << "b=" << b;
    ref_w[b] = std::pow(size * prio[slot] / total, -beta);  // raw: the consumers normalise
  }
  EXPECT_LE(RelError(got_w, ref_w), kExactTol);
  // The stratified draw is spread over the filled slots only.
  for (int32_t i : got_idx) EXPECT_LT(i, size);
}

// The documented definition of LaunchPrioritySample (per_sample.h) on the
// host, in the same arithmetic: the fixed-point inclusive prefix, floor(u),
// first j with prefix_j > floor(u) (capacity when none), the clamp to size-1,
// and the raw w = (size p / total)^-beta. Every step but pow is an
// exactly rounded IEEE operation on both sides, and a double pow that is off
// by an ulp moves the float it rounds to with probability ~2^-28.
struct SampleReference {
  std::vector<int32_t> indices;
  std::vector<float> weights;
};

SampleReference ReferencePrioritySample(const std::vector<float>& prio, int64_t size, uint64_t seed,
                                        int64_t t, int batch, float beta_start, float beta_end,
                                        int64_t anneal_steps) {
  const int64_t capacity = static_cast<int64_t>(prio.size());
  const int shift = kernels::FixedPointShift(capacity);
  const float fixed_scale = std::ldexp(1.0f, shift);
  std::vector<uint64_t> prefix(capacity);
  uint64_t acc = 0;
  for (int64_t i = 0; i < capacity; ++i)
    prefix[i] = acc += static_cast<uint64_t>(std::rint(prio[i] * fixed_scale));
  const uint64_t total = prefix.back();
  const double total_real = static_cast<double>(total) / std::ldexp(1.0, shift);
  const float beta =
      anneal_steps == 0
          ? beta_end
          : std::fma(beta_end - beta_start,
                     std::min(1.0f, static_cast<float>(t) / static_cast<float>(anneal_steps)), beta_start);
  SampleReference ref;
  for (int b = 0; b < batch; ++b) {
    const float r = Uniform01(seed, static_cast<uint64_t>(t), static_cast<uint64_t>(b));
    const double u = (static_cast<double>(b) + r) / batch * static_cast<double>(total);
    const uint64_t u_int = static_cast<uint64_t>(std::floor(u));
    const int64_t j = std::upper_bound(prefix.begin(), prefix.end(), u_int) - prefix.begin();
    const int64_t idx = j < size ? j : size - 1;
    const double prob = static_cast<double>(prio[idx]) / total_real;
    const float w =
        static_cast<float>(std::pow(static_cast<double>(size) * prob, -static_cast<double>(beta)));
    ref.indices.push_back(static_cast<int32_t>(idx));
    ref.weights.push_back(w);
  }
  return ref;
}

struct SampleCase {
  const char* name;
  int64_t capacity;
  int64_t size;  // filled slots; the rest hold 0 unless `stale`
  int batch;
  bool stale;  // slots >= size keep nonzero priorities: the search lands there, the clamp brings it back
};

class PrioritySampleBitwiseTest : public ::testing::TestWithParam<SampleCase> {};

// The multi-block warp sampler against the host definition, bit for bit, on
// priorities over a wide range with isolated zeros, a run of zeros (flat
// prefix), priorities that round to 0 in fixed point, and a few near the
// fixed-point maximum (many samples, adjacent duplicates).
TEST_P(PrioritySampleBitwiseTest, MatchesFixedPointDefinitionBitwise) {
  QS_SKIP_WITHOUT_GPU();
  const SampleCase c = GetParam();
  std::mt19937_64 rng(1000 + c.capacity + c.batch + c.size);
  std::uniform_real_distribution<float> log_p(-8.0f, 3.0f);
  std::vector<float> prio(c.capacity);
  for (float& p : prio) p = std::exp(log_p(rng));
  for (int64_t i = 0; i < c.capacity; ++i) {
    if (rng() % 10 == 0) prio[i] = 0.0f;
  }
  const int64_t run = std::min<int64_t>(c.size / 8, 5000);  // zeros across 32-ary sub-range borders
  for (int64_t i = c.size / 3; i < c.size / 3 + run; ++i) prio[i] = 0.0f;
  for (int k = 0; k < 5; ++k) prio[rng() % c.size] = 4000.0f;
  prio[rng() % c.size] = std::ldexp(1.0f, -kernels::FixedPointShift(c.capacity) - 2);  // fixed point 0
  prio[0] = 0.0f;
  // The last filled slot: unwritten too, or (stale) where the clamp sends the
  // samples that land beyond it, so it must have a weight.
  prio[c.size - 1] = c.stale ? 1.0f : 0.0f;
  if (!c.stale) {
    for (int64_t i = c.size; i < c.capacity; ++i) prio[i] = 0.0f;
  }
  const int64_t t = 4321;
  const uint64_t seed = 0x5EEDull + c.capacity;
  kernels::DeviceState state;
  state.t = t;
  state.replay_size = c.size;
  DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});
  DeviceArray<float> d_prio(prio);
  DeviceArray<uint64_t> sums(kernels::PrioritySumWords(c.capacity));
  DeviceArray<int32_t> idx(c.batch);
  DeviceArray<float> w(c.batch);
  sums.Poison();
  idx.Poison();
  w.Poison();
  kernels::PrioritySampleArgs a;
  a.replay.priorities = d_prio.get();
  a.replay.capacity = c.capacity;
  a.sums = sums.get();
  a.fixed_shift = kernels::FixedPointShift(c.capacity);
  a.state = d_state.get();
  a.seed = seed;
  a.batch = c.batch;
  a.beta_start = 0.4f;
  a.beta_end = 1.0f;
  a.beta_anneal_steps = 10007;
  a.indices = idx.get();
  a.weights = w.get();
  QS_ASSERT_CUDA(kernels::LaunchPrioritySample(a, nullptr));
  const auto got_idx = idx.Download();
  const auto got_w = w.Download();
  const SampleReference ref = ReferencePrioritySample(prio, c.size, seed, t, c.batch, 0.4f, 1.0f, 10007);

  int clamped = 0;
  for (int b = 0; b < c.batch; ++b) {
    ASSERT_EQ(got_idx[b], ref.indices[b]) << c.name << " b=" << b;
    EXPECT_EQ(std::bit_cast<uint32_t>(got_w[b]), std::bit_cast<uint32_t>(ref.weights[b]))
        << c.name << " b=" << b << ": " << got_w[b] << " vs " << ref.weights[b];
    EXPECT_GE(got_idx[b], 0);
    EXPECT_LT(got_idx[b], c.size);
    if (b > 0) {
      EXPECT_LE(got_idx[b - 1], got_idx[b]) << "indices must be nondecreasing, b=" << b;
    }
    if (!c.stale) {
      EXPECT_GT(prio[got_idx[b]], 0.0f) << "an unwritten slot was sampled, b=" << b;
    }
    clamped += got_idx[b] == c.size - 1;
  }
  if (c.stale) {
    EXPECT_GT(clamped, 0) << "the case must exercise the clamp";
  }
  // The same step again: the same bits (no atomics, no run-to-run order).
  idx.Poison();
  w.Poison();
  QS_ASSERT_CUDA(kernels::LaunchPrioritySample(a, nullptr));
  EXPECT_EQ(idx.Download(), got_idx);
  const auto again_w = w.Download();
  for (int b = 0; b < c.batch; ++b) {
    EXPECT_EQ(std::bit_cast<uint32_t>(again_w[b]), std::bit_cast<uint32_t>(got_w[b])) << "b=" << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrioritySampleBitwiseTest,
                         ::testing::Values(SampleCase{"c1000_b32", 1000, 1000, 32, false},
                                           SampleCase{"c1000_b1024", 1000, 1000, 1024, false},
                                           SampleCase{"c1000_partial_b1024", 1000, 613, 1024, false},
                                           SampleCase{"c1000_stale_b1024", 1000, 613, 1024, true},
                                           SampleCase{"c65536_b32", 65536, 65536, 32, false},
                                           SampleCase{"c65536_b1024", 65536, 65536, 1024, false},
                                           SampleCase{"c65536_partial_b37", 65536, 40000, 37, false},
                                           SampleCase{"c1M_b32", 1 << 20, 1 << 20, 32, false},
                                           SampleCase{"c1M_b1024", 1 << 20, 1 << 20, 1024, false},
                                           SampleCase{"c1M_partial_b1024", 1 << 20, 777777, 1024, false},
                                           SampleCase{"c1M_stale_b4096", 1 << 20, 300001, 4096, true},
                                           // Chunks of 2048 slots (two splits per search), the last
                                           // one partial; and of 4096.
                                           SampleCase{"c3M_b1024", 3000000, 3000000, 1024, false},
                                           SampleCase{"c3M_stale_b256", 3000000, 2500001, 256, true},
                                           SampleCase{"c5M_partial_b512", 5000000, 4999999, 512, false}),
                         [](const auto& info) { return std::string(info.param.name); });

// The gather in the sampler's launch: every sampled row's columns, copied.
TEST(PrioritySample, GathersSampledRows) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8);
  const int64_t capacity = 3000;
  const int D = 37, NB = 3, B = 50;
  const auto obs = RandomUniform(rng, capacity * D, -1, 1), next = RandomUniform(rng, capacity * D, -1, 1);
  const auto rew = RandomUniform(rng, capacity, -1, 1), disc = RandomUniform(rng, capacity, 0, 1);
  const auto prio = RandomUniform(rng, capacity, 0.01f, 2.0f);
  std::vector<int32_t> act(capacity * NB);
  for (auto& x : act) x = int32_t(rng() % 5);
  kernels::DeviceState state;
  state.t = 12;
  state.replay_size = 2400;
  DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});
  DeviceArray<float> d_obs(obs), d_next(next), d_rew(rew), d_disc(disc), d_prio(prio);
  DeviceArray<int32_t> d_act(act);
  DeviceArray<uint64_t> sums(kernels::PrioritySumWords(capacity));
  DeviceArray<float> o(size_t(B) * D), n(size_t(B) * D), r(B), d(B), w(B);
  DeviceArray<int32_t> a(size_t(B) * NB), d_idx(B);
  for (auto* x : {&o, &n, &r, &d, &w}) x->Poison();
  a.Poison();
  d_idx.Poison();
  kernels::PrioritySampleArgs g;
  g.replay.obs = d_obs.get();
  g.replay.next_obs = d_next.get();
  g.replay.actions = d_act.get();
  g.replay.rewards = d_rew.get();
  g.replay.discounts = d_disc.get();
  g.replay.priorities = d_prio.get();
  g.replay.capacity = capacity;
  g.replay.obs_dim = D;
  g.replay.num_branches = NB;
  g.sums = sums.get();
  g.fixed_shift = kernels::FixedPointShift(capacity);
  g.state = d_state.get();
  g.seed = 17;
  g.batch = B;
  g.beta_start = 0.5f;
  g.beta_end = 1.0f;
  g.indices = d_idx.get();
  g.weights = w.get();
  g.obs = o.get();
  g.next_obs = n.get();
  g.actions = a.get();
  g.rewards = r.get();
  g.discounts = d.get();
  QS_ASSERT_CUDA(kernels::LaunchPrioritySample(g, nullptr));
  const auto idx = d_idx.Download();
  const SampleReference ref = ReferencePrioritySample(prio, 2400, 17, 12, B, 0.5f, 1.0f, 0);
  EXPECT_EQ(idx, ref.indices);
  const auto go = o.Download(), gn = n.Download(), gr = r.Download(), gd = d.Download();
  const auto ga = a.Download();
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < D; ++i) {
      ASSERT_EQ(go[b * D + i], obs[idx[b] * D + i]);
      ASSERT_EQ(gn[b * D + i], next[idx[b] * D + i]);
    }
    for (int i = 0; i < NB; ++i) ASSERT_EQ(ga[b * NB + i], act[idx[b] * NB + i]);
    ASSERT_EQ(gr[b], rew[idx[b]]);
    ASSERT_EQ(gd[b], disc[idx[b]]);
  }
}

TEST(BiasActivation, ForwardAndBackward) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  const int rows = 333, cols = 70;
  const auto y = RandomUniform(rng, size_t(rows) * cols, -1, 1);
  const auto bias = RandomUniform(rng, cols, -0.5f, 0.5f);
  DeviceArray<float> d_y(y), d_b(bias);
  QS_ASSERT_CUDA(kernels::LaunchBiasActivation({d_y.get(), rows, cols}, d_b.get(), true, nullptr));
  const auto act = d_y.Download();
  std::vector<double> ref(y.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) ref[r * cols + c] = std::max(0.0, double(y[r * cols + c]) + bias[c]);
  EXPECT_LE(RelError(act, ref), kExactTol);

  const auto dy = RandomUniform(rng, size_t(rows) * cols, -1, 1);
  DeviceArray<float> d_dy(dy), db(cols);
  db.Poison();
  QS_ASSERT_CUDA(kernels::LaunchActivationBackwardBiasGrad({d_dy.get(), rows, cols}, d_y.get(), db.get(), nullptr));
  std::vector<double> ref_dy(dy.size()), ref_db(cols, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      ref_dy[r * cols + c] = act[r * cols + c] > 0 ? dy[r * cols + c] : 0.0;
      ref_db[c] += ref_dy[r * cols + c];
    }
  }
  EXPECT_LE(RelError(d_dy.Download(), ref_dy), kExactTol);
  EXPECT_LE(RelError(db.Download(), ref_db), kExactTol);
}

class GemmTest : public ::testing::TestWithParam<bool> {};

// Two layers x0 -> relu(x0 W0^T + b0) = h -> h W1^T + b1 = y and their
// backward, through the fused cuBLASLt epilogues (RELU_AUX_BIAS, BIAS,
// BGRADB, DRELU_BGRAD with the forward's mask), against double loops.
TEST_P(GemmTest, FusedLinearLayersMatchDouble) {
  QS_SKIP_WITHOUT_GPU();
  const bool tf32 = GetParam();
  const double tol = tf32 ? kTf32Tol : kExactTol;
  std::mt19937_64 rng(tf32 ? 10 : 11);
  const int rows = 129, in0 = 20, mid = 48, out = 77;
  const auto x0 = RandomUniform(rng, size_t(rows) * in0, -1, 1);
  const auto w0 = RandomUniform(rng, size_t(mid) * in0, -1, 1), b0 = RandomUniform(rng, mid, -0.5f, 0.5f);
  const auto w1 = RandomUniform(rng, size_t(out) * mid, -1, 1), b1 = RandomUniform(rng, out, -0.5f, 0.5f);
  const auto dy = RandomUniform(rng, size_t(rows) * out, -1, 1);
  // Forward reference in double.
  std::vector<double> h(size_t(rows) * mid), y(size_t(rows) * out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < mid; ++o) {
      double acc = b0[o];
      for (int i = 0; i < in0; ++i) acc += double(x0[r * in0 + i]) * w0[o * in0 + i];
      h[r * mid + o] = std::max(acc, 0.0);
    }
    for (int o = 0; o < out; ++o) {
      double acc = b1[o];
      for (int i = 0; i < mid; ++i) acc += h[r * mid + i] * w1[o * mid + i];
      y[r * out + o] = acc;
    }
  }
  // Backward reference in double from the device's own forward output: with
  // TF32 a pre-activation within rounding of 0 may land on the other side of
  // the ReLU, which would flip a mask bit and is not a backward error.
  auto backward_reference = [&](const std::vector<float>& hd, std::vector<double>* dh, std::vector<double>* db0,
                                std::vector<double>* dw0, std::vector<double>* dw1, std::vector<double>* db1) {
    dh->assign(size_t(rows) * mid, 0.0);
    db0->assign(mid, 0.0);
    dw0->assign(size_t(mid) * in0, 0.0);
    dw1->assign(size_t(out) * mid, 0.0);
    db1->assign(out, 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < out; ++o) {
        (*db1)[o] += dy[r * out + o];
        for (int i = 0; i < mid; ++i) {
          (*dw1)[o * mid + i] += double(dy[r * out + o]) * hd[r * mid + i];
          (*dh)[r * mid + i] += double(dy[r * out + o]) * w1[o * mid + i];
        }
      }
      for (int i = 0; i < mid; ++i) {
        if (hd[r * mid + i] <= 0.0f) (*dh)[r * mid + i] = 0;
        (*db0)[i] += (*dh)[r * mid + i];
        for (int j = 0; j < in0; ++j) (*dw0)[i * in0 + j] += (*dh)[r * mid + i] * x0[r * in0 + j];
      }
    }
  };
  cudaStream_t stream = nullptr;
  QS_ASSERT_CUDA(cudaStreamCreate(&stream));
  {
    cuda::Gemm gemm;
    ASSERT_TRUE(gemm.Init(stream, tf32 ? kernels::Precision::kTf32 : kernels::Precision::kFp32).ok());
    DeviceArray<float> d_x0(x0), d_w0(w0), d_b0(b0), d_w1(w1), d_b1(b1), d_dy(dy);
    DeviceArray<float> d_h(size_t(rows) * mid), d_y(size_t(rows) * out), d_dh(size_t(rows) * mid), d_db0(mid),
        d_dw0(size_t(mid) * in0), d_dw1(size_t(out) * mid), d_db1(out);
    DeviceArray<char> mask(cuda::ReluMask::Bytes(mid, rows));
    for (auto* a : {&d_h, &d_y, &d_dh, &d_db0, &d_dw0, &d_dw1, &d_db1}) a->Poison();
    const cuda::ReluMask m{mask.get(), cuda::ReluMask::LeadingDim(mid)};
    const absl::Status fwd = gemm.Forward(d_x0.get(), d_w0.get(), d_b0.get(), rows, in0, mid, true, m, d_h.get());
    if (absl::IsUnimplemented(fwd)) GTEST_SKIP() << "no fused epilogue here (backend falls back): " << fwd;
    ASSERT_TRUE(fwd.ok()) << fwd;
    ASSERT_TRUE(gemm.Forward(d_h.get(), d_w1.get(), d_b1.get(), rows, mid, out, false, {}, d_y.get()).ok());
    ASSERT_TRUE(gemm.BackwardWeight(d_dy.get(), d_h.get(), rows, mid, out, d_db1.get(), d_dw1.get()).ok());
    ASSERT_TRUE(gemm.BackwardData(d_dy.get(), d_w1.get(), rows, mid, out, 0.0f, m, d_db0.get(), d_dh.get()).ok());
    ASSERT_TRUE(gemm.BackwardWeight(d_dh.get(), d_x0.get(), rows, in0, mid, nullptr, d_dw0.get()).ok());
    const std::vector<float> h_dev = d_h.Download();
    std::vector<double> dh, db0, dw0, dw1, db1;
    backward_reference(h_dev, &dh, &db0, &dw0, &dw1, &db1);
    EXPECT_LE(RelError(h_dev, h), tol);
    EXPECT_LE(RelError(d_y.Download(), y), tol);
    EXPECT_LE(RelError(d_dw1.Download(), dw1), tol);
    EXPECT_LE(RelError(d_db1.Download(), db1), tol);
    EXPECT_LE(RelError(d_dh.Download(), dh), tol);
    EXPECT_LE(RelError(d_db0.Download(), db0), tol);
    EXPECT_LE(RelError(d_dw0.Download(), dw0), tol);
  }
  cudaStreamDestroy(stream);
}

// The unfused path: plain GEMMs (beta accumulation included).
TEST_P(GemmTest, PlainGemmsMatchDouble) {
  QS_SKIP_WITHOUT_GPU();
  const bool tf32 = GetParam();
  const double tol = tf32 ? kTf32Tol : kExactTol;
  std::mt19937_64 rng(tf32 ? 20 : 21);
  const int rows = 129, in = 48, out = 77;
  const auto x = RandomUniform(rng, size_t(rows) * in, -1, 1);
  const auto w = RandomUniform(rng, size_t(out) * in, -1, 1);
  const auto dy = RandomUniform(rng, size_t(rows) * out, -1, 1);
  const auto dx0 = RandomUniform(rng, size_t(rows) * in, -1, 1);
  cudaStream_t stream = nullptr;
  QS_ASSERT_CUDA(cudaStreamCreate(&stream));
  {
    cuda::Gemm gemm;
    ASSERT_TRUE(gemm.Init(stream, tf32 ? kernels::Precision::kTf32 : kernels::Precision::kFp32).ok());
    DeviceArray<float> d_x(x), d_w(w), d_dy(dy), d_dx(dx0), y(size_t(rows) * out), dw(size_t(out) * in);
    y.Poison();
    dw.Poison();
    ASSERT_TRUE(gemm.Forward(d_x.get(), d_w.get(), nullptr, rows, in, out, false, {}, y.get()).ok());
    ASSERT_TRUE(gemm.BackwardData(d_dy.get(), d_w.get(), rows, in, out, 1.0f, {}, nullptr, d_dx.get()).ok());
    ASSERT_TRUE(gemm.BackwardWeight(d_dy.get(), d_x.get(), rows, in, out, nullptr, dw.get()).ok());
    std::vector<double> ry(size_t(rows) * out, 0), rdx(dx0.begin(), dx0.end()), rdw(size_t(out) * in, 0);
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o)
        for (int i = 0; i < in; ++i) {
          ry[r * out + o] += double(x[r * in + i]) * w[o * in + i];
          rdx[r * in + i] += double(dy[r * out + o]) * w[o * in + i];
          rdw[o * in + i] += double(dy[r * out + o]) * x[r * in + i];
        }
    EXPECT_LE(RelError(y.Download(), ry), tol);
    EXPECT_LE(RelError(d_dx.Download(), rdx), tol);
    EXPECT_LE(RelError(dw.Download(), rdw), tol);
  }
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Modes, GemmTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Tf32" : "ExactFp32"; });

struct FinalizeCase {
  const char* name;
  int poison;  // 0 none, 1 NaN CE, 2 inf grad, 3 huge grad, 4 Q out of range
  GuardReason expect;
};

class FinalizeTest : public ::testing::TestWithParam<FinalizeCase> {};

TEST_P(FinalizeTest, NormStatsAndGuard) {
  QS_SKIP_WITHOUT_GPU();
  const FinalizeCase c = GetParam();
  std::mt19937_64 rng(12 + c.poison);
  const int B = 300, NB = 3, TA = 9;
  const int64_t n = 100003;
  auto g = RandomUniform(rng, n, -0.1f, 0.1f);
  auto ce = RandomUniform(rng, B, 0.1f, 4.0f);
  // Raw IS weights (the sampler's): the finalize divides by their max.
  const auto w = RandomUniform(rng, B, 0.1f, 5.0f), clip = RandomUniform(rng, B, 0.0f, 0.5f);
  auto qmin = RandomUniform(rng, B, -5, -1), qmax = RandomUniform(rng, B, 1, 5);
  const auto qsum = RandomUniform(rng, B, -9, 9);
  // The loss kernel's L_b (the MSE blend) differs from its CE_b: the loss
  // reduces L_b, the priorities take CE_b.
  auto item_loss = RandomUniform(rng, B, 0.0f, 0.5f);
  for (int b = 0; b < B; ++b) item_loss[b] += 0.3f * ce[b];
  if (c.poison == 1) item_loss[17] = ce[17] = std::numeric_limits<float>::quiet_NaN();
  if (c.poison == 2) g[5000] = std::numeric_limits<float>::infinity();
  if (c.poison == 3) g[n - 1] = 5000.0f;
  if (c.poison == 4) qmax[3] = 11.0f;
  DeviceArray<float> d_g(g), d_ce(ce), d_item_loss(item_loss), d_w(w), d_clip(clip), d_qmin(qmin),
      d_qmax(qmax), d_qsum(qsum);
  DeviceArray<int32_t> d_bad(std::vector<int32_t>(B, 0));
  const int64_t capacity = 100;  // fewer slots than samples: duplicate indices
  const auto prio = RandomUniform(rng, capacity, 0.1f, 1.0f);
  std::vector<int32_t> idx(B);
  for (auto& i : idx) i = int32_t(rng() % capacity);
  DeviceArray<float> d_prio(prio);
  DeviceArray<int32_t> d_idx(idx);
  DeviceArray<float> partials(kernels::kNormBlocks);
  partials.Poison();
  kernels::DeviceState init;
  init.t = 41;
  init.adam_updates = 6;
  DeviceArray<kernels::DeviceState> state(std::vector<kernels::DeviceState>{init});
  QS_ASSERT_CUDA(kernels::LaunchGradSumSquares(d_g.get(), n, partials.get(), nullptr));
  kernels::FinalizeArgs a;
  a.norm_partials = partials.get();
  a.ce = d_ce.get();
  a.item_loss = d_item_loss.get();
  a.weights = d_w.get();
  a.clip_mass = d_clip.get();
  a.q_min = d_qmin.get();
  a.q_max = d_qmax.get();
  a.q_sum = d_qsum.get();
  a.q_bad = d_bad.get();
  a.batch = B;
  a.num_branches = NB;
  a.total_actions = TA;
  a.max_grad_norm = 1000.0f;
  a.q_bound = 10.001f;
  a.clip_grad_norm = 10.0f;
  a.beta1 = 0.9f;
  a.beta2 = 0.999f;
  a.priorities = d_prio.get();
  a.indices = d_idx.get();
  a.priority_epsilon = 1e-6f;
  a.alpha = 0.6f;
  a.state = state.get();
  QS_ASSERT_CUDA(kernels::LaunchFinalize(a, nullptr));
  const kernels::DeviceState s = state.Download()[0];

  const double norm = cpu::GlobalNorm(g.data(), n);
  double loss = 0, clip_sum = 0, qs = 0, lo = 1e30, hi = -1e30;
  for (int b = 0; b < B; ++b) {
    loss += double(w[b]) / *std::max_element(w.begin(), w.end()) * item_loss[b];
    clip_sum += clip[b];
    qs += qsum[b];
    lo = std::min<double>(lo, qmin[b]);
    hi = std::max<double>(hi, qmax[b]);
  }
  loss /= B;
  EXPECT_EQ(s.stats.guard, static_cast<int32_t>(c.expect)) << c.name;
  EXPECT_EQ(s.stats.step, 42);
  EXPECT_EQ(s.t, 42);  // advanced in every case
  // Priority write-back in b order (a later b wins a duplicate slot), skipped on a trip.
  auto ref_prio = prio;
  float max_p = 1.0f;
  if (c.poison == 0) {
    for (int b = 0; b < B; ++b) {
      const float p = std::pow(ce[b] + 1e-6f, 0.6f);
      ref_prio[idx[b]] = p;
      max_p = std::max(max_p, p);
    }
  }
  EXPECT_LE(RelError(d_prio.Download(), ref_prio), kExactTol);
  EXPECT_NEAR(s.max_priority, max_p, max_p * kExactTol);
  if (c.poison == 0) {
    EXPECT_NEAR(s.stats.grad_norm, norm, norm * kExactTol);
    EXPECT_NEAR(s.stats.loss, loss, loss * kExactTol);
    EXPECT_NEAR(s.stats.target_clip_fraction, clip_sum / (B * NB), kExactTol);
    EXPECT_NEAR(s.stats.q_mean, qs / (B * TA), 1e-5);
    EXPECT_EQ(s.stats.q_min, static_cast<float>(lo));
    EXPECT_EQ(s.stats.q_max, static_cast<float>(hi));
    EXPECT_EQ(s.apply, 1);
    EXPECT_EQ(s.adam_updates, 7);
    EXPECT_NEAR(s.clip_scale, cpu::ClipScale(static_cast<float>(norm), 10.0f), 1e-6);
    EXPECT_NEAR(s.bias_correction1, 1.0 - std::pow(0.9, 7), 1e-7);
    EXPECT_NEAR(s.bias_correction2, 1.0 - std::pow(0.999, 7), 1e-7);
    for (int64_t t : s.guard_trips) EXPECT_EQ(t, 0);
  } else {
    EXPECT_EQ(s.apply, 0);
    EXPECT_EQ(s.adam_updates, 6);
    EXPECT_EQ(s.guard_trips[static_cast<int>(c.expect)], 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Guard, FinalizeTest,
                         ::testing::Values(FinalizeCase{"clean", 0, GuardReason::kNone},
                                           FinalizeCase{"nan_loss", 1, GuardReason::kNonFiniteLoss},
                                           FinalizeCase{"inf_grad", 2, GuardReason::kNonFiniteGrad},
                                           FinalizeCase{"grad_norm", 3, GuardReason::kGradNorm},
                                           FinalizeCase{"q_range", 4, GuardReason::kQRange}));

// Runs LaunchFinalize on clean inputs (the guard passes) with the given
// indices and CE, over `prio`; returns the priorities after the write-back.
std::vector<float> RunPriorityWriteBack(const std::vector<int32_t>& idx, const std::vector<float>& ce,
                                        const std::vector<float>& prio, float* max_priority) {
  const int B = static_cast<int>(idx.size());
  std::mt19937_64 rng(31 + B);
  const int64_t n = 4099;
  const auto g = RandomUniform(rng, n, -0.01f, 0.01f);
  const auto w = RandomUniform(rng, B, 0.1f, 1.0f), clip = RandomUniform(rng, B, 0.0f, 0.5f);
  const auto qmin = RandomUniform(rng, B, -5, -1), qmax = RandomUniform(rng, B, 1, 5);
  const auto qsum = RandomUniform(rng, B, -9, 9);
  DeviceArray<float> d_g(g), d_ce(ce), d_w(w), d_clip(clip), d_qmin(qmin), d_qmax(qmax), d_qsum(qsum);
  DeviceArray<int32_t> d_bad(std::vector<int32_t>(B, 0));
  DeviceArray<float> d_prio(prio);
  DeviceArray<int32_t> d_idx(idx);
  DeviceArray<float> partials(kernels::kNormBlocks);
  partials.Poison();
  kernels::DeviceState init;
  init.t = 7;
  DeviceArray<kernels::DeviceState> state(std::vector<kernels::DeviceState>{init});
  EXPECT_EQ(kernels::LaunchGradSumSquares(d_g.get(), n, partials.get(), nullptr), cudaSuccess);
  kernels::FinalizeArgs a;
  a.norm_partials = partials.get();
  a.ce = d_ce.get();
  a.weights = d_w.get();
  a.clip_mass = d_clip.get();
  a.q_min = d_qmin.get();
  a.q_max = d_qmax.get();
  a.q_sum = d_qsum.get();
  a.q_bad = d_bad.get();
  a.batch = B;
  a.num_branches = 2;
  a.total_actions = 6;
  a.max_grad_norm = 1000.0f;
  a.q_bound = 10.0f;
  a.clip_grad_norm = 10.0f;
  a.beta1 = 0.9f;
  a.beta2 = 0.999f;
  a.priorities = d_prio.get();
  a.indices = d_idx.get();
  a.priority_epsilon = 1e-6f;
  a.alpha = 0.6f;
  a.state = state.get();
  EXPECT_EQ(kernels::LaunchFinalize(a, nullptr), cudaSuccess);
  const kernels::DeviceState s = state.Download()[0];
  EXPECT_EQ(s.apply, 1) << "the write-back tests need the guard to pass";
  EXPECT_EQ(s.t, 8);
  *max_priority = s.max_priority;
  return d_prio.Download();
}

// CE values whose priorities (CE + eps)^0.6 differ by >= ~0.02% between any
// two samples, far above the powf tolerance, so a slot's value names its writer.
std::vector<float> DistinctCe(std::mt19937_64& rng, int B) {
  std::vector<int> perm(B);
  for (int b = 0; b < B; ++b) perm[b] = b;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<float> ce(B);
  for (int b = 0; b < B; ++b) ce[b] = 0.5f + 0.01f * static_cast<float>(perm[b]);
  return ce;
}

// Host reference of the write-back (b in order, so the largest b wins a
// slot), then every slot checked: a written slot holds its largest b's
// priority (to powf rounding, far below the gap to any other b's), any other
// slot its old value bit for bit.
void ExpectLargestBWins(const std::vector<int32_t>& idx, const std::vector<float>& ce,
                        const std::vector<float>& prio, const char* what) {
  float max_priority = 0.0f;
  const auto got = RunPriorityWriteBack(idx, ce, prio, &max_priority);
  std::vector<int> owner(prio.size(), -1);
  double max_p = 1.0;  // the initial max_priority
  for (size_t b = 0; b < idx.size(); ++b) {
    owner[idx[b]] = static_cast<int>(b);
    max_p = std::max(max_p, std::pow(static_cast<double>(ce[b] + 1e-6f), 0.6));
  }
  std::vector<double> ref(prio.begin(), prio.end());
  for (size_t s = 0; s < prio.size(); ++s) {
    if (owner[s] < 0) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[s]), std::bit_cast<uint32_t>(prio[s])) << what << ": slot " << s;
      continue;
    }
    ref[s] = std::pow(static_cast<double>(ce[owner[s]] + 1e-6f), 0.6);
    EXPECT_NEAR(got[s], ref[s], ref[s] * 2e-6) << what << ": slot " << s << " owner b=" << owner[s];
  }
  EXPECT_LE(RelError(got, ref), kExactTol) << what;
  EXPECT_NEAR(max_priority, max_p, max_p * 2e-6) << what;
}

// Sorted indices (the sampler's), in runs of duplicates: runs of 1..12, one
// of 300 that spans the block's 1024-thread stride, the first and last slot,
// and B > 1024 so owners and their right neighbours sit in different passes.
// One staged chunk into the ring: every column lands at the cursor (wrapping
// past the end), the new slots get max_priority, the other slots keep their
// words bit for bit, and size/cursor are what the launcher said. Staging rows
// past `count` hold NaN bytes and must not reach the ring.
TEST(ReplayCommit, MovesAStagedChunkIntoTheRing) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(std::random_device{}());
  struct Case {
    int64_t capacity, first_slot, count, stride;
    int obs_dim, branches;
  };
  const int64_t cap = 700 + static_cast<int64_t>(rng() % 300);
  const std::vector<Case> cases = {
      {cap, cap - 37, 100, 128, 48, 4},  // wraps
      {cap, 0, cap, cap, 5, 1},          // the whole ring, full staging
      {cap, 123, 1, 64, 48, 4},          // one row
      {cap, cap - 1, 2, 3, 7, 3},        // wraps after one row
      {cap, 200, 300, 512, 1, 2},        // no wrap
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message() << "capacity " << k.capacity << " first " << k.first_slot << " count "
                                      << k.count << " obs_dim " << k.obs_dim << " branches " << k.branches);
    const int d = k.obs_dim, nb = k.branches;
    const size_t c = static_cast<size_t>(k.capacity), r = static_cast<size_t>(k.stride);
    auto ring_obs = RandomUniform(rng, c * d, -1, 1), ring_next = RandomUniform(rng, c * d, -1, 1);
    auto ring_rew = RandomUniform(rng, c, -1, 1), ring_disc = RandomUniform(rng, c, 0, 1);
    auto ring_prio = RandomUniform(rng, c, 0.1f, 1);
    std::vector<int32_t> ring_act(c * nb);
    for (int32_t& a : ring_act) a = static_cast<int32_t>(rng() % 1000);
    // Staging: five regions of `stride` rows; rows past count are NaN bytes.
    std::vector<float> staged(r * (2 * d + nb + 2));
    std::memset(staged.data(), 0xFF, staged.size() * sizeof(float));
    const size_t o_next = r * d, o_act = 2 * r * d, o_rew = o_act + r * nb, o_disc = o_rew + r;
    auto s_obs = RandomUniform(rng, k.count * d, -5, 5), s_next = RandomUniform(rng, k.count * d, -5, 5);
    auto s_rew = RandomUniform(rng, k.count, -5, 5), s_disc = RandomUniform(rng, k.count, 0, 1);
    std::vector<int32_t> s_act(k.count * nb);
    for (int32_t& a : s_act) a = static_cast<int32_t>(rng() % 1000);
    std::copy(s_obs.begin(), s_obs.end(), staged.begin());
    std::copy(s_next.begin(), s_next.end(), staged.begin() + o_next);
    std::memcpy(staged.data() + o_act, s_act.data(), s_act.size() * sizeof(int32_t));
    std::copy(s_rew.begin(), s_rew.end(), staged.begin() + o_rew);
    std::copy(s_disc.begin(), s_disc.end(), staged.begin() + o_disc);

    DeviceArray<float> d_staged(staged), d_obs(ring_obs), d_next(ring_next), d_rew(ring_rew),
        d_disc(ring_disc), d_prio(ring_prio);
    DeviceArray<int32_t> d_act(ring_act);
    kernels::DeviceState state;
    state.max_priority = 0.25f + static_cast<float>(rng() % 100) / 64.0f;
    state.replay_size = 5;
    DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});

    kernels::ReplayCommitArgs a;
    a.staged.obs = d_staged.get();
    a.staged.next_obs = d_staged.get() + o_next;
    a.staged.actions = reinterpret_cast<const int32_t*>(d_staged.get() + o_act);
    a.staged.rewards = d_staged.get() + o_rew;
    a.staged.discounts = d_staged.get() + o_disc;
    a.ring = {d_obs.get(),  d_next.get(), d_act.get(), d_rew.get(), d_disc.get(),
              d_prio.get(), k.capacity,   d,           nb};
    a.first_slot = k.first_slot;
    a.count = k.count;
    a.new_size = std::min(k.capacity, 5 + k.count);
    a.new_cursor = (k.first_slot + k.count) % k.capacity;
    a.state = d_state.get();
    QS_ASSERT_CUDA(kernels::LaunchReplayCommit(a, nullptr));

    // The reference: the same rows written slot by slot on the host.
    for (int64_t i = 0; i < k.count; ++i) {
      const size_t slot = static_cast<size_t>((k.first_slot + i) % k.capacity);
      std::copy_n(s_obs.begin() + i * d, d, ring_obs.begin() + slot * d);
      std::copy_n(s_next.begin() + i * d, d, ring_next.begin() + slot * d);
      std::copy_n(s_act.begin() + i * nb, nb, ring_act.begin() + slot * nb);
      ring_rew[slot] = s_rew[i];
      ring_disc[slot] = s_disc[i];
      ring_prio[slot] = state.max_priority;
    }
    auto bits = [](const std::vector<float>& v) {
      std::vector<uint32_t> b(v.size());
      std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
      return b;
    };
    EXPECT_EQ(bits(d_obs.Download()), bits(ring_obs));
    EXPECT_EQ(bits(d_next.Download()), bits(ring_next));
    EXPECT_EQ(d_act.Download(), ring_act);
    EXPECT_EQ(bits(d_rew.Download()), bits(ring_rew));
    EXPECT_EQ(bits(d_disc.Download()), bits(ring_disc));
    EXPECT_EQ(bits(d_prio.Download()), bits(ring_prio));
    const kernels::DeviceState after = d_state.Download()[0];
    EXPECT_EQ(after.replay_size, a.new_size);
    EXPECT_EQ(after.replay_cursor, a.new_cursor);
    EXPECT_EQ(after.max_priority, state.max_priority);
  }
}

TEST(PriorityWriteBack, SortedRunsLargestBWins) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(41);
  const int64_t capacity = 20000;
  std::vector<int32_t> idx;
  int32_t slot = 0;
  while (idx.size() < 2500) {
    const int len = idx.size() == 1000 ? 300 : 1 + static_cast<int>(rng() % 12);
    for (int k = 0; k < len; ++k) idx.push_back(slot);
    slot += 1 + static_cast<int32_t>(rng() % 7);
  }
  idx.resize(2500);
  idx.back() = static_cast<int32_t>(capacity - 1);
  idx[idx.size() - 2] = static_cast<int32_t>(capacity - 1);
  ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  const int B = static_cast<int>(idx.size());
  const auto prio = RandomUniform(rng, capacity, 0.1f, 1.0f);
  ExpectLargestBWins(idx, DistinctCe(rng, B), prio, "sorted runs");
  // Every sample in one slot, and all distinct.
  ExpectLargestBWins(std::vector<int32_t>(B, 5), DistinctCe(rng, B), prio, "one slot");
  std::vector<int32_t> distinct(B);
  for (int b = 0; b < B; ++b) distinct[b] = 3 * b;
  ExpectLargestBWins(distinct, DistinctCe(rng, B), prio, "distinct");
}

// The sampler's own output (capacity 1000, B 1024: many duplicates) through the
// write-back.
TEST(PriorityWriteBack, SampledIndicesLargestBWins) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(43);
  const int64_t capacity = 1000;
  const int B = 1024;
  auto prio = RandomUniform(rng, capacity, 0.01f, 1.0f);
  for (int k = 0; k < 4; ++k) prio[rng() % capacity] = 50.0f;
  kernels::DeviceState state;
  state.t = 99;
  state.replay_size = capacity;
  DeviceArray<kernels::DeviceState> d_state(std::vector<kernels::DeviceState>{state});
  DeviceArray<float> d_prio(prio);
  DeviceArray<uint64_t> sums(kernels::PrioritySumWords(capacity));
  DeviceArray<int32_t> d_idx(B);
  DeviceArray<float> d_w(B);
  kernels::PrioritySampleArgs a;
  a.replay.priorities = d_prio.get();
  a.replay.capacity = capacity;
  a.sums = sums.get();
  a.fixed_shift = kernels::FixedPointShift(capacity);
  a.state = d_state.get();
  a.seed = 3;
  a.batch = B;
  a.beta_start = 0.4f;
  a.beta_end = 1.0f;
  a.indices = d_idx.get();
  a.weights = d_w.get();
  QS_ASSERT_CUDA(kernels::LaunchPrioritySample(a, nullptr));
  const auto idx = d_idx.Download();
  ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  std::vector<int32_t> unique_idx = idx;
  unique_idx.erase(std::unique(unique_idx.begin(), unique_idx.end()), unique_idx.end());
  ASSERT_LT(unique_idx.size(), idx.size()) << "the case must sample duplicates";
  ExpectLargestBWins(idx, DistinctCe(rng, B), prio, "sampled");
}

// Unsorted indices (never produced by the sampler): the block-wide check sends
// the write-back to the full scan, and the largest b still wins, including
// duplicates that are not adjacent and a single inversion at the very end.
TEST(PriorityWriteBack, UnsortedFallbackLargestBWins) {
  QS_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(47);
  const int64_t capacity = 3000;
  const auto prio = RandomUniform(rng, capacity, 0.1f, 1.0f);
  // 5 5 3 5 ...: the adjacent rule alone would let b=1 write slot 5 as well.
  std::vector<int32_t> gaps = {5, 5, 3, 5, 7, 7, 3, 9};
  ExpectLargestBWins(gaps, DistinctCe(rng, static_cast<int>(gaps.size())), prio, "non-adjacent duplicates");
  // Sorted runs over 2 strides of the block, then one inversion in the last pair.
  std::vector<int32_t> tail;
  for (int b = 0; b < 2100; ++b) tail.push_back(static_cast<int32_t>(b / 4));
  tail.back() = 0;  // slot 0's writers: b = 0..3 and the last b
  ExpectLargestBWins(tail, DistinctCe(rng, static_cast<int>(tail.size())), prio, "last-pair inversion");
  // Random with duplicates.
  std::vector<int32_t> random(1500);
  for (auto& i : random) i = static_cast<int32_t>(rng() % 500);
  ExpectLargestBWins(random, DistinctCe(rng, static_cast<int>(random.size())), prio, "random");
}

class AdamTest : public ::testing::TestWithParam<int> {};  // param: target period

TEST_P(AdamTest, MatchesCpuAdamAndTarget) {
  QS_SKIP_WITHOUT_GPU();
  const int period = GetParam();
  std::mt19937_64 rng(13 + period);
  const int64_t n = 54321;
  const auto theta = RandomUniform(rng, n, -1, 1), g = RandomUniform(rng, n, -1, 1), m = RandomUniform(rng, n, -0.1f, 0.1f);
  const auto v = RandomUniform(rng, n, 0, 0.01f), target = RandomUniform(rng, n, -1, 1);
  for (int apply = 0; apply <= 1; ++apply) {
    kernels::DeviceState s;
    s.t = 10;  // t + 1 as the finalize kernel leaves it: a copy step when period == 5
    s.apply = apply;
    s.clip_scale = 0.7f;
    s.adam_updates = 3;
    s.bias_correction1 = static_cast<float>(1.0 - std::pow(0.9, 3));
    s.bias_correction2 = static_cast<float>(1.0 - std::pow(0.999, 3));
    DeviceArray<kernels::DeviceState> state(std::vector<kernels::DeviceState>{s});
    DeviceArray<float> d_theta(theta), d_g(g), d_m(m), d_v(v), d_t(target);
    kernels::AdamArgs a;
    a.params = d_theta.get();
    a.grads = d_g.get();
    a.m = d_m.get();
    a.v = d_v.get();
    a.target = d_t.get();
    a.n = n;
    a.lr = 1e-3f;
    a.beta1 = 0.9f;
    a.beta2 = 0.999f;
    a.epsilon = 1e-8f;
    a.tau = 0.005f;
    a.target_period = period;
    a.state = state.get();
    QS_ASSERT_CUDA(kernels::LaunchAdamTarget(a, nullptr));
    auto rt = theta, rm = m, rv = v, rtarget = target;
    if (apply) cpu::AdamUpdate({1e-3f, 0.9f, 0.999f, 1e-8f}, 3, 0.7f, g.data(), rm.data(), rv.data(), rt.data(), n);
    if (period == 0) cpu::EmaUpdate(0.005f, rt.data(), rtarget.data(), n);
    if (period == 5) rtarget = rt;
    EXPECT_LE(RelError(d_theta.Download(), rt), kExactTol);
    EXPECT_LE(RelError(d_m.Download(), rm), kExactTol);
    EXPECT_LE(RelError(d_v.Download(), rv), kExactTol);
    EXPECT_LE(RelError(d_t.Download(), rtarget), kExactTol);
  }
}

INSTANTIATE_TEST_SUITE_P(TargetPeriods, AdamTest, ::testing::Values(0, 5, 7));

}  // namespace
}  // namespace qstream
