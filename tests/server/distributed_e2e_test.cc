// Data-parallel flags and Admin Pause at_step end to end: qstreamd as a child
// process on loopback ports chosen at run time. No GPU: a group that would
// need NCCL is refused, and a rank > 0 is stopped while it waits for rank 0.
#include <signal.h>

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::qstream::testing::ChildProcess;
using ::qstream::testing::RefusingPort;
using ::testing::HasSubstr;

constexpr int kObsDim = 4;
const std::vector<int> kBranches = {3, 2};
constexpr int kBatchSize = 32;

// samples_per_insert 1 with an error buffer of two batches: the learner
// takes exactly inserts / batch_size steps and then waits for data, and
// ingest runs at most 128 transitions ahead of the learner.
std::string ConfigText() {
  return absl::StrCat(R"(
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 16 num_atoms: 11 branch_actions: 3 branch_actions: 2 }
replay { capacity: 100000 batch_size: )",
                      kBatchSize, R"( }
rate_limiter { min_size_to_sample: 64 samples_per_insert: 1 error_buffer: 64 }
server { publish_every: 1000 stats_every: 1 }
)");
}

std::unique_ptr<ChildProcess> SpawnQstreamd(const std::vector<std::string>& flags) {
  auto child = testing::SpawnDaemon(flags);
  EXPECT_NE(child, nullptr);
  return child;
}

TEST(DistributedE2E, AGroupOnTheCpuBackendIsRefused) {
  RefusingPort port;
  auto child = SpawnQstreamd({"--backend=cpu", "--world_size=2", "--rendezvous_address=" + port.address()});
  const auto code = child->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << child->output();
  EXPECT_EQ(*code, 1) << child->output();
  EXPECT_THAT(child->output(), HasSubstr("a data-parallel group needs the CUDA backend"));
  EXPECT_THAT(child->output(), HasSubstr("--backend=cpu"));
}

TEST(DistributedE2E, AGroupWithoutRendezvousAddressIsAUsageError) {
  auto child = SpawnQstreamd({"--backend=cpu", "--world_size=2"});
  const auto code = child->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << child->output();
  EXPECT_EQ(*code, 2) << child->output();
  EXPECT_THAT(child->output(), HasSubstr("distributed.rendezvous_address"));
}

TEST(DistributedE2E, RankOutOfRangeIsAUsageError) {
  RefusingPort port;
  auto child = SpawnQstreamd({"--world_size=2", "--rank=2", "--rendezvous_address=" + port.address()});
  const auto code = child->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << child->output();
  EXPECT_EQ(*code, 2) << child->output();
  EXPECT_THAT(child->output(), HasSubstr("distributed.rank: must be in [0, world_size = 2)"));
}

TEST(DistributedE2E, ARankWaitingForRankZeroStopsOnSigterm) {
  RefusingPort port;
  auto child = SpawnQstreamd({"--world_size=2", "--rank=1", "--rendezvous_address=" + port.address()});
  const auto line = child->WaitForLine("waiting for rank 0's rendezvous", absl::Seconds(30));
  ASSERT_TRUE(line.has_value()) << child->output();
  EXPECT_THAT(*line, HasSubstr(port.address()));
  const absl::Time signalled = absl::Now();
  child->Signal(SIGTERM);
  const auto code = child->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.has_value()) << "still running 10 s after SIGTERM:\n" << child->output();
  EXPECT_EQ(*code, 0) << child->output();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
  EXPECT_THAT(child->output(), HasSubstr("stopped while waiting"));
  EXPECT_THAT(child->output(), ::testing::Not(HasSubstr("listening grpc=")));
}

class AdminClient {
 public:
  explicit AdminClient(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        admin_(v1::AdminService::NewStub(channel_)),
        experience_(v1::ExperienceService::NewStub(channel_)) {}

  v1::StatusResponse Status() { return testing::GetStatus(channel_); }
  grpc::Status Pause(int64_t at_step) {
    grpc::ClientContext context;
    v1::PauseRequest request;
    request.set_at_step(at_step);
    v1::PauseResponse response;
    return admin_->Pause(&context, request, &response);
  }
  grpc::Status Resume() {
    grpc::ClientContext context;
    v1::ResumeResponse response;
    return admin_->Resume(&context, v1::ResumeRequest(), &response);
  }
  // Sends `batches` batches of kBatchSize on one stream, each acked before the next.
  void Feed(int batches, uint32_t seed) {
    std::mt19937 rng(seed);
    grpc::ClientContext context;
    auto stream = experience_->Stream(&context);
    for (int i = 1; i <= batches; ++i) {
      v1::Ack ack;
      ASSERT_TRUE(stream->Write(testing::RandomNStepBatch(kBatchSize, i, kObsDim, kBranches, 0.729f, &rng)));
      ASSERT_TRUE(stream->Read(&ack));
      ASSERT_FALSE(ack.has_error()) << ack.error().message();
      ASSERT_EQ(ack.accepted(), static_cast<uint32_t>(kBatchSize));
    }
    stream->WritesDone();
    const grpc::Status st = stream->Finish();
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  // Polls Status until `pred` holds or 30 s pass.
  v1::StatusResponse WaitForStatus(const std::function<bool(const v1::StatusResponse&)>& pred) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    v1::StatusResponse s = Status();
    while (!pred(s) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
      s = Status();
    }
    EXPECT_TRUE(pred(s)) << "timed out; last status: " << s.ShortDebugString();
    return s;
  }
  // Waits until the learner has taken every step the data allows.
  v1::StatusResponse WaitForIdleAt(int64_t steps) {
    return WaitForStatus([steps](const v1::StatusResponse& s) {
      return s.learner_steps() == steps && s.rate_limiter().sample_blocked();
    });
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  std::unique_ptr<v1::ExperienceService::Stub> experience_;
};

TEST(DistributedE2E, PauseAtStepStopsTheLearnerAtThatStep) {
  auto d = testing::StartCpuDaemonOrDie(ConfigText());
  auto admin = std::make_unique<AdminClient>(d.grpc_address);
  AdminClient& client = *admin;
  v1::StatusResponse s = client.Status();
  EXPECT_EQ(s.world_size(), 1);
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.pause_at_step(), 0);

  const grpc::Status negative = client.Pause(-1);
  EXPECT_EQ(negative.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(negative.error_message(), HasSubstr("at_step"));
  EXPECT_FALSE(client.Status().paused());

  ASSERT_NO_FATAL_FAILURE(client.Feed(20, 1));  // 640 transitions: 20 steps
  s = client.WaitForIdleAt(20);
  EXPECT_FALSE(s.paused());

  ASSERT_TRUE(client.Pause(24).ok());
  s = client.Status();
  EXPECT_EQ(s.pause_at_step(), 24);
  EXPECT_FALSE(s.paused());
  EXPECT_EQ(s.learner_steps(), 20);

  ASSERT_NO_FATAL_FAILURE(client.Feed(8, 2));  // enough for 28 steps
  s = client.WaitForStatus([](const v1::StatusResponse& r) { return r.paused(); });
  EXPECT_EQ(s.learner_steps(), 24);
  EXPECT_EQ(s.pause_at_step(), 0);
  EXPECT_EQ(s.transitions_ingested(), 28 * kBatchSize);
  EXPECT_EQ(s.world_size(), 1);
  EXPECT_EQ(s.rank(), 0);

  ASSERT_TRUE(client.Resume().ok());
  s = client.WaitForIdleAt(28);
  EXPECT_FALSE(s.paused());

  // A step already passed: paused at once, where it is.
  ASSERT_TRUE(client.Pause(3).ok());
  s = client.WaitForStatus([](const v1::StatusResponse& r) { return r.paused(); });
  EXPECT_EQ(s.learner_steps(), 28);
  EXPECT_EQ(s.pause_at_step(), 0);

  // at_step 0 on a single daemon: pause now (no group to keep in step).
  ASSERT_TRUE(client.Resume().ok());
  EXPECT_FALSE(client.Status().paused());
  ASSERT_TRUE(client.Pause(0).ok());
  EXPECT_TRUE(client.Status().paused());

  admin.reset();  // an open channel would hold the daemon's shutdown to its deadline
  d.process->Signal(SIGTERM);
  const auto code = d.process->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << d.process->output();
}

}  // namespace
}  // namespace qstream
