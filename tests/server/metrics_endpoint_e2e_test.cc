// The /metrics endpoint against hostile clients, with real qstreamd processes
// on loopback: clients that send half a request and hold it, hundreds of
// connections that send nothing, and basic auth from --metrics_auth_file.
// The assertions are on behaviour (status codes, bodies, which sockets the
// server closed); the deadlines are generous upper bounds, not speeds.
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

constexpr char kMetric[] = "qstream_train_steps_total";
constexpr int kDefaultThreads = 16;  // MetricsOptions::threads, the --metrics_threads default

// Closes its sockets when the test ends, pass or fail.
struct Sockets {
  std::vector<int> fds;
  ~Sockets() {
    for (int fd : fds) close(fd);
  }
};

testing::Daemon Start(const std::vector<std::string>& flags) {
  std::string error;
  auto d = testing::StartDaemon(flags, &error);
  if (!d) ADD_FAILURE() << error;
  return d ? std::move(*d) : testing::Daemon{};
}

std::string Basic(const std::string& user, const std::string& password) {
  return "Basic " + absl::Base64Escape(user + ":" + password);
}

// One GET /metrics that must come back 200 with the daemon's metrics.
void ExpectScrape(int port, absl::Duration timeout, const std::string& authorization = "") {
  const auto r = testing::HttpExchange(port, testing::HttpGetRequest("/metrics", authorization), timeout);
  ASSERT_TRUE(r.has_value()) << "no complete response within " << timeout;
  EXPECT_EQ(r->status, 200) << r->headers;
  EXPECT_TRUE(absl::StrContains(r->body, kMetric)) << r->body.substr(0, 500);
}

int Status(int port, const std::string& authorization) {
  const auto r =
      testing::HttpExchange(port, testing::HttpGetRequest("/metrics", authorization), absl::Seconds(20));
  if (!r) return -1;
  if (r->status == 401) {
    EXPECT_TRUE(absl::StrContains(r->headers, "WWW-Authenticate: Basic")) << r->headers;
    EXPECT_FALSE(absl::StrContains(r->body, kMetric));
  }
  return r->status;
}

std::string WriteAuthFile(const std::string& name, const std::string& text, mode_t mode) {
  const std::string path = testing::WriteTempFile(name, text);
  chmod(path.c_str(), mode);
  return path;
}

// Slowloris: more clients than the old two workers hold half a request each.
// Scrapes keep succeeding while they do, and the server closes them once the
// request timeout has passed.
TEST(MetricsEndpointE2E, HalfSentRequestsNeitherBlockScrapesNorStayOpen) {
  constexpr absl::Duration kRequestTimeout = absl::Seconds(4);
  constexpr int kSlowClients = 4;
  testing::Daemon d =
      Start({absl::StrCat("--metrics_request_timeout=", absl::FormatDuration(kRequestTimeout))});
  ASSERT_TRUE(d.process);

  Sockets slow;
  const std::string half = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow";
  const absl::Time connected = absl::Now();
  for (int i = 0; i < kSlowClients; ++i) {
    const int fd = testing::ConnectLoopback(d.metrics_port);
    ASSERT_GE(fd, 0);
    slow.fds.push_back(fd);
    ASSERT_EQ(write(fd, half.data(), half.size()), static_cast<ssize_t>(half.size()));
  }

  // Accepted before it, the slow clients hold workers while this scrape runs.
  ExpectScrape(d.metrics_port, absl::Seconds(20));
  EXPECT_EQ(testing::AwaitPeerClose(slow.fds, absl::ZeroDuration()), 0)
      << "the half-sent requests were closed before their timeout";

  int scrapes = 1;
  int closed = 0;
  const absl::Time deadline = connected + kRequestTimeout + absl::Seconds(20);
  while (closed < kSlowClients && absl::Now() < deadline) {
    closed = testing::AwaitPeerClose(slow.fds, absl::Milliseconds(250));
    ExpectScrape(d.metrics_port, absl::Seconds(20));
    ++scrapes;
  }
  EXPECT_EQ(closed, kSlowClients) << "slow clients still open after " << absl::Now() - connected;
  EXPECT_GE(absl::Now() - connected, kRequestTimeout) << "closed before the request timeout";
  EXPECT_GE(scrapes, 2);
}

// 300 connections that send nothing: a scrape queued behind them still
// succeeds, and every idle connection is closed by the server. Each idle
// connection holds a worker for one request timeout, so they drain in
// ceil(300 / threads) timeouts.
TEST(MetricsEndpointE2E, IdleConnectionsAreClosedAndScrapesStillSucceed) {
  constexpr absl::Duration kRequestTimeout = absl::Seconds(1);
  constexpr int kIdle = 300;
  testing::Daemon d =
      Start({absl::StrCat("--metrics_request_timeout=", absl::FormatDuration(kRequestTimeout))});
  ASSERT_TRUE(d.process);

  Sockets idle;
  for (int i = 0; i < kIdle; ++i) {
    const int fd = testing::ConnectLoopback(d.metrics_port);
    ASSERT_GE(fd, 0) << "connection " << i;
    idle.fds.push_back(fd);
  }
  const absl::Duration drain = kRequestTimeout * ((kIdle + kDefaultThreads - 1) / kDefaultThreads);
  ExpectScrape(d.metrics_port, drain + absl::Seconds(20));
  EXPECT_EQ(testing::AwaitPeerClose(idle.fds, drain + absl::Seconds(20)), kIdle);
  ExpectScrape(d.metrics_port, absl::Seconds(20));
}

// --metrics_auth_file with a plain password (mode 0600): no credentials,
// a wrong password or a wrong user get 401; the right pair gets the metrics.
// The password never shows in the daemon's output.
TEST(MetricsEndpointE2E, BasicAuthFromPlainPasswordFile) {
  const std::string password = "correct-horse-battery";
  const std::string file = WriteAuthFile("auth_plain", "# scrape user\nprometheus " + password + "\n", 0600);
  testing::Daemon d = Start({"--metrics_auth_file=" + file});
  ASSERT_TRUE(d.process);

  EXPECT_EQ(Status(d.metrics_port, ""), 401);
  EXPECT_EQ(Status(d.metrics_port, Basic("prometheus", "wrong")), 401);
  EXPECT_EQ(Status(d.metrics_port, Basic("prometheus", password + "x")), 401);
  EXPECT_EQ(Status(d.metrics_port, Basic("grafana", password)), 401);
  EXPECT_EQ(Status(d.metrics_port, "Bearer " + password), 401);
  ExpectScrape(d.metrics_port, absl::Seconds(20), Basic("prometheus", password));
  EXPECT_FALSE(absl::StrContains(d.process->output(), password));
  EXPECT_FALSE(absl::StrContains(d.process->output(), "readable by others"));
  unlink(file.c_str());
}

// The sha256: form, in a file others may read: the daemon warns and starts;
// the password is accepted, its digest as a password is not.
TEST(MetricsEndpointE2E, BasicAuthFromDigestFileReadableByOthers) {
  const std::string digest = "62249369389075490555a758353aec61500c6218fa597252d52dc4bd0148f12d";  // sha256sum
  const std::string file = WriteAuthFile("auth_digest", "prometheus sha256:" + digest + "\n", 0644);
  testing::Daemon d = Start({"--metrics_auth_file=" + file});
  ASSERT_TRUE(d.process);

  EXPECT_TRUE(absl::StrContains(d.process->output(), "readable by others")) << d.process->output();
  EXPECT_EQ(Status(d.metrics_port, ""), 401);
  EXPECT_EQ(Status(d.metrics_port, Basic("prometheus", digest)), 401);
  EXPECT_EQ(Status(d.metrics_port, Basic("prometheus", "sha256:" + digest)), 401);
  ExpectScrape(d.metrics_port, absl::Seconds(20), Basic("prometheus", "correct-horse-battery"));
  unlink(file.c_str());
}

// A malformed file stops the daemon at start (exit 2) with an error naming
// the file and the line, and without echoing the line.
TEST(MetricsEndpointE2E, MalformedAuthFileRefusesToStart) {
  const std::string secret = "s3cret-s3cret";
  const std::string file = WriteAuthFile("auth_bad", "# comment\n\nprometheus " + secret + " extra\n", 0600);
  auto p = testing::ChildProcess::Spawn({testing::BuildDir() + "/qstreamd", "--listen=127.0.0.1:0",
                                         "--metrics_listen=127.0.0.1:0", "--metrics_auth_file=" + file});
  ASSERT_TRUE(p);
  EXPECT_EQ(p->Wait(absl::Seconds(60)), 2) << p->output();
  EXPECT_TRUE(absl::StrContains(p->output(), file + " line 3")) << p->output();
  EXPECT_FALSE(absl::StrContains(p->output(), secret)) << p->output();
  unlink(file.c_str());
}

}  // namespace
}  // namespace qstream
