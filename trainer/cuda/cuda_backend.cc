#include "trainer/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/c51_loss.h"
#include "kernels/launch.h"
#include "kernels/optimizer.h"
#include "kernels/per_sample.h"
#include "kernels/step_finalize.h"
#include "kernels/views.h"
#include "trainer/config.h"
#include "trainer/cuda/cublas_network.h"
#include "trainer/cuda/cuda_status.h"
#include "trainer/cuda/device_memory.h"
#include "trainer/cuda/device_replay.h"
#include "trainer/cuda/fused_network.h"
#include "trainer/cuda/nccl.h"
#include "trainer/cuda/step_times.h"

namespace qstream {
namespace {

using cuda::DeviceBuffer;
using cuda::Event;
using cuda::PinnedBuffer;

// Pinned copies of the device statistics in flight at once.
constexpr int kStatsSlots = 4;
// The target parameters start this many floats (256 bytes) aligned after
// the online ones, so both batches of a strided GEMM are equally aligned.
constexpr int64_t kParamAlignFloats = 64;
// Floats after the gradient in the group all-reduce: the guard's inputs
// (kernels::LaunchGroupGuardInputs).
constexpr int64_t kGroupGuardFloats = 2;
// Default shared memory a block may use without opting in.
constexpr size_t kSharedBytesLimit = 48 * 1024;

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(const v1::TrainerConfig& config,
                                                         const DistributedGroup* group);

  std::string name() const override { return "cuda"; }
  std::string device() const override {
    return device_name_ + " [" + path_ + "]" + (dependent_launch_ != 0 ? " [dependent launch]" : "");
  }
  DeviceMemory device_memory() const override { return device_memory_; }
  const NetworkSpec& spec() const override { return spec_; }

  absl::Status Insert(const TransitionColumns& batch) override {
    absl::MutexLock lock(&mu_);
    // An upload between replays is not step time: the window ends before it.
    QS_RETURN_IF_ERROR(step_times_.Close());
    return replay_->Insert(batch);
  }
  double ConsumeInsertWaitSeconds() override {
    absl::MutexLock lock(&mu_);
    return replay_->ConsumeWaitSeconds();
  }
  void InsertMany(const std::vector<const TransitionColumns*>& batches,
                  std::vector<absl::Status>* statuses) override {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = step_times_.Close(); !s.ok()) {
      statuses->assign(batches.size(), s);
      return;
    }
    replay_->InsertMany(batches, statuses);
  }
  int64_t replay_size() const override {
    absl::MutexLock lock(&mu_);
    return replay_->size();
  }
  int64_t replay_capacity() const override { return config_.replay().capacity(); }

  absl::Status Step() override;
  int64_t steps() const override {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

  StepStats last_stats() override {
    absl::MutexLock lock(&mu_);
    HarvestStats();
    return latest_stats_;
  }
  std::vector<int64_t> guard_trips() override {
    absl::MutexLock lock(&mu_);
    HarvestStats();
    return latest_trips_;
  }
  void DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) override;

  std::vector<float> GetParams() override;
  absl::Status SetParams(const std::vector<float>& params) override;
  absl::Status SaveState(bool include_replay, BackendState* out) override;
  absl::Status LoadState(const BackendState& state, StateParts parts) override;
  absl::Status SyncGroup() override;
  int world_size() const override { return comm_ != nullptr ? comm_->world_size() : 1; }
  int rank() const override { return comm_ != nullptr ? comm_->rank() : 0; }

 private:
  CudaBackend(const v1::TrainerConfig& config, NetworkSpec spec, const DistributedGroup* group);
  // Joins the group: communicator, rank 0's initial parameters, and one
  // all-reduce outside the graph so NCCL connects before the capture.
  absl::Status InitGroup();
  absl::Status Init();
  absl::Status CaptureStep();
  // The learner step, one line per stage of DESIGN.md; enqueued once into the graph.
  absl::Status EnqueueStep();
  float* params() const { return net_params_.get(); }
  float* target() const { return net_params_.get() + target_offset_; }
  // The loss over the logits the network pass wrote (fused or cuBLASLt).
  absl::Status EnqueueLoss();
  absl::Status EnqueueStatsCopy() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HarvestStats() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::TrainerConfig config_;
  const NetworkSpec spec_;
  const int B_;
  const int stats_every_;
  kernels::HeadShape head_;
  const kernels::Precision precision_;
  std::string device_name_;
  std::string path_;  // which network path runs, and why
  // Which of the step's kernels launch as programmatic dependents
  // (kernels/launch.h): on 9.0+ devices, QSTREAM_CUDA_PDL or the default.
  uint32_t dependent_launch_ = 0;  // kernels::StepKernel bits

  mutable absl::Mutex mu_;
  cuda::Stream stream_;
  // The network passes: fused, or (fused_ null) through cuBLASLt.
  std::unique_ptr<cuda::FusedNetwork> fused_;
  std::unique_ptr<cuda::CublasNetwork> cublas_;
  DeviceBuffer<kernels::DeviceState> state_;
  std::unique_ptr<cuda::DeviceReplay> replay_;

  // One flat buffer each, layout of NetworkSpec; online and target parameters
  // share one allocation [online | target] so one strided GEMM serves both.
  // grads_ holds kGroupGuardFloats more: the guard inputs a group all-reduces
  // with the gradient.
  DeviceBuffer<float> net_params_, grads_, adam_m_, adam_v_;
  int64_t target_offset_ = 0;  // num_params rounded up to 256 bytes
  float* group_guard() const { return grads_.get() + spec_.num_params; }

  // Data-parallel group (null comm_: none).
  std::optional<DistributedGroup> group_;
  std::unique_ptr<cuda::NcclComm> comm_;

  // Sampled batch: x holds s in rows [0, B), s' in [B, 2B), zeros in [2B, 3B)
  // (the target pass reads rows [B, 3B) and only its first B rows are used).
  DeviceBuffer<int32_t> indices_, actions_, q_bad_;
  DeviceBuffer<float> weights_, x_, rewards_, discounts_;
  // Per-sample loss outputs and reductions.
  DeviceBuffer<float> ce_, item_loss_, clip_mass_, q_min_, q_max_, q_sum_, norm_partials_;
  DeviceBuffer<uint64_t> priority_sums_;
  int fixed_shift_ = 0;

  cuda::Graph graph_;
  cuda::GraphExec exec_;

  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);

  // Statistics: device state copied to pinned slots every stats_every steps.
  PinnedBuffer<kernels::DeviceState> stats_host_;
  std::vector<Event> stats_copied_;
  // At most kStepsInFlight steps are queued on the stream: step k waits for
  // the end of step k - kStepsInFlight before it is launched. The device
  // never idles for it (a step is always queued behind the running one),
  // and an upload or a stats read never waits behind a long queue of steps
  // (which made every ack wait ~10 steps under ingest).
  static constexpr int kStepsInFlight = 2;
  std::vector<Event> step_done_;
  std::vector<bool> step_queued_;
  int next_step_slot_ = 0;
  std::vector<int64_t> stats_seq_ ABSL_GUARDED_BY(mu_);
  int next_stats_slot_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t latest_seq_ ABSL_GUARDED_BY(mu_) = -1;
  StepStats latest_stats_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> latest_trips_ ABSL_GUARDED_BY(mu_);

  // Step-time windows: event pairs around runs of graph replays.
  DeviceMemory device_memory_;  // set by Init, then const
  cuda::StepTimes step_times_ ABSL_GUARDED_BY(mu_);
};

CudaBackend::CudaBackend(const v1::TrainerConfig& config, NetworkSpec spec, const DistributedGroup* group)
    : config_(config),
      spec_(std::move(spec)),
      B_(config.replay().batch_size()),
      stats_every_(std::max(1, config.server().stats_every())),
      precision_(static_cast<kernels::Precision>(MatmulPrecision(config))),
      latest_trips_(kNumGuardReasons, 0) {
  if (group != nullptr) group_ = *group;
  head_.num_atoms = spec_.num_atoms;
  head_.num_branches = spec_.num_branches();
  head_.total_actions = spec_.total_actions();
  head_.v_min = spec_.v_min;
  head_.v_max = spec_.v_max;
  head_.delta_z = spec_.delta_z();
  for (int br = 0; br <= spec_.num_branches(); ++br) head_.branch_offset[br] = spec_.branch_offset(br);
}

absl::StatusOr<std::unique_ptr<Backend>> CudaBackend::Create(const v1::TrainerConfig& config,
                                                             const DistributedGroup* group) {
  QS_RETURN_IF_ERROR(ValidateConfig(config));
  auto spec = NetworkSpec::Create(config.network());
  if (!spec.ok()) return spec.status();
  if (spec->num_atoms > kernels::kMaxAtoms) {
    return absl::UnimplementedError(
        absl::StrCat("network.num_atoms: the CUDA backend supports at most ", kernels::kMaxAtoms));
  }
  if (spec->num_branches() > kernels::kMaxBranches) {
    return absl::UnimplementedError(absl::StrCat("network.branch_actions: the CUDA backend supports at most ",
                                                 kernels::kMaxBranches, " branches"));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(config, *std::move(spec), group));
  QS_RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<Backend>(std::move(b));
}

absl::Status CudaBackend::Init() {
  const int B = B_;
  if (B < 1) return absl::InvalidArgumentError("replay.batch_size: must be >= 1");
  if (kernels::C51LossSharedBytes(head_) > kSharedBytesLimit ||
      sizeof(int32_t) * size_t(B) > kSharedBytesLimit) {
    return absl::UnimplementedError("network/batch too large for the CUDA loss kernels' shared memory");
  }
  int dev = 0;
  QS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  QS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  device_name_ = prop.name;
  // QSTREAM_CUDA_PDL (hex): 0 off, 1 (or unset) kernels::kDefaultStepKernels,
  // another mask (e.g. 0x1ff: all) the kernels::StepKernel bits that launch
  // as dependents (a diagnostic).
  dependent_launch_ = kernels::kDefaultStepKernels;
  if (const char* env_pdl = std::getenv("QSTREAM_CUDA_PDL"); env_pdl != nullptr) {
    uint32_t mask = 0;
    if (!absl::SimpleHexAtoi(env_pdl, &mask) || mask > kernels::kAllStepKernels) {
      return absl::InvalidArgumentError(absl::StrCat("QSTREAM_CUDA_PDL: '", env_pdl,
                                                     "' is not 0, 1 or a hex mask of step kernels <= 0x",
                                                     absl::Hex(kernels::kAllStepKernels)));
    }
    if (mask != 1) dependent_launch_ = mask;
  }
  if (prop.major < 9) dependent_launch_ = 0;

  QS_RETURN_IF_ERROR(cuda::CreateStream(&stream_));
  QS_RETURN_IF_ERROR(state_.Allocate(1));
  const kernels::DeviceState initial;
  QS_CUDA_CHECK(cudaMemcpy(state_.get(), &initial, sizeof(initial), cudaMemcpyHostToDevice));

  const int64_t capacity = config_.replay().capacity();
  // Staging holds several batches: the learner packs what it gathered between two steps into one upload.
  const int64_t staging_rows = std::max<int64_t>(config_.server().max_batch_transitions(), 8192);
  auto replay = cuda::DeviceReplay::Create(spec_, capacity, staging_rows, stream_.get(), state_.get());
  if (!replay.ok()) return replay.status();
  replay_ = *std::move(replay);

  const size_t n = spec_.num_params;
  target_offset_ = (spec_.num_params + kParamAlignFloats - 1) / kParamAlignFloats * kParamAlignFloats;
  QS_RETURN_IF_ERROR(net_params_.Allocate(2 * target_offset_));
  QS_RETURN_IF_ERROR(grads_.Allocate(n + kGroupGuardFloats));
  for (auto* buf : {&adam_m_, &adam_v_}) QS_RETURN_IF_ERROR(buf->Allocate(n));
  const std::vector<float> init = InitParams(spec_, config_.seed());
  QS_CUDA_CHECK(cudaMemcpy(params(), init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  QS_CUDA_CHECK(cudaMemcpy(target(), init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  if (group_.has_value()) QS_RETURN_IF_ERROR(InitGroup());

  const int NB = spec_.num_branches();
  QS_RETURN_IF_ERROR(indices_.Allocate(B));
  QS_RETURN_IF_ERROR(actions_.Allocate(size_t(B) * NB));
  QS_RETURN_IF_ERROR(q_bad_.Allocate(B));
  for (auto* buf :
       {&weights_, &rewards_, &discounts_, &ce_, &item_loss_, &clip_mass_, &q_min_, &q_max_, &q_sum_}) {
    QS_RETURN_IF_ERROR(buf->Allocate(B));
  }
  QS_RETURN_IF_ERROR(x_.Allocate(size_t(3 * B) * spec_.obs_dim));
  static_assert(kernels::kMaxGradTiles <= kernels::kNormBlocks,
                "weight-gradient tiles write the norm partials");
  QS_RETURN_IF_ERROR(norm_partials_.Allocate(kernels::kNormBlocks));
  QS_RETURN_IF_ERROR(priority_sums_.Allocate(kernels::PrioritySumWords(capacity)));
  fixed_shift_ = kernels::FixedPointShift(capacity);

  QS_RETURN_IF_ERROR(stats_host_.Allocate(kStatsSlots));
  step_done_.resize(kStepsInFlight);
  step_queued_.assign(kStepsInFlight, false);
  for (Event& e : step_done_) QS_RETURN_IF_ERROR(cuda::CreateEvent(&e, /*timing=*/false));
  stats_copied_.resize(kStatsSlots);
  for (Event& e : stats_copied_) QS_RETURN_IF_ERROR(cuda::CreateEvent(&e, /*timing=*/false));
  stats_seq_.assign(kStatsSlots, -1);
  {
    absl::MutexLock lock(&mu_);
    QS_RETURN_IF_ERROR(step_times_.Init(stream_.get()));
  }

  // The fused network passes where they fit (and are not switched off), else cuBLASLt.
  static_assert(int(kernels::Precision::kBf16) == v1::TrainerConfig::BF16 &&
                int(kernels::Precision::kTf32) == v1::TrainerConfig::TF32 &&
                int(kernels::Precision::kFp32) == v1::TrainerConfig::FP32);
  static const char* const kPrecisionNames[] = {"fp32", "tf32", "bf16"};
  const char* precision_name = kPrecisionNames[static_cast<int>(precision_)];
  std::string why_not = cuda::FusedNetwork::Unsupported(spec_, B, precision_, prop.sharedMemPerBlockOptin);
  if (prop.major < 8) why_not = absl::StrCat("compute capability ", prop.major, ".", prop.minor, " < 8.0");
  // QSTREAM_CUDA_PATH=auto (default) | fused | cublas; auto: where the fused
  // passes were measured faster (cuda::FusedNetwork::AutoDeclines).
  const char* env_path = std::getenv("QSTREAM_CUDA_PATH");
  const std::string forced = env_path != nullptr ? env_path : "auto";
  if (forced == "cublas") {
    why_not = "QSTREAM_CUDA_PATH=cublas";
  } else if (forced != "fused" && why_not.empty()) {
    why_not = cuda::FusedNetwork::AutoDeclines(spec_, B, precision_);
  }
  if (why_not.empty()) {
    fused_ = std::make_unique<cuda::FusedNetwork>();
    cuda::FusedNetworkIo io;
    io.params = params();
    io.target = target();
    io.grads = grads_.get();
    io.x = x_.get();
    io.norm_partials = norm_partials_.get();
    QS_RETURN_IF_ERROR(fused_->Init(spec_, B, precision_, io, stream_.get()));
    path_ = absl::StrCat("fused ", precision_name);
  } else {
    path_ = absl::StrCat("cublaslt ", precision_name, "; fused path off: ", why_not);
    cublas_ = std::make_unique<cuda::CublasNetwork>();
    cuda::CublasNetworkIo io;
    io.params = params();
    io.target_offset = target_offset_;
    io.grads = grads_.get();
    io.x = x_.get();
    QS_RETURN_IF_ERROR(cublas_->Init(spec_, B, precision_, io, stream_.get()));
    device_name_ += cublas_->fallbacks();
  }
  QS_RETURN_IF_ERROR(CaptureStep());
  // Every allocation is made by now (none after the capture).
  size_t free_bytes = 0, total_bytes = 0;
  QS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  device_memory_ = {.used_bytes = static_cast<int64_t>(total_bytes - free_bytes),
                    .total_bytes = static_cast<int64_t>(total_bytes)};
  return absl::OkStatus();
}

absl::Status CudaBackend::InitGroup() {
  auto comm = cuda::NcclComm::Create(group_->nccl_unique_id, group_->world_size, group_->rank);
  if (!comm.ok()) return comm.status();
  comm_ = *std::move(comm);
  cudaStream_t s = stream_.get();
  QS_RETURN_IF_ERROR(comm_->Broadcast(net_params_.get(), static_cast<int64_t>(net_params_.bytes()), 0, s));
  // The gradient buffer is still zero: its mean is zero too.
  QS_RETURN_IF_ERROR(comm_->AllReduceMean(grads_.get(), static_cast<int64_t>(grads_.size()), s));
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

absl::Status CudaBackend::CaptureStep() {
  QS_CUDA_CHECK(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
  absl::Status enqueued;
  {
    const kernels::DependentLaunchScope dependent(dependent_launch_);
    enqueued = EnqueueStep();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_.get(), &graph);
  graph_.Reset(graph);
  QS_RETURN_IF_ERROR(enqueued);
  QS_CUDA_CHECK(ended);
  cudaGraphExec_t exec = nullptr;
  QS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph_.get(), 0));
  exec_.Reset(exec);
  QS_CUDA_CHECK(cudaGraphUpload(exec_.get(), stream_.get()));
  QS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueStep() {
  cudaStream_t s = stream_.get();
  const int B = B_;
  const auto& rep = config_.replay();
  const auto& opt = config_.optimizer();
  const kernels::ReplayColumns replay = replay_->columns();

  // 1-2. Sample B slots stratified over the priorities' fixed-point sums,
  //      raw IS weights; gather s, a, R, discount, s' (one launch after the
  //      chunk sums).
  kernels::PrioritySampleArgs sample;
  sample.replay = replay;
  sample.sums = priority_sums_.get();
  sample.fixed_shift = fixed_shift_;
  sample.state = state_.get();
  sample.seed = config_.seed();
  sample.batch = B;
  sample.beta_start = rep.beta_start();
  sample.beta_end = rep.beta_end();
  sample.beta_anneal_steps = rep.beta_anneal_steps();
  sample.indices = indices_.get();
  sample.weights = weights_.get();
  sample.obs = x_.get();
  sample.next_obs = x_.get() + size_t(B) * spec_.obs_dim;
  sample.actions = actions_.get();
  sample.rewards = rewards_.get();
  sample.discounts = discounts_.get();
  QS_CUDA_CHECK(kernels::LaunchPrioritySample(sample, s));

  if (fused_ != nullptr) {
    // 3. Online forward on s and s', target forward on s': one kernel, from
    //    this step's packed operand copy of both networks.
    QS_RETURN_IF_ERROR(fused_->EnqueuePack(s));
    QS_RETURN_IF_ERROR(fused_->EnqueueForward(s));
    // 4-7. Dueling softmax, double DQN, projection (+ label smoothing), CE
    //      (+ MSE blend), d logits, Q stats.
    QS_RETURN_IF_ERROR(EnqueueLoss());
    // 8. Data gradients (one kernel), then weight gradients with the
    //    grad-norm partials (one kernel).
    QS_RETURN_IF_ERROR(fused_->EnqueueBackward(s));
  } else {
    // 3. Online forward on [s; s'] (2B rows) and target forward on s', one
    //    strided-batch GEMM per layer.
    QS_RETURN_IF_ERROR(cublas_->EnqueueForward(s));
    // 4-7.
    QS_RETURN_IF_ERROR(EnqueueLoss());
    // 8. Backward through heads and trunk into the flat gradient buffer.
    QS_RETURN_IF_ERROR(cublas_->EnqueueBackward(s));
    // A group takes the norm of the all-reduced gradient instead (8b).
    if (comm_ == nullptr) {
      QS_CUDA_CHECK(kernels::LaunchGradSumSquares(grads_.get(), spec_.num_params, norm_partials_.get(), s));
    }
  }

  // 9. Global grad norm, guard, statistics (+ step 11, below).
  kernels::FinalizeArgs fin;
  fin.norm_partials = norm_partials_.get();
  fin.ce = ce_.get();
  fin.item_loss = item_loss_.get();
  fin.weights = weights_.get();
  fin.clip_mass = clip_mass_.get();
  fin.q_min = q_min_.get();
  fin.q_max = q_max_.get();
  fin.q_sum = q_sum_.get();
  fin.q_bad = q_bad_.get();
  fin.batch = B;
  fin.num_branches = spec_.num_branches();
  fin.total_actions = spec_.total_actions();
  fin.max_grad_norm = config_.guard().max_grad_norm();
  fin.q_bound = step::QBound(config_.guard().max_abs_q(), spec_.v_min, spec_.v_max);
  fin.clip_grad_norm = opt.clip_grad_norm();
  fin.beta1 = opt.beta1();
  fin.beta2 = opt.beta2();
  // 11. (same launch) New priorities (skipped on a trip), max priority, t += 1.
  fin.priorities = replay.priorities;
  fin.indices = indices_.get();
  fin.priority_epsilon = rep.priority_epsilon();
  fin.alpha = rep.alpha();
  fin.state = state_.get();
  if (comm_ != nullptr) {
    // 8b. Data-parallel group: this rank's guard inputs beside its gradient,
    //     one all-reduce (mean over the ranks) of both, and the norm partials
    //     again, of the mean gradient. From here on every rank computes alike.
    QS_CUDA_CHECK(kernels::LaunchGroupGuardInputs(fin, group_guard(), s));
    QS_RETURN_IF_ERROR(comm_->AllReduceMean(grads_.get(), spec_.num_params + kGroupGuardFloats, s));
    QS_CUDA_CHECK(kernels::LaunchGradSumSquares(grads_.get(), spec_.num_params, norm_partials_.get(), s));
    fin.group_guard = group_guard();
  }
  QS_CUDA_CHECK(kernels::LaunchFinalize(fin, s));

  // 10. Clip + Adam (skipped on a trip) and the target update, one pass.
  kernels::AdamArgs adam;
  adam.params = params();
  adam.grads = grads_.get();
  adam.m = adam_m_.get();
  adam.v = adam_v_.get();
  adam.target = target();
  adam.n = spec_.num_params;
  adam.lr = opt.lr();
  adam.lr_end = opt.lr_end();
  adam.lr_decay_steps = opt.lr_decay_steps();
  adam.beta1 = opt.beta1();
  adam.beta2 = opt.beta2();
  adam.epsilon = opt.epsilon();
  adam.tau = opt.target_tau();
  adam.target_period = opt.target_update_period();
  adam.state = state_.get();
  QS_CUDA_CHECK(kernels::LaunchAdamTarget(adam, s));

  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueLoss() {
  const int B = B_;
  kernels::C51LossArgs loss;
  loss.head = head_;
  loss.batch = B;
  if (fused_ != nullptr) {
    loss.online_v = fused_->value_logits();
    loss.online_a = fused_->adv_logits();
    loss.target_v = fused_->value_logits() + int64_t{2} * B * spec_.num_atoms;
    loss.target_a = fused_->adv_logits() + int64_t{2} * B * spec_.adv_out.out;
    loss.dv = fused_->d_value();
    loss.da = fused_->d_adv();
    loss.dv_ld = fused_->d_value_ld();
    loss.da_ld = fused_->d_adv_ld();
    loss.grad_precision = precision_;
  } else {
    loss.online_v = cublas_->value_logits();
    loss.online_a = cublas_->adv_logits();
    loss.target_v = cublas_->target_value_logits();
    loss.target_a = cublas_->target_adv_logits();
    loss.dv = cublas_->d_value();
    loss.da = cublas_->d_adv();
  }
  loss.actions = actions_.get();
  loss.rewards = rewards_.get();
  loss.discounts = discounts_.get();
  loss.weights = weights_.get();
  // Label smoothing and the MSE blend; alpha follows the device's step counter.
  const auto& options = config_.loss();
  loss.options.label_smoothing = options.label_smoothing();
  loss.options.mse_blend_start = options.mse_blend().start();
  loss.options.mse_blend_end = options.mse_blend().end();
  loss.options.mse_blend_steps = options.mse_blend().steps();
  loss.state = state_.get();
  loss.ce = ce_.get();
  loss.item_loss = item_loss_.get();
  loss.clip_mass = clip_mass_.get();
  loss.q_min = q_min_.get();
  loss.q_max = q_max_.get();
  loss.q_sum = q_sum_.get();
  loss.q_bad = q_bad_.get();
  QS_CUDA_CHECK(kernels::LaunchC51Loss(loss, stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackend::Step() {
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  if (replay_->size() == 0) return absl::FailedPreconditionError("cuda backend: replay is empty");
  const int slot = next_step_slot_;
  next_step_slot_ = (slot + 1) % kStepsInFlight;
  if (step_queued_[slot]) QS_CUDA_CHECK(cudaEventSynchronize(step_done_[slot].get()));
  QS_RETURN_IF_ERROR(step_times_.Open());
  QS_CUDA_CHECK(cudaGraphLaunch(exec_.get(), stream_.get()));
  QS_CUDA_CHECK(cudaEventRecord(step_done_[slot].get(), stream_.get()));
  step_queued_[slot] = true;
  ++steps_;
  step_times_.CountStep();
  // Every step is timed on its own (an event pair around its replay), so the
  // step-time histogram holds each step, tail steps included.
  QS_RETURN_IF_ERROR(step_times_.Close());
  if (steps_ % stats_every_ == 0) QS_RETURN_IF_ERROR(EnqueueStatsCopy());
  return absl::OkStatus();
}

void CudaBackend::DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = step_times_.Drain(out); !s.ok() && error_.ok()) error_ = s;
}

absl::Status CudaBackend::EnqueueStatsCopy() {
  const int slot = next_stats_slot_;
  next_stats_slot_ = (slot + 1) % kStatsSlots;
  HarvestStats();  // keeps the slot's previous copy if nobody read it yet
  QS_CUDA_CHECK(cudaMemcpyAsync(stats_host_.get() + slot, state_.get(), sizeof(kernels::DeviceState),
                                cudaMemcpyDeviceToHost, stream_.get()));
  QS_CUDA_CHECK(cudaEventRecord(stats_copied_[slot].get(), stream_.get()));
  stats_seq_[slot] = steps_;
  return absl::OkStatus();
}

void CudaBackend::HarvestStats() {
  int best = -1;
  for (int slot = 0; slot < kStatsSlots; ++slot) {
    if (stats_seq_[slot] <= latest_seq_) continue;
    const cudaError_t q = cudaEventQuery(stats_copied_[slot].get());
    if (q == cudaErrorNotReady) continue;
    if (q != cudaSuccess) {
      if (error_.ok()) error_ = cuda::ToStatus(q, "stats copy event", __FILE__, __LINE__);
      continue;
    }
    if (best < 0 || stats_seq_[slot] > stats_seq_[best]) best = slot;
  }
  if (best < 0) return;
  latest_seq_ = stats_seq_[best];
  const kernels::DeviceState& d = stats_host_.get()[best];
  latest_stats_.step = d.stats.step;
  latest_stats_.loss = d.stats.loss;
  latest_stats_.grad_norm = d.stats.grad_norm;
  latest_stats_.q_min = d.stats.q_min;
  latest_stats_.q_mean = d.stats.q_mean;
  latest_stats_.q_max = d.stats.q_max;
  latest_stats_.target_clip_fraction = d.stats.target_clip_fraction;
  latest_stats_.guard = static_cast<GuardReason>(d.stats.guard);
  latest_stats_.consecutive_trips = d.consecutive_trips;
  for (int r = 0; r < kNumGuardReasons; ++r) latest_trips_[r] = d.guard_trips[r];
}

std::vector<float> CudaBackend::GetParams() {
  absl::MutexLock lock(&mu_);
  std::vector<float> out(spec_.num_params);
  if (cudaMemcpyAsync(out.data(), params(), out.size() * sizeof(float), cudaMemcpyDeviceToHost,
                      stream_.get()) != cudaSuccess ||
      cudaStreamSynchronize(stream_.get()) != cudaSuccess) {
    if (error_.ok()) error_ = absl::InternalError("cuda backend: reading parameters failed");
  }
  return out;
}

absl::Status CudaBackend::SetParams(const std::vector<float>& values) {
  if (static_cast<int64_t>(values.size()) != spec_.num_params) {
    return absl::InvalidArgumentError(
        absl::StrCat("params: ", values.size(), " values, network has ", spec_.num_params));
  }
  absl::MutexLock lock(&mu_);
  // Online and target both (a restore starts from equal networks); Adam moments kept.
  const size_t bytes = values.size() * sizeof(float);
  QS_CUDA_CHECK(cudaMemcpyAsync(params(), values.data(), bytes, cudaMemcpyHostToDevice, stream_.get()));
  QS_CUDA_CHECK(cudaMemcpyAsync(target(), values.data(), bytes, cudaMemcpyHostToDevice, stream_.get()));
  QS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackend::SaveState(bool include_replay, BackendState* out) {
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  QS_RETURN_IF_ERROR(step_times_.Close());
  const size_t n = spec_.num_params;
  out->params.resize(n);
  out->target.resize(n);
  out->adam_m.resize(n);
  out->adam_v.resize(n);
  kernels::DeviceState state;
  cudaStream_t s = stream_.get();
  QS_CUDA_CHECK(cudaMemcpyAsync(out->params.data(), params(), n * sizeof(float), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(cudaMemcpyAsync(out->target.data(), target(), n * sizeof(float), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(out->adam_m.data(), adam_m_.get(), n * sizeof(float), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(out->adam_v.data(), adam_v_.get(), n * sizeof(float), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(cudaMemcpyAsync(&state, state_.get(), sizeof(state), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  out->steps = state.t;
  out->applied_updates = state.adam_updates;
  out->guard_trips.assign(state.guard_trips, state.guard_trips + kNumGuardReasons);
  out->consecutive_trips = state.consecutive_trips;
  out->has_replay = include_replay;
  out->replay = ReplayState{};
  if (include_replay) QS_RETURN_IF_ERROR(replay_->Save(&out->replay));
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadState(const BackendState& in, StateParts parts) {
  const size_t n = spec_.num_params;
  if (absl::Status st = CheckNetworkState(in, spec_.num_params); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  QS_RETURN_IF_ERROR(step_times_.Close());
  cudaStream_t s = stream_.get();
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  if (parts == StateParts::kAll) {
    ReplayState replay;
    if (in.has_replay) {
      replay = ResizeReplayState(in.replay, replay_->capacity());
      QS_RETURN_IF_ERROR(CheckReplayState(replay, spec_));
    } else {
      replay.capacity = replay_->capacity();
      replay.rows.obs_dim = spec_.obs_dim;
      replay.rows.num_branches = spec_.num_branches();
    }
    QS_RETURN_IF_ERROR(replay_->Load(replay));
  }
  kernels::DeviceState state;
  QS_CUDA_CHECK(cudaMemcpyAsync(&state, state_.get(), sizeof(state), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  state.adam_updates = in.applied_updates;
  state.consecutive_trips = 0;
  if (parts == StateParts::kAll) {
    state.t = in.steps;
    for (int r = 0; r < kNumGuardReasons; ++r) {
      state.guard_trips[r] = r < static_cast<int>(in.guard_trips.size()) ? in.guard_trips[r] : 0;
    }
    state.consecutive_trips = in.consecutive_trips;
    state.stats = kernels::DeviceStats{};
    state.stats.step = in.steps;
    steps_ = in.steps;
    for (int r = 0; r < kNumGuardReasons; ++r) latest_trips_[r] = state.guard_trips[r];
    latest_stats_ = StepStats{};
    latest_stats_.step = in.steps;
    latest_stats_.consecutive_trips = in.consecutive_trips;
    stats_seq_.assign(kStatsSlots, -1);
    latest_seq_ = -1;
  }
  QS_CUDA_CHECK(cudaMemcpyAsync(params(), in.params.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  QS_CUDA_CHECK(cudaMemcpyAsync(target(), in.target.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(adam_m_.get(), in.adam_m.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  QS_CUDA_CHECK(
      cudaMemcpyAsync(adam_v_.get(), in.adam_v.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  QS_CUDA_CHECK(cudaMemcpyAsync(state_.get(), &state, sizeof(state), cudaMemcpyHostToDevice, s));
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

absl::Status CudaBackend::SyncGroup() {
  if (comm_ == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return error_;
  QS_RETURN_IF_ERROR(step_times_.Close());
  cudaStream_t s = stream_.get();
  QS_RETURN_IF_ERROR(comm_->Broadcast(net_params_.get(), static_cast<int64_t>(net_params_.bytes()), 0, s));
  QS_RETURN_IF_ERROR(comm_->Broadcast(adam_m_.get(), static_cast<int64_t>(adam_m_.bytes()), 0, s));
  QS_RETURN_IF_ERROR(comm_->Broadcast(adam_v_.get(), static_cast<int64_t>(adam_v_.bytes()), 0, s));
  // t and the applied-update count lead DeviceState; the rest (replay
  // cursor, max priority, trips) stays this rank's.
  static_assert(offsetof(kernels::DeviceState, t) == 0 &&
                offsetof(kernels::DeviceState, adam_updates) == sizeof(int64_t));
  QS_RETURN_IF_ERROR(comm_->Broadcast(state_.get(), 2 * sizeof(int64_t), 0, s));
  kernels::DeviceState state;
  QS_CUDA_CHECK(cudaMemcpyAsync(&state, state_.get(), sizeof(state), cudaMemcpyDeviceToHost, s));
  QS_CUDA_CHECK(cudaStreamSynchronize(s));
  steps_ = state.t;
  latest_stats_ = StepStats{};
  latest_stats_.step = state.t;
  stats_seq_.assign(kStatsSlots, -1);
  latest_seq_ = -1;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const v1::TrainerConfig& config,
                                                           const DistributedGroup* group) {
  return CudaBackend::Create(config, group);
}

bool CudaDeviceAvailable(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = absl::StrCat("no usable CUDA device: ", cudaGetErrorString(err));
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

}  // namespace qstream
