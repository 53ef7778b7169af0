#include "tests/server/e2e_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <future>
#include <limits>
#include <regex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "clients/cpp/health_check.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"

namespace qstream::testing {

std::unique_ptr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe(fds) != 0) return nullptr;
  const pid_t pid = fork();
  if (pid < 0) return nullptr;
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  auto p = std::unique_ptr<ChildProcess>(new ChildProcess);
  p->pid_ = pid;
  p->fd_ = fds[0];
  return p;
}

ChildProcess::~ChildProcess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (fd_ >= 0) close(fd_);
}

bool ChildProcess::ReadSome(absl::Duration timeout) {
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return false;
  char buf[4096];
  const ssize_t n = read(fd_, buf, sizeof(buf));
  if (n <= 0) return false;
  output_.append(buf, n);
  return true;
}

std::optional<std::string> ChildProcess::WaitForLine(const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    size_t eol;
    while ((eol = output_.find('\n', scanned_)) != std::string::npos) {
      std::string line = output_.substr(scanned_, eol - scanned_);
      scanned_ = eol + 1;
      if (line.find(needle) != std::string::npos) return line;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return std::nullopt;
    if (!ReadSome(std::min(left, absl::Milliseconds(100)))) {
      int status;
      if (!exited_ && waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        while (ReadSome(absl::ZeroDuration())) {
        }
      }
      if (exited_ && output_.find('\n', scanned_) == std::string::npos) return std::nullopt;
    }
  }
}

std::optional<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!exited_) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    ReadSome(absl::Milliseconds(20));  // keep the pipe drained
  }
  while (ReadSome(absl::ZeroDuration())) {
  }
  return exit_code_;
}

void ChildProcess::Signal(int signal_number) {
  if (!exited_) kill(pid_, signal_number);
}

std::string BuildDir() {
  const char* dir = std::getenv("QSTREAM_BUILD_DIR");
  return dir ? dir : ".";
}

std::string WriteTempFile(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/qstream_e2e_", getpid(), "_", name);
  std::ofstream(path) << text;
  return path;
}

int FreePort() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  close(s);
  return ntohs(a.sin_port);
}

RefusingPort::RefusingPort() {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
}

RefusingPort::~RefusingPort() { close(fd_); }

std::string RefusingPort::address() const { return absl::StrCat("127.0.0.1:", port_); }

v1::StatusResponse GetStatus(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::AdminService::NewStub(channel);
  grpc::ClientContext context;
  v1::StatusResponse r;
  const grpc::Status st = stub->Status(&context, v1::StatusRequest(), &r);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return r;
}

v1::TransitionBatch RandomNStepBatch(int count, uint64_t sequence, int obs_dim,
                                     const std::vector<int>& branches, float discount, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_sequence(sequence);
  b.set_count(count);
  std::vector<float> obs, next_obs, rewards;
  std::vector<int32_t> actions;
  for (int i = 0; i < count * obs_dim; ++i) {
    obs.push_back(u(*rng));
    next_obs.push_back(u(*rng));
  }
  for (int i = 0; i < count; ++i) {
    for (int n : branches) actions.push_back(static_cast<int32_t>((*rng)() % n));
    rewards.push_back(u(*rng));
  }
  const auto num_branches = static_cast<int64_t>(branches.size());
  wire::SetTensor(b.mutable_obs(), obs, {count, obs_dim});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {count, obs_dim});
  wire::SetTensor(b.mutable_actions(), actions, {count, num_branches});
  wire::SetTensor(b.mutable_rewards(), rewards, {count});
  wire::SetTensor(b.mutable_discounts(), std::vector<float>(count, discount), {count});
  return b;
}

std::unique_ptr<ChildProcess> SpawnDaemon(const std::vector<std::string>& extra_flags) {
  std::vector<std::string> argv = {BuildDir() + "/qstreamd", "--listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  return ChildProcess::Spawn(argv);
}

std::optional<Daemon> AwaitDaemon(std::unique_ptr<ChildProcess> process, absl::Duration timeout,
                                  std::string* error) {
  if (!process) {
    *error = "spawn failed";
    return std::nullopt;
  }
  Daemon d;
  d.process = std::move(process);
  const auto line = d.process->WaitForLine("listening grpc=", timeout);
  if (!line) {
    *error = absl::StrCat("no start-up line; output:\n", d.process->output());
    return std::nullopt;
  }
  std::smatch m;
  if (!std::regex_search(*line, m, std::regex(R"(grpc=(\S+) metrics=127\.0\.0\.1:(\d+))"))) {
    *error = absl::StrCat("unparsable start-up line: ", *line);
    return std::nullopt;
  }
  d.grpc_address = m[1];
  d.metrics_port = std::stoi(m[2]);
  return d;
}

std::optional<Daemon> StartDaemon(const std::vector<std::string>& extra_flags, std::string* error) {
  return AwaitDaemon(SpawnDaemon(extra_flags), absl::Seconds(60), error);
}

Daemon StartCpuDaemonOrDie(const std::string& config_text, const std::vector<std::string>& extra_flags) {
  std::vector<std::string> flags = {"--backend=cpu", "--config=" + WriteTempFile("config.txt", config_text)};
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  std::string error;
  auto d = StartDaemon(flags, &error);
  if (!d) {
    ADD_FAILURE() << error;
    std::abort();
  }
  return std::move(*d);
}

std::string HttpGet(int port, const std::string& path) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return "";
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(s, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(s);
    return "";
  }
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = read(s, buf, sizeof(buf))) > 0) response.append(buf, n);
  close(s);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || response.find(" 200 ") == std::string::npos ||
      body == std::string::npos) {
    return "";
  }
  return response.substr(body + 4);
}

std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value;
    const absl::string_view v = line.substr(space + 1);
    if (v == "Nan" || v == "NaN") {
      value = std::numeric_limits<double>::quiet_NaN();
    } else if (!absl::SimpleAtod(v, &value)) {
      continue;
    }
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

std::vector<std::string> MetricTypes(const std::string& text) {
  std::vector<std::string> names;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    names.emplace_back(line.substr(0, line.find(' ')));
  }
  return names;
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  auto status = actor::CheckHealth(channel, "", absl::Seconds(10));
  return status.ok() ? static_cast<int>(*status) : -1;
}

int ConnectLoopback(int port) {
  const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

namespace {

// Reads what is queued on `fd` into `out` (when not null); true once the peer
// has closed (EOF or reset).
bool DrainUntilClosed(int fd, std::string* out) {
  char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      if (out != nullptr) out->append(buf, n);
      continue;
    }
    if (n == 0) return true;
    if (errno == EINTR) continue;
    return errno != EAGAIN && errno != EWOULDBLOCK;  // ECONNRESET and the like: closed
  }
}

}  // namespace

int AwaitPeerClose(const std::vector<int>& fds, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<pollfd> waiting;
  for (int fd : fds) waiting.push_back({fd, POLLIN, 0});
  int closed = 0;
  do {  // at least one poll, so a zero timeout still counts what is closed now
    const int64_t left_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (poll(waiting.data(), waiting.size(), static_cast<int>(std::min<int64_t>(left_ms, 1000))) < 0 &&
        errno != EINTR) {
      break;
    }
    for (size_t i = 0; i < waiting.size();) {
      if (waiting[i].revents != 0 && DrainUntilClosed(waiting[i].fd, nullptr)) {
        ++closed;
        waiting[i] = waiting.back();
        waiting.pop_back();
      } else {
        waiting[i].revents = 0;
        ++i;
      }
    }
  } while (!waiting.empty() && absl::Now() < deadline);
  return closed;
}

std::optional<HttpResponse> HttpExchange(int port, const std::string& request, absl::Duration timeout) {
  const int s = ConnectLoopback(port);
  if (s < 0) return std::nullopt;
  const absl::Time deadline = absl::Now() + timeout;
  bool closed = false;
  std::string raw;
  if (send(s, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
    while (!closed) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      pollfd p{s, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left) + 1)) < 0 && errno != EINTR) break;
      closed = DrainUntilClosed(s, &raw);
    }
  }
  close(s);
  const size_t end = raw.find("\r\n\r\n");
  HttpResponse r;
  if (!closed || end == std::string::npos || raw.rfind("HTTP/1.", 0) != 0 || raw.size() < 12 ||
      !absl::SimpleAtoi(absl::string_view(raw).substr(9, 3), &r.status)) {
    return std::nullopt;
  }
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  return r;
}

std::string HttpGetRequest(const std::string& path, const std::string& authorization) {
  std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n");
  if (!authorization.empty()) absl::StrAppend(&request, "Authorization: ", authorization, "\r\n");
  return request + "\r\n";
}

int64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    int64_t kib;
    if (!absl::ConsumeSuffix(&rest, " kB") || !absl::SimpleAtoi(rest, &kib)) return -1;
    return kib * 1024;
  }
  return -1;
}

}  // namespace qstream::testing
