// Rank 0's rendezvous and JoinGroup over real gRPC on loopback (port 0):
// the barrier, the refusals, the timeouts, cancellation and the admin token.
#include "server/rendezvous.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"
#include "tests/server/e2e_support.h"
#include "trainer/config.h"

namespace qstream {
namespace {

using ::qstream::testing::RefusingPort;
using ::testing::HasSubstr;

// 128 bytes like an ncclUniqueId, with zero and high bytes.
std::string GroupId() {
  std::string id(128, '\0');
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>((i * 37 + 11) % 256);
  id[5] = '\0';
  return id;
}

v1::TrainerConfig RankConfig(int world_size, int rank) {
  v1::TrainerConfig c = DefaultConfig();
  c.mutable_distributed()->set_world_size(world_size);
  c.mutable_distributed()->set_rank(rank);
  c.mutable_distributed()->set_rendezvous_address("127.0.0.1:1");
  return c;
}

std::unique_ptr<RendezvousServer> StartRendezvous(int world_size,
                                                  std::shared_ptr<TokenAuthorizer> authorizer = nullptr) {
  RendezvousServer::Options options;
  options.listen = "127.0.0.1:0";
  options.config = RankConfig(world_size, 0);
  options.unique_id = GroupId();
  options.authorizer = std::move(authorizer);
  auto server = RendezvousServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  return *std::move(server);
}

JoinOptions JoinTo(const RendezvousServer& server, v1::TrainerConfig config) {
  JoinOptions options;
  options.address = absl::StrCat("127.0.0.1:", server.port());
  options.config = std::move(config);
  options.timeout = absl::Seconds(20);
  options.retry_interval = absl::Milliseconds(20);
  return options;
}

// A joiner on a thread of its own; done() is notified when JoinGroup returned.
class Joiner {
 public:
  explicit Joiner(JoinOptions options, std::function<void()> on_done = {})
      : thread_([this, options = std::move(options), on_done = std::move(on_done)] {
          result_ = JoinGroup(options);
          if (on_done) on_done();
          done_.Notify();
        }) {}
  ~Joiner() { thread_.join(); }
  const absl::Notification& done() const { return done_; }
  const absl::StatusOr<std::string>& result() {
    done_.WaitForNotification();
    return result_;
  }

 private:
  absl::StatusOr<std::string> result_ = absl::UnknownError("not returned");
  absl::Notification done_;
  std::thread thread_;
};

// Notifies once the daemon's log holds a line containing `needle`: how the
// test learns that rank 0 has registered a join.
class LogWatch final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit LogWatch(std::string needle) : needle_(std::move(needle)) {}
  absl::Notification& seen() { return seen_; }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string_view payload(msg.payload.data(), msg.payload.size());
    if (!seen_.HasBeenNotified() && payload.find(needle_) != std::string_view::npos) seen_.Notify();
  }
  void flush_() override {}

 private:
  const std::string needle_;
  absl::Notification seen_;
};

class RendezvousTest : public ::testing::Test {
 protected:
  // Installed before any server starts and removed after it is gone, so no
  // thread logs while the sink list changes.
  std::shared_ptr<LogWatch> WatchLog(const std::string& needle) {
    auto watch = std::make_shared<LogWatch>(needle);
    spdlog::default_logger()->sinks().push_back(watch);
    watches_.push_back(watch);
    return watch;
  }
  // Rank 0 of a group of three, and its rank 1 joined (rank 0 has logged
  // the join) and waiting up to `timeout` for rank 2.
  struct RankOneWaiting {
    std::unique_ptr<RendezvousServer> server;
    std::unique_ptr<Joiner> rank1;
  };
  RankOneWaiting StartWithRankOneWaiting(absl::Duration timeout) {
    auto rank1_in = WatchLog("rank 1 joined (2 of 3 ranks)");
    RankOneWaiting g;
    g.server = StartRendezvous(3);
    JoinOptions options = JoinTo(*g.server, RankConfig(3, 1));
    options.timeout = timeout;
    g.rank1 = std::make_unique<Joiner>(options);
    rank1_in->seen().WaitForNotification();
    return g;
  }
  void TearDown() override {
    auto& sinks = spdlog::default_logger()->sinks();
    for (const auto& w : watches_) sinks.erase(std::remove(sinks.begin(), sinks.end(), w), sinks.end());
  }

 private:
  std::vector<std::shared_ptr<LogWatch>> watches_;
};

TEST_F(RendezvousTest, EveryJoinerOfAGroupOfThreeGetsTheId) {
  auto server = StartRendezvous(3);
  Joiner rank1(JoinTo(*server, RankConfig(3, 1)));
  Joiner rank2(JoinTo(*server, RankConfig(3, 2)));
  EXPECT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
  ASSERT_TRUE(rank1.result().ok()) << rank1.result().status();
  ASSERT_TRUE(rank2.result().ok()) << rank2.result().status();
  EXPECT_EQ(*rank1.result(), GroupId());
  EXPECT_EQ(*rank2.result(), GroupId());
  EXPECT_EQ(rank1.result()->size(), 128u);
}

TEST_F(RendezvousTest, JoinIsABarrierUntilTheLastRankJoins) {
  auto rank1_in = WatchLog("rank 1 joined (2 of 3 ranks)");
  auto server = StartRendezvous(3);
  absl::Notification rank2_started;
  std::atomic<bool> rank1_answered_before_rank2{false};
  Joiner rank1(JoinTo(*server, RankConfig(3, 1)),
               [&] { rank1_answered_before_rank2 = !rank2_started.HasBeenNotified(); });
  rank1_in->seen().WaitForNotification();
  // Rank 0 holds the join, across the client's one-second attempts too.
  EXPECT_FALSE(rank1.done().WaitForNotificationWithTimeout(absl::Milliseconds(1500)));
  rank2_started.Notify();
  Joiner rank2(JoinTo(*server, RankConfig(3, 2)));
  ASSERT_TRUE(rank2.result().ok()) << rank2.result().status();
  ASSERT_TRUE(rank1.result().ok()) << rank1.result().status();
  EXPECT_FALSE(rank1_answered_before_rank2);
  EXPECT_EQ(*rank1.result(), GroupId());
  EXPECT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
}

TEST_F(RendezvousTest, AnotherWorldSizeIsRefused) {
  auto server = StartRendezvous(2);
  const absl::Time start = absl::Now();
  auto id = JoinGroup(JoinTo(*server, RankConfig(3, 1)));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  EXPECT_THAT(std::string(id.status().message()),
              HasSubstr("world_size: 3, rank 0 has distributed.world_size = 2"));
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("refused the join"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // refused, not retried until the timeout
}

TEST_F(RendezvousTest, RankOutOfRangeIsRefused) {
  auto server = StartRendezvous(2);
  for (int rank : {2, 0, -1}) {
    v1::TrainerConfig config = RankConfig(2, 1);
    config.mutable_distributed()->set_rank(rank);
    auto id = JoinGroup(JoinTo(*server, config));
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << rank << ": " << id.status();
    EXPECT_THAT(std::string(id.status().message()),
                HasSubstr(absl::StrCat("rank: ", rank, " is not in [1, 2)")));
  }
  // The refusals left the group waiting for rank 1 alone.
  auto id = JoinGroup(JoinTo(*server, RankConfig(2, 1)));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
}

TEST_F(RendezvousTest, ADifferentLearnerConfigIsRefusedNamingTheField) {
  auto server = StartRendezvous(2);
  v1::TrainerConfig other = RankConfig(2, 1);
  other.mutable_network()->set_trunk_hidden(0, 256);
  auto refused = JoinGroup(JoinTo(*server, other));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("network.trunk_hidden"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("rank 1's config differs from rank 0's"));

  // A shard of another capacity is the same learner.
  v1::TrainerConfig bigger_shard = RankConfig(2, 1);
  bigger_shard.mutable_replay()->set_capacity(3 * bigger_shard.replay().capacity());
  auto id = JoinGroup(JoinTo(*server, bigger_shard));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, GroupId());
  EXPECT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
}

TEST_F(RendezvousTest, AJoinAfterTheGroupFormedIsRefused) {
  auto server = StartRendezvous(2);
  ASSERT_TRUE(JoinGroup(JoinTo(*server, RankConfig(2, 1))).ok());
  ASSERT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
  auto late = JoinGroup(JoinTo(*server, RankConfig(2, 1)));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("the group has formed already"));
}

TEST_F(RendezvousTest, AMissingRankTimesOutNamingIt) {
  auto [server, rank1] = StartWithRankOneWaiting(absl::Seconds(1));
  const absl::Status st = server->AwaitGroup(absl::Milliseconds(300));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank(s) 2 of 3 did not join"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("distributed.rendezvous_timeout_seconds"));
  // The waiting joiner gets no id.
  EXPECT_EQ(rank1->result().status().code(), absl::StatusCode::kDeadlineExceeded) << rank1->result().status();
}

TEST_F(RendezvousTest, AwaitGroupNamesEveryMissingRank) {
  auto server = StartRendezvous(4);
  const absl::Status st = server->AwaitGroup(absl::Milliseconds(100));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank(s) 1, 2, 3 of 4 did not join"));
}

// Rank 0's DEADLINE_EXCEEDED is the group's failure, not the attempt's own
// deadline: the joiner reports rank 0's reason at once instead of asking again.
TEST_F(RendezvousTest, JoinersGetRankZerosTimeoutAtOnce) {
  auto [server, rank1] = StartWithRankOneWaiting(absl::Seconds(8));
  const absl::Time failed = absl::Now();
  EXPECT_EQ(server->AwaitGroup(absl::Milliseconds(300)).code(), absl::StatusCode::kDeadlineExceeded);
  const auto& id = rank1->result();
  EXPECT_LT(absl::Now() - failed, absl::Seconds(5));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("rank(s) 2 of 3 did not join"));

  // A join after the failure gets it at once too.
  const absl::Time start = absl::Now();
  JoinOptions options = JoinTo(*server, RankConfig(3, 2));
  options.timeout = absl::Seconds(8);
  auto late = JoinGroup(options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("rank(s) 2 of 3 did not join"));
}

TEST_F(RendezvousTest, CancelledWaitStopsRankZeroAndTheJoiner) {
  auto [server, rank1] = StartWithRankOneWaiting(absl::Seconds(20));
  int asked = 0;
  const absl::Time start = absl::Now();
  const absl::Status st = server->AwaitGroup(absl::Seconds(30), [&] { return ++asked > 1; });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("stopped while waiting for the other ranks"));
  // The joiner hears rank 0's reason at once instead of waiting out its timeout.
  const auto& id = rank1->result();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(id.ok());
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("refused the join"));
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("stopped while waiting for the other ranks"));
}

TEST_F(RendezvousTest, NobodyListeningIsDeadlineExceededAfterTheTimeout) {
  RefusingPort port;
  JoinOptions options;
  options.address = port.address();
  options.config = RankConfig(2, 1);
  options.timeout = absl::Milliseconds(600);
  options.retry_interval = absl::Milliseconds(50);
  const absl::Time start = absl::Now();
  auto id = JoinGroup(options);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_THAT(std::string(id.status().message()),
              HasSubstr(absl::StrCat("no group from rank 0's rendezvous at ", options.address)));
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("UNAVAILABLE"));
  EXPECT_GE(took, absl::Milliseconds(600));
  EXPECT_LT(took, absl::Seconds(10));
}

TEST_F(RendezvousTest, CancelledJoinStopsRetrying) {
  RefusingPort port;
  JoinOptions options;
  options.address = port.address();
  options.config = RankConfig(2, 1);
  options.timeout = absl::Seconds(60);
  options.retry_interval = absl::Milliseconds(20);
  int asked = 0;
  options.cancelled = [&] { return ++asked > 3; };
  auto id = JoinGroup(options);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kCancelled) << id.status();
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("stopped while waiting for rank 0's rendezvous"));
  EXPECT_EQ(asked, 4);
}

TEST_F(RendezvousTest, RankZeroGoingAwayAnswersAPendingJoinUnavailable) {
  auto [server, rank1] = StartWithRankOneWaiting(absl::Seconds(2));
  server.reset();
  // Rank 0 is gone: the joiner keeps asking until its own timeout.
  const auto& id = rank1->result();
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("UNAVAILABLE"));
}

TEST_F(RendezvousTest, WithTokensAJoinNeedsTheAdminToken) {
  const std::string admin = "admin-token-0123456789abcdef";
  const std::string actor = "actor-token-0123456789abcdef";
  auto authorizer = TokenAuthorizer::Create(
      testing::WriteTempFile("tokens", absl::StrCat("admin ", admin, "\nactor ", actor, "\n")));
  ASSERT_TRUE(authorizer.ok()) << authorizer.status();
  auto server = StartRendezvous(2, *authorizer);

  auto none = JoinGroup(JoinTo(*server, RankConfig(2, 1)));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("refused the join"));

  JoinOptions as_actor = JoinTo(*server, RankConfig(2, 1));
  as_actor.token_file = testing::WriteTempFile("actor_token", actor + "\n");
  auto wrong_role = JoinGroup(as_actor);
  EXPECT_EQ(wrong_role.status().code(), absl::StatusCode::kPermissionDenied) << wrong_role.status();

  JoinOptions unknown = JoinTo(*server, RankConfig(2, 1));
  unknown.token_file = testing::WriteTempFile("unknown_token", "not-a-listed-token-0123456789\n");
  EXPECT_EQ(JoinGroup(unknown).status().code(), absl::StatusCode::kUnauthenticated);

  EXPECT_EQ((*authorizer)->failures(AuthFailure::kMissing), 1);
  EXPECT_EQ((*authorizer)->failures(AuthFailure::kWrongRole), 1);
  EXPECT_EQ((*authorizer)->failures(AuthFailure::kUnknownToken), 1);

  JoinOptions as_admin = JoinTo(*server, RankConfig(2, 1));
  as_admin.token_file = testing::WriteTempFile("admin_token", admin + "\n");
  auto id = JoinGroup(as_admin);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, GroupId());
  EXPECT_TRUE(server->AwaitGroup(absl::Seconds(20)).ok());
}

// gRPC binds with SO_REUSEPORT by default; the rendezvous does not, or a
// second rank 0 on the same host and port would take some of the joins, each
// handing out its own NCCL id.
TEST_F(RendezvousTest, AnAddressInUseIsUnavailableNamingTheFlag) {
  auto first = StartRendezvous(2);
  RendezvousServer::Options options;
  options.listen = absl::StrCat("127.0.0.1:", first->port());
  options.config = RankConfig(2, 0);
  options.unique_id = GroupId();
  auto second = RendezvousServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("distributed.rendezvous_listen="));
}

}  // namespace
}  // namespace qstream
