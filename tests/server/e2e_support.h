// Helpers of the end-to-end tests: a qstreamd child process on loopback
// ports chosen at run time, a plain-socket HTTP GET, and the Prometheus text
// format parsed into a map.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "qstream/v1/admin.pb.h"
#include "qstream/v1/experience.pb.h"

namespace qstream::testing {

// A child process with stdout and stderr on one pipe.
class ChildProcess {
 public:
  static std::unique_ptr<ChildProcess> Spawn(const std::vector<std::string>& argv);
  ~ChildProcess();  // SIGKILL + reap when still running

  // Reads output until a line contains `needle`; returns that line.
  std::optional<std::string> WaitForLine(const std::string& needle, absl::Duration timeout);
  // Exit code (128 + signal when killed), or nullopt on timeout.
  std::optional<int> Wait(absl::Duration timeout);
  void Signal(int signal_number);
  // Everything read from the child so far.
  const std::string& output() const { return output_; }
  pid_t pid() const { return pid_; }

 private:
  bool ReadSome(absl::Duration timeout);  // false on EOF or timeout
  pid_t pid_ = -1;
  int fd_ = -1;
  bool exited_ = false;
  int exit_code_ = 0;
  std::string output_;
  size_t scanned_ = 0;
};

// qstreamd started with --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0
// and `extra_flags`; ports parsed from its start-up line.
struct Daemon {
  std::unique_ptr<ChildProcess> process;
  std::string grpc_address;
  int metrics_port = 0;
};
std::optional<Daemon> StartDaemon(const std::vector<std::string>& extra_flags, std::string* error);
// The two halves of StartDaemon, for daemons that must start together (the
// ranks of a group): SpawnDaemon does not wait (nullptr when the spawn
// fails); AwaitDaemon waits up to `timeout` for the start-up line.
std::unique_ptr<ChildProcess> SpawnDaemon(const std::vector<std::string>& extra_flags);
std::optional<Daemon> AwaitDaemon(std::unique_ptr<ChildProcess> process, absl::Duration timeout,
                                  std::string* error);
// StartDaemon with --backend=cpu, --config=<config_text in a temp file> and
// `extra_flags`; the test fails and aborts when the daemon does not start.
Daemon StartCpuDaemonOrDie(const std::string& config_text, const std::vector<std::string>& extra_flags = {});

std::string BuildDir();
// Writes `text` to a fresh file under the test's temp dir and returns its path.
std::string WriteTempFile(const std::string& name, const std::string& text);
// A loopback TCP port that was free a moment ago.
int FreePort();

// A loopback port bound but not listening: connections to it are refused,
// and no other process takes it while the object lives.
class RefusingPort {
 public:
  RefusingPort();
  ~RefusingPort();
  RefusingPort(const RefusingPort&) = delete;
  RefusingPort& operator=(const RefusingPort&) = delete;
  int port() const { return port_; }
  std::string address() const;  // "127.0.0.1:<port>"

 private:
  int fd_ = -1;
  int port_ = 0;
};

// AdminService.Status; a failed call fails the test and returns an empty response.
v1::StatusResponse GetStatus(const std::shared_ptr<grpc::Channel>& channel);

// `count` KIND_NSTEP transitions for a network of `obs_dim` inputs and
// `branches` (actions per branch): observations and rewards uniform in
// [-1, 1), actions uniform per branch, every discount `discount`.
v1::TransitionBatch RandomNStepBatch(int count, uint64_t sequence, int obs_dim,
                                     const std::vector<int>& branches, float discount, std::mt19937* rng);

// Body of GET http://127.0.0.1:port/path ("" on failure).
std::string HttpGet(int port, const std::string& path);
// "name{labels}" -> value for every sample line of a Prometheus text page.
std::map<std::string, double> ParseMetrics(const std::string& text);
// grpc.health.v1.Health/Check for service "": 1 SERVING, 2 NOT_SERVING,
// 0 UNKNOWN, -1 when the call fails.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel);

// Metric family names that have a "# TYPE" line.
std::vector<std::string> MetricTypes(const std::string& text);

// One HTTP response as read off the socket.
struct HttpResponse {
  int status = 0;       // from the status line
  std::string headers;  // status line and header lines, CRLF-separated
  std::string body;
};
// Sends `request` (raw bytes) to 127.0.0.1:port and reads until the server
// closes; nullopt when connecting fails, the response has no status line,
// or the server has not closed by `timeout`.
std::optional<HttpResponse> HttpExchange(int port, const std::string& request, absl::Duration timeout);
// A GET of `path` over HTTP/1.0, with `authorization` as the Authorization
// header when not empty.
std::string HttpGetRequest(const std::string& path, const std::string& authorization = "");

// A blocking TCP socket connected to 127.0.0.1:port, -1 on failure.
int ConnectLoopback(int port);
// Waits until the peer has closed each socket of `fds` (EOF or reset; bytes
// it sent first are discarded) and returns how many it closed by `timeout`.
// The sockets stay open on this side.
int AwaitPeerClose(const std::vector<int>& fds, absl::Duration timeout);

// Resident set size of process `pid` (VmRSS of /proc/<pid>/status), bytes;
// -1 when unreadable.
int64_t RssBytes(pid_t pid);

}  // namespace qstream::testing
