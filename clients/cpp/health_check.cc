#include "clients/cpp/health_check.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"

namespace qstream::actor {
namespace {

// Protobuf wire form of HealthCheckRequest{service = 1: string}.
std::string EncodeRequest(const std::string& service) {
  if (service.empty()) return "";
  std::string out = "\x0a";
  size_t n = service.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + service;
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing: return "SERVING";
    case ServingStatus::kNotServing: return "NOT_SERVING";
    case ServingStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown: break;
  }
  return "UNKNOWN";
}

absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          const std::string& service, absl::Duration timeout) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  const std::string request_bytes = EncodeRequest(service);
  grpc::Slice request_slice(request_bytes);
  grpc::ByteBuffer request(&request_slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("grpc.health.v1.Health/Check: ", status.error_message()));
  }
  grpc::Slice slice;
  if (!response.DumpToSingleSlice(&slice).ok())
    return absl::InvalidArgumentError("health: unreadable response");
  const std::string bytes(reinterpret_cast<const char*>(slice.begin()), slice.size());
  if (bytes.empty()) return ServingStatus::kUnknown;  // the default value is not on the wire
  // Field 1 (status), varint, one byte for the values 0..3.
  if (bytes.size() != 2 || bytes[0] != 0x08 || bytes[1] < 0 || bytes[1] > 3) {
    return absl::InvalidArgumentError("health: response is not a HealthCheckResponse");
  }
  return static_cast<ServingStatus>(bytes[1]);
}

}  // namespace qstream::actor
