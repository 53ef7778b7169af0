// grpc.health.v1.Health/Check through a generic stub (Debian's gRPC ships no
// C++ stubs of health.proto): HealthCheckRequest{service} out, the
// ServingStatus enum of the response back.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace qstream::actor {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

const char* ServingStatusName(ServingStatus status);

// One Check call for `service` ("" = the whole server) with `timeout`. The
// call's error (UNAVAILABLE, DEADLINE_EXCEEDED, ...) as a status, or
// InvalidArgument when the response is not a HealthCheckResponse.
absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          const std::string& service, absl::Duration timeout);

}  // namespace qstream::actor
